// Helpers shared by the node daemon tests (test_nodes.cpp: training across nodes and losing them;
// test_nodes_security.cpp: hostile peers and keys): daemons and in-process nodes to train on, a small job,
// the job id a node logs, and a bare socket that authenticates.
#pragma once
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>

#include "actors/node_service.hpp"
#include "actors/training.hpp"
#include "net/keys.hpp"
#include "tests/test_util.hpp"

namespace ringmaster::test {

// ringmaster-node daemons on free loopback ports, killed (SIGKILL) when they go unless stopped before.
inline daemons start_nodes(int n, const std::string& devices = "cpu:2") {
  return start_daemons(n, {RINGMASTER_NODE_BIN}, devices, RINGMASTER_DATA_DIR);
}

inline train_config small_job() {
  train_config c;
  c.model = "784-64-10";
  c.global_batch = 60;
  c.epochs = 1;
  return c;
}

// The job id in a node's "job N started: ..." line.
inline std::string job_id_text(const std::string& started) {
  const size_t at = started.find("job ") + 4;
  return started.substr(at, started.find(' ', at) - at);
}
inline uint64_t job_id_of(const std::string& started) {
  uint64_t id = 0;
  for (char ch : job_id_text(started)) id = id * 10 + uint64_t(ch - '0');
  return id;
}

// A bare socket that authenticates with the key every test process and daemon shares (~/.ringmaster: a
// daemon accepts its own key): a hostile peer that got past authentication, for the tests of what a
// node still refuses such a peer. server_key: the daemon's, which is the same.
inline void authenticate(zmq::socket_t& s) {
  net::key_pair k;
  std::string err;
  REQUIRE(net::load_or_create_keys(net::default_key_dir(), &k, &err));
  s.set(zmq::sockopt::curve_serverkey, k.public_key);
  s.set(zmq::sockopt::curve_publickey, k.public_key);
  s.set(zmq::sockopt::curve_secretkey, k.secret_key);
}

// A node service in this process whose log lines the test can read.
struct logged_node {
  std::mutex mu;
  std::vector<std::string> lines;
  std::unique_ptr<node_service> node;

  explicit logged_node(const std::string& name, const std::string& key_dir = "", bool insecure = false) {
    node_options o;
    o.key_dir = key_dir;
    o.insecure = insecure;
    o.listen = "tcp://127.0.0.1:0";
    o.name = name;
    o.devices = "cpu:1";
    o.data_dir = RINGMASTER_DATA_DIR;
    o.log = [this](const std::string& l) {
      std::lock_guard<std::mutex> lock(mu);
      lines.push_back(l);
    };
    node = std::make_unique<node_service>(o);
    std::string err;
    REQUIRE(node->start(&err));
  }
  // Lines logged so far: wait_for(text, wait, logged()) then finds only later ones.
  size_t logged() {
    std::lock_guard<std::mutex> lock(mu);
    return lines.size();
  }
  // The first line holding `text` from line `from` on ("" if none within the wait).
  std::string wait_for(const std::string& text, std::chrono::milliseconds wait = std::chrono::seconds(10), size_t from = 0) {
    for (auto until = std::chrono::steady_clock::now() + wait; std::chrono::steady_clock::now() < until;) {
      {
        std::lock_guard<std::mutex> lock(mu);
        for (size_t i = from; i < lines.size(); ++i)
          if (lines[i].find(text) != std::string::npos) return lines[i];
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return "";
  }
};

}  // namespace ringmaster::test
