// The coordinator's checkpoints against nodes that lie: rank 0's states and the ranks' checksums of theirs,
// held, judged and written, or given up (actors/coordinator_checkpoints.cpp).
#include <catch2/catch.hpp>
#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "tests/coordinator_job.hpp"

using namespace ringmaster;
using namespace ringmaster::test_coordinator;
using namespace std::chrono_literals;

namespace {

// The checksum of the state the stand-ins hold after k steps: 3 zeros.
uint64_t held_sum(int64_t k) {
  network_state s;
  s.steps = k;
  s.params.assign(3, 0.0f);
  return state_checksum(s);
}

// checkpoint_each_step(steps) on nodes A and B (an elastic job: faulty nodes recorded in *dropped), rank
// 0's states watched for (state_timeout 1.5 s).
coordinator_config watched(int64_t steps, const std::shared_ptr<std::vector<std::string>>& dropped) {
  coordinator_config cc = checkpoint_each_step(steps);
  cc.where = {"node A", "node B"};
  cc.report_timeout = 10000ms;
  cc.state_timeout = 1500ms;
  cc.on_faulty_node = [dropped](const std::string& where, const std::string& why) { dropped->push_back(where + ": " + why); };
  return cc;
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
  CHECK(out.checkpoints_skipped == 12);  // each counted, for the summary and the report
  REQUIRE(rec.events->size() == 1);
  CHECK(rec.events->front() == "skipped the checkpoint after step 1: 8 states waited for their steps' reports");
  INFO(out.error);
  CHECK(out.ok);
}

TEST_CASE("coordinator: a checkpoint whose state was let go as later ones waited does not make rank 0's node look as if it "
          "withheld it", "[coordinator]") {
  // An honest node with checkpoints every step: its states run 9 ahead of the reports (the coordinator
  // is busy), so the state after step 1 is let go. Its metrics come after, and then nothing for 2.5 s
  // (an evaluation, say). They used to wait for a state that was gone, and the node was named as
  // withholding it after state_timeout (1.5 s).
  auto dropped = std::make_shared<std::vector<std::string>>();
  coordinator_config cc = watched(9, dropped);
  const recorded rec(&cc);
  job j(cc);
  train_result out = j.run([](job& j) {
    for (int64_t k = 1; k <= 9; ++k) send_state(j, k, 3);
    j.step(0, 0, 0), j.step(1, 0, 0);
    std::this_thread::sleep_for(2500ms);
    for (int64_t s = 1; s < 9; ++s) j.step(0, 0, s), j.step(1, 0, s);
    j.done(0), j.done(1);
  });
  INFO(out.error);
  CHECK(out.ok);
  CHECK(dropped->empty());
  CHECK(*rec.written == std::vector<int64_t>{2, 3, 4, 5, 6, 7, 8, 9});
  CHECK(*rec.events == std::vector<std::string>{"skipped the checkpoint after step 1: 8 states waited for their steps' reports"});
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
  CHECK(out.checkpoints_skipped == 1);
  REQUIRE(rec.events->size() == 1);
  CHECK(rec.events->front() == "skipped the checkpoint after step 2: rank 0's node sent no state for it, only for a later step");
  INFO(out.error);
  CHECK(out.ok);
}

TEST_CASE("coordinator: a checkpoint after the last step that holds other weights than the final ones is an error", "[coordinator]") {
  // As rank 0's node would make it by sending a state that is not its own: --save and a resume of the
  // finished run would disagree. Checked where the replicas differ too (rank 1 apart: a node found faulty
  // as the job ended finishes with the others), since rank 0's final weights are what is saved.
  for (const bool apart : {false, true})
    for (float value : {0.0f, 1234.5f}) {
      INFO("rank 1 apart " << apart << ", rank 0's last state of " << value);
      coordinator_config cc = checkpoint_each_step(3);
      const recorded rec(&cc);
      job j(cc, apart ? stand_in_apart : stand_in);
      train_result out = j.run([value](job& j) {
        for (int64_t k = 1; k <= 3; ++k) send_state(j, k, 3, k < 3 ? 7.0f : value);  // earlier ones are not compared
        for (int64_t s = 0; s < 3; ++s) j.step(0, 0, s), j.step(1, 0, s);
        j.done(0), j.done(1);
      });
      CHECK(*rec.written == std::vector<int64_t>{1, 2, 3});
      INFO(out.error);
      CHECK(out.ok == (value == 0.0f));
      if (value == 0.0f) CHECK(out.identical == !apart);
      else if (!apart)
        CHECK(out.error == "the checkpoint after the last step (3) holds other weights than every rank's final ones: rank 0 sent a "
                           "state that was not its own; do not resume from it");
      else
        CHECK(out.error == "the checkpoint after the last step (3) holds other weights than rank 0's final ones, and the replicas "
                           "differ: the node of rank 0 sent a state or final weights not its own; use neither");
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
      j.step(0, 0, k - 1, 2, 1, 0.5, 0, 0, held_sum(k));  // what the ranks hold after step k
      j.step(1, 0, k - 1, 2, 1, 0.5, 0, 0, held_sum(k));
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
  // no later state can take the place of rank 0's: that checkpoint is not written, and the result is
  // rank 1's final weights, the majority's (the job used to fail, losing its result).
  auto run = [](int64_t steps) {
    auto dropped = std::make_shared<std::vector<std::string>>();
    coordinator_config cc = watched(steps, dropped);
    const recorded rec(&cc);
    job j(cc);
    train_result out = j.run([steps](job& j) {
      for (int64_t k = 1; k <= steps; ++k) {
        send_state(j, k, 3, k == 2 ? 7.0f : 0.0f);
        j.step(0, 0, k - 1, 2, 1, 0.5, 0, 0, held_sum(k));
        j.step(1, 0, k - 1, 2, 1, 0.5, 0, 0, held_sum(k));
      }
      j.done(0), j.done(1);
    });
    return std::make_tuple(out, *rec.written, *rec.events, *dropped);
  };
  auto [out, written, events, dropped] = run(3);
  INFO(out.error);
  CHECK(out.ok);
  CHECK(written == std::vector<int64_t>{1, 3});
  CHECK(out.checkpoints_skipped == 1);  // the summary and the report count it (they said 0)
  CHECK(dropped == std::vector<std::string>{"node A: it sent rank 0's state after step 2, which its own ranks do not hold (a faulty or lying node)"});
  CHECK(std::find(events.begin(), events.end(),
                  "the checkpoint after step 2 was not written: rank 0's node, node A, is faulty: it sent rank 0's state after step 2, "
                  "which its own ranks do not hold") != events.end());
  std::tie(out, written, events, dropped) = run(2);  // step 2 is the last
  INFO(out.error);
  CHECK(out.ok);
  CHECK(out.result_rank == 1);
  CHECK(out.last_checkpoint_refused);
  CHECK(written == std::vector<int64_t>{1});
  CHECK(out.checkpoints_skipped == 1);
  CHECK(dropped == std::vector<std::string>{"node A: it sent rank 0's state after step 2, which its own ranks do not hold (a faulty or lying node)"});
  CHECK(std::find(events.begin(), events.end(),
                  "the checkpoint after step 2 was not written: rank 0's node, node A, is faulty: it sent rank 0's state after step 2, "
                  "which its own ranks do not hold; the result is the final weights of rank 1 (node B), which holds the majority's "
                  "state, and the last checkpoint, after step 1, is kept") != events.end());
}

TEST_CASE("coordinator: a node the checksums show faulty after the last step is handed on, and rank 0's state, the majority's, "
          "is written", "[coordinator]") {
  // 3 ranks on nodes A, B and C. After the last step node C's rank holds another state than A and B, which
  // hold rank 0's: the job's result stands. The launcher keeps C to the end (drop_faulty: no ring is
  // re-formed while the final weights come in); the job used to fail here, with no checkpoint of its result.
  // With --on-node-loss abort (no on_faulty_node) the job fails naming C, once the majority's state is
  // written (none was, and the words cast rank 0 as the suspect).
  for (const bool elastic : {true, false}) {
    INFO("elastic " << elastic);
    auto dropped = std::make_shared<std::vector<std::string>>();
    coordinator_config cc = watched(2, dropped);
    if (!elastic) cc.on_faulty_node = nullptr;
    cc.replicas = 3;
    cc.global_batch = 6;
    cc.where = {"node A", "node B", "node C"};
    const recorded rec(&cc);
    job j(cc);
    train_result out = j.run([](job& j) {
      for (int64_t k = 1; k <= 2; ++k) {
        send_state(j, k, 3);
        for (int r = 0; r < 3; ++r) j.step(r, 0, k - 1, 2, 1, 0.5, 0, 0, r == 2 && k == 2 ? held_sum(k) + 1 : held_sum(k));
      }
      j.done(0), j.done(1), j.done(2);
    });
    INFO(out.error);
    CHECK(*rec.written == std::vector<int64_t>{1, 2});
    const std::string why = "its ranks hold another state after step 2 than node A and node B hold (a faulty or lying node)";
    CHECK(out.ok == elastic);
    if (elastic) CHECK(*dropped == std::vector<std::string>{"node C: " + why});
    else
      CHECK(out.error == "node C is faulty: " + why + "; --on-node-loss abort ends the job (rank 2 (node C): another state than "
                         "rank 0's); the checkpoint after step 2, rank 0's state, which the majority of nodes holds, is written");
  }
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
    for (int64_t k = 1; k <= steps; ++k) j.step(1, 0, k - 1, 2, 1, 0.5, 0, 0, held_sum(k));
    for (int64_t k = 1; k <= steps; k += 5) {
      for (int64_t i = k; i < k + 5; ++i) j.step(0, 0, i - 1, 2, 1, 0.5, 0, 0, held_sum(i));
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
    auto dropped = std::make_shared<std::vector<std::string>>();
    coordinator_config cc = watched(4, dropped);
    if (!elastic) cc.on_faulty_node = nullptr;
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
  CHECK(out.checkpoints_skipped == 1);  // step 2's
  CHECK(dropped == std::vector<std::string>{"node A: it sent no state for the checkpoint after step 2 within 1.5 s of that step's end, "
                                            "nor one for a later step (a faulty or lying node, or a link too slow for its states)"});
  std::tie(out, written, dropped) = run(false);  // without the check, state 3 would supersede 2 and the job end well
  CHECK_FALSE(out.ok);
  CHECK(out.error == "rank 0's node (node A) sent no state for the checkpoint after step 2 within 1.5 s of that step's end, nor one for a "
                     "later step (a faulty or lying node, or a link too slow for its states); the last checkpoint, after step 1, is kept");
  CHECK(written == std::vector<int64_t>{1});
}

TEST_CASE("coordinator: the time it takes to write a checkpoint is not counted against rank 0's node", "[coordinator]") {
  // Writing the state after step 1 takes 2.5 s (a slow disk), longer than state_timeout; the state after
  // step 2 came meanwhile, behind a tick in the coordinator's mailbox.
  auto dropped = std::make_shared<std::vector<std::string>>();
  coordinator_config cc = watched(4, dropped);
  const recorded rec(&cc);
  cc.on_checkpoint = [w = rec.written](const job_progress& p, const network_state&) {
    w->push_back(p.step);
    if (p.step == 1) std::this_thread::sleep_for(2500ms);
    return std::string();
  };
  job j(cc);
  train_result out = j.run([](job& j) {
    for (int64_t s = 0; s < 2; ++s) j.step(0, 0, s, 2, 1, 0.5, 0, 0, held_sum(s + 1)), j.step(1, 0, s, 2, 1, 0.5, 0, 0, held_sum(s + 1));
    send_state(j, 1, 3);
    std::this_thread::sleep_for(1200ms);
    send_state(j, 2, 3);
    for (int64_t s = 2; s < 4; ++s) j.step(0, 0, s), j.step(1, 0, s);
    send_state(j, 3, 3), send_state(j, 4, 3);
    j.done(0), j.done(1);
  });
  INFO(out.error);
  CHECK(out.ok);
  CHECK(dropped->empty());
  CHECK(*rec.written == std::vector<int64_t>{1, 2, 3, 4});
}

TEST_CASE("coordinator: states for steps far ahead do not keep a node that withholds the one due from being named",
          "[coordinator]") {
  // Rank 0's node holds back the state after step 2 and sends a made-up one for step 1039, far past the
  // steps complete, every half second: no honest node is that far ahead, so it is no news from it.
  auto dropped = std::make_shared<std::vector<std::string>>();
  coordinator_config cc = watched(1040, dropped);
  const recorded rec(&cc);
  job j(cc);
  j.run(
      [](job& j) {
        send_state(j, 1, 3);
        for (int64_t s = 0; s < 2; ++s) j.step(0, 0, s), j.step(1, 0, s);
        for (int i = 0; i < 8; ++i) {
          send_state(j, 1039, 3, 7.0f);
          std::this_thread::sleep_for(500ms);
        }
      },
      5000ms);
  REQUIRE(dropped->size() == 1);
  CHECK(dropped->front().rfind("node A: it sent no state for the checkpoint after step 2 within 1.5 s", 0) == 0);
}

TEST_CASE("coordinator: rank 0's node that gives no checksum of its own and sends another state fails the job",
          "[coordinator]") {
  // Two nodes: A reports no checksums (0, "none") and sends states of 7s; B holds zeros. B alone cannot
  // bar A, and A must not go on with every checkpoint refused until the job's end.
  auto dropped = std::make_shared<std::vector<std::string>>();
  coordinator_config cc = watched(4, dropped);
  const recorded rec(&cc);
  job j(cc);
  train_result out = j.run([](job& j) {
    for (int64_t k = 1; k <= 4; ++k) {
      j.step(0, 0, k - 1, 2, 1, 0.5, 0, 0, 0);
      j.step(1, 0, k - 1, 2, 1, 0.5, 0, 0, held_sum(k));
      send_state(j, k, 3, 7.0f);
    }
    j.done(0), j.done(1);
  });
  CHECK_FALSE(out.ok);
  CHECK(out.error.rfind("the state rank 0 (node A) sent after step 1 is not the one held by rank 1 (node B): no checkpoint was written", 0) == 0);
  CHECK(dropped->empty());
  CHECK(rec.written->empty());
}

TEST_CASE("coordinator: where rank 0's state after the last step is not the majority's, the result is a rank of the "
          "majority's nodes, picked among the ranks of the ring that finishes", "[coordinator]") {
  // 3 ranks on nodes A, B and C, 2 steps. After step 2 node A sends a state of 7s its own ranks do not
  // hold: that checkpoint is given up, and the result comes from B or C. Then node A is lost, and the ring
  // re-forms as B (rank 0) and C (rank 1): B sends its state for step 2, which is not taken (that
  // checkpoint's metrics are long gone: it could never be written, and the job failed waiting for it),
  // and the result is rank 0's, B's (picked by the numbers the votes had in the old ring, it was C's).
  auto dropped = std::make_shared<std::vector<std::string>>();
  coordinator_config cc = watched(2, dropped);
  cc.replicas = 3;
  cc.where = {"node A", "node B", "node C"};
  const recorded rec(&cc);
  job j(cc);
  train_result out = j.run([](job& j) {
    for (int64_t k = 1; k <= 2; ++k) {
      send_state(j, k, 3, k == 2 ? 7.0f : 0.0f);
      j.step(0, 0, k - 1, 2, 1, 0.5, 0, 0, held_sum(k));
      j.step(1, 0, k - 1, 1, 1, 0.5, 0, 0, held_sum(k));
      j.step(2, 0, k - 1, 1, 1, 0.5, 0, 0, held_sum(k));
    }
    lose_rank_0(j, 2);
    send_state(j, 2, 3);
    j.done(0), j.done(1);
  });
  INFO(out.error);
  REQUIRE(out.ok);
  CHECK(*rec.written == std::vector<int64_t>{1});
  CHECK(out.result_rank == 0);
  CHECK(out.last_checkpoint_refused);  // though rank 0's weights are the result, that checkpoint was not written
  REQUIRE(out.checksums.size() == 2);
  CHECK(out.checksums[0] == fnv1a(out.weights.data(), out.weights.size()));
  CHECK(*dropped == std::vector<std::string>{"node A: it sent rank 0's state after step 2, which its own ranks do not hold (a faulty or lying node)"});
  CHECK(std::find(rec.events->begin(), rec.events->end(),
                  "the checkpoint after step 2 was not written: rank 0's node, node A, is faulty: it sent rank 0's state after step 2, "
                  "which its own ranks do not hold; the result is the final weights of rank 1 (node B), which holds the majority's "
                  "state, and the last checkpoint, after step 1, is kept") != rec.events->end());
}

TEST_CASE("coordinator: a node lost after the last step (in the evaluation) changed no rank of any step the checkpoint holds",
          "[coordinator]") {
  // 3 ranks on nodes A, B and C, one epoch of 2 steps, evaluated. Node A (rank 0's) is lost once both
  // steps are done; B and C evaluate again, and B, the new rank 0, sends the state. The checkpoint is the
  // uninterrupted run's: a resume of it must not say its ranks changed on the way (it said 1 time).
  coordinator_config cc = checkpoint_each_step(2);
  cc.replicas = 3;
  cc.evaluate = true;
  cc.where = {"node A", "node B", "node C"};
  auto changed = std::make_shared<std::vector<int>>(), replicas = std::make_shared<std::vector<int>>();
  cc.on_checkpoint = [changed, replicas](const job_progress& p, const network_state&) {
    changed->push_back(p.ranks_changed);
    replicas->push_back(p.replicas);
    return std::string();
  };
  job j(cc);
  train_result out = j.run([](job& j) {
    send_state(j, 1, 3);
    for (int64_t s = 0; s < 2; ++s) j.step(0, 0, s, 2), j.step(1, 0, s, 1), j.step(2, 0, s, 1);
    lose_rank_0(j, 2);
    j.eval(0, 1, 0, 10, 5), j.eval(1, 1, 0, 10, 5);
    send_state(j, 2, 3);
    j.done(0), j.done(1);  // the new ring's numbers
  });
  INFO(out.error);
  REQUIRE(out.ok);
  REQUIRE(out.losses.size() == 1);
  CHECK(*changed == std::vector<int>{0, 0});
  CHECK(*replicas == std::vector<int>{3, 3});  // the ring that ran the steps, not the 2 left after them
}
