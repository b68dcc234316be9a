// Raw peers for the node daemon tests (test_nodes_security.cpp, test_nodes_keys.cpp, test_nodes_liars.cpp,
// test_nodes_launchers.cpp): bare sockets that speak our protocol with an accepted key, a job sent by
// hand, and a two-node job run by a launcher thread.
#pragma once
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

namespace ringmaster::node_peers {

using namespace std::chrono_literals;
using test::authenticate;
using test::endpoints;
using test::free_endpoint;
using test::job_id_of;
using test::job_id_text;
using test::logged_node;
using test::small_job;
using test::start_nodes;

// A bare DEALER with an accepted key, connected to `endpoint`, that waits at most 5 s for a reply.
inline zmq::socket_t client(zmq::context_t& ctx, const std::string& endpoint) {
  zmq::socket_t s(ctx, zmq::socket_type::dealer);
  s.set(zmq::sockopt::linger, 0);
  s.set(zmq::sockopt::rcvtimeo, 5000);
  authenticate(s);
  s.connect(endpoint);
  return s;
}

// A peer that is no part of the job: a bare DEALER that sends one message and reads the error reply.
inline std::string send_and_read_error(const std::string& endpoint, wire::header h, const std::string& payload) {
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
inline std::string ring_port_of(const std::string& endpoint) {
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
inline void send_own_job(zmq::socket_t& s, const std::string& endpoint, const std::string& name, const std::string& model,
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

// The next message a raw client gets: its header and its payload (a tensor's floats as bytes). False
// when none comes within the socket's receive timeout.
inline bool next_message(zmq::socket_t& s, wire::header* h, std::string* body) {
  for (zmq::message_t head; s.recv(head);) {
    zmq::message_t payload;
    if (head.more()) REQUIRE(s.recv(payload));
    std::string err;
    if (!wire::decode(head.data(), head.size(), h, &err)) continue;
    *body = payload.to_string();  // a tensor's floats too, as bytes
    return true;
  }
  return false;
}

// Reads until a message of this type comes (heartbeats come too); its header in *h, its text in *body.
inline bool next_of(zmq::socket_t& s, wire::msg_type type, wire::header* h, std::string* body) {
  while (next_message(s, h, body))
    if (h->type == type) return true;
  return false;
}

// The node's job_ack to a job send_own_job sent; a refusal fails the test.
inline void await_job_ack(zmq::socket_t& s) {
  wire::header h;
  std::string body;
  while (h.type != wire::msg_type::job_ack) {
    REQUIRE(next_message(s, &h, &body));
    INFO(body);
    REQUIRE(h.type != wire::msg_type::error);
  }
}

// small_job() over `ro` with its nodes as between hosts (no shared memory), on 600 training and 100 test
// samples: it trains, bit-identical everywhere. (REQUIRE: what follows reads the nodes' logs of it.)
inline void train_between_hosts(remote_options ro) {
  ro.shared_memory = false;
  ro.limit_train = 600;
  ro.limit_test = 100;
  const train_result r = train_remote(small_job(), ro);
  INFO(r.error);
  REQUIRE(r.ok);
  CHECK(r.identical);
}

// A launcher by hand: a bare client of node `a` (named `name`) that sent it a one-node job of `model` on
// 600 samples (send_own_job) and has its job_ack; it waits up to 20 s for each reply.
struct raw_launcher {
  zmq::context_t ctx;
  zmq::socket_t s;
  uint64_t id;
  raw_launcher(logged_node& a, const std::string& name, const std::string& model, uint64_t job,
               const std::function<void(job_plan&)>& tweak = {})
      : s(client(ctx, a.node->endpoint())), id(job) {
    s.set(zmq::sockopt::rcvtimeo, 20000);
    send_own_job(s, a.node->endpoint(), name, model, id, 600, tweak);
    await_job_ack(s);
  }
  // A message of the job without payload: a weights request for `rank`, an abort.
  void send(wire::msg_type type, int rank = -1) {
    wire::header h;
    h.type = type;
    h.job_id = id;
    h.sender_rank = rank;
    test::send_raw(s, h);
  }
};

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
inline train_result small_job_on(const std::string& endpoint, std::chrono::milliseconds connect_timeout) {
  remote_options ro;
  ro.nodes = {endpoint};
  ro.limit_train = 600;
  ro.limit_test = 100;
  ro.connect_timeout = connect_timeout;
  return train_remote(small_job(), ro);
}

}  // namespace ringmaster::node_peers
