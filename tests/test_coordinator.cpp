// The coordinator against ranks that lie: reports of nodes arrive as messages, and a node of the job may
// send anything a report can hold (actors/launcher.cpp passes on what parses). Stand-in ranks here: the
// test sends the coordinator what a lying node's reports would become.
#include <catch2/catch.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "actors/coordinator.hpp"
#include "actors/messages.hpp"
#include "actors/training.hpp"

using namespace ringmaster;
using namespace std::chrono_literals;

namespace {

// A rank that takes whatever it is sent and answers a weights request with 3 zeros, a checksum request with
// theirs. (caf::drop would answer the coordinator's messages with an error, and an error it does not expect
// ends the coordinator.)
caf::behavior stand_in(caf::event_based_actor* self) {
  self->set_default_handler([](caf::scheduled_actor*, caf::message_view&) -> caf::result<caf::message> { return caf::message{}; });
  const std::vector<float> zeros(3, 0.0f);
  return {[zeros](weights_atom) { return chunk_ptr(std::make_shared<std::vector<float>>(zeros)); },
          [zeros](sum_atom) -> caf::result<uint64_t, bool> { return {fnv1a(zeros.data(), zeros.size()), true}; }};
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
  // Any settings for 2 ranks; rank 1 may be another stand-in (a liar).
  explicit job(const coordinator_config& cc, caf::behavior (*rank1)(caf::event_based_actor*) = stand_in) {
    ranks = {sys.spawn(stand_in), sys.spawn(rank1)};
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
  void whole_job() {
    for (int64_t e = 0; e < 2; ++e)
      for (int64_t s = 0; s < 3; ++s) step(0, e, s), step(1, e, s);
  }
};

}  // namespace

TEST_CASE("coordinator: honest reports make a job, a rank's done said twice counts once", "[coordinator]") {
  job j;
  train_result r = j.run([](job& j) {
    j.whole_job();
    j.done(0), j.done(0), j.done(1);
  });
  INFO(r.error);
  REQUIRE(r.ok);
  REQUIRE(r.history.size() == 2);
  CHECK(r.history[1].samples == 12);
  CHECK(r.history[1].accuracy == Approx(0.5));
  CHECK(r.identical);
}

TEST_CASE("coordinator: the ranks' wait for a slower one's forward/backward is summed step by step", "[coordinator]") {
  job j;
  train_result r = j.run([](job& j) {
    for (int64_t e = 0; e < 2; ++e)
      for (int64_t s = 0; s < 3; ++s) {
        const double slow = s == 1 ? 0.25 : 0.5;  // rank 1 is the slower one but in step 2 of each epoch
        j.step(0, e, s, 2, 1, 0.5, 0, 0.375), j.step(1, e, s, 2, 1, 0.5, 0, slow);
      }
    j.done(0), j.done(1);
  });
  INFO(r.error);
  REQUIRE(r.ok);
  CHECK(r.compute == 6 * 0.375 + 4 * 0.5 + 2 * 0.25);
  // Per step: the slowest's time less each rank's, summed over ranks (0.125 every step, either way).
  CHECK(r.wait_slower == 6 * 0.125);
}

TEST_CASE("coordinator: every rank done before the job's steps is an error, not a short success", "[coordinator]") {
  job j;
  train_result r = j.run([](job& j) {
    j.step(0, 0, 0), j.step(1, 0, 0);
    j.done(1), j.done(1), j.done(0);  // the first done twice: it still counts once
  });
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("every rank said it was done, but the job's 1 steps complete") != std::string::npos);
}

TEST_CASE("coordinator: reports outside the job, twice, or of impossible batches end it naming the rank", "[coordinator]") {
  struct lie {
    std::function<void(job&)> send;
    std::string says;
  };
  const std::vector<lie> lies = {
      {[](job& j) { j.step(1, 2, 0); }, "rank 1 reported step 1 of epoch 3, which the job (2 epochs of 3 steps) does not have"},
      {[](job& j) { j.step(1, 0, 3); }, "rank 1 reported step 4 of epoch 1, which the job"},
      {[](job& j) { j.step(0, -1, 0); }, "rank 0 reported step 1 of epoch index -1, which the job"},
      // The largest numbers a node can send, counted from 1 without overflow (UBSan would stop here).
      {[](job& j) { j.step(0, INT64_MAX, INT64_MAX); }, "step 9223372036854775808 of epoch 9223372036854775808, which the job"},
      {[](job& j) { j.step(1, 0, 0), j.step(1, 0, 0); }, "rank 1 reported step 1 of epoch 1 twice"},
      {[](job& j) { j.step(0, 0, 0), j.step(1, 0, 0), j.step(1, 0, 0); }, "rank 1 reported step 1 of epoch 1 again: it is complete"},
      {[](job& j) { j.step(0, 0, 0, 2, 3); }, "rank 0 reported step 1 of epoch 1 with 3 of 2 samples right"},
      {[](job& j) { j.step(0, 0, 0, 5, 1); }, "not a batch of at most 4"},
      {[](job& j) { j.step(0, 0, 0, 2, 1, -3.0); }, "loss sum -3"},
      {[](job& j) { j.step(0, 0, 0, 1), j.step(1, 0, 0, 2); }, "the ranks reported 3 samples for step 1 of epoch 1, not the global batch of 4"},
      {[](job& j) { j.step(1, 0, 0, 2, 1, 0.5, 0, std::nan("")); }, "rank 1 reported step 1 of epoch 1 with a time of nan s"},
      {[](job& j) { j.step(0, 0, 0, 2, 1, 0.5, 0, -1.0); }, "rank 0 reported step 1 of epoch 1 with a time of -1 s"},
      {[](job& j) { j.step(0, 0, 0, 2, 1, -1e308); }, "loss sum -1e+308: not a batch"},  // not 310 digits
  };
  for (const lie& l : lies) {
    job j;
    train_result r = j.run(l.send);
    INFO(l.says << " / got: " << r.error);
    CHECK_FALSE(r.ok);
    CHECK(r.error.find(l.says) != std::string::npos);
  }
  // An evaluation's time is printed: none that is not a time.
  for (auto [t, said] : {std::pair<double, const char*>{std::numeric_limits<double>::infinity(), "inf"}, {-2.0, "-2"}}) {
    coordinator_config cc = job::small();
    cc.evaluate = true;
    job j(cc);
    train_result r = j.run([t](job& j) {
      for (int64_t s = 0; s < 3; ++s) j.step(0, 0, s), j.step(1, 0, s);
      eval_report e;
      e.rank = 1;
      e.count = 2;
      e.seconds = t;
      caf::anon_send(j.coord, e);
    });
    INFO(r.error);
    CHECK_FALSE(r.ok);
    CHECK(r.error.find(std::string("rank 1 reported an evaluation of epoch 1 that took ") + said + " s") != std::string::npos);
  }
  // An evaluation of more samples than the test set has (its sums would overflow): a node's lie, not a
  // result. One whose loss is not a number stops the job as a training loss does, saying so (it read as a
  // protocol error: "reported an evaluation ... loss sum nan").
  struct eval_lie {
    int64_t count;
    double loss;
    std::string says;
  };
  for (const eval_lie& l : {eval_lie{INT64_MAX, 1.0, "rank 1 reported an evaluation of epoch 1 with 0 of 9223372036854775807 samples right"},
                            eval_lie{9, 1.0, "rank 1 reported an evaluation of epoch 1 with 0 of 9 samples right"},
                            eval_lie{2, std::nan(""), "the test loss became NaN in the evaluation after epoch 1 (rank 1); the job was stopped"},
                            eval_lie{2, std::numeric_limits<double>::infinity(), "the test loss became infinite in the evaluation after epoch 1"}}) {
    coordinator_config cc = job::small();
    cc.evaluate = true;
    cc.eval_batches = 2;  // of the global batch of 4: at most 8 samples
    job j(cc);
    train_result r = j.run([&l](job& j) {
      for (int64_t s = 0; s < 3; ++s) j.step(0, 0, s), j.step(1, 0, s);
      eval_report e;
      e.rank = 1;
      e.count = l.count;
      e.loss_sum = l.loss;
      caf::anon_send(j.coord, e);
    });
    INFO(r.error);
    CHECK_FALSE(r.ok);
    CHECK(r.error.find(l.says) != std::string::npos);
  }
  // Ranks on nodes: the rank's node is named too.
  job on_nodes(0ms, {"node tcp://10.0.0.1:5601", "node tcp://10.0.0.2:5601"});
  train_result r = on_nodes.run([](job& j) { j.step(1, 0, 0), j.step(1, 0, 0); });
  INFO(r.error);
  CHECK(r.error.find("rank 1 (node tcp://10.0.0.2:5601) reported step 1 of epoch 1 twice") != std::string::npos);
}

TEST_CASE("coordinator: a rank that holds back its reports while the others report fails the job in time, naming it", "[coordinator]") {
  job j(1000ms, {"node tcp://10.0.0.1:5601", "node tcp://10.0.0.2:5601"});
  const auto t0 = std::chrono::steady_clock::now();
  train_result r = j.run([](job& j) {
    j.step(0, 0, 0), j.step(1, 0, 0);
    j.step(0, 0, 1);  // rank 1 says nothing more
  });
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(r.error);
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("rank(s) 1 (node tcp://10.0.0.2:5601) sent no report of step 2 of epoch 1 in 1 s after the others did") !=
        std::string::npos);
  CHECK(took < 4);

  job quiet(1000ms);  // the others done, one not
  r = quiet.run([](job& j) {
    j.whole_job();
    j.done(1);
  });
  CHECK(r.error.find("rank(s) 0 did not say they were done in 1 s") != std::string::npos);
}

TEST_CASE("coordinator: while a ring is formed anew its report clock stands still", "[coordinator]") {
  job j(500ms);
  const auto t0 = std::chrono::steady_clock::now();
  std::thread launcher;
  train_result r = j.run(
      [&launcher](job& j) {
        j.step(0, 0, 0);
        caf::anon_send(j.coord, pause_atom::value, 1);  // the launcher pauses the ranks for ring 1
        launcher = std::thread([&j] {
          std::this_thread::sleep_for(2000ms);  // 4x the report timeout: no verdict meanwhile
          reform_note note;                     // ring 1 formed, of the same ranks, from step 0
          note.gen = 1;
          note.ranks = j.ranks;
          note.where = {"node tcp://10.0.0.3:5601", "node tcp://10.0.0.4:5601"};  // where the new ranks run
          caf::anon_send(j.coord, reform_atom::value, note);
          j.step(0, 0, 0, 2, 1, 0.5, 1);  // then rank 1 falls silent in the new ring
        });
      },
      8000ms);
  launcher.join();
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(r.error);
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("rank(s) 1 (node tcp://10.0.0.4:5601) sent no report of step 1 of epoch 1") != std::string::npos);
  CHECK(took > 2.0);
  CHECK(took < 5.0);
}

TEST_CASE("coordinator: ranks that all fall silent at once fail the job in time, naming every one", "[coordinator]") {
  // No rank is late behind another, so only the silence of all of them tells: a one-node job whose
  // replicas hang, or every node stuck at once while its daemon still answers.
  job j(500ms, {"node tcp://10.0.0.1:5601", "node tcp://10.0.0.2:5601"});
  const auto t0 = std::chrono::steady_clock::now();
  train_result r = j.run([](job& j) { j.step(0, 0, 0), j.step(1, 0, 0), j.step(0, 0, 1), j.step(1, 0, 1); });
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(r.error);
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("no rank has reported anything for ") == 0);
  CHECK(r.error.find("ranks 0 (node tcp://10.0.0.1:5601), 1 (node tcp://10.0.0.2:5601) are stuck") != std::string::npos);
  CHECK(took < 3.0);

  job never(500ms);  // not even a first step: twice the report timeout (a device may warm up)
  auto t1 = std::chrono::steady_clock::now();
  r = never.run([](job&) {});
  double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  CHECK(r.error.find("no rank has reported anything for 1 s, and no step is done: ranks 0, 1 are stuck, or one step of this model "
                     "takes longer than that (then raise the ring timeout, --ring-timeout") == 0);
  CHECK(waited > 0.9);
  CHECK(waited < 4.0);
  // Resumed, its state may be on its way to every node first: ten times.
  coordinator_config resumed = job::small(500ms);
  resumed.start.step = 3;
  resumed.start.history.resize(1);
  job late(resumed);
  t1 = std::chrono::steady_clock::now();
  r = late.run([](job&) {});
  waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  INFO(r.error);
  CHECK(r.error.find("no rank has reported anything for 5 s") == 0);
  CHECK(waited > 4.9);
  CHECK(waited < 8.0);
}

namespace {
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
coordinator_config checkpoint_each_step(int64_t steps) {
  coordinator_config cc = job::small();
  cc.steps_per_epoch = steps;
  cc.epochs = 1;
  cc.checkpoint_every = 1;
  return cc;
}

// Rank 0's state after `steps` steps, of n parameters: those the stand-ins end with (3 zeros), or else.
void send_state(job& j, int64_t steps, size_t n, float value = 0.0f) {
  auto s = std::make_shared<network_state>();
  s->steps = steps;
  s->params.assign(n, value);
  caf::anon_send(j.coord, checkpt_atom::value, state_ptr(std::move(s)));
}
}  // namespace

TEST_CASE("coordinator: a node that sends states for steps far ahead makes it hold a few, not all, and the last", "[coordinator]") {
  coordinator_config cc = checkpoint_each_step(20);
  const recorded rec(&cc);
  job j(cc);
  train_result out = j.run([](job& j) {
    for (int64_t k = 1; k <= 20; ++k) {  // rank 0's state after every step, before any step is reported
      send_state(j, k, k < 20 ? 1000 : 3);
    }
    for (int64_t s = 0; s < 20; ++s) j.step(0, 0, s), j.step(1, 0, s);
    j.done(0), j.done(1);
  });
  // The newest 8 were held and written, the older ones let go (said once); the job ends well, its last
  // checkpoint written.
  CHECK(*rec.written == std::vector<int64_t>{13, 14, 15, 16, 17, 18, 19, 20});
  REQUIRE(rec.events->size() == 1);
  CHECK(rec.events->front() == "skipped the checkpoint after step 1: 8 states waited for their steps' reports");
  INFO(out.error);
  CHECK(out.ok);
}

TEST_CASE("coordinator: a checkpoint whose state never comes, only a later one's, is skipped with a line", "[coordinator]") {
  coordinator_config cc = checkpoint_each_step(3);
  const recorded rec(&cc);
  job j(cc);
  train_result out = j.run([](job& j) {
    for (int64_t k : {1, 3}) {  // rank 0's node withholds the state after step 2
      send_state(j, k, k < 3 ? 10 : 3);
    }
    for (int64_t s = 0; s < 3; ++s) j.step(0, 0, s), j.step(1, 0, s);
    j.done(0), j.done(1);
  });
  CHECK(*rec.written == std::vector<int64_t>{1, 3});
  REQUIRE(rec.events->size() == 1);
  CHECK(rec.events->front() == "skipped the checkpoint after step 2: rank 0's node sent no state for it, only for a later step");
  INFO(out.error);
  CHECK(out.ok);
}

TEST_CASE("coordinator: a checkpoint after the last step that holds other weights than the final ones is an error", "[coordinator]") {
  // As rank 0's node would make it by sending a state that is not its own: --save and a resume of the
  // finished run would disagree.
  for (float value : {0.0f, 1234.5f}) {
    coordinator_config cc = checkpoint_each_step(3);
    const recorded rec(&cc);
    job j(cc);
    train_result out = j.run([value](job& j) {
      for (int64_t k = 1; k <= 3; ++k) send_state(j, k, 3, k < 3 ? 7.0f : value);  // earlier ones are not compared
      for (int64_t s = 0; s < 3; ++s) j.step(0, 0, s), j.step(1, 0, s);
      j.done(0), j.done(1);
    });
    CHECK(*rec.written == std::vector<int64_t>{1, 2, 3});
    INFO(out.error);
    CHECK(out.ok == (value == 0.0f));
    if (value != 0.0f)
      CHECK(out.error == "the checkpoint after the last step (3) holds other weights than every rank's final ones: rank 0 sent a "
                         "state that was not its own; do not resume from it");
  }
}

TEST_CASE("coordinator: a state of rank 0 that is not the one the other ranks hold is not written, and the job fails naming them",
          "[coordinator]") {
  // As rank 0's node would make it by sending a state not its own, of finite, plausible values (which the
  // launcher's state_fault passes): from step 2 on its state holds 7s, while every rank reports the
  // checksum of zeros. A resume would have trained on from it.
  coordinator_config cc = checkpoint_each_step(3);
  cc.where = {"node A", "node B"};
  const recorded rec(&cc);
  job j(cc);
  train_result out = j.run([](job& j) {
    for (int64_t k = 1; k <= 3; ++k) {
      send_state(j, k, 3, k < 2 ? 0.0f : 7.0f);
      network_state held;  // what the ranks hold after step k
      held.steps = k;
      held.params.assign(3, 0.0f);
      j.step(0, 0, k - 1, 2, 1, 0.5, 0, 0, state_checksum(held));
      j.step(1, 0, k - 1, 2, 1, 0.5, 0, 0, state_checksum(held));
    }
    j.done(0), j.done(1);
  });
  CHECK(*rec.written == std::vector<int64_t>{1});
  INFO(out.error);
  CHECK_FALSE(out.ok);
  CHECK(out.error == "the state rank 0 (node A) sent after step 2 is not the one held by ranks 0 (node A), 1 (node B): no checkpoint "
                     "was written from it (a faulty or lying node: node A, it sent rank 0's state after step 2, which its own ranks "
                     "do not hold); the last one, after step 1, is kept");
}

TEST_CASE("coordinator: a node the checksums show faulty is handed on to be dropped, and only the majority's state is written",
          "[coordinator]") {
  // Elastic jobs on nodes (on_faulty_node set): rank 0's node sends a state of 7s after step 2 while
  // its own ranks and the other node's hold zeros. It is named, its state not written, and the job goes
  // on (the launcher would re-form the ring without it; here both stand-ins go on). After the last step
  // the job fails instead: no ring is left to re-form.
  auto run = [](int64_t steps) {
    coordinator_config cc = checkpoint_each_step(steps);
    cc.where = {"node A", "node B"};
    auto dropped = std::make_shared<std::vector<std::string>>();
    cc.on_faulty_node = [dropped](const std::string& where, const std::string& why) { dropped->push_back(where + ": " + why); };
    const recorded rec(&cc);
    job j(cc);
    train_result out = j.run([steps](job& j) {
      for (int64_t k = 1; k <= steps; ++k) {
        send_state(j, k, 3, k == 2 ? 7.0f : 0.0f);
        network_state held;
        held.steps = k;
        held.params.assign(3, 0.0f);
        j.step(0, 0, k - 1, 2, 1, 0.5, 0, 0, state_checksum(held));
        j.step(1, 0, k - 1, 2, 1, 0.5, 0, 0, state_checksum(held));
      }
      j.done(0), j.done(1);
    });
    return std::make_tuple(out, *rec.written, *rec.events, *dropped);
  };
  auto [out, written, events, dropped] = run(3);
  INFO(out.error);
  CHECK(out.ok);
  CHECK(written == std::vector<int64_t>{1, 3});
  CHECK(dropped == std::vector<std::string>{"node A: it sent rank 0's state after step 2, which its own ranks do not hold (a faulty or lying node)"});
  CHECK(std::find(events.begin(), events.end(),
                  "the checkpoint after step 2 was not written: rank 0's node, node A, is faulty: it sent rank 0's state after step 2, "
                  "which its own ranks do not hold") != events.end());
  std::tie(out, written, events, dropped) = run(2);  // step 2 is the last
  CHECK_FALSE(out.ok);
  CHECK(out.error.find("the state rank 0 (node A) sent after step 2 is not the one held by ranks 0 (node A), 1 (node B)") == 0);
  CHECK(written == std::vector<int64_t>{1});
  CHECK(dropped.empty());
}

TEST_CASE("coordinator: a rank that reports its states' checksums far ahead does not make checkpoints waiting for their state go",
          "[coordinator]") {
  // Rank 1's node reports 300 steps at once, each with its checksum (the report lead allows it); rank 0
  // reports 5 steps at a time and its states come after. The checksums held for steps to come once
  // counted against the bound on checkpoints whose metrics wait for their state, and made those go.
  const int64_t steps = 300;
  coordinator_config cc = checkpoint_each_step(steps);
  cc.where = {"node A", "node B"};
  const recorded rec(&cc);
  job j(cc);
  train_result out = j.run([](job& j) {
    auto held = [](int64_t k) {
      network_state s;
      s.steps = k;
      s.params.assign(3, 0.0f);
      return state_checksum(s);
    };
    for (int64_t k = 1; k <= steps; ++k) j.step(1, 0, k - 1, 2, 1, 0.5, 0, 0, held(k));
    for (int64_t k = 1; k <= steps; k += 5) {
      for (int64_t i = k; i < k + 5; ++i) j.step(0, 0, i - 1, 2, 1, 0.5, 0, 0, held(i));
      for (int64_t i = k; i < k + 5; ++i) send_state(j, i, 3);
    }
    j.done(0), j.done(1);
  });
  INFO(out.error);
  CHECK(out.ok);
  CHECK(rec.written->size() == size_t(steps));
  CHECK(rec.events->empty());
}

TEST_CASE("coordinator: rank 0's node that withholds its states is named within state_timeout, not at the job's end",
          "[coordinator]") {
  // It sends the state after step 1, then none: the checkpoint after step 2 waits. Elastic (on_faulty_node),
  // the node is handed on once and the job goes on (rank 0's states come again: a new ring's rank 0);
  // otherwise the job fails naming it, the checkpoint after step 1 kept.
  auto run = [](bool elastic) {
    coordinator_config cc = checkpoint_each_step(4);
    cc.where = {"node A", "node B"};
    cc.report_timeout = 10000ms;
    cc.state_timeout = 1500ms;
    auto dropped = std::make_shared<std::vector<std::string>>();
    if (elastic) cc.on_faulty_node = [dropped](const std::string& where, const std::string& why) { dropped->push_back(where + ": " + why); };
    const recorded rec(&cc);
    job j(cc);
    train_result out = j.run([](job& j) {
      send_state(j, 1, 3);
      for (int64_t s = 0; s < 2; ++s) j.step(0, 0, s), j.step(1, 0, s);
      std::this_thread::sleep_for(4000ms);  // named after 1.5 s, at a tick: 2 s here, with room for a loaded machine
      for (int64_t s = 2; s < 4; ++s) j.step(0, 0, s), j.step(1, 0, s);
      send_state(j, 3, 3), send_state(j, 4, 3);
      j.done(0), j.done(1);
    });
    return std::make_tuple(out, *rec.written, *dropped);
  };
  auto [out, written, dropped] = run(true);
  INFO(out.error);
  CHECK(out.ok);
  CHECK(written == std::vector<int64_t>{1, 3, 4});
  CHECK(dropped == std::vector<std::string>{"node A: it sent no state of rank 0 for the checkpoint after step 2 within 2 s of that step's end, "
                                            "nor a later one (a faulty or lying node)"});
  std::tie(out, written, dropped) = run(false);  // without the check, state 3 would supersede 2 and the job end well
  CHECK_FALSE(out.ok);
  CHECK(out.error == "rank 0 (node A) sent no state of rank 0 for the checkpoint after step 2 within 2 s of that step's end, nor a later one "
                     "(a faulty or lying node, or a link too slow for it); the last checkpoint, after step 1, is kept");
  CHECK(written == std::vector<int64_t>{1});
}

namespace {
// A rank whose node says its final weights hold a NaN.
caf::behavior nan_weights(caf::event_based_actor* self) {
  self->set_default_handler([](caf::scheduled_actor*, caf::message_view&) -> caf::result<caf::message> { return caf::message{}; });
  const std::vector<float> w{0, NAN, 0};
  return {[w](weights_atom) { return chunk_ptr(std::make_shared<std::vector<float>>(w)); },
          [w](sum_atom) -> caf::result<uint64_t, bool> { return {fnv1a(w.data(), w.size()), false}; }};
}

// A rank that answers only a checksum of its final weights, of others than rank 0's: asked for the
// weights themselves, it answers nothing the coordinator expects.
caf::behavior sum_only(caf::event_based_actor* self) {
  self->set_default_handler([](caf::scheduled_actor*, caf::message_view&) -> caf::result<caf::message> { return caf::message{}; });
  const std::vector<float> w{1, 2, 3};
  return {[w](sum_atom) -> caf::result<uint64_t, bool> { return {fnv1a(w.data(), w.size()), true}; }};
}
}  // namespace

TEST_CASE("coordinator: of every rank but rank 0 it asks only a checksum of the final weights, and tells when they differ",
          "[coordinator]") {
  // From nodes, every rank's weights crossed the network to the launcher, which held them all at once:
  // 16 ranks of a 237M-parameter model, 15 GB.
  job j(job::small(), sum_only);
  train_result r = j.run([](job& j) {
    j.whole_job();
    j.done(0), j.done(1);
  });
  INFO(r.error);
  REQUIRE(r.ok);
  CHECK(r.weights == std::vector<float>(3, 0.0f));
  const std::vector<float> w{1, 2, 3};
  REQUIRE(r.checksums.size() == 2);
  CHECK(r.checksums[1] == fnv1a(w.data(), w.size()));
  CHECK(r.checksums[0] != r.checksums[1]);
  CHECK_FALSE(r.identical);
}

TEST_CASE("coordinator: final weights that hold NaN are an error, not a result", "[coordinator]") {
  coordinator_config cc = job::small();
  cc.epochs = 1;
  job j(cc, nan_weights);
  train_result out = j.run([](job& j) {
    for (int64_t s = 0; s < 3; ++s) j.step(0, 0, s), j.step(1, 0, s);
    j.done(0), j.done(1);
  });
  CHECK_FALSE(out.ok);
  CHECK(out.error == "rank 1 sent final weights that hold NaN or infinite values");
}

TEST_CASE("coordinator: checksums are written as 16 lowercase hex digits, leading zeros kept", "[coordinator]") {
  CHECK(hex64(0) == "0000000000000000");
  CHECK(hex64(0x1234abcdULL) == "000000001234abcd");
  CHECK(hex64(~0ULL) == "ffffffffffffffff");
}
