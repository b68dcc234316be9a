// What a node daemon refuses hostile peers, and keys: malformed frames, strangers who know a job's id,
// floods, a lying node, launchers and nodes whose keys it does not accept (tests/test_nodes.cpp: training
// across nodes).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <functional>
#include <tuple>
#include <iterator>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "actors/job_plan.hpp"
#include "actors/node_service.hpp"
#include "actors/remote_job.hpp"
#include "actors/report_kv.hpp"
#include "actors/training.hpp"
#include "net/bridge.hpp"
#include "net/keys.hpp"
#include "net/seal.hpp"
#include "net/wire.hpp"
#include "tests/test_nodes.hpp"
#include "tests/test_util.hpp"
#include "tests/test_zmq.hpp"

using namespace ringmaster;
using namespace std::chrono_literals;

namespace {

using test::authenticate;
using test::endpoints;
using test::free_endpoint;
using test::job_id_of;
using test::job_id_text;
using test::logged_node;
using test::small_job;
using test::start_nodes;

// A bare DEALER with an accepted key, connected to `endpoint`, that waits at most 5 s for a reply.
zmq::socket_t client(zmq::context_t& ctx, const std::string& endpoint) {
  zmq::socket_t s(ctx, zmq::socket_type::dealer);
  s.set(zmq::sockopt::linger, 0);
  s.set(zmq::sockopt::rcvtimeo, 5000);
  authenticate(s);
  s.connect(endpoint);
  return s;
}

// A peer that is no part of the job: a bare DEALER that sends one message and reads the error reply.
std::string send_and_read_error(const std::string& endpoint, wire::header h, const std::string& payload) {
  h.payload_bytes = payload.size();
  zmq::context_t ctx;
  zmq::socket_t s = client(ctx, endpoint);
  test::send_raw(s, h, {zmq::buffer(payload)});
  zmq::message_t head, body;
  if (!s.recv(head, zmq::recv_flags::none) || !s.recv(body, zmq::recv_flags::none)) return "no reply";
  wire::header rh;
  std::string err;
  if (!wire::decode(head.data(), head.size(), &rh, &err)) return "bad reply header: " + err;
  wire::kv_map kv;
  if (rh.type != wire::msg_type::error || !wire::decode_kv(body.to_string(), &kv, &err)) return "not an error reply";
  return kv["error"] + " (invalid=" + kv["invalid"] + ")";
}

// The port a node's hello_ack names for ring chunks from other hosts ("" if it did not answer).
std::string ring_port_of(const std::string& endpoint) {
  zmq::context_t ctx;
  zmq::socket_t s = client(ctx, endpoint);
  wire::header h;
  h.type = wire::msg_type::hello;
  test::send_raw(s, h);
  zmq::message_t head, body;
  if (!s.recv(head, zmq::recv_flags::none) || !s.recv(body, zmq::recv_flags::none)) return "";
  wire::kv_map kv;
  std::string err;
  if (!wire::decode_kv(body.to_string(), &kv, &err)) return "";
  return kv["ring_port"];
}

// Sends, as its launcher, a one-node job of `model` to node `name` at `endpoint`: training only, on the
// first `limit_train` samples. The node's key is the tests' own (the default key directory).
void send_own_job(zmq::socket_t& s, const std::string& endpoint, const std::string& name, const std::string& model,
                  uint64_t id, int64_t limit_train, const std::function<void(job_plan&)>& tweak = {}) {
  net::key_pair keys;
  std::string err;
  REQUIRE(net::load_or_create_keys(net::default_key_dir(), &keys, &err));
  train_config c = small_job();
  c.model = model;
  job_placement w;
  w.nodes = {{endpoint, name}};
  w.rank_node = {0};
  w.devices = {"cpu"};
  job_plan plan;
  REQUIRE(make_job_plan(c, w, &plan, &err));
  plan.job_id = id;
  plan.recipient = 0;
  plan.nodes[0].key = keys.public_key;
  plan.limit_train = limit_train;
  plan.limit_test = 0;
  plan.evaluate = false;
  if (tweak) tweak(plan);
  wire::header job;
  job.type = wire::msg_type::job;
  job.job_id = id;
  const std::string text = to_json(plan);
  job.payload_bytes = text.size();
  test::send_raw(s, job, {zmq::buffer(text)});
}

// The next message a raw client gets: its header and, for a non-tensor one, its payload as text. False
// when none comes within the socket's receive timeout.
bool next_message(zmq::socket_t& s, wire::header* h, std::string* body) {
  for (zmq::message_t head; s.recv(head);) {
    zmq::message_t payload;
    if (head.more()) REQUIRE(s.recv(payload));
    std::string err;
    if (!wire::decode(head.data(), head.size(), h, &err)) continue;
    *body = wire::is_tensor_type(h->type) ? "" : payload.to_string();
    return true;
  }
  return false;
}

// Reads until a message of this type comes (heartbeats come too); its header in *h, its text in *body.
bool next_of(zmq::socket_t& s, wire::msg_type type, wire::header* h, std::string* body) {
  while (next_message(s, h, body))
    if (h->type == type) return true;
  return false;
}

// The node's job_ack to a job send_own_job sent; a refusal fails the test.
void await_job_ack(zmq::socket_t& s) {
  wire::header h;
  std::string body;
  while (h.type != wire::msg_type::job_ack) {
    REQUIRE(next_message(s, &h, &body));
    INFO(body);
    REQUIRE(h.type != wire::msg_type::error);
  }
}

// A job of 784-128-10 on the first 6,000 samples, rank 0 on node a and rank 1 on node b, run by a launcher
// thread: start() returns once it trains, finish() waits for its result (and so does the destructor, so a
// failed REQUIRE does not leave the thread running).
struct two_node_job {
  train_config c = small_job();
  remote_options ro;
  train_result r;
  std::atomic<bool> training{false};
  std::thread launcher;
  two_node_job(logged_node& a, logged_node& b, int64_t epochs) {
    c.model = "784-128-10";
    c.epochs = epochs;
    c.on_progress = [this](const progress&) { training = true; };
    ro.nodes = {a.node->endpoint(), b.node->endpoint()};
    ro.limit_train = 6000;
    ro.limit_test = 200;
  }
  void start() {
    launcher = std::thread([this] { r = train_remote(c, ro); });
    for (int i = 0; i < 600 && !training; ++i) std::this_thread::sleep_for(50ms);
  }
  const train_result& finish() {
    if (launcher.joinable()) launcher.join();
    return r;
  }
  ~two_node_job() { finish(); }
};

// small_job() on one node, on 600 training and 100 test samples.
train_result small_job_on(const std::string& endpoint, std::chrono::milliseconds connect_timeout) {
  remote_options ro;
  ro.nodes = {endpoint};
  ro.limit_train = 600;
  ro.limit_test = 100;
  ro.connect_timeout = connect_timeout;
  return train_remote(small_job(), ro);
}

}  // namespace

TEST_CASE("a node fed malformed frames keeps serving and refuses other protocol versions", "[nodes]") {
  auto nodes = start_nodes(1);
  zmq::context_t ctx;
  zmq::socket_t s(ctx, zmq::socket_type::dealer);
  s.set(zmq::sockopt::linger, 0);
  s.set(zmq::sockopt::rcvtimeo, 3000);
  authenticate(s);
  s.connect(nodes[0]->endpoint);
  // Garbage: one short frame, five frames, bad magic, random bytes, a valid header with a bad payload size.
  s.send(zmq::buffer(std::string("hi")), zmq::send_flags::none);
  for (int i = 0; i < 4; ++i) s.send(zmq::buffer(std::string("x")), zmq::send_flags::sndmore);
  s.send(zmq::buffer(std::string("x")), zmq::send_flags::none);
  std::string junk(56, '\x7f');
  s.send(zmq::buffer(junk), zmq::send_flags::none);
  std::mt19937 rng(3);
  for (int i = 0; i < 50; ++i) {
    std::string r(rng() % 100, '\0');
    for (auto& c : r) c = char(rng());
    s.send(zmq::buffer(r), zmq::send_flags::none);
  }
  wire::header h;
  h.type = wire::msg_type::chunk;
  h.elements = 10;
  h.payload_bytes = 40;
  test::send_raw(s, h, {zmq::buffer(std::string(12, '\0'))});  // 12 bytes, not 40
  // A hello from a future protocol version is answered with an error naming both versions.
  wire::header hello;
  hello.type = wire::msg_type::hello;
  hello.version = wire::kProtocolVersion + 1;
  auto hello_bytes = wire::encode(hello);
  s.send(zmq::buffer(hello_bytes.data(), hello_bytes.size()), zmq::send_flags::none);
  zmq::message_t reply;
  std::string text;
  for (int i = 0; i < 5 && text.find("version") == std::string::npos; ++i) {
    REQUIRE(s.recv(reply, zmq::recv_flags::none));
    text = reply.to_string();
  }
  INFO(text);
  CHECK(text.find(std::to_string(wire::kProtocolVersion + 1)) != std::string::npos);
  CHECK(text.find(std::to_string(wire::kProtocolVersion)) != std::string::npos);

  remote_options ro;
  ro.nodes = endpoints(nodes);
  ro.limit_train = 600;
  ro.limit_test = 100;
  train_result r = train_remote(small_job(), ro);
  INFO(r.error);
  CHECK(r.ok);
}

TEST_CASE("node daemons --insecure: ring chunks between hosts go plain to the ring ports, or through the bridges", "[nodes]") {
  logged_node a("node-a", "", true), b("node-b", "", true);
  CHECK(a.wait_for("(ring chunks from other hosts on port ").find(", plain)") != std::string::npos);  // insecure nodes have one too
  const bool ring_ports = GENERATE(true, false);
  INFO((ring_ports ? "ring ports" : "bridges"));
  remote_options ro;
  ro.insecure = true;
  ro.ring_ports = ring_ports;
  ro.nodes = {a.node->endpoint(), b.node->endpoint()};
  ro.shared_memory = false;  // as between hosts
  ro.limit_train = 600;
  ro.limit_test = 100;
  train_result r = train_remote(small_job(), ro);
  INFO(r.error);
  CHECK(r.ok);
  CHECK(r.identical);
  const std::string said = " plain (--insecure) at tcp://127.0.0.1:";
  CHECK((a.wait_for(said, ring_ports ? 10s : 0s) != "") == ring_ports);
  CHECK((b.wait_for(said, ring_ports ? 10s : 0s) != "") == ring_ports);
}

TEST_CASE("node daemons --insecure: a stranger who logs in to a ring port again and again with bad frames is logged a few times, not each",
          "[nodes]") {
  logged_node a("node-a", "", true), b("node-b", "", true);
  const std::string listening = b.wait_for("(ring chunks from other hosts on port ");
  const size_t at_port = listening.find(" on port ");
  REQUIRE(at_port != std::string::npos);
  const int port = std::atoi(listening.c_str() + at_port + 9);
  REQUIRE(port > 0);
  two_node_job running(a, b, 100);  // rank 0 on a sends to b's ring port; broken long before its end
  running.ro.insecure = true;
  running.ro.shared_memory = false;     // as between hosts
  running.ro.abort_on_node_loss = true;  // the first bad frame breaks the ring: the job ends
  running.start();
  const uint64_t id = job_id_of(a.wait_for(" started: "));
  // Plain, anyone who knows the job id may log in as node 0 (--insecure authenticates nobody); then a
  // frame that is no chunk. 200 times.
  wire::header login;
  login.type = wire::msg_type::hello;
  login.job_id = id;
  login.sender_rank = 0;
  wire::header bad = login;
  bad.type = wire::msg_type::heartbeat;
  std::vector<unsigned char> bytes(2 * (wire::kHeaderSize + net::kTrailerBytes));
  for (int k = 0; k < 2; ++k) {
    const auto hb = wire::encode(k == 0 ? login : bad);
    unsigned char* at = bytes.data() + size_t(k) * (wire::kHeaderSize + net::kTrailerBytes);
    std::copy(hb.begin(), hb.end(), at);
    net::write_trailer({id, 0, uint64_t(k)}, at + wire::kHeaderSize);
  }
  for (int i = 0; i < 200; ++i) {
    const int u = test::loopback_connect(port);
    CHECK(u >= 0);
    CHECK(send(u, bytes.data(), bytes.size(), MSG_NOSIGNAL) == ssize_t(bytes.size()));
    char closed;
    recv(u, &closed, 1, 0);  // until the node hangs up
    close(u);
  }
  CHECK(b.wait_for("plain connection from node 0: a heartbeat, not a ring chunk") != "");
  CHECK_FALSE(running.finish().ok);  // its ring was broken on purpose
  std::lock_guard<std::mutex> lock(b.mu);
  int first = 0, more = 0;  // the first in full, as the job's; then the node's rate-limited fault lines
  for (const std::string& l : b.lines) {
    first += l.find(": plain connection from node 0: a heartbeat") != std::string::npos && l.find("job ") != std::string::npos &&
             l.find(" ended: ") == std::string::npos;
    more += l.find("dropped a message (malformed message): plain connection from node 0") != std::string::npos;
  }
  CHECK(first == 1);
  CHECK(more <= 5);
}

TEST_CASE("node daemons --insecure: a flood of large job plans neither stops the running job nor floods the log", "[nodes]") {
  logged_node a("node-a", "", true), b("node-b", "", true);
  two_node_job running(a, b, 30);  // still running when the flood is in, on a fast machine too
  running.ro.insecure = true;
  running.start();
  // A stranger (anyone, --insecure) sends 300 plans of ~600 KB each: well-formed JSON, slow to read.
  std::string plan = "{\"job\": 9, \"pad\": [";
  for (int i = 0; i < 100000; ++i) plan += (i ? ",0." : "0.") + std::to_string(i);
  plan += "]}";
  zmq::context_t ctx;
  zmq::socket_t s(ctx, zmq::socket_type::dealer);
  s.set(zmq::sockopt::linger, 0);
  s.connect(a.node->endpoint());
  wire::header job;
  job.type = wire::msg_type::job;
  job.job_id = 9;
  job.payload_bytes = plan.size();
  for (int i = 0; i < 300; ++i) test::send_raw(s, job, {zmq::buffer(plan)});
  const train_result& r = running.finish();
  INFO(r.error);
  CHECK(r.ok);  // its heartbeats kept going: the node refused each plan as busy, unread
  CHECK(r.losses.empty());
  CHECK(a.wait_for("more lines of 'refused job' in the last 10 s", 15s) != "");  // once the window is over
  std::lock_guard<std::mutex> lock(a.mu);
  int refusals = 0;
  for (const std::string& l : a.lines) refusals += l.find("refused job 9: busy with another job") != std::string::npos;
  CHECK(refusals >= 1);
  CHECK(refusals <= 5);
}

TEST_CASE("node daemon --insecure: clients past --max-connections are refused too", "[nodes]") {
  node_options o;
  o.insecure = true;
  o.listen = "tcp://127.0.0.1:0";
  o.name = "node-limit";
  o.devices = "cpu:1";
  o.data_dir = RINGMASTER_DATA_DIR;
  o.max_connections = 2;
  std::mutex mu;
  std::vector<std::string> lines;
  o.log = [&](const std::string& l) {
    std::lock_guard<std::mutex> lock(mu);
    lines.push_back(l);
  };
  node_service node(o);
  std::string err;
  REQUIRE(node.start(&err));
  zmq::context_t ctx;
  std::vector<zmq::socket_t> clients;
  wire::header h;
  h.type = wire::msg_type::hello;
  int answered = 0;
  for (int i = 0; i < 3; ++i) {
    clients.emplace_back(ctx, zmq::socket_type::dealer);
    zmq::socket_t& c = clients.back();
    c.set(zmq::sockopt::linger, 0);
    c.set(zmq::sockopt::rcvtimeo, i < 2 ? 5000 : 1500);
    c.connect(node.endpoint());
    test::send_raw(c, h);
    zmq::message_t head, body;
    const bool got = c.recv(head, zmq::recv_flags::none).has_value();
    if (got && head.more()) (void)c.recv(body, zmq::recv_flags::none);
    answered += got;
    CHECK(got == (i < 2));
  }
  CHECK(answered == 2);
  bool said = false;
  for (int i = 0; i < 100 && !said; ++i) {
    {
      std::lock_guard<std::mutex> lock(mu);
      for (const std::string& l : lines) said = said || l.find("over the limit of 2") != std::string::npos;
    }
    if (!said) std::this_thread::sleep_for(20ms);
  }
  CHECK(said);
  node.stop();
}

TEST_CASE("node daemon: --ring-port fixes the port ring chunks from other hosts go to, a taken or bad one is a clear error", "[nodes][keys]") {
  const int port = test::free_port();
  test::daemon_process a({RINGMASTER_NODE_BIN, "--ring-port", std::to_string(port)}, free_endpoint(), "cpu:1", RINGMASTER_DATA_DIR);
  logged_node b("node-b");
  std::this_thread::sleep_for(300ms);
  CHECK(ring_port_of(a.endpoint) == std::to_string(port));  // what its hello_ack tells launchers
  // The two train together, b's chunks going to a on that port.
  remote_options ro;
  ro.nodes = {a.endpoint, b.node->endpoint()};
  ro.shared_memory = false;  // as between hosts
  ro.limit_train = 600;
  ro.limit_test = 100;
  train_result r = train_remote(small_job(), ro);
  INFO(r.error);
  CHECK(r.ok);
  CHECK(r.identical);
  CHECK(b.wait_for(std::string("sealed (") + net::kSealCipher + ") at tcp://127.0.0.1:" + std::to_string(port)) != "");

  const test::run_result taken = test::run(std::string(RINGMASTER_NODE_BIN) + " --listen " + free_endpoint() +
                                           " --ring-port " + std::to_string(port));
  CHECK(taken.status == 1);
  CHECK(taken.out.find("the ring port 127.0.0.1:" + std::to_string(port) + ": address already in use") != std::string::npos);
  // Its own listen port: once "address already in use" (exit 1), as if another program held it.
  const test::run_result same = test::run(std::string(RINGMASTER_NODE_BIN) + " --listen tcp://127.0.0.1:" + std::to_string(port) +
                                          " --ring-port " + std::to_string(port));
  CHECK(same.status == 2);
  CHECK(same.out.find("--ring-port " + std::to_string(port) + " is the --listen port: ring chunks need a port of their own") !=
        std::string::npos);
  const test::run_result bad = test::run(std::string(RINGMASTER_NODE_BIN) + " --listen " + free_endpoint() + " --ring-port 70000");
  CHECK(bad.status == 2);
  CHECK(bad.out.find("--ring-port must be a port number") != std::string::npos);
  const test::run_result spin = test::run(std::string(RINGMASTER_NODE_BIN) + " --listen " + free_endpoint() + " --ring-poll-us -1");
  CHECK(spin.status == 2);
  CHECK(spin.out.find("--ring-poll-us must be 0-1000000") != std::string::npos);
  const test::run_result stray = test::run("timeout 10 " + std::string(RINGMASTER_NODE_BIN) + " --listen " + free_endpoint() + " --insecure extra");
  CHECK(stray.status == 2);  // it served, the word ignored
  CHECK(stray.out.find("unexpected argument") != std::string::npos);
  const test::run_result local = test::run(std::string(RINGMASTER_NODE_BIN) + " --listen ipc:///tmp/ringmaster-test-ring-port --ring-port " +
                                           std::to_string(port));
  CHECK(local.status == 2);
  CHECK(local.out.find("--ring-port needs a tcp:// --listen endpoint") != std::string::npos);
  // A key folder with --insecure was ignored: the node served without keys.
  const test::run_result keyless = test::run("timeout 10 " + std::string(RINGMASTER_NODE_BIN) + " --listen " + free_endpoint() +
                                             " --insecure --key-dir /tmp");
  CHECK(keyless.status == 2);
  CHECK(keyless.out.find("--key-dir and --insecure: a node run --insecure uses no keys") != std::string::npos);
  // The name is our links' routing id, which plans carry: too long a one is refused at once.
  const test::run_result named = test::run(std::string(RINGMASTER_NODE_BIN) + " --listen " + free_endpoint() + " --name " +
                                           std::string(201, 'n'));
  CHECK(named.status == 2);
  CHECK(named.out.find("--name must be at most 200 printable ASCII characters") != std::string::npos);
  // A port past 65535 would wrap to another one; an empty value is an unset variable, not the default.
  const test::run_result wrapped = test::run(std::string(RINGMASTER_NODE_BIN) + " --listen tcp://127.0.0.1:99999");
  CHECK(wrapped.status == 2);
  CHECK(wrapped.out.find("--listen: 'tcp://127.0.0.1:99999': the port must be a number in 0-65535") != std::string::npos);
  // A host name: ZeroMQ would not listen on it, and the ring port was blamed (exit 1).
  const test::run_result named_host = test::run(std::string(RINGMASTER_NODE_BIN) + " --listen tcp://nosuchhost.invalid:5601");
  CHECK(named_host.status == 2);
  CHECK(named_host.out.find("--listen: 'nosuchhost.invalid' is neither an IP address nor a network interface") != std::string::npos);
  // An address of another machine: named as such (exit 2), not blamed on the ring port (exit 1).
  const test::run_result elsewhere = test::run(std::string(RINGMASTER_NODE_BIN) + " --listen tcp://192.0.2.1:5601");
  CHECK(elsewhere.status == 2);
  CHECK(elsewhere.out.find("--listen: '192.0.2.1' is not an address of this machine") != std::string::npos);
  // An IPv6 address without brackets: ZeroMQ said "No such device" (exit 1).
  const test::run_result bare_v6 = test::run(std::string(RINGMASTER_NODE_BIN) + " --listen tcp://::1:5601");
  CHECK(bare_v6.status == 2);
  CHECK(bare_v6.out.find("write an IPv6 address in brackets, tcp://[::1]:5601") != std::string::npos);
  // A device kind no daemon has: a mistake in the command line (exit 2), not a failed start (exit 1).
  const test::run_result gpu = test::run(std::string(RINGMASTER_NODE_BIN) + " --listen " + free_endpoint() + " --devices gpu:0");
  CHECK(gpu.status == 2);
  CHECK(gpu.out.find("--devices gpu:0: unknown device kind 'gpu'") != std::string::npos);
  // A key folder that will not do: exit 2 as the launcher's (exit 1 once, as if it had failed to start).
  const std::string keys = "/tmp/ringmaster-test-node-keys-" + std::to_string(getpid());
  { std::ofstream(keys) << "not a folder"; }
  const test::run_result key_file = test::run("timeout 10 " + std::string(RINGMASTER_NODE_BIN) + " --listen " + free_endpoint() +
                                              " --key-dir " + keys);
  CHECK(key_file.status == 2);
  CHECK(key_file.out.find("--key-dir: ") != std::string::npos);
  unlink(keys.c_str());
  const test::run_result no_dir = test::run(std::string(RINGMASTER_NODE_BIN) + " --listen " + free_endpoint() + " --key-dir ''");
  CHECK(no_dir.status == 2);
  CHECK(no_dir.out.find("--key-dir must not be empty") != std::string::npos);
  const test::run_result no_data = test::run(std::string(RINGMASTER_NODE_BIN) + " --listen " + free_endpoint() + " --data /nonexistent");
  CHECK(no_data.status == 2);
  CHECK(no_data.out.find("--data /nonexistent is not a folder") != std::string::npos);
  // An ipc path where a file is: ZeroMQ would have deleted it to bind there.
  const std::string file = "/tmp/ringmaster-test-not-a-socket-" + std::to_string(getpid());
  { std::ofstream(file) << "keep"; }
  const test::run_result on_file = test::run("timeout 10 " + std::string(RINGMASTER_NODE_BIN) + " --listen ipc://" + file);
  CHECK(on_file.status == 1);
  CHECK(on_file.out.find("cannot start: ipc://" + file + ": a file that is not a socket is there; it is left alone") !=
        std::string::npos);
  CHECK(access(file.c_str(), F_OK) == 0);
  unlink(file.c_str());
}

TEST_CASE("node daemons on IPv6 loopback: launcher and ring chunks (sealed, over TCP) reach them at tcp://[::1]:P", "[nodes][keys]") {
  const int probe = ::socket(AF_INET6, SOCK_STREAM, 0);
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  const bool v6 = probe >= 0 && ::bind(probe, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  if (probe >= 0) ::close(probe);
  if (!v6) {
    WARN("this machine has no IPv6 loopback: nothing to test");
    return;
  }
  test::daemons nodes;
  for (int i = 0; i < 2; ++i)
    nodes.push_back(std::make_unique<test::daemon_process>(std::vector<std::string>{RINGMASTER_NODE_BIN},
                                                           "tcp://[::1]:" + std::to_string(test::free_port()), "cpu:1", RINGMASTER_DATA_DIR));
  std::this_thread::sleep_for(300ms);
  remote_options ro;
  ro.nodes = test::endpoints(nodes);
  ro.shared_memory = false;  // as between hosts: each node's ring port, at [::1]
  ro.limit_train = 600;
  ro.limit_test = 100;
  const train_result r = train_remote(small_job(), ro);
  INFO(r.error);
  CHECK(r.ok);
  CHECK(r.identical);
}

TEST_CASE("a node names the bad field of a plan, tells a stranger only that it is busy, and takes no chunk from a stranger",
          "[nodes]") {
  logged_node a("node-a"), b("node-b");
  wire::header job;
  job.type = wire::msg_type::job;
  job.job_id = 5;
  CHECK(send_and_read_error(a.node->endpoint(), job, "{\"job\": 5}") == "node node-a: job plan: 'optimizer' is missing (invalid=1)");
  CHECK(send_and_read_error(a.node->endpoint(), job, "[[[[[[[[[[]]]]]]]]]]") ==
        "node node-a: job plan: the text nests deeper than 3 levels (invalid=1)");

  two_node_job running(a, b, 10);  // rank 0 on a, rank 1 on b
  running.ro.shared_memory = false;  // chunks between the nodes over the network, as between hosts
  running.start();
  const std::string started = a.wait_for(" started: ");
  const std::string id_text = job_id_text(started);
  const uint64_t id = job_id_of(started);

  // Another launcher's job: refused without a word about the running one.
  train_config other = small_job();
  job_placement w;
  w.nodes = {{a.node->endpoint(), "someone"}};
  w.rank_node = {0};
  w.devices = {"cpu"};
  job_plan plan;
  std::string err;
  REQUIRE(make_job_plan(other, w, &plan, &err));
  plan.job_id = job.job_id = 77;
  plan.recipient = 0;
  const std::string busy = send_and_read_error(a.node->endpoint(), job, to_json(plan));
  CHECK(busy == "node node-a: busy with another job (one whose launcher is gone is dropped within 5 s) (invalid=0)");
  CHECK(busy.find(id_text) == std::string::npos);

  // A chunk said to come from rank 0 (which node-a runs), sent to node-b by a stranger who knows the job id.
  zmq::context_t ctx;
  zmq::socket_t s(ctx, zmq::socket_type::dealer);
  s.set(zmq::sockopt::linger, 0);
  authenticate(s);
  s.connect(b.node->endpoint());
  wire::header chunk;
  chunk.type = wire::msg_type::chunk;
  chunk.job_id = id;
  chunk.sender_rank = 0;
  chunk.elements = 4;
  chunk.payload_bytes = 16;
  const float junk[4] = {1e30f, 1e30f, 1e30f, 1e30f};
  test::send_raw(s, chunk, {zmq::buffer(junk, sizeof junk)});
  // (node-a sends its chunks to node-b's ring port, so none may come through the bridge, whoever sends it.)
  const std::string dropped = b.wait_for("dropped a chunk said to be from rank 0 through the bridge: node " + a.node->endpoint() +
                                         " sends its chunks to our ring port");
  if (dropped.empty()) {
    std::lock_guard<std::mutex> lock(b.mu);
    for (const std::string& l : b.lines) UNSCOPED_INFO(l);
  }
  CHECK(dropped != "");
  // The same by the thousand, from a rank no job has: a few lines, not a flood.
  chunk.sender_rank = -1;
  for (int i = 0; i < 2000; ++i) test::send_raw(s, chunk, {zmq::buffer(junk, sizeof junk)});
  chunk.sender_rank = 0;
  CHECK(b.wait_for("dropped a message (malformed message): a chunk from rank -1 of a job of 2") != "");
  // Then one more chunk said to be rank 0's, on the same connection: once its (second) line is logged,
  // all 2000 before it have been handled.
  test::send_raw(s, chunk, {zmq::buffer(junk, sizeof junk)});
  auto said_twice = [&] {
    std::lock_guard<std::mutex> lock(b.mu);
    return std::count_if(b.lines.begin(), b.lines.end(),
                         [](const std::string& l) { return l.find("dropped a chunk said to be from rank 0") != std::string::npos; }) >= 2;
  };
  for (int i = 0; i < 500 && !said_twice(); ++i) std::this_thread::sleep_for(20ms);
  CHECK(said_twice());
  {
    std::lock_guard<std::mutex> lock(b.mu);
    int chunk_lines = 0;
    for (const std::string& l : b.lines) chunk_lines += l.find("a chunk from rank -1") != std::string::npos;
    CHECK(chunk_lines <= 5);
  }
  // Between the nodes, ring chunks are sealed (net/seal.hpp) and go to each node's ring port
  // (net/tcp_link.hpp). A stranger there cannot log in without the pair's key, whatever it claims.
  CHECK(a.wait_for("ring chunks to node " + b.node->endpoint() + " sealed (" + net::kSealCipher + ")") != "");
  const std::string port = ring_port_of(b.node->endpoint());
  REQUIRE(port != "");
  REQUIRE(port != "0");
  const int u = test::loopback_connect(std::stoi(port));
  CHECK(u >= 0);
  wire::header login;  // posing as node 0 of the job, with a tag it cannot make
  login.type = wire::msg_type::hello;
  login.job_id = id;
  login.sender_rank = 0;
  std::vector<unsigned char> forged(wire::kHeaderSize + net::kTrailerBytes);
  const auto lb = wire::encode(login);
  std::copy(lb.begin(), lb.end(), forged.begin());
  for (int i = 0; i < 8; ++i) forged[wire::kHeaderSize + size_t(i)] = static_cast<unsigned char>(id >> (8 * i));
  forged[wire::kHeaderSize + 12] = 0xff;  // a counter far ahead
  forged[wire::kHeaderSize + 19] = 0x7f;
  CHECK(send(u, forged.data(), forged.size(), MSG_NOSIGNAL) == ssize_t(forged.size()));
  CHECK(b.wait_for("ring port: a login as node 0 that failed: bad tag") != "");
  char closed;
  CHECK(recv(u, &closed, 1, 0) == 0);  // and hung up on
  close(u);
  // A weights request from the stranger for rank 1 (which node-b runs): no answer, the weights stay home.
  wire::header want;
  want.type = wire::msg_type::weights;
  want.job_id = id;
  want.sender_rank = 1;
  const auto wb = wire::encode(want);
  s.set(zmq::sockopt::rcvtimeo, 1000);
  s.send(zmq::buffer(wb.data(), wb.size()), zmq::send_flags::none);
  zmq::message_t nothing;
  CHECK_FALSE(s.recv(nothing, zmq::recv_flags::none));
  // An abort from the stranger, naming the job: not its launcher, so nothing happens.
  wire::header abort_h;
  abort_h.type = wire::msg_type::abort;
  abort_h.job_id = id;
  const std::string reason = "reason=killed by a stranger\n";
  abort_h.payload_bytes = reason.size();
  test::send_raw(s, abort_h, {zmq::buffer(reason)});

  // A stranger's pause and re-formed ring: only the job's launcher steers it.
  zmq::socket_t t(ctx, zmq::socket_type::dealer);
  t.set(zmq::sockopt::linger, 0);
  t.connect(a.node->endpoint());
  wire::header pause;
  pause.type = wire::msg_type::pause;
  pause.job_id = id;
  const std::string gen = "gen=1\n";
  pause.payload_bytes = gen.size();
  test::send_raw(t, pause, {zmq::buffer(gen)});

  const train_result& r = running.finish();
  INFO(r.error);
  CHECK(r.ok);
  CHECK(r.identical);
  CHECK(r.losses.empty());
  std::lock_guard<std::mutex> lock(a.mu);
  for (const std::string& l : a.lines) CHECK(l.find("paused") == std::string::npos);
}

TEST_CASE("keys: a node serves only launchers it accepts, known_nodes pins a node's key, --insecure is both sides' choice",
          "[nodes][keys]") {
  char tmpl[] = "/tmp/ringmaster-nodekeys-XXXXXX";
  REQUIRE(mkdtemp(tmpl));
  const std::string dir = tmpl, node_dir = dir + "/node", alice = dir + "/alice";
  logged_node node("node-k", node_dir);  // a key directory of its own, shared with nobody
  net::key_pair nk, ak;
  std::string err;
  REQUIRE(net::load_or_create_keys(node_dir, &nk, &err));
  REQUIRE(net::load_or_create_keys(alice, &ak, &err));
  remote_options ro;
  ro.nodes = {node.node->endpoint()};
  ro.limit_train = 600;
  ro.limit_test = 100;
  ro.key_dir = alice;

  // Alice does not know the node's key, and expects her own: the node cannot answer her hello.
  train_result r = train_remote(small_job(), ro);
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("does not hold the key we expect") != std::string::npos);
  INFO(r.error);
  CHECK(r.error.find("No key is known for it (no @KEY given, none in " + alice + "/known_nodes), so it was expected to share ours: "
                     "give --nodes " + node.node->endpoint() + "@KEY") != std::string::npos);

  // She gives its key, but the node does not accept hers: told so, and nothing of hers got through.
  ro.node_keys = {nk.public_key};
  r = train_remote(small_job(), ro);
  CHECK_FALSE(r.ok);
  CHECK(r.error == "node " + node.node->endpoint() + " refused our key (status 400): add our key.pub to its authorized_keys (if it is there, the file may be refused: see the node's log)");
  CHECK(node.wait_for("its key " + ak.public_key + " is not authorized") != "");
  CHECK(node.wait_for("job ", 100ms) == "");
  CHECK(test::slurp(alice + "/known_nodes").empty());  // nothing proven, nothing recorded

  // Authorized (the daemon reads the file again when it changes): she trains, and the key is recorded.
  std::ofstream(node_dir + "/authorized_keys") << "# alice\n" << ak.public_key << " alice@laptop\n";
  r = train_remote(small_job(), ro);
  INFO(r.error);
  REQUIRE(r.ok);
  CHECK(test::slurp(alice + "/known_nodes") == node.node->endpoint() + " " + nk.public_key + "\n");
  // Next time the recorded key is used; a different key for that endpoint is refused before connecting.
  ro.node_keys = {};
  r = train_remote(small_job(), ro);
  CHECK(r.ok);
  ro.node_keys = {ak.public_key};
  r = train_remote(small_job(), ro);
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("differs from the one recorded in " + alice + "/known_nodes:1") != std::string::npos);

  // A bad line put in authorized_keys while the node runs: the file is refused as a whole, and no key in it
  // (not even one just revoked) commands the node until it is fixed; then she trains again.
  std::ofstream(node_dir + "/authorized_keys") << ak.public_key << " alice@laptop\nnot-a-key\n";
  ro.node_keys = {};
  r = train_remote(small_job(), ro);
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("refused our key") != std::string::npos);
  CHECK(node.wait_for("authorized_keys refused, no other key may command this node") != "");
  std::ofstream(node_dir + "/authorized_keys") << ak.public_key << "\n";
  r = train_remote(small_job(), ro);
  INFO(r.error);
  CHECK(r.ok);
  CHECK(node.wait_for("authorized_keys read again: 1 keys") != "");

  // Her key revoked while her job runs: the job ends at once, and she is told why.
  train_config long_job = small_job();
  long_job.epochs = 1000;
  train_result revoked;
  const size_t before = node.logged();
  std::thread run([&] { revoked = train_remote(long_job, ro); });
  REQUIRE(node.wait_for("started: model 784-64-10", 10s, before) != "");
  const auto t0 = std::chrono::steady_clock::now();
  std::ofstream(node_dir + "/authorized_keys") << "# nobody\n";
  run.join();
  CHECK(std::chrono::steady_clock::now() - t0 < 1s);
  INFO(revoked.error);
  CHECK_FALSE(revoked.ok);
  CHECK(revoked.error.find("the launcher's key " + ak.public_key + " may no longer command this node (not in authorized_keys)") !=
        std::string::npos);
  CHECK(node.wait_for("ended: the launcher's key " + ak.public_key + " may no longer command this node") != "");

  // --insecure is an explicit choice of both sides: a launcher with keys cannot talk to a plain node.
  logged_node plain("node-plain", "", true);
  CHECK(plain.wait_for("--insecure: no keys, no encryption") != "");
  remote_options po;
  po.nodes = {plain.node->endpoint()};
  po.limit_train = 600;
  po.limit_test = 100;
  po.key_dir = alice;
  po.connect_timeout = 3s;
  r = train_remote(small_job(), po);
  CHECK_FALSE(r.ok);
  // Told as libzmq saw it: a mechanism mismatch, or (when the node hung up before it said its own) a hang-up.
  INFO(r.error);
  CHECK((r.error.find(plain.node->endpoint() + " runs --insecure and we use keys: run both sides with --insecure, or neither") !=
             std::string::npos ||
         r.error.find("hangs up during the handshake: it does not hold the key we expect, it runs without keys (--insecure)") !=
             std::string::npos));
  // Neither libzmq says more than that the handshake failed: the node says what it saw (once a minute).
  // (A ZeroMQ client may hang up before the node saw its mechanism: test::zmtp_greeting's always shows it.)
  const auto port_of = [](const std::string& ep) { return std::stoi(ep.substr(ep.rfind(':') + 1)); };
  CHECK(test::zmtp_greeting(port_of(plain.node->endpoint()), "CURVE"));
  CHECK(plain.wait_for("refused a client that offers CurveZMQ keys: this node runs --insecure") != "");
  po.insecure = true;
  r = train_remote(small_job(), po);
  INFO(r.error);
  CHECK(r.ok);

  // And the other way round: a launcher run --insecure at the node with keys is told which side lacks them.
  remote_options io = po;
  io.nodes = {node.node->endpoint()};
  r = train_remote(small_job(), io);
  CHECK_FALSE(r.ok);
  INFO(r.error);
  CHECK(r.error.find("We run --insecure: a node with keys does not answer us") != std::string::npos);
  CHECK(test::zmtp_greeting(port_of(node.node->endpoint()), "NULL"));
  CHECK(node.wait_for("refused a client that offers no keys (a launcher or node run --insecure?): this node runs with keys") != "");
}

TEST_CASE("a node under a low descriptor limit hangs up a flood at accept, without spinning, and serves again after it", "[nodes][keys]") {
  char tmpl[] = "/tmp/ringmaster-fdlog-XXXXXX";
  const int fd = mkstemp(tmpl);
  REQUIRE(fd >= 0);
  close(fd);
  const std::string log = tmpl;
  // The daemon under a low descriptor limit, its log in a file.
  auto nodes = test::start_daemons(
      1, {"/bin/sh", "-c", "exec 2>" + log + "; ulimit -n 64; exec \"$0\" \"$@\"", RINGMASTER_NODE_BIN}, "cpu:1",
      RINGMASTER_DATA_DIR);
  const std::string ep = nodes[0]->endpoint;
  const int port = std::stoi(ep.substr(ep.rfind(':') + 1));
  // CPU time (user + system, in clock ticks) the daemon has used so far.
  const auto cpu_ticks = [pid = nodes[0]->pid] {
    std::istringstream in(test::slurp("/proc/" + std::to_string(pid) + "/stat"));
    std::string field;
    long long ticks = 0;
    for (int i = 1; i <= 15 && in >> field; ++i)  // fields 14 and 15 (after a name without spaces)
      if (i >= 14) ticks += std::strtoll(field.c_str(), nullptr, 10);
    return ticks;
  };
  std::vector<int> flood;
  for (int i = 0; i < 200; ++i) {
    const int s = test::loopback_connect(port, true);
    REQUIRE(s >= 0);
    flood.push_back(s);
  }
  const long long before = cpu_ticks();
  std::this_thread::sleep_for(1500ms);
  const long long spent = cpu_ticks() - before;
  for (int s : flood) close(s);
  const std::string text = test::slurp(log);
  INFO(text);
  // It fitted its clients to the limit, so the flood was hung up as it came: at most one report of
  // running out, and no busy loop (libzmq retrying a failed accept took both cores: ~300 ticks here).
  CHECK(text.find("file descriptor limit 64 (ulimit -n): serving at most 1 client at once") != std::string::npos);
  size_t reports = 0;
  for (size_t at = 0; (at = text.find("out of file descriptors", at)) != std::string::npos; ++at) ++reports;
  CHECK(reports <= 1);
  INFO("CPU ticks over 1.5 s of the flood: " << spent);
  CHECK(spent < 60);
  // The strangers' connections close (handshake timeout or hang-up), and a launcher is served again.
  train_result r = small_job_on(ep, 10s);
  INFO(r.error);
  CHECK(r.ok);
  std::remove(log.c_str());
}

TEST_CASE("a flood of idle connections from one host, hung up at accept, does not keep a launcher from another out", "[nodes][keys]") {
  auto nodes = test::start_daemons(1, {RINGMASTER_NODE_BIN, "--max-connections", "4"}, "cpu:1", RINGMASTER_DATA_DIR);
  const std::string ep = nodes[0]->endpoint;
  const int port = std::stoi(ep.substr(ep.rfind(':') + 1));
  // Four times the limit in idle connections from 127.0.0.2: past the few told why at the handshake,
  // they are hung up as they come; the rest stay until the handshake timeout (3 s).
  std::vector<int> idle;
  for (int i = 0; i < 16; ++i) {
    idle.push_back(test::loopback_connect_from("127.0.0.2", port));
    REQUIRE(idle.back() >= 0);
  }
  // Before the handshakes of those kept could time out (3 s): 16, less the 4 within the limit and the
  // 1 told why, are hung up.
  std::vector<bool> gone(idle.size(), false);
  int hung_up = 0;
  for (const auto until = std::chrono::steady_clock::now() + 2500ms; hung_up < 11 && std::chrono::steady_clock::now() < until;) {
    for (size_t i = 0; i < idle.size(); ++i) {
      char buf[256];  // libzmq may have written its greeting before the hang-up
      ssize_t n = 0;
      while (!gone[i] && (n = ::recv(idle[i], buf, sizeof buf, MSG_DONTWAIT)) > 0) {
      }
      if (!gone[i] && (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK))) gone[i] = true, ++hung_up;
    }
    std::this_thread::sleep_for(20ms);
  }
  CHECK(hung_up == 11);
  // The launcher, from 127.0.0.1, is let in at once, long before the strangers' handshakes time out.
  train_result r = small_job_on(ep, 2s);
  INFO(r.error);
  CHECK(r.ok);
  for (int fd : idle) close(fd);
}

TEST_CASE("a node logs at most 5 lines of one kind of fault per 10 s, however many come", "[nodes]") {
  logged_node a("node-flood");
  zmq::context_t ctx;
  zmq::socket_t s(ctx, zmq::socket_type::dealer);
  s.set(zmq::sockopt::linger, 0);
  authenticate(s);
  s.connect(a.node->endpoint());
  for (int i = 0; i < 200; ++i) s.send(zmq::buffer(std::string("junk")), zmq::send_flags::none);
  // The node keeps serving: a hello after the junk is answered.
  wire::header h;
  h.type = wire::msg_type::hello;
  const auto hb = wire::encode(h);
  s.set(zmq::sockopt::rcvtimeo, 5000);
  s.send(zmq::buffer(hb.data(), hb.size()), zmq::send_flags::none);
  zmq::message_t reply;
  REQUIRE(s.recv(reply, zmq::recv_flags::none));
  std::this_thread::sleep_for(200ms);
  std::lock_guard<std::mutex> lock(a.mu);
  int lines = 0;
  for (const std::string& l : a.lines) lines += l.find("dropped a message (malformed message)") != std::string::npos;
  CHECK(lines == 5);
}

// A node that speaks our protocol (with our key) and answers as a script says: a hello with hello_ack, a
// job plan with `on_job` (messages: a type and its fields each), anything else not at all.
struct scripted_node {
  using answers = std::vector<std::pair<wire::msg_type, wire::kv_map>>;
  std::function<answers()> on_job;
  // Any other message (a start, heartbeats): whatever it does with the bridge.
  std::function<void(net::bridge&, const net::peer_info&, const wire::header&)> on_other;
  std::unique_ptr<net::bridge> br;

  explicit scripted_node(std::function<answers()> job) : on_job(std::move(job)) {
    net::bridge_options bo;
    std::string err;
    REQUIRE(net::load_or_create_keys(net::default_key_dir(), &bo.keys, &err));
    bo.authorize = [](const std::string&) { return true; };
    br = std::make_unique<net::bridge>(bo);
    br->set_handler([this](const net::peer_info& from, const wire::header& h, net::payload) {
      answers say;
      if (h.type == wire::msg_type::hello)
        say = {{wire::msg_type::hello_ack, {{"name", "scripted"}, {"id", "scripted"}, {"devices", "cpu:1"}, {"version", "3"}}}};
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

// n node daemons in this process, each with a key of its own that trusts only the launcher's (not the
// other nodes'), all in a fresh folder `dir` (removed at the end); ro names them, their keys and the
// launcher's key folder.
struct own_key_nodes {
  std::string dir;
  std::vector<std::unique_ptr<logged_node>> nodes;
  remote_options ro;
  explicit own_key_nodes(int n) {
    char tmpl[] = "/tmp/ringmaster-ownkeys-XXXXXX";
    REQUIRE(mkdtemp(tmpl));
    dir = tmpl;
    net::key_pair lk;
    std::string err;
    REQUIRE(net::load_or_create_keys(dir + "/launcher", &lk, &err));
    for (int i = 0; i < n; ++i) {
      const std::string nd = dir + "/node" + std::to_string(i);
      net::key_pair nk;
      REQUIRE(net::load_or_create_keys(nd, &nk, &err));
      std::ofstream(nd + "/authorized_keys") << lk.public_key << "\n";
      nodes.push_back(std::make_unique<logged_node>("node" + std::to_string(i), nd));
      ro.nodes.push_back(nodes.back()->node->endpoint());
      ro.node_keys.push_back(nk.public_key);
    }
    ro.key_dir = dir + "/launcher";
  }
  ~own_key_nodes() {
    nodes.clear();  // stopped before their folders go
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
};

TEST_CASE("keys: nodes with keys of their own train together, each trusting the launcher and, for the job, each other", "[nodes][keys]") {
  own_key_nodes own(3);
  const std::string& dir = own.dir;
  std::string err;
  auto& nodes = own.nodes;
  remote_options ro = own.ro;
  ro.shared_memory = false;  // as between hosts: the ring's chunks sealed between them
  ro.limit_train = 600;
  ro.limit_test = 100;
  train_result r = train_remote(small_job(), ro);
  INFO(r.error);
  REQUIRE(r.ok);
  CHECK(r.identical);
  // Their ring chunks went sealed, each pair under the key only its two nodes can derive.
  for (int i = 0; i < 3; ++i)
    CHECK(nodes[size_t(i)]->wait_for("ring chunks to node " + ro.nodes[size_t((i + 1) % 3)] + " sealed (" + net::kSealCipher + ")") != "");
  // Between jobs a node's key is no key to the others: node 1 cannot command node 0.
  net::key_pair k1;
  REQUIRE(net::load_or_create_keys(dir + "/node1", &k1, &err));
  remote_options by_node1;
  by_node1.nodes = {ro.nodes[0]};
  by_node1.node_keys = {ro.node_keys[0]};
  by_node1.key_dir = dir + "/node1";
  r = train_remote(small_job(), by_node1);
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("refused our key") != std::string::npos);
}

TEST_CASE("keys: a job's node gets through another's command port only if it sends its chunks there", "[nodes][keys]") {
  // One that may connect can send one message of endless frames, which ZeroMQ holds until the last:
  // nodes whose chunks go to the ring ports (sealed) have no business there.
  own_key_nodes own(2);
  const std::string& dir = own.dir;
  auto& nodes = own.nodes;
  remote_options ro = own.ro;
  ro.shared_memory = false;  // as between hosts
  ro.limit_train = 6000;
  ro.limit_test = 100;
  train_config c = small_job();
  c.model = "784-512-512-10";
  c.epochs = 40;
  std::atomic<bool> training{false};
  std::atomic<int> stop{0};
  c.on_progress = [&](const progress&) { training = true; };
  c.interrupt = &stop;  // done once the probe has its answer
  train_result r;
  std::thread launcher([&] { r = train_remote(c, ro); });
  for (int i = 0; i < 600 && !training; ++i) std::this_thread::sleep_for(50ms);
  if (!training) stop = SIGINT, launcher.join();  // a failed REQUIRE must not leave the thread running
  REQUIRE(training);
  // While node 1 sends its chunks to node 0's ring port, its key is refused at node 0's command port.
  remote_options by_node1;
  by_node1.nodes = {ro.nodes[0]};
  by_node1.node_keys = {ro.node_keys[0]};
  by_node1.key_dir = dir + "/node1";
  const train_result probe = train_remote(small_job(), by_node1);
  stop = SIGINT;
  launcher.join();
  INFO(probe.error);
  CHECK_FALSE(probe.ok);
  CHECK(probe.error.find("refused our key") != std::string::npos);  // was: in, then told "busy"
  CHECK(nodes[0]->wait_for("its key " + ro.node_keys[1] + " is not authorized") != "");
  CHECK(nodes[0]->wait_for("refused node " + ro.nodes[1] + " of job ") != "");  // and why
  // Without ring ports the chunks go through the bridges: there the sending node is let in.
  ro.ring_ports = false;
  c = small_job();
  r = train_remote(c, ro);
  INFO(r.error);
  CHECK(r.ok);
  CHECK(r.identical);
}

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
  zmq::context_t ctx;
  zmq::socket_t s = client(ctx, a.node->endpoint());
  s.set(zmq::sockopt::rcvtimeo, 20000);
  const uint64_t id = 4545;
  send_own_job(s, a.node->endpoint(), "node-a", "784-64-10", id, 600, [](job_plan& p) { p.elastic = true; });
  await_job_ack(s);
  wire::header rh;
  std::string text;
  for (const std::string bad : {"gen=abc\n", "gen=0\n", "gen=1\nat=-1\n", "not kv"}) {
    wire::header pause;
    pause.type = wire::msg_type::pause;
    pause.job_id = id;
    pause.payload_bytes = bad.size();
    test::send_raw(s, pause, {zmq::buffer(bad)});
    REQUIRE(next_of(s, wire::msg_type::error, &rh, &text));
    INFO(text);
    CHECK(text.find("error=node node-a ignored a pause with") == 0);
  }
  // Still its job: a weights request is answered.
  wire::header want;
  want.type = wire::msg_type::weights;
  want.job_id = id;
  want.sender_rank = 0;
  test::send_raw(s, want);
  CHECK(next_of(s, wire::msg_type::weights, &rh, &text));
  wire::header bye;
  bye.type = wire::msg_type::abort;
  bye.job_id = id;
  test::send_raw(s, bye);
}
