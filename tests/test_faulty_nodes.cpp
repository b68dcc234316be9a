// Faulty and lying nodes (actors/state_verdict.hpp): nodes started to lie in the states they send or in
// their ranks' checksums, found out at checkpoints, stops and re-formings by the majority's word, dropped
// (or kept to the end, found as it ended) so that nothing is written from a state not the majority's.
#include <catch2/catch.hpp>

#include "actors/checkpoint.hpp"
#include "tests/elastic_util.hpp"

using namespace ringmaster;
using namespace ringmaster::elastic_test;
using namespace std::chrono_literals;

TEST_CASE("elastic: a re-forming that moves no state judges the paused ranks' checksums, and drops a node they show faulty",
          "[nodes][elastic][stall]") {
  // Node 3's rank hangs after step 15, so every other rank pauses after step 15 and no state moves; node 1
  // reports checksums not its rank's own. Nodes 0 and 2 hold one state: node 1 is dropped there, not
  // left in the new ring until a checkpoint (with none, never).
  test::daemons nodes = start_nodes_one_odd(3, 1, {"--lie-in-sums"});
  test::daemons hung = start_nodes_one_hung(1, 0, 15);
  nodes.push_back(std::move(hung[0]));
  remote_options ro;
  ro.rejoin = false;
  event_log events;
  ro.on_event = events.hook();
  double took = 0;
  train_result r = run_with_hung_rank(nodes, ro, 2, &took);
  INFO(r.error);
  REQUIRE(r.ok);
  for (const epoch_stats& e : r.history) CHECK(e.samples == 3000);
  REQUIRE(r.losses.size() == 2);
  CHECK(r.losses[0].node == nodes[3]->endpoint);
  CHECK(r.losses[1].node == nodes[1]->endpoint);
  CHECK(r.losses[1].why == "its ranks hold another state after step 15 than node " + nodes[0]->endpoint + " and node " +
                               nodes[2]->endpoint + " hold (a faulty or lying node)");
  CHECK(events.count("lost node " + nodes[1]->endpoint + " (rank 1): " + r.losses[1].why +
                                                     "; the others go on without it") == 1);
  CHECK(r.checksums.size() == 2);  // nodes 0 and 2, bit-identical
  CHECK(r.identical);
}

TEST_CASE("checkpoints on nodes: a node that sends a state not its ranks' own is dropped, or fails the job, and none is written from it",
          "[nodes][elastic][checkpoint]") {
  // Rank 0's node changes a parameter of each state it sends (finite and plausible: state_fault passes
  // it), as a faulty or lying node could; its ranks and the other node report their states' checksums.
  test::daemons nodes = start_nodes_one_odd(2, 0, {"--lie-in-states"});
  const std::string dir = "/tmp/ringmaster-test-lying-states-" + std::to_string(getpid());
  auto checkpoints_written = [&dir] {
    size_t n = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir)) n += e.path().filename().string().rfind("ckpt-", 0) == 0;
    return n;
  };
  remote_options ro = on_small_data(nodes);  // 50 steps an epoch
  const std::string a = nodes[0]->endpoint, b = nodes[1]->endpoint;
  std::atomic<int> signal{0};
  std::atomic<bool> go{false};
  // Elastic (the default): its own ranks' checksums give it away. It is dropped as a lost node, the other
  // goes on alone, and the checkpoints written are the honest node's, from the second epoch's end on.
  std::filesystem::remove_all(dir);
  train_config c = stoppable_job(dir, &signal, &go, 1000);  // no signal
  std::vector<std::string> written;
  event_log events;
  c.on_checkpoint = [&](const std::string& path) { written.push_back(std::filesystem::path(path).filename()); };
  ro.on_event = events.hook();
  train_result r = train_remote(c, ro);
  INFO(r.error);
  REQUIRE(r.ok);
  // None from the lie. The ring re-formed without it some steps after step 50 (about 100 under ctest's
  // load): where that is past step 100, the lie's state for that checkpoint is refused too.
  REQUIRE_FALSE(written.empty());
  if (written.size() == 1) CHECK(events.said("the checkpoint after step 100 was not written: "));
  else CHECK(written == std::vector<std::string>{checkpoint_name(2, 0), checkpoint_name(3, 0)});
  CHECK(written.back() == checkpoint_name(3, 0));
  CHECK(events.count("the checkpoint after step 50 was not written: rank 0's node, node " + a +
                                                     ", is faulty: it sent rank 0's state after step 50, which its own ranks do not hold") == 1);
  c.on_checkpoint = nullptr;
  ro.on_event = nullptr;
  REQUIRE(r.losses.size() == 1);
  CHECK(r.losses[0].node == a);
  CHECK(r.losses[0].why == "it sent rank 0's state after step 50, which its own ranks do not hold (a faulty or lying node)");
  CHECK(r.losses[0].survivors == 1);
  CHECK(r.joins.empty());  // never taken back, though it still answers
  CHECK(r.history.size() == 3);
  checkpoint last;
  std::string err;
  REQUIRE(read_checkpoint(r.checkpoint, layer_registry::with_builtins(), &last, &err));
  CHECK(last.state.steps == 150);
  CHECK(last.state.params == r.weights);
  // Found out at the last step (its checkpoint the first due): too late to re-form the ring, node A
  // finishes with the others. That checkpoint is not written, and the result is rank 1's final weights,
  // node B's, the majority's (the job used to fail here, losing its result).
  std::filesystem::remove_all(dir);
  written.clear();
  c.epochs = 1;
  event_log at_end;
  ro.on_event = at_end.hook();
  const train_result late = train_remote(c, ro);
  ro.on_event = nullptr;
  INFO(late.error);
  REQUIRE(late.ok);
  CHECK(late.losses.empty());
  REQUIRE(late.faults.size() == 1);
  CHECK(late.faults[0].node == a);
  CHECK(late.faults[0].why == "it sent rank 0's state after step 50, which its own ranks do not hold (a faulty or lying node)");
  CHECK(at_end.count("the checkpoint after step 50 was not written: rank 0's node, node " + a + ", is faulty: it sent rank 0's state after step 50, "
                     "which its own ranks do not hold; the result is the final weights of rank 1 (node " + b + "), which holds the majority's state") == 1);
  CHECK(late.result_rank == 1);
  CHECK(late.last_checkpoint_refused);
  REQUIRE(late.checksums.size() == 2);
  CHECK(fnv1a(late.weights.data(), late.weights.size()) == late.checksums[1]);
  CHECK(late.identical);  // it lied in the states it sent only
  CHECK(written.empty());
  CHECK(late.checkpoint.empty());
  c.epochs = 3;
  // --on-node-loss abort: the job fails, naming every rank, and nothing was written.
  std::filesystem::remove_all(dir);
  ro.abort_on_node_loss = true;
  r = train_remote(c, ro);
  INFO(r.error);
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("the state rank 0 (node " + a + ") sent after step 50 is not the one held by ranks 0 (node " + a + "), 1 (node " + b +
                     "): no checkpoint was written from it (a faulty or lying node: node " + a +
                     ", it sent rank 0's state after step 50, which its own ranks do not hold)") != std::string::npos);
  CHECK(r.checkpoint.empty());
  CHECK(checkpoints_written() == 0);
  ro.abort_on_node_loss = false;
  // The launcher says so, and that none was written (not "yet": the first was due and refused).
  std::filesystem::remove_all(dir);
  const test::run_result l = run_launcher("--nodes " + test::node_list(nodes) + " --model 784-64-10 --batch 60 --epochs 2 --limit-train 3000 " +
                                              "--limit-test 300 -q --on-node-loss abort --checkpoint-dir " + dir, [](const std::string&) {});
  INFO(l.out);
  CHECK(l.status == 1);
  CHECK(l.out.find("training failed: the state rank 0 (node " + a + ") sent after step 50 is not the one held by") != std::string::npos);
  CHECK(l.out.find("ringmaster-mnist: no checkpoint was written; they are due at the end of every epoch") != std::string::npos);
  CHECK(checkpoints_written() == 0);
  // Elastic and found out at the last step, its summary says whose weights are the result.
  std::filesystem::remove_all(dir);
  const test::run_result end = run_launcher("--nodes " + test::node_list(nodes) + " --model 784-64-10 --batch 60 --epochs 1 --limit-train 3000 " +
                                                "--limit-test 300 -q --checkpoint-dir " + dir, [](const std::string&) {});
  INFO(end.out);
  CHECK(end.status == 0);
  CHECK(end.out.find("Faulty node " + a + " (rank 0): it sent rank 0's state after step 50, which its own ranks do not hold") != std::string::npos);
  CHECK(end.out.find("The result is rank 1's final weights, which hold the majority's state; rank 0's node was faulty, and the checkpoint "
                     "after the last step was not written from it") != std::string::npos);
  CHECK(checkpoints_written() == 0);
  // Stopped by a signal mid-epoch, before any checkpoint was due: the state of the stop is judged as well.
  // Elastic, node A is dropped and the stop's checkpoint is the honest node's state (the job used to end
  // with none); with --on-node-loss abort none is written, and the error names node A.
  for (const bool abort : {false, true}) {
    INFO("abort " << abort);
    std::filesystem::remove_all(dir);
    ro.abort_on_node_loss = abort;
    event_log said;
    ro.on_event = said.hook();
    r = stop_early(dir, ro);
    ro.on_event = nullptr;
    INFO(r.error);
    CHECK(r.interrupted == SIGTERM);
    if (abort) {
      CHECK(r.error.find("no checkpoint was written at the stop: node " + a + " sent a state after step ") != std::string::npos);
      CHECK(r.error.find(" that is not the one held by ranks 0 (node " + a + "), 1 (node " + b + ") (a faulty or lying node: node " + a +
                         ", it sent rank 0's state after step ") != std::string::npos);
      CHECK(r.stopped_after == -1);
      CHECK(checkpoints_written() == 0);
      continue;
    }
    REQUIRE(r.stopped_after > 0);
    REQUIRE(r.losses.size() == 1);
    CHECK(r.losses[0].node == a);
    CHECK(r.losses[0].why == "it sent rank 0's state after step " + std::to_string(r.stopped_after) +
                                 ", which its own ranks do not hold (a faulty or lying node)");
    // Its state was not the majority's: the other paused again and sent its own.
    CHECK(said.count("lost node " + a + " (rank 0): " + r.losses[0].why + "; the others pause again for the stop's state") == 1);
    CHECK(checkpoints_written() == 1);
    REQUIRE(read_checkpoint(r.checkpoint, layer_registry::with_builtins(), &last, &err));
    CHECK(last.state.steps == r.stopped_after);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("checkpoints on nodes: of 3 nodes, one whose ranks' checksums the other two contradict is dropped, and the "
          "checkpoints go on", "[nodes][elastic][checkpoint]") {
  // Node 1 is not rank 0's: it changes every checksum of its rank's state it reports. Rank 0's state is
  // the one nodes 0 and 2 hold, so it is written, and node 1 is dropped as lost.
  test::daemons nodes = start_nodes_one_odd(3, 1, {"--lie-in-sums"});
  const std::string dir = "/tmp/ringmaster-test-lying-sums-" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  train_config c = small_job(2);  // 50 steps an epoch; both checkpoints are kept
  c.checkpoint_dir = dir;
  const remote_options ro = on_small_data(nodes);
  const train_result r = train_remote(c, ro);
  INFO(r.error);
  REQUIRE(r.ok);
  REQUIRE(r.losses.size() == 1);
  CHECK(r.losses[0].node == nodes[1]->endpoint);
  CHECK(r.losses[0].why == "its ranks hold another state after step 50 than node " + nodes[0]->endpoint + " and node " + nodes[2]->endpoint +
                               " hold (a faulty or lying node)");
  CHECK(r.losses[0].survivors == 2);
  REQUIRE(r.history.size() == 2);
  for (const epoch_stats& e : r.history) CHECK(e.samples == 3000);
  // The first epoch's checkpoint was written from the majority's state, and the last one holds the result.
  checkpoint first, last;
  std::string err;
  REQUIRE(read_checkpoint(dir + "/" + checkpoint_name(1, 0), layer_registry::with_builtins(), &first, &err));
  CHECK(first.state.steps == 50);
  REQUIRE(read_checkpoint(r.checkpoint, layer_registry::with_builtins(), &last, &err));
  CHECK(last.state.steps == 100);
  CHECK(last.state.params == r.weights);
  // The same node found out as the last step ends (checkpoints due after steps 49 and 50 of 50): no ring
  // is re-formed while the final weights come in. It finishes with the others, named as faulty, and the
  // checkpoint after the last step is the majority's state, the result (the job used to fail here).
  std::filesystem::remove_all(dir);
  c.epochs = 1;
  c.checkpoint_every = 49;
  const train_result late = train_remote(c, ro);
  INFO(late.error);
  REQUIRE(late.ok);
  CHECK(late.losses.empty());
  REQUIRE(late.faults.size() == 1);
  CHECK(late.faults[0].node == nodes[1]->endpoint);
  CHECK(late.faults[0].ranks == "1");
  CHECK(late.faults[0].why == "its ranks hold another state after step 49 than node " + nodes[0]->endpoint + " and node " +
                                  nodes[2]->endpoint + " hold (a faulty or lying node)");
  CHECK(late.identical);  // it lied in its checksums only
  REQUIRE(read_checkpoint(late.checkpoint, layer_registry::with_builtins(), &last, &err));
  CHECK(last.state.steps == 50);
  CHECK(last.state.params == late.weights);
  // The launcher's summary and report say so.
  std::filesystem::remove_all(dir);
  const std::string json = dir + ".json";
  const test::run_result l = run_launcher("--nodes " + test::node_list(nodes) + " --model 784-64-10 --batch 60 --epochs 1 --limit-train 3000 " +
                                              "--limit-test 300 -q --checkpoint-every 49 --checkpoint-dir " + dir + " --report-json " + json,
                                          [](const std::string&) {});
  INFO(l.out);
  CHECK(l.status == 0);
  CHECK(l.out.find("Faulty node " + nodes[1]->endpoint + " (rank 1): its ranks hold another state after step 49 than node ") != std::string::npos);
  CHECK(l.out.find("(a faulty or lying node); found as the job ended, it finished with the others") != std::string::npos);
  const nlohmann::json rep = report(json);
  REQUIRE(rep["node_faults"].size() == 1);
  CHECK(rep["node_faults"][0]["node"] == nodes[1]->endpoint);
  CHECK(rep["node_losses"].empty());
  std::remove(json.c_str());
  // Stopped by a signal before any checkpoint was due: the paused ranks' sums are judged the same way.
  // Node 1 contradicts nodes 0 and 2, which hold the state rank 0's node sent: it is dropped, and the
  // stop's checkpoint is written (the job used to end with none).
  std::filesystem::remove_all(dir);
  event_log events;
  remote_options watched = ro;
  watched.on_event = events.hook();
  const train_result stopped = stop_early(dir, watched);
  INFO(stopped.error);
  CHECK(stopped.interrupted == SIGTERM);
  REQUIRE(stopped.stopped_after > 0);
  REQUIRE(stopped.losses.size() == 1);
  CHECK(stopped.losses[0].node == nodes[1]->endpoint);
  CHECK(stopped.losses[0].why == "its ranks hold another state after step " + std::to_string(stopped.stopped_after) + " than node " +
                                     nodes[0]->endpoint + " and node " + nodes[2]->endpoint + " hold (a faulty or lying node)");
  // The state in hand was the majority's: written with no second pause and transfer.
  CHECK(events.count("lost node " + nodes[1]->endpoint + " (rank 1): " + stopped.losses[0].why +
                                                     "; the stop's checkpoint is the state in hand, the majority's") == 1);
  REQUIRE(read_checkpoint(stopped.checkpoint, layer_registry::with_builtins(), &last, &err));
  CHECK(last.state.steps == stopped.stopped_after);
  std::filesystem::remove_all(dir);
}

TEST_CASE("checkpoints on nodes: two of 5 nodes found faulty at once at a stop are both dropped, each named with the ranks "
          "left", "[nodes][elastic][checkpoint]") {
  // Nodes 1 and 2 change the checksums of their ranks' states; nodes 0, 3 and 4 hold the state rank 0's
  // node sent, the majority's. Stopped by SIGTERM, both are dropped and the stop's checkpoint is written
  // from the state in hand. Each loss counts the 3 ranks left (the first counted the second's rank too).
  test::daemons nodes;
  for (int i = 0; i < 5; ++i) {
    std::vector<std::string> argv{RINGMASTER_NODE_BIN};
    if (i == 1 || i == 2) argv.push_back("--lie-in-sums");
    nodes.push_back(std::make_unique<test::daemon_process>(argv, test::free_endpoint(), "cpu:1", RINGMASTER_DATA_DIR));
  }
  std::this_thread::sleep_for(300ms);
  const std::string dir = "/tmp/ringmaster-test-two-liars-" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  const train_result r = stop_early(dir, on_small_data(nodes));
  INFO(r.error);
  CHECK(r.interrupted == SIGTERM);
  REQUIRE(r.stopped_after > 0);
  REQUIRE(r.losses.size() == 2);
  std::set<std::string> lost;
  for (const node_loss& l : r.losses) {
    lost.insert(l.node);
    CHECK(l.survivors == 3);
    CHECK(l.why.find("its ranks hold another state after step " + std::to_string(r.stopped_after)) == 0);
  }
  CHECK(lost == std::set<std::string>{nodes[1]->endpoint, nodes[2]->endpoint});
  checkpoint last;
  std::string err;
  REQUIRE(read_checkpoint(r.checkpoint, layer_registry::with_builtins(), &last, &err));
  CHECK(last.state.steps == r.stopped_after);
  std::filesystem::remove_all(dir);
}

TEST_CASE("checkpoints on nodes: a lying node's step record of a ring generation to come, at the job's last step, does not keep "
          "it from being dropped", "[nodes][elastic][checkpoint]") {
  // The launcher took the record for the ring's progress, which the coordinator drops: the job looked
  // at its end, so the node whose states lie was kept to the end and no checkpoint written after it.
  test::daemons nodes = start_nodes_one_odd(2, 0, {"--lie-in-states", "--lie-in-steps"});
  const std::string dir = "/tmp/ringmaster-test-lying-steps-" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  std::atomic<int> signal{0};
  std::atomic<bool> go{false};
  const train_result r = train_remote(stoppable_job(dir, &signal, &go, 1000), on_small_data(nodes));  // no signal
  std::filesystem::remove_all(dir);
  INFO(r.error);
  REQUIRE(r.ok);
  CHECK(r.faults.empty());
  REQUIRE(r.losses.size() == 1);
  CHECK(r.losses[0].node == nodes[0]->endpoint);
  CHECK(r.losses[0].why == "it sent rank 0's state after step 50, which its own ranks do not hold (a faulty or lying node)");
  CHECK(r.history.size() == 3);
}
