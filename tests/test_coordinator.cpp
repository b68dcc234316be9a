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

#include "tests/coordinator_job.hpp"

using namespace ringmaster;
using namespace ringmaster::test_coordinator;
using namespace std::chrono_literals;

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

TEST_CASE("coordinator: an epoch whose reports come in a burst (a launcher stopped, then woken) took at least its forward/backward",
          "[coordinator]") {
  std::vector<progress> shown;
  coordinator_config cc = job::small();
  cc.on_progress = [&shown](const progress& p) { shown.push_back(p); };
  job j{cc};
  train_result r = j.run([](job& j) {
    std::this_thread::sleep_for(800ms);  // the ranks train while the launcher is stopped
    for (int64_t e = 0; e < 2; ++e)
      for (int64_t s = 0; s < 3; ++s) j.step(0, e, s, 2, 1, 0.5, 0, 0.125), j.step(1, e, s, 2, 1, 0.5, 0, s == 1 ? 0.25 : 0.0625);
    j.done(0), j.done(1);
  });
  INFO(r.error);
  REQUIRE(r.ok);
  REQUIRE(r.history.size() == 2);
  CHECK(r.history[0].seconds >= 0.8);  // from the job's start
  CHECK(r.history[1].seconds >= 0.5);  // 0.125 + 0.25 + 0.125, each step's slowest: its reports came within milliseconds
  CHECK(r.history[1].seconds < 0.7);
  CHECK(r.train_seconds == Approx(r.history[0].seconds + r.history[1].seconds));
  int ends = 0;
  for (const progress& p : shown) {
    if (!p.epoch_end) continue;
    ++ends;
    CHECK(p.samples_per_sec <= 12 / 0.5);  // 12 samples in at least half a second
  }
  CHECK(ends == 2);
  // A node's word for its forward/backward goes no further than the job has run (a lie of 10^6 s).
  job liar;
  r = liar.run([](job& j) {
    for (int64_t e = 0; e < 2; ++e)
      for (int64_t s = 0; s < 3; ++s) j.step(0, e, s), j.step(1, e, s, 2, 1, 0.5, 0, 1e6);
    j.done(0), j.done(1);
  });
  REQUIRE(r.ok);
  for (const epoch_stats& e : r.history) CHECK(e.seconds < 5);
}

TEST_CASE("coordinator: a job resumed in an epoch with samples whose loss went with a lost node leaves them out of its loss",
          "[coordinator][checkpoint]") {
  coordinator_config cc = job::small();
  cc.start.step = 1;  // one step of epoch 1 done: 4 samples, rank 1's 2 lost with its node
  cc.start.loss = 0.5;
  cc.start.correct = 1;
  cc.start.count = 4;
  cc.start.unmeasured = 2;
  job j{cc};
  train_result r = j.run([](job& j) {
    for (int64_t g = 1; g < 6; ++g) j.step(0, g / 3, g % 3), j.step(1, g / 3, g % 3);  // 2 samples, 1 right, loss 0.5 each
    j.done(0), j.done(1);
  });
  INFO(r.error);
  REQUIRE(r.ok);
  REQUIRE(r.history.size() == 2);
  CHECK(r.history[0].samples == 12);
  CHECK(r.history[0].loss == Approx(2.5 / 10));  // over the 10 measured samples, not 12
  CHECK(r.history[0].accuracy == Approx(0.5));
  CHECK(r.history[1].loss == Approx(0.25));
  CHECK(r.unmeasured == 2);
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
      // A rank reports its steps in order: one past the next means those between were lost (a connection
      // that broke under way), and the epochs and checkpoints they belong to could never be whole.
      {[](job& j) { j.step(0, 0, 0), j.step(0, 0, 2); }, "rank 0 reported step 3 of epoch 1 without its report of step 2 of the job before it: lost on the way"},
      {[](job& j) { j.step(1, 1, 1); }, "rank 1 reported step 2 of epoch 2 without its reports of steps 1-4 of the job before it"},
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

TEST_CASE("coordinator: a rank is late when the others report a step it does not, not when a minority runs ahead", "[coordinator]") {
  // A lying node reported its rank's steps far ahead of the ring, and the honest ranks, still reporting
  // step by step, were blamed; a node that held back its reports, one every 29 s, was not blamed at all.
  coordinator_config cc = job::small(1000ms, {"node tcp://10.0.0.1:5601", "node tcp://10.0.0.2:5601", "node tcp://10.0.0.3:5601"});
  cc.replicas = 3;
  cc.global_batch = 6;
  auto slowly = [](job& j, std::vector<int> ranks, std::chrono::milliseconds each) {
    for (int64_t e = 0; e < 2; ++e)
      for (int64_t s = 0; s < 3; ++s) {
        std::this_thread::sleep_for(each);
        for (int r : ranks) j.step(r, e, s);
      }
  };
  job ahead(cc);
  train_result r = ahead.run([&](job& j) {
    for (int64_t e = 0; e < 2; ++e)
      for (int64_t s = 0; s < 3; ++s) j.step(2, e, s);  // the whole job at once
    slowly(j, {0, 1}, 400ms);                            // 2.4 s in all, more than the report timeout
    j.done(0), j.done(1), j.done(2);
  });
  INFO(r.error);
  CHECK(r.ok);
  CHECK(r.history.size() == 2);
  job behind(cc);
  const auto t0 = std::chrono::steady_clock::now();
  r = behind.run([&](job& j) {
    for (int64_t s = 0; s < 3; ++s) j.step(0, 0, s), j.step(1, 0, s);
    for (int64_t s = 0; s < 3; ++s) std::this_thread::sleep_for(600ms), j.step(2, 0, s);  // reporting, 1.2 s behind
  });
  CHECK(r.error.rfind("rank(s) 2 (node tcp://10.0.0.3:5601) sent no report of step 2 of epoch 1 in 1 s after the others did", 0) == 0);
  CHECK(std::chrono::steady_clock::now() - t0 < 4s);
  // Half and half: which half lies cannot be told, so both are named.
  job two(1000ms, {"node tcp://10.0.0.1:5601", "node tcp://10.0.0.2:5601"});
  r = two.run([&](job& j) {
    for (int64_t s = 0; s < 3; ++s) j.step(1, 0, s);
    slowly(j, {0}, 600ms);
  });
  CHECK(r.error.rfind("rank(s) 0 (node tcp://10.0.0.1:5601) sent no report of step 2 of epoch 1 in 1 s after rank(s) 1 (node "
                      "tcp://10.0.0.2:5601) did, though they go on reporting: one half holds its reports back, or the other makes them up", 0) == 0);
}

TEST_CASE("coordinator: reports from before the job runs are dropped", "[coordinator]") {
  // Ranks start as it runs, so only a lying node's come before: they wrote past its per-rank clocks (not
  // made yet), and their steps counted against the job's.
  job j;
  j.step(0, 0, 0), j.step(1, 0, 0), j.done(0);
  std::this_thread::sleep_for(100ms);
  const train_result r = j.run([](job& j) {
    j.whole_job();
    j.done(0), j.done(1);
  });
  INFO(r.error);
  CHECK(r.ok);
  CHECK(r.history.size() == 2);
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

TEST_CASE("coordinator: epochs close in order, each timed, when a re-forming closes one short of a lost rank's evaluation",
          "[coordinator]") {
  // The survivors' evaluations closed epoch 2 as the ring was re-formed without rank 0, before epoch 1,
  // still short of rank 0's (lost with its node): the history came out of order, and epoch 2, never
  // started, was timed from the clock's zero (the machine's uptime).
  coordinator_config cc = job::small(0ms, {"node A", "node B", "node C"});
  cc.replicas = 3;
  cc.global_batch = 6;
  cc.epochs = 3;
  cc.evaluate = true;
  // What a progress bar is shown: an epoch's steps came before the end of the one before it, so its
  // header was printed, then the other's end, then its header again.
  auto shown = std::make_shared<std::vector<int64_t>>();
  cc.on_progress = [shown](const progress& p) { shown->push_back(p.epoch); };
  job j(cc);
  auto eval = [&j](int rank, int64_t epoch, int gen) {  // a third of 30 test samples each, or half once 2 ranks are left
    eval_report r;
    r.rank = rank, r.gen = gen, r.epoch = epoch, r.count = gen == 0 ? 10 : 15, r.correct = 5, r.loss_sum = 1;
    caf::anon_send(j.coord, r);
  };
  const train_result r = j.run([&](job& j) {
    for (int64_t s = 0; s < 3; ++s) j.step(0, 0, s, 2), j.step(1, 0, s, 2), j.step(2, 0, s, 2);
    eval(1, 0, 0), eval(2, 0, 0);  // rank 0's evaluation went with its node, and its reports of epoch 2
    for (int64_t s = 0; s < 3; ++s) j.step(1, 1, s, 2), j.step(2, 1, s, 2);
    eval(1, 1, 0), eval(2, 1, 0);
    j.step(1, 2, 0, 2), j.step(2, 2, 0, 2);
    std::this_thread::sleep_for(150ms);  // progress is shown at most 10 times a second
    lose_rank_0(j, 7);  // the ring of ranks 1 and 2, from step 2 of epoch 3
    for (int64_t s = 1; s < 3; ++s) j.step(0, 2, s, 3, 1, 0.5, 1), j.step(1, 2, s, 3, 1, 0.5, 1);
    eval(0, 2, 1), eval(1, 2, 1);
    j.done(0), j.done(1);
  });
  INFO(r.error);
  REQUIRE(r.ok);
  REQUIRE(r.history.size() == 3);
  for (int64_t e = 0; e < 3; ++e) {
    CHECK(r.history[size_t(e)].epoch == e);
    CHECK(r.history[size_t(e)].samples == 18);
    CHECK(r.history[size_t(e)].seconds < 60);
  }
  CHECK(r.train_seconds < 60);
  CHECK(r.partial_evals == 2);  // epochs 1 and 2: 20 of the 30 test samples
  CHECK(std::is_sorted(shown->begin(), shown->end()));
}
