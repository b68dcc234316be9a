// Nodes that lie to their launcher or fail it as it sets a job up: nonsense in a job_ack or step records,
// silence, a stop, another release; nodes that do not fit the daemons (test_nodes_security.cpp).
#include <catch2/catch.hpp>

#include "tests/node_peers.hpp"

using namespace ringmaster;
using namespace ringmaster::node_peers;
using namespace std::chrono_literals;

// A node that speaks our protocol (with our key) and answers as a script says: a hello with hello_ack, a
// job plan with `on_job` (messages: a type and its fields each), anything else not at all.
struct scripted_node {
  using answers = std::vector<std::pair<wire::msg_type, wire::kv_map>>;
  std::function<answers()> on_job;
  // Any other message (a start, heartbeats): whatever it does with the bridge.
  std::function<void(net::bridge&, const net::peer_info&, const wire::header&)> on_other;
  std::unique_ptr<net::bridge> br;

  // hello: more fields of its hello_ack (busy, free_in_ms).
  explicit scripted_node(std::function<answers()> job, const wire::kv_map& hello = {}) : on_job(std::move(job)) {
    net::bridge_options bo;
    std::string err;
    REQUIRE(net::load_or_create_keys(net::default_key_dir(), &bo.keys, &err));
    bo.authorize = [](const std::string&) { return true; };
    br = std::make_unique<net::bridge>(bo);
    br->set_handler([this, hello](const net::peer_info& from, const wire::header& h, net::payload) {
      answers say;
      if (h.type == wire::msg_type::hello) {
        say = {{wire::msg_type::hello_ack, {{"name", "scripted"}, {"id", "scripted"}, {"devices", "cpu:1"}, {"version", "3"}}}};
        for (const auto& [k, v] : hello) say[0].second[k] = v;
      }
      else if (h.type == wire::msg_type::job)
        say = on_job();
      else if (on_other)
        on_other(*br, from, h);
      for (const auto& [type, kv] : say) {
        wire::header r;
        r.job_id = h.job_id;
        r.type = type;
        std::string text, e;
        wire::encode_kv(kv, &text, &e);
        br->reply(from, r, net::payload::copy_of(text));
      }
    });
    br->set_error_handler([](const net::bridge_error&) {});
    REQUIRE(br->start("tcp://127.0.0.1:0", &err));
  }
  ~scripted_node() { br->stop(); }
  std::string endpoint() const { return br->endpoint(); }
};

TEST_CASE("a node that answers our hello and then falls silent as it sets up is named as such, not as one that never "
          "answered", "[nodes]") {
  scripted_node mute([]() -> scripted_node::answers { return {}; });  // takes the job, says nothing more
  remote_options ro;
  ro.nodes = {mute.endpoint()};
  train_result r = train_remote(small_job(), ro);
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("node " + mute.endpoint() + " fell silent while it set the job up: nothing from it for") != std::string::npos);
  CHECK(r.error.find("(it had answered our hello: stopped, killed or cut off?)") != std::string::npos);
  CHECK(r.error.find("is ringmaster-node running there") == std::string::npos);
  CHECK(r.error.find("nothing from it for 5 s") != std::string::npos);  // before its first word: the hello's allowance
  // One that heartbeats once it has the job (as ringmaster-node does) and then falls silent is given up
  // on as a running job's node is, after 1.5 s (before its first word: the hello's 5 s).
  scripted_node stops([]() -> scripted_node::answers { return {{wire::msg_type::heartbeat, {}}}; });
  ro.nodes = {stops.endpoint()};
  const auto t0 = std::chrono::steady_clock::now();
  r = train_remote(small_job(), ro);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("node " + stops.endpoint() + " fell silent while it set the job up: nothing from it for 1.5 s") != std::string::npos);
  CHECK(took < 4);
}

TEST_CASE("a node busy with a live launcher's job is refused at once, and one that says it will soon be free is "
          "waited for no longer than the launcher allows", "[nodes]") {
  const scripted_node::answers busy{{wire::msg_type::error, {{"error", "node scripted: busy with another job"}}}};
  auto run = [](const std::string& node, std::vector<std::string>* events, double* took) {
    remote_options ro;
    ro.nodes = {node};
    ro.busy_wait = 2s;
    ro.on_event = [events](const std::string& line) { events->push_back(line); };
    const auto t0 = std::chrono::steady_clock::now();
    train_result r = train_remote(small_job(), ro);
    *took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
  };
  std::vector<std::string> events;
  double took = 0;
  // Its job's launcher is alive (no free_in_ms): asked again for a second (one that crashed a moment ago
  // has not been silent long enough to tell), then our job goes, for the node to refuse.
  scripted_node live([&] { return busy; }, {{"busy", "1"}});
  train_result r = run(live.endpoint(), &events, &took);
  CHECK_FALSE(r.ok);
  CHECK(r.error == "node scripted: busy with another job");
  CHECK(events.empty());
  CHECK(took >= 1);
  CHECK(took < 2.5);
  // A launcher gone, said to be dropped within 0.3 s, for ever (a liar): asked again until the launcher's
  // 2 s are nearly out, said once, then refused.
  scripted_node soon([&] { return busy; }, {{"busy", "1"}, {"free_in_ms", "300"}});
  r = run(soon.endpoint(), &events, &took);
  CHECK_FALSE(r.ok);
  CHECK(r.error == "node scripted: busy with another job");
  REQUIRE(events.size() == 1);
  CHECK(events[0] == soon.endpoint() + " holds a job whose launcher fell silent (crashed?), dropped within 0.3 s: waiting for it");
  CHECK(took > 1.5);
  CHECK(took < 3.5);
  // Interrupted while it waits: no job went to the node.
  std::atomic<int> stop{0};
  train_config job = small_job();
  job.interrupt = &stop;
  remote_options ro;
  ro.nodes = {soon.endpoint()};
  std::thread ctrl_c([&stop] {
    std::this_thread::sleep_for(500ms);
    stop = SIGINT;
  });
  r = train_remote(job, ro);
  ctrl_c.join();
  CHECK(r.interrupted == SIGINT);
  CHECK_FALSE(r.sent);
  // Free only after the launcher's limit, or a value no node sends: not waited for.
  events.clear();
  for (const std::string bad : {"60000", "-1", "12x"}) {
    scripted_node later([&] { return busy; }, {{"busy", "1"}, {"free_in_ms", bad}});
    r = run(later.endpoint(), &events, &took);
    INFO(bad);
    CHECK(r.error == "node scripted: busy with another job");
    CHECK(events.empty());
    CHECK(took < 1.5);
  }
}

TEST_CASE("a lying node that answers the job with train=abc, params=-1, another model or terminal escapes gets a clear "
          "error, not a crash", "[nodes]") {
  std::string train = "abc", params = "1000", train_data = "7", description = "784-64-10", refusal;
  scripted_node liar([&]() -> scripted_node::answers {
    if (!refusal.empty()) return {{wire::msg_type::error, {{"error", refusal}}}};
    return {{wire::msg_type::job_ack,
             {{"train", train}, {"train_data", train_data}, {"test", "1"}, {"model", "1"}, {"params", params}, {"description", description}}}};
  });
  std::string err;
  remote_options ro;
  ro.nodes = {liar.endpoint()};
  train_result r = train_remote(small_job(), ro);
  CHECK_FALSE(r.ok);
  CHECK(r.error == "node " + liar.endpoint() + " sent a bad sample count 'abc'");
  train = std::string("1") + char(27) + "]2;pwned" + char(7);  // printed raw, it retitled the terminal
  r = train_remote(small_job(), ro);
  CHECK(r.error.find("sent a bad sample count '1") != std::string::npos);
  CHECK(r.error.find(char(27)) == std::string::npos);
  train = "100";
  params = "-1";  // the size of every state the job sends around
  r = train_remote(small_job(), ro);
  CHECK_FALSE(r.ok);
  CHECK(r.error == "node " + liar.endpoint() + " sent a bad parameter count '-1'");
  train_data = "x";
  r = train_remote(small_job(), ro);
  CHECK(r.error == "node " + liar.endpoint() + " sent a bad data fingerprint 'x'");
  // Another model than the job's, said in full (a node's description names its input): --save would
  // write it as this job's result.
  train_data = "7";
  const auto other = build_model("784-32-10", shape{1, 28, 28}, &err);
  REQUIRE(other);
  description = other->description();
  params = std::to_string(other->param_count());
  r = train_remote(small_job(), ro);
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("node " + liar.endpoint() + " built another model than this job's") != std::string::npos);
  // A refusal that would retitle the terminal and redraw its line: printed with its control characters
  // replaced.
  refusal = std::string("no ") + char(27) + "]0;PWNED" + char(7) + char(27) + "[2K\rOVERWRITTEN";
  r = train_remote(small_job(), ro);
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("PWNED") != std::string::npos);
  CHECK(r.error.find(char(27)) == std::string::npos);
  CHECK(r.error.find(char(7)) == std::string::npos);
  // Two nodes whose test sets differ: refused as the training sets are (the largest, 10^12, was taken for
  // the coordinator's patience while the ranks evaluate, and overflowed it).
  refusal.clear();
  scripted_node twin([&]() -> scripted_node::answers {
    return {{wire::msg_type::job_ack,
             {{"train", train}, {"train_data", train_data}, {"test", "1000000000000"}, {"model", "1"}, {"params", params}, {"description", description}}}};
  }, {{"id", "twin"}});
  ro.nodes = {liar.endpoint(), twin.endpoint()};
  r = train_remote(small_job(), ro);
  CHECK(r.invalid);
  CHECK(r.error == "nodes disagree on the data: " + liar.endpoint() + " has 1 test samples, " + twin.endpoint() + " has 1000000000000");
}

TEST_CASE("a lying node whose step records say a negative count or a time that is no time is named, and the job ends", "[nodes]") {
  std::string err;
  const auto m = build_model(small_job().model, shape{1, 28, 28}, &err);
  REQUIRE(m);
  step_report lie;  // rank 0, step 0 of epoch 0, as a first report would be
  lie.count = 32;
  lie.loss_sum = 7;
  std::string bad_field;
  scripted_node liar([&]() -> scripted_node::answers {
    return {{wire::msg_type::job_ack, {{"train", "60000"}, {"train_data", "7"}, {"test", "10000"}, {"model", "1"},
                                       {"params", std::to_string(m->param_count())}, {"description", m->description()}}}};
  });
  liar.on_other = [&](net::bridge& br, const net::peer_info& from, const wire::header& h) {
    if (h.type != wire::msg_type::start) return;
    step_report r[2] = {lie, lie};
    r[1].step = 1;
    if (bad_field == "count") r[1].count = -1;
    if (bad_field == "compute") r[1].compute = NAN;
    wire::header out;
    out.type = wire::msg_type::steps;
    out.job_id = h.job_id;
    out.elements = 2;
    const std::string records = encode_steps(r, 2);
    out.payload_bytes = records.size();
    br.reply(from, out, net::payload::copy_of(records));
  };
  remote_options ro;
  ro.nodes = {liar.endpoint()};
  for (const char* field : {"count", "compute"}) {
    bad_field = field;
    const auto t0 = std::chrono::steady_clock::now();
    const train_result r = train_remote(small_job(), ro);
    INFO(r.error);
    CHECK_FALSE(r.ok);
    CHECK(r.error.find("node " + liar.endpoint() + " sent a bad step report: step record 1 has a bad " + field) != std::string::npos);
    CHECK(std::chrono::steady_clock::now() - t0 < 4s);  // named at once, not waited for as a silent node
  }
}

TEST_CASE("launcher: nodes that do not fit the daemons exit 2: one daemon at two addresses, more replicas than it offers", "[nodes]") {
  // Listening on every address: 127.0.0.1 and 127.0.0.2 are the same daemon. (Text alone cannot tell.)
  // On a port it picks, read from its log: a free 127.0.0.1 port may not be free on every address.
  const std::string log = "/tmp/ringmaster-test-any-address-" + std::to_string(getpid()) + ".log";
  std::remove(log.c_str());
  test::daemon_process d({RINGMASTER_NODE_BIN}, "tcp://0.0.0.0:0", "cpu:1", RINGMASTER_DATA_DIR, log);
  std::string port;
  for (int i = 0; i < 500 && port.empty(); ++i) {
    std::this_thread::sleep_for(20ms);
    std::ifstream in(log);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::string mark = "listening on tcp://0.0.0.0:";
    if (const size_t at = text.find(mark); at != std::string::npos)
      port = text.substr(at + mark.size(), text.find_first_not_of("0123456789", at + mark.size()) - at - mark.size());
  }
  std::remove(log.c_str());
  REQUIRE(!port.empty());
  const std::string a = "tcp://127.0.0.1:" + port, b = "tcp://127.0.0.2:" + port;
  const test::run_result r = test::run(std::string(RINGMASTER_MNIST_BIN) + " --epochs 1 --limit-train 256 --nodes " + a + "," + b);
  INFO(r.out);
  CHECK(r.status == 2);
  CHECK(r.out.find("--nodes " + a + " and " + b + " answered with the same id ") != std::string::npos);
  CHECK(r.out.find(": one daemon named twice (name each node once), or two started with the same --name") != std::string::npos);
  CHECK(r.out.find("Epoch") == std::string::npos);
  // It offers cpu:1 (exit 1 once, as if the node had failed).
  const test::run_result more = test::run(std::string(RINGMASTER_MNIST_BIN) + " --epochs 1 --limit-train 256 --nodes " + a +
                                          " --replicas-per-node 2");
  INFO(more.out);
  CHECK(more.status == 2);
  CHECK(more.out.find("job asks for 2 replicas, this node offers cpu:1") != std::string::npos);
  // Into a pipe too, the header (stdout) comes before the error (stderr), as it was printed.
  CHECK(more.out.find("ringmaster-mnist: model ") < more.out.find("job asks for 2 replicas"));
}

TEST_CASE("a node stopped while it sets up a job is named as stopped at once, not waited for as a silent one", "[nodes]") {
  // As a daemon stopped by Ctrl-C while it loads the job's data answers the plan (node_service::stop).
  wire::kv_map abort = {{"reason", "node quitter was stopped (SIGINT)"}, {"stopped", "SIGINT"}};
  bool ack_first = false;  // stopped just after its answer, before the launcher starts the job
  std::string err;
  const auto m = build_model(small_job().model, shape{1, 28, 28}, &err);
  REQUIRE(m);
  scripted_node quitter([&]() -> scripted_node::answers {
    if (!ack_first) return {{wire::msg_type::abort, abort}};
    return {{wire::msg_type::job_ack, {{"train", "60000"}, {"train_data", "7"}, {"test", "10000"}, {"model", "1"},
                                       {"params", std::to_string(m->param_count())}, {"description", m->description()}}},
            {wire::msg_type::abort, abort}};
  });
  remote_options ro;
  ro.nodes = {quitter.endpoint()};
  auto t0 = std::chrono::steady_clock::now();
  train_result r = train_remote(small_job(), ro);
  CHECK_FALSE(r.ok);
  CHECK(r.error == "node " + quitter.endpoint() + " was stopped (SIGINT) while it set up the job");
  CHECK(std::chrono::steady_clock::now() - t0 < 4500ms);  // was "did not answer within 5.00 s"
  // Any other abort: its reason.
  abort = {{"reason", "out of patience"}};
  r = train_remote(small_job(), ro);
  CHECK(r.error == "node " + quitter.endpoint() + " gave up the job as it set it up: out of patience");
  // Stopped between its answer and the start: named as stopped (it was "no heartbeat" 1.5 s later).
  abort = {{"reason", "node quitter was stopped (SIGINT)"}, {"stopped", "SIGINT"}};
  ack_first = true;
  r = train_remote(small_job(), ro);
  INFO(r.error);
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("node " + quitter.endpoint() + " (rank 0) was stopped (SIGINT)") != std::string::npos);
}

TEST_CASE("a node of another release is named as such at once, not waited for as a silent one", "[nodes]") {
  // As a node of the release before answers a hello: an error, in its own protocol version (a raw
  // ROUTER: our bridge sends only its own version).
  zmq::context_t ctx;
  zmq::socket_t older(ctx, zmq::socket_type::router);
  older.set(zmq::sockopt::linger, 0);
  older.bind("tcp://127.0.0.1:0");
  const std::string endpoint = older.get(zmq::sockopt::last_endpoint);
  std::atomic<bool> stop{false};
  std::thread answer([&] {
    while (!stop) {
      zmq::pollitem_t item{older.handle(), 0, ZMQ_POLLIN, 0};
      if (zmq::poll(&item, 1, std::chrono::milliseconds(50)) == 0) continue;
      std::vector<zmq::message_t> parts;
      if (!zmq::recv_multipart(older, std::back_inserter(parts)) || parts.size() < 2) continue;
      wire::header h;
      std::string e;
      if (!wire::decode(parts[1].data(), parts[1].size(), &h, &e) || h.type != wire::msg_type::hello) continue;
      wire::header r;
      r.version = wire::kProtocolVersion - 1;
      r.type = wire::msg_type::error;
      const std::string text = "protocol version " + std::to_string(wire::kProtocolVersion) + ", this build speaks " +
                               std::to_string(wire::kProtocolVersion - 1);
      r.payload_bytes = text.size();
      older.send(parts[0], zmq::send_flags::sndmore);
      test::send_raw(older, r, {zmq::buffer(text)});
    }
  });
  remote_options ro;
  ro.insecure = true;
  ro.nodes = {endpoint};
  const auto t0 = std::chrono::steady_clock::now();
  train_result r = train_remote(small_job(), ro);
  stop = true;
  answer.join();
  CHECK_FALSE(r.ok);
  CHECK(r.error == "node " + endpoint + " runs another release of ringmaster (protocol version " +
                       std::to_string(wire::kProtocolVersion - 1) + ", this build speaks " +
                       std::to_string(wire::kProtocolVersion) + "): run the same one on the launcher and every node");
  CHECK(std::chrono::steady_clock::now() - t0 < 3s);  // not the 5 s a silent node is given
}
