// Launchers that misbehave towards a node: jobs started and stopped in a loop, weights and states asked
// for and never read, a slow reader of checkpoints, a malformed pause (test_nodes_security.cpp).
#include <catch2/catch.hpp>

#include "actors/report_kv.hpp"
#include "tests/node_peers.hpp"

using namespace ringmaster;
using namespace ringmaster::node_peers;
using namespace std::chrono_literals;

TEST_CASE("a launcher that starts and stops jobs in a loop is told the node is busy loading, not given a data thread each",
          "[nodes]") {
  logged_node a("node-a");
  std::string err;
  zmq::context_t ctx;
  zmq::socket_t s = client(ctx, a.node->endpoint());
  s.set(zmq::sockopt::rcvtimeo, 10);  // jobs come faster than a data thread copies 50,000 samples
  const std::string reason = "reason=changed my mind\n";
  std::vector<std::string> refusals;
  for (int i = 0; i < 16; ++i) {
    const uint64_t id = 1000 + uint64_t(i);
    send_own_job(s, a.node->endpoint(), "node-a", "784-64-10", id, 50000);  // a copy of 50,000 samples a data thread
    wire::header abort_h;
    abort_h.type = wire::msg_type::abort;
    abort_h.job_id = id;
    abort_h.payload_bytes = reason.size();
    test::send_raw(s, abort_h, {zmq::buffer(reason)});
    for (zmq::message_t head, body; s.recv(head) && head.more() && s.recv(body);) {
      wire::header rh;
      wire::kv_map kv;
      if (wire::decode(head.data(), head.size(), &rh, &err) && rh.type == wire::msg_type::error && wire::decode_kv(body.to_string(), &kv, &err))
        refusals.push_back(kv["error"]);
    }
  }
  CHECK(std::count(refusals.begin(), refusals.end(), "node node-a: busy loading the data of jobs stopped before they ran") >= 1);
  // Once they are done, a job is taken again.
  for (int i = 0; i < 100; ++i) std::this_thread::sleep_for(50ms);
  train_config again = small_job();
  remote_options ro;
  ro.nodes = {a.node->endpoint()};
  ro.limit_train = 600;
  ro.limit_test = 100;
  train_result r = train_remote(again, ro);
  INFO(r.error);
  CHECK(r.ok);
}

TEST_CASE("a launcher that asks for the weights again and again without reading makes the node hold one copy, not one each",
          "[nodes]") {
  logged_node a("node-a");
  zmq::context_t ctx;
  zmq::socket_t s = client(ctx, a.node->endpoint());  // the job's launcher, as it sends the job
  s.set(zmq::sockopt::rcvtimeo, 20000);
  s.set(zmq::sockopt::rcvhwm, 1);  // it reads nothing for now: let the kernel's buffers fill
  const uint64_t id = 4242;
  send_own_job(s, a.node->endpoint(), "node-a", "784-512-512-10", id, 600);  // 2.7 MB of weights a copy
  await_job_ack(s);
  wire::header rh;
  std::string text;
  wire::header beat;  // the launcher's heartbeats, or the node ends the job
  beat.type = wire::msg_type::heartbeat;
  beat.job_id = id;
  wire::header want;
  want.type = wire::msg_type::weights;
  want.job_id = id;
  want.sender_rank = 0;
  for (int i = 0; i < 2000; ++i) test::send_raw(s, want);
  for (int i = 0; i < 5; ++i) {
    std::this_thread::sleep_for(300ms);
    test::send_raw(s, beat);
  }
  // Now it reads: the copies that were on their way, and no more.
  s.set(zmq::sockopt::rcvtimeo, 1500);
  int copies = 0;
  while (next_message(s, &rh, &text)) copies += rh.type == wire::msg_type::weights;
  CHECK(copies >= 1);
  CHECK(copies < 100);  // one at a time; the kernel's buffers hold a few
  WARN(copies << " copies of the weights for 2000 requests");
  wire::header bye;
  bye.type = wire::msg_type::abort;
  bye.job_id = id;
  test::send_raw(s, bye);
}

TEST_CASE("a launcher that reads nothing while a job checkpoints every step, or asks for states again and again, makes the node "
          "hold a few states, not one each", "[nodes]") {
  logged_node a("node-a");
  zmq::context_t ctx;
  zmq::socket_t s = client(ctx, a.node->endpoint());  // the job's launcher
  s.set(zmq::sockopt::rcvtimeo, 20000);
  s.set(zmq::sockopt::rcvhwm, 1);  // it reads nothing for now: let the kernel's buffers fill
  const uint64_t id = 4343;
  send_own_job(s, a.node->endpoint(), "node-a", "784-512-512-10", id, 6400, [](job_plan& p) {  // 8 MB a state
    p.checkpoints = true;
    p.checkpoint_every = 1;
    p.epochs = 1000;
    p.elastic = true;
  });
  await_job_ack(s);
  wire::header rh;
  std::string text;
  wire::header go, beat, pause, want;
  go.type = wire::msg_type::start, beat.type = wire::msg_type::heartbeat, pause.type = wire::msg_type::pause;
  want.type = wire::msg_type::checkpoint;
  go.job_id = beat.job_id = pause.job_id = want.job_id = id;
  go.sender_rank = want.sender_rank = 0;
  test::send_raw(s, go);
  for (int i = 0; i < 6; ++i) {  // it trains, a state after every step
    std::this_thread::sleep_for(300ms);
    test::send_raw(s, beat);
  }
  // Paused, it is asked for its state 2000 times.
  const std::string gen = "gen=1\n";
  pause.payload_bytes = gen.size();
  test::send_raw(s, pause, {zmq::buffer(gen)});
  std::this_thread::sleep_for(300ms);
  for (int i = 0; i < 2000; ++i) test::send_raw(s, want);
  for (int i = 0; i < 3; ++i) {
    std::this_thread::sleep_for(300ms);
    test::send_raw(s, beat);
  }
  // Now it reads: the steps it reported, and the states on their way, no more.
  s.set(zmq::sockopt::rcvtimeo, 1500);
  int steps = 0, states = 0;
  while (next_message(s, &rh, &text)) {
    if (rh.type == wire::msg_type::checkpoint && rh.segment == 0) ++states;
    if (rh.type == wire::msg_type::steps) steps += int(rh.elements);
  }
  WARN(states << " states for " << steps << " steps and 2000 requests");
  CHECK(steps >= 30);
  CHECK(states >= 1);
  CHECK(states < 20);
  wire::header bye;
  bye.type = wire::msg_type::abort;
  bye.job_id = id;
  test::send_raw(s, bye);
}

TEST_CASE("a node that checkpoints every step for a launcher slow to read sends the last step's state before its done", "[nodes]") {
  // The launcher asks for the weights once every rank is done; a state still waiting at the node then
  // would come after them, and the job's last checkpoint would be missing.
  logged_node a("node-a");
  zmq::context_t ctx;
  zmq::socket_t s = client(ctx, a.node->endpoint());
  s.set(zmq::sockopt::rcvtimeo, 20000);
  s.set(zmq::sockopt::rcvhwm, 1);
  const uint64_t id = 4444;
  send_own_job(s, a.node->endpoint(), "node-a", "784-512-512-10", id, 1280, [](job_plan& p) {
    p.checkpoints = true;
    p.checkpoint_every = 1;
  });
  await_job_ack(s);
  wire::header rh;
  std::string text;
  wire::header go, beat;
  go.type = wire::msg_type::start, beat.type = wire::msg_type::heartbeat;
  go.job_id = beat.job_id = id;
  go.sender_rank = 0;
  test::send_raw(s, go);
  for (int i = 0; i < 8; ++i) {  // it trains to its end while we read nothing
    std::this_thread::sleep_for(300ms);
    test::send_raw(s, beat);
  }
  s.set(zmq::sockopt::rcvtimeo, 1500);
  int steps = 0;
  int64_t last_state = -1;
  bool done = false, state_after_done = false;
  while (next_message(s, &rh, &text)) {
    if (rh.type == wire::msg_type::steps) steps += int(rh.elements);
    if (rh.type == wire::msg_type::checkpoint && rh.segment == 0) last_state = rh.step, state_after_done |= done;
    if (rh.type == wire::msg_type::done) done = true;
  }
  INFO(steps << " steps, last state after step " << last_state);
  REQUIRE(done);
  CHECK(steps >= 5);
  CHECK(last_state == steps);
  CHECK_FALSE(state_after_done);
}

TEST_CASE("a node answers its launcher's malformed pause with an error naming it, and goes on", "[nodes]") {
  logged_node a("node-a");
  raw_launcher l(a, "node-a", "784-64-10", 4545, [](job_plan& p) { p.elastic = true; });
  wire::header rh;
  std::string text;
  for (const std::string bad : {"gen=abc\n", "gen=0\n", "gen=1\nat=-1\n", "not kv"}) {
    wire::header pause;
    pause.type = wire::msg_type::pause;
    pause.job_id = l.id;
    pause.payload_bytes = bad.size();
    test::send_raw(l.s, pause, {zmq::buffer(bad)});
    REQUIRE(next_of(l.s, wire::msg_type::error, &rh, &text));
    INFO(text);
    CHECK(text.find("error=node node-a ignored a pause with") == 0);
  }
  // Still its job: a weights request is answered.
  l.send(wire::msg_type::weights, 0);
  CHECK(next_of(l.s, wire::msg_type::weights, &rh, &text));
  l.send(wire::msg_type::abort);
}

TEST_CASE("a node held for its launcher's stop says how many steps its rank started, starts no more, and pauses after the step "
          "it is told", "[nodes]") {
  logged_node a("node-a");
  zmq::context_t ctx;
  zmq::socket_t s = client(ctx, a.node->endpoint());  // the job's launcher
  s.set(zmq::sockopt::rcvtimeo, 20000);
  const uint64_t id = 4747;
  // Updated bucket by bucket (not elastic): a pause at once could catch the replica half updated.
  send_own_job(s, a.node->endpoint(), "node-a", "784-512-512-10", id, 6400, [](job_plan& p) { p.epochs = 1000; });
  wire::header go, beat, pause;
  go.type = wire::msg_type::start, beat.type = wire::msg_type::heartbeat, pause.type = wire::msg_type::pause;
  go.job_id = beat.job_id = pause.job_id = id;
  go.sender_rank = 0;
  // Reads for `t` with heartbeats: the steps reported, and the last held and paused reports.
  int64_t steps = 0;
  wire::kv_map held, paused;
  auto read_for = [&](std::chrono::milliseconds t) {
    wire::header rh;
    std::string text;
    std::string err;
    auto beat_at = std::chrono::steady_clock::now();
    for (auto end = beat_at + t; std::chrono::steady_clock::now() < end;) {
      if (std::chrono::steady_clock::now() >= beat_at) test::send_raw(s, beat), beat_at += 200ms;
      if (!next_message(s, &rh, &text)) continue;
      REQUIRE(rh.type != wire::msg_type::error);
      REQUIRE(rh.type != wire::msg_type::abort);
      if (rh.type == wire::msg_type::steps) steps += int64_t(rh.elements);
      wire::kv_map kv;
      if (rh.type == wire::msg_type::report && wire::decode_kv(text, &kv, &err)) (kv["kind"] == "held" ? held : paused) = kv;
    }
  };
  auto send_pause = [&](const std::string& kv) {
    pause.payload_bytes = kv.size();
    test::send_raw(s, pause, {zmq::buffer(kv)});
  };
  await_job_ack(s);
  s.set(zmq::sockopt::rcvtimeo, 100);
  test::send_raw(s, go);
  read_for(1500ms);  // it trains
  REQUIRE(steps > 0);
  send_pause("gen=1\nfor=hold\n");
  read_for(1000ms);
  INFO(steps << " steps reported");
  held_report h;
  std::string err;
  REQUIRE(from_kv(held, &h, &err));
  CHECK(h.gen == 1);
  const int64_t started = h.started;
  CHECK(steps == started);  // the one in flight finished and was reported; no other began
  CHECK(paused.empty());
  read_for(500ms);
  CHECK(steps == started);
  // Told to stop two steps further (another rank started those), it runs on to there and pauses.
  const int64_t at = started + 2;
  send_pause("gen=1\nat=" + std::to_string(at) + "\nfor=stop\n");
  read_for(1000ms);
  CHECK(paused["gen"] == "1");
  CHECK(paused["applied"] == std::to_string(at));
  CHECK(steps == at);
  CHECK(a.wait_for("its launcher stops it; pausing after step " + std::to_string(at) + " for a checkpoint there", 5s).size() > 0);
  wire::header bye;
  bye.type = wire::msg_type::abort;
  bye.job_id = id;
  test::send_raw(s, bye);
}

TEST_CASE("a node whose launcher was killed drops its job at once, saying why once, not each message it cannot send it", "[nodes]") {
  logged_node a("node-a");
  const std::string node = a.node->endpoint();
  const pid_t launcher = fork();
  if (launcher == 0) {
    const int null = ::open("/dev/null", O_WRONLY);
    if (null >= 0) dup2(null, 1), dup2(null, 2);
    execl(RINGMASTER_MNIST_BIN, RINGMASTER_MNIST_BIN, "--nodes", node.c_str(), "--epochs", "1000", "--limit-train", "6000",
          "--limit-test", "64", "-q", static_cast<char*>(nullptr));
    _exit(127);
  }
  REQUIRE(launcher > 0);
  const std::string started = a.wait_for(" started: ", 20s);
  ::kill(launcher, SIGKILL);
  ::waitpid(launcher, nullptr, 0);
  REQUIRE(started != "");
  // The first heartbeat or report that cannot reach it (within 100 ms) ends the job: what the launcher
  // never gets, its accounting would miss for good. It used to go on for the launcher's 4 s of silence.
  const auto killed = std::chrono::steady_clock::now();
  CHECK(a.wait_for("ended: its launcher's connection broke (what the job sent it was lost)", 5s) != "");
  CHECK(std::chrono::steady_clock::now() - killed < 3s);
  std::this_thread::sleep_for(500ms);  // what was still on its way fails too: said once, if at all
  std::lock_guard<std::mutex> lock(a.mu);
  size_t ended = 0;
  for (const std::string& l : a.lines) {
    CHECK(l.find("no such peer connected") == std::string::npos);
    ended += l.find(" ended: ") != std::string::npos;
  }
  CHECK(ended == 1);
}
