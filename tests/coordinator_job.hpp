// Stand-in ranks for the coordinator's tests (test_coordinator.cpp, test_coordinator_checkpoints.cpp):
// the test sends the coordinator what a node's reports, honest or lying, would become.
#pragma once
#include <caf/all.hpp>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "actors/coordinator.hpp"
#include "actors/messages.hpp"
#include "actors/training.hpp"

namespace ringmaster::test_coordinator {

using namespace std::chrono_literals;


// A rank that takes whatever it is sent and answers a weights request with 3 of `value`, a checksum request
// with theirs. (caf::drop would answer the coordinator's messages with an error, and an error it does not
// expect ends the coordinator.)
inline caf::behavior stand_in_holding(caf::event_based_actor* self, float value) {
  self->set_default_handler([](caf::scheduled_actor*, caf::message_view&) -> caf::result<caf::message> { return caf::message{}; });
  const std::vector<float> held(3, value);
  return {[held](weights_atom) { return chunk_ptr(std::make_shared<std::vector<float>>(held)); },
          [held](sum_atom) -> caf::result<uint64_t, bool> { return {fnv1a(held.data(), held.size()), true}; }};
}
// 3 zeros: every rank's final weights in these tests.
inline caf::behavior stand_in(caf::event_based_actor* self) { return stand_in_holding(self, 0.0f); }
// A replica whose final weights are not the others' (3 ones).
inline caf::behavior stand_in_apart(caf::event_based_actor* self) { return stand_in_holding(self, 1.0f); }

// The launcher's word of a lost node: its endpoint, its ranks ("2-3"), its last message now.
inline node_loss lost_node(const std::string& node, const std::string& ranks) {
  node_loss l;
  l.node = node;
  l.ranks = ranks;
  l.since = std::chrono::steady_clock::now();
  return l;
}

inline eval_report evaluation(int rank, int gen, int64_t epoch, int64_t count, int64_t correct) {
  eval_report e;
  e.rank = rank;
  e.gen = gen;
  e.epoch = epoch;
  e.count = count;
  e.correct = correct;
  return e;
}

struct job {
  caf::actor_system_config cfg;
  caf::actor_system sys{(configure(cfg, 2), cfg)};
  std::vector<caf::actor> ranks;
  caf::actor coord;
  caf::scoped_actor self{sys};

  // 2 ranks, a global batch of 4, 2 epochs of 3 steps, no evaluation.
  // where: coordinator_config::where, as a launcher sets it for ranks on nodes.
  static coordinator_config small(std::chrono::milliseconds report_timeout = 0ms, std::vector<std::string> where = {}) {
    coordinator_config cc;
    cc.replicas = 2;
    cc.global_batch = 4;
    cc.steps_per_epoch = 3;
    cc.epochs = 2;
    cc.evaluate = false;
    cc.report_timeout = report_timeout;
    cc.where = std::move(where);
    return cc;
  }
  explicit job(std::chrono::milliseconds report_timeout = 0ms, std::vector<std::string> where = {})
      : job(small(report_timeout, std::move(where))) {}
  // Any settings for cc.replicas ranks (2 or more); rank 1 may be another stand-in (a liar).
  explicit job(const coordinator_config& cc, caf::behavior (*rank1)(caf::event_based_actor*) = stand_in) {
    ranks = {sys.spawn(stand_in), sys.spawn(rank1)};
    while (int(ranks.size()) < cc.replicas) ranks.push_back(sys.spawn(stand_in));
    coord = sys.spawn(coordinator, cc);
  }
  ~job() {
    caf::anon_send_exit(coord, caf::exit_reason::kill);
    for (auto& r : ranks) caf::anon_send_exit(r, caf::exit_reason::user_shutdown);
  }
  // Starts the job, runs `send`, and returns its result (a request_timeout error after `wait`).
  template <class Send>
  train_result run(Send send, std::chrono::milliseconds wait = 10000ms) {
    train_result out;
    auto pending = self->request(coord, wait, run_atom::value, ranks, ranks, ranks);
    send(*this);
    pending.receive([&](std::shared_ptr<train_result> r) { out = *r; }, [&](caf::error& e) { out.error = sys.render(e); });
    return out;
  }
  void step(int rank, int64_t epoch, int64_t s, int64_t count = 2, int64_t correct = 1, double loss = 0.5, int gen = 0,
            double compute = 0, uint64_t state_sum = 0) {
    step_report r;
    r.state_sum = state_sum;
    r.compute = compute;
    r.rank = rank;
    r.gen = gen;
    r.epoch = epoch;
    r.step = s;
    r.count = count;
    r.correct = correct;
    r.loss_sum = loss;
    caf::anon_send(coord, r);
  }
  void done(int rank) { caf::anon_send(coord, done_atom::value, rank); }
  void eval(int rank, int gen, int64_t epoch, int64_t count, int64_t correct) {
    caf::anon_send(coord, evaluation(rank, gen, epoch, count, correct));
  }
  void whole_job() {
    for (int64_t e = 0; e < 2; ++e)
      for (int64_t s = 0; s < 3; ++s) step(0, e, s), step(1, e, s);
  }
};


// The launcher's word that node A, rank 0's of 3, is lost and ranks 1 and 2 (on nodes B and C) go on
// from global step `start` in ring 1.
inline void lose_rank_0(job& j, int64_t start) {
  reform_note note;
  note.gen = 1;
  note.start_step = start;
  note.ranks = {j.ranks[1], j.ranks[2]};
  note.where = {"node B", "node C"};
  note.losses = {lost_node("node A", "0")};
  caf::anon_send(j.coord, reform_atom::value, note);
}

// The checkpoints a job writes (by step) and the lines it says, recorded through cc's callbacks.
struct recorded {
  std::shared_ptr<std::vector<int64_t>> written = std::make_shared<std::vector<int64_t>>();
  std::shared_ptr<std::vector<std::string>> events = std::make_shared<std::vector<std::string>>();
  explicit recorded(coordinator_config* cc) {
    cc->on_checkpoint = [w = written](const job_progress& p, const network_state&) {
      w->push_back(p.step);
      return std::string();
    };
    cc->on_event = [e = events](const std::string& line) { e->push_back(line); };
  }
};

// One epoch of `steps` steps with a checkpoint after each.
inline coordinator_config checkpoint_each_step(int64_t steps) {
  coordinator_config cc = job::small();
  cc.steps_per_epoch = steps;
  cc.epochs = 1;
  cc.checkpoint_every = 1;
  return cc;
}

// Rank 0's state after `steps` steps, of n parameters: those the stand-ins end with (3 zeros), or else.
inline void send_state(job& j, int64_t steps, size_t n, float value = 0.0f) {
  auto s = std::make_shared<network_state>();
  s->steps = steps;
  s->params.assign(n, value);
  caf::anon_send(j.coord, checkpt_atom::value, state_ptr(std::move(s)));
}

}  // namespace ringmaster::test_coordinator
