// Elastic continuation's actors without daemons: the coordinator completes the steps before a re-forming
// and counts on, a checkpoint whose state went with a lost rank 0 is given up, a replica paused a step
// behind takes a finished one's state, and a node that is back rejoins at an epoch's end. The plan: test_reform.cpp.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <thread>

#include "actors/coordinator.hpp"
#include "actors/messages.hpp"
#include "actors/node_job.hpp"
#include "actors/reform.hpp"
#include "actors/ring_links.hpp"
#include "actors/report_kv.hpp"
#include "actors/training.hpp"
#include "kernels/model.hpp"
#include "tests/coordinator_job.hpp"
#include "tests/sim_backend.hpp"
#include "tests/test_data.hpp"

using namespace ringmaster;
using ringmaster::test_coordinator::evaluation;
using ringmaster::test_coordinator::lost_node;

namespace {

// A stand-in for a rank: takes run, answers weights with `w`.
caf::behavior fake_rank(caf::event_based_actor*, std::vector<float> w) {
  return {
      [](run_atom, caf::actor, caf::actor, caf::actor) {},
      [w](weights_atom) { return chunk_ptr(std::make_shared<std::vector<float>>(w)); },
      [w](sum_atom) -> caf::result<uint64_t, bool> { return {fnv1a(w.data(), w.size()), true}; },
  };
}

// n stand-in ranks (weights {1, 2, 3}) as replicas, loaders and reducers alike, for a coordinator.
rank_actors stand_ins(caf::actor_system& sys, int n) {
  rank_actors all;
  for (int r = 0; r < n; ++r) all.replicas.push_back(sys.spawn(fake_rank, std::vector<float>{1, 2, 3}));
  all.loaders = all.reducers = all.replicas;
  return all;
}

step_report report(int rank, int gen, int64_t epoch, int64_t step, int64_t count) {
  step_report r;
  r.rank = rank;
  r.gen = gen;
  r.epoch = epoch;
  r.step = step;
  r.loss_sum = 0.5 * double(count);
  r.correct = count / 2;
  r.count = count;
  return r;
}

// A coordinator of `cc` over n stand-in ranks, run: `send(sys, coord)` sends the job's messages; its result.
template <class Send>
std::shared_ptr<train_result> run_coordinator(const coordinator_config& cc, int n, Send send) {
  caf::actor_system_config cfg;
  configure(cfg, 2);
  caf::actor_system sys{cfg};
  auto coord = sys.spawn(coordinator, cc);
  const rank_actors all = stand_ins(sys, n);
  caf::scoped_actor self{sys};
  auto running = self->request(coord, caf::infinite, run_atom::value, all.replicas, all.loaders, all.reducers);
  send(sys, coord);
  std::shared_ptr<train_result> result;
  running.receive([&](std::shared_ptr<train_result> r) { result = std::move(r); }, [&](caf::error& e) { FAIL(sys.render(e)); });
  return result;
}

}  // namespace

TEST_CASE("reform: the coordinator completes the steps before the restart, drops later ones, counts on, times the recovery to the next step run",
          "[reform]") {
  caf::actor_system_config cfg;
  configure(cfg, 2);
  caf::actor_system sys{cfg};
  // 3 ranks, batch 30 (10 each), 4 steps an epoch, 2 epochs, evaluating.
  coordinator_config cc{3, 30, 4, 2, true, nullptr};
  std::vector<std::string> events;
  cc.on_event = [&](const std::string& l) { events.push_back(l); };
  auto coord = sys.spawn(coordinator, cc);
  const rank_actors all = stand_ins(sys, 3);
  // Messages sent from this thread after the run request reach the coordinator after it.
  caf::scoped_actor self{sys};
  auto running = self->request(coord, caf::infinite, run_atom::value, all.replicas, all.loaders, all.reducers);
  // Steps 0 and 1 complete; rank 2 (lost) never reported step 2, which ranks 0 and 1 applied; rank 0
  // also applied step 3, which rank 1 never finished: rank 1 takes rank 0's state and the ring re-forms
  // after step 3 (4 steps done), so step 3 counts with rank 1's and rank 2's samples unmeasured.
  for (int64_t s = 0; s < 2; ++s)
    for (int r = 0; r < 3; ++r) caf::anon_send(coord, report(r, 0, 0, s, 10));
  caf::anon_send(coord, report(0, 0, 0, 2, 10));
  caf::anon_send(coord, report(1, 0, 0, 2, 10));
  caf::anon_send(coord, report(0, 0, 0, 3, 10));
  // Steps 2 and 3 ran before the ring stalled: they are timed by their reports, not by the re-forming,
  // and the recovery lasts until the next step run (step 4), not until they are settled.
  const auto pause = std::chrono::milliseconds(500);
  std::this_thread::sleep_for(pause);
  reform_note note;
  note.gen = 1;
  note.start_step = 4;
  for (int r = 0; r < 2; ++r) note.ranks.push_back(sys.spawn(fake_rank, std::vector<float>{4, 5, 6}));
  note.losses = {lost_node("tcp://lost:1", "2")};
  caf::anon_send(coord, reform_atom::value, note);
  std::this_thread::sleep_for(pause);
  // A late report of the old ring is dropped; the new ranks (15 samples each) evaluate epoch 0 again (it
  // ended at the restart), then run steps 4 to 7.
  caf::anon_send(coord, report(1, 0, 0, 3, 10));
  for (int r = 0; r < 2; ++r) caf::anon_send(coord, evaluation(r, 1, 0, 50, 40));
  for (int64_t g = 4; g < 8; ++g) {
    for (int r = 0; r < 2; ++r) caf::anon_send(coord, report(r, 1, g / 4, g % 4, 15));
    if (g % 4 == 3)
      for (int r = 0; r < 2; ++r) caf::anon_send(coord, evaluation(r, 1, g / 4, 50, 40));
  }
  for (int r = 0; r < 2; ++r) caf::anon_send(coord, done_atom::value, r);
  std::shared_ptr<train_result> result;
  running.receive([&](std::shared_ptr<train_result> r) { result = std::move(r); }, [&](caf::error& e) { FAIL(sys.render(e)); });
  REQUIRE(result);
  INFO(result->error);
  REQUIRE(result->ok);
  REQUIRE(result->history.size() == 2);
  CHECK(result->history[0].samples == 120);  // 4 steps of 30: 10 of step 2 and 20 of step 3 without their loss
  CHECK(result->history[1].samples == 120);
  CHECK(result->unmeasured == 30);
  CHECK(result->history[0].val_accuracy == Approx(0.8));
  CHECK(result->checksums.size() == 2);
  CHECK(result->weights == std::vector<float>{4, 5, 6});
  REQUIRE(result->losses.size() == 1);
  CHECK(result->losses[0].survivors == 2);
  CHECK(result->losses[0].epoch == 1);
  CHECK(result->losses[0].step == 0);
  CHECK(result->losses[0].recovered >= 0.5);  // from the last word to step 4, the pause after the re-forming in it
  CHECK(result->losses[0].recovered < 10);
  CHECK(result->history[0].seconds < 0.4);  // to its last report, before both pauses
  REQUIRE(events.size() == 1);
  CHECK(events[0].find("the next step was complete") != std::string::npos);
}

TEST_CASE("reform: each node lost in one re-forming has its recovery counted from its own last message", "[reform]") {
  // 3 ranks, batch 30, 4 steps, 1 epoch: after step 2 the nodes of ranks 1 and 2 are lost together, rank
  // 1's silent a second longer; rank 0 goes on alone. Both used to count from the earlier silence.
  auto result = run_coordinator({3, 30, 4, 1, false, nullptr}, 3, [](caf::actor_system& sys, const caf::actor& coord) {
    for (int64_t s = 0; s < 2; ++s)
      for (int r = 0; r < 3; ++r) caf::anon_send(coord, report(r, 0, 0, s, 10));
    reform_note note;
    note.gen = 1;
    note.start_step = 2;
    note.ranks.push_back(sys.spawn(fake_rank, std::vector<float>{1, 2, 3}));
    node_loss early = lost_node("tcp://lost:1", "1"), late = lost_node("tcp://lost:2", "2");
    early.since = late.since - std::chrono::seconds(1);
    note.losses = {early, late};
    caf::anon_send(coord, reform_atom::value, note);
    for (int64_t s = 2; s < 4; ++s) caf::anon_send(coord, report(0, 1, 0, s, 30));
    caf::anon_send(coord, done_atom::value, 0);
  });
  REQUIRE(result);
  INFO(result->error);
  REQUIRE(result->ok);
  REQUIRE(result->losses.size() == 2);
  CHECK(result->losses[1].recovered < 0.9);
  CHECK(result->losses[0].recovered - result->losses[1].recovered == Approx(1.0).margin(0.01));
}

TEST_CASE("reform: a node lost after the job's last step is said to be lost there, not in an epoch the job has not",
          "[reform]") {
  // 2 ranks, batch 20, 4 steps, 1 epoch, not evaluating: both report every step, then rank 1's node is
  // lost before it says it is done; the ring re-forms with no step left (it said "epoch 2, step 1").
  auto result = run_coordinator({2, 20, 4, 1, false, nullptr}, 2, [](caf::actor_system& sys, const caf::actor& coord) {
    for (int64_t s = 0; s < 4; ++s)
      for (int r = 0; r < 2; ++r) caf::anon_send(coord, report(r, 0, 0, s, 10));
    reform_note note;
    note.gen = 1;
    note.start_step = 4;
    note.ranks.push_back(sys.spawn(fake_rank, std::vector<float>{1, 2, 3}));
    note.losses = {lost_node("tcp://lost:1", "1")};
    caf::anon_send(coord, reform_atom::value, note);
    caf::anon_send(coord, done_atom::value, 0);
  });
  REQUIRE(result);
  INFO(result->error);
  REQUIRE(result->ok);
  REQUIRE(result->losses.size() == 1);
  CHECK(result->losses[0].epoch == 0);  // the last step, 0-based: epoch 1, step 4
  CHECK(result->losses[0].step == 3);
  CHECK(std::isnan(result->losses[0].recovered));  // no step came after it
}

TEST_CASE("reform: a checkpoint whose state went with a lost rank 0 is given up, the next ones are written", "[reform][checkpoint]") {
  caf::actor_system_config cfg;
  configure(cfg, 2);
  caf::actor_system sys{cfg};
  // 2 ranks, batch 20, 4 steps an epoch, 2 epochs, evaluating, a checkpoint at each epoch's end.
  coordinator_config cc{2, 20, 4, 2, true, nullptr};
  std::vector<int64_t> written;
  cc.on_checkpoint = [&](const job_progress& p, const network_state&) {
    written.push_back(p.step);
    return std::string();
  };
  std::vector<std::string> events;  // the coordinator's own thread, read once it is done
  cc.on_event = [&](const std::string& line) { events.push_back(line); };
  auto coord = sys.spawn(coordinator, cc);
  const rank_actors all = stand_ins(sys, 2);
  caf::scoped_actor self{sys};
  auto running = self->request(coord, caf::infinite, run_atom::value, all.replicas, all.loaders, all.reducers);
  // Epoch 0 is stepped through; rank 0 dies with its evaluation and its state after step 4 unsent, while
  // rank 1 goes on to report epoch 1's first step: the ring re-forms at step 5 without rank 0.
  for (int64_t s = 0; s < 4; ++s)
    for (int r = 0; r < 2; ++r) caf::anon_send(coord, report(r, 0, 0, s, 10));
  caf::anon_send(coord, evaluation(1, 0, 0, 50, 40));
  caf::anon_send(coord, report(1, 0, 1, 0, 10));
  reform_note note;
  note.gen = 1;
  note.start_step = 5;
  note.ranks.push_back(sys.spawn(fake_rank, std::vector<float>{4, 5, 6}));
  note.losses = {lost_node("tcp://lost:1", "0")};
  caf::anon_send(coord, reform_atom::value, note);
  // The survivor, now rank 0 alone, runs steps 5 to 7, evaluates, and sends its state after step 8.
  for (int64_t s = 1; s < 4; ++s) caf::anon_send(coord, report(0, 1, 1, s, 20));
  caf::anon_send(coord, evaluation(0, 1, 1, 50, 45));
  auto state = std::make_shared<network_state>();
  state->steps = 8;
  state->params = {4, 5, 6};
  caf::anon_send(coord, checkpt_atom::value, state_ptr(state));
  caf::anon_send(coord, done_atom::value, 0);
  std::shared_ptr<train_result> result;
  running.receive([&](std::shared_ptr<train_result> r) { result = std::move(r); }, [&](caf::error& err) { FAIL(sys.render(err)); });
  REQUIRE(result);
  INFO(result->error);
  CHECK(result->ok);
  CHECK(written == std::vector<int64_t>{8});  // step 4's state never came: given up, not waited for
  CHECK(result->history.size() == 2);
  CHECK(std::count(events.begin(), events.end(), "the checkpoint after step 4 is skipped: its state went with rank 0's node") == 1);
}

namespace {

// One replica in a ring of its own, on the first 100 training samples (10 steps of 10), run by `self` as
// its coordinator.
struct lone_rank {
  rank_actors a;
  lone_rank(caf::actor_system& sys, const train_config& c, std::shared_ptr<const model> m) {
    job_plan plan;
    std::string err;
    REQUIRE(make_local_plan(c, &plan, &err));
    plan.elastic = true;
    a = spawn_ranks(sys, plan, c, m, {0});
    join(*a.ports[0], make_port_link(a.ports[0]));
  }
  // Runs it; what self sent the replica before (a planned pause) comes first.
  void start(caf::scoped_actor& self) {
    self->send(a.replicas[0], run_atom::value, a.loaders[0], a.reducers[0], caf::actor_cast<caf::actor>(self));
  }
  ~lone_rank() {
    leave(*a.ports[0]);
    for (auto* g : {&a.replicas, &a.loaders, &a.reducers}) caf::anon_send_exit((*g)[0], caf::exit_reason::user_shutdown);
  }
};

std::vector<float> weights_of(caf::scoped_actor& self, const caf::actor& replica) {
  std::vector<float> w;
  self->request(replica, std::chrono::seconds(10), weights_atom::value)
      .receive([&](chunk_ptr p) { w = *p; }, [&](caf::error& e) { FAIL(self->system().render(e)); });
  return w;
}

}  // namespace

TEST_CASE("reform: a replica paused a step behind takes the state of one that finished it, bit for bit", "[reform]") {
  caf::actor_system_config cfg;
  configure(cfg, 2);
  caf::actor_system sys{cfg};
  caf::scoped_actor self{sys};
  train_config c;
  c.model = "784-16-10";
  c.replicas = 1;
  c.global_batch = 10;
  c.train = test::load("train", 100);
  std::string err;
  auto m = build_model(c, &err);
  REQUIRE(m);
  // Two copies of one job: a stops after step 3, b after step 4 (planned pauses), as survivors a step
  // apart after a lost node.
  lone_rank a(sys, c, m), b(sys, c, m);
  self->send(a.a.replicas[0], pause_atom::value, 1, int64_t(3));
  self->send(b.a.replicas[0], pause_atom::value, 1, int64_t(4));
  a.start(self);  // after the pauses: a replica's steps take microseconds, it would be past step 3 first
  b.start(self);
  std::map<int64_t, int> paused_at;  // steps applied -> replicas
  int steps_seen = 0;
  for (int got = 0; got < 2;)
    self->receive([&](const pause_report& r) { ++paused_at[r.applied], ++got; }, [&](const step_report&) { ++steps_seen; },

                  caf::after(std::chrono::seconds(10)) >> [&] { FAIL("no pause report after " << steps_seen << " steps"); });
  CHECK(paused_at == std::map<int64_t, int>{{3, 1}, {4, 1}});
  // b's state (a paused replica answers with it) goes to a; a now holds b's weights and moments exactly.
  state_ptr s;
  self->request(b.a.replicas[0], std::chrono::seconds(10), checkpt_atom::value)
      .receive([&](state_ptr x) { s = std::move(x); }, [&](caf::error& e) { FAIL(sys.render(e)); });
  REQUIRE(s);
  CHECK(s->steps == 4);
  CHECK(weights_of(self, a.a.replicas[0]) != weights_of(self, b.a.replicas[0]));
  self->send(a.a.replicas[0], restore_atom::value, s);
  CHECK(weights_of(self, a.a.replicas[0]) == s->params);
  CHECK(weights_of(self, b.a.replicas[0]) == s->params);
  // Sent again (it is there already), it changes nothing; a state two steps ahead is refused: the replica
  // stops with the reason, and so does its job.
  self->send(a.a.replicas[0], restore_atom::value, s);
  CHECK(weights_of(self, a.a.replicas[0]) == s->params);
  auto ahead = std::make_shared<network_state>(*s);
  ahead->steps = 6;
  self->monitor(a.a.replicas[0]);
  self->send(a.a.replicas[0], restore_atom::value, state_ptr(ahead));
  bool down = false;
  self->receive([&](caf::down_msg& d) { down = true, err = sys.render(d.reason); },
                caf::after(std::chrono::seconds(10)) >> [] {});
  CHECK(down);
  CHECK(err.find("paused after 4 steps, it was sent the state after 6") != std::string::npos);
}

TEST_CASE("reform: a node that is back rejoins at the first epoch's end it has time for, or the last one", "[reform]") {
  // 100 steps an epoch, 6 epochs: step 150 seen.
  CHECK(rejoin_step(150, 100, 600, 30, 16) == 200);
  CHECK(rejoin_step(150, 100, 600, 50, 16) == 200);  // exactly at an epoch's end
  CHECK(rejoin_step(150, 100, 600, 51, 16) == 300);
  // A margin that reaches past the job's end (the pace of a ring with more nodes, say): the last epoch's
  // end, which was refused with epochs still to go.
  CHECK(rejoin_step(150, 100, 600, 1000, 16) == 500);
  CHECK(rejoin_step(480, 100, 600, 1000, 16) == 500);
  // Too close to it for the setup itself, or in the last epoch, or a job of one epoch: none.
  CHECK(rejoin_step(490, 100, 600, 1000, 16) == -1);
  CHECK(rejoin_step(520, 100, 600, 30, 16) == -1);
  CHECK(rejoin_step(10, 100, 100, 16, 16) == -1);
  CHECK(rejoin_step(10, 0, 100, 16, 16) == -1);
}
