// The topology API's ranks in this process, when nodes take part too: the node service that serves them
// listens where the nodes can reach it, not on 127.0.0.1 (a node on another machine was told to send its
// ring chunks to its own loopback: "cannot reach tcp://127.0.0.1:34235 (a ring port) after 20 tries").
#include <ifaddrs.h>
#include <netinet/in.h>
#include <arpa/inet.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <string>
#include <vector>

#include "actors/topology.hpp"
#include "net/keys.hpp"
#include "tests/test_nodes.hpp"

using namespace ringmaster;

namespace {

// This machine's IPv4 addresses other than loopback ones.
std::vector<std::string> outward_addresses() {
  std::vector<std::string> out;
  ifaddrs* all = nullptr;
  if (getifaddrs(&all) != 0) return out;
  for (ifaddrs* a = all; a; a = a->ifa_next) {
    if (!a->ifa_addr || a->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN];
    if (!inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, text, sizeof text)) continue;
    if (std::string(text).rfind("127.", 0) != 0) out.push_back(text);
  }
  freeifaddrs(all);
  return out;
}

// A job of one rank here and one on a daemon listening at `host`, as `t` sets it up; the daemon's log.
std::string mixed_job(const std::string& host, topology& t, train_result* r) {
  const std::string log = "/tmp/ringmaster-test-topology-" + std::to_string(::getpid()) + ".log";
  std::remove(log.c_str());
  const std::string ep = "tcp://" + host + ":" + std::to_string(test::free_port());
  test::daemon_process node({RINGMASTER_NODE_BIN}, ep, "cpu:1", RINGMASTER_DATA_DIR, log);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  t.connect(ep).place(1, {"", "cpu"}).place(1, {ep, "cpu"});
  t.data_dir(RINGMASTER_DATA_DIR).limit(600, 100);
  *r = t.train(test::small_job());
  node.stop(SIGTERM);
  const std::string logged = test::slurp(log);
  std::remove(log.c_str());
  return logged;
}

}  // namespace

TEST_CASE("net: address_toward names this machine's address on the route to a host", "[topology][keys]") {
  CHECK(net::address_toward("tcp://127.0.0.1:9") == "127.0.0.1");
  CHECK(net::address_toward("tcp://localhost:9").rfind("127.", 0) == 0);
  CHECK(net::address_toward("ipc:///tmp/x").empty());
  CHECK(net::address_toward("tcp://no-such-host.invalid:9").empty());
  for (const std::string& a : outward_addresses()) CHECK(net::address_toward("tcp://" + a + ":9") == a);
}

TEST_CASE("topology API: ranks here serve a node where it reaches them, or where listen() says", "[nodes][topology]") {
  const std::vector<std::string> outward = outward_addresses();
  if (outward.empty()) WARN("this machine has no address but loopback: only listen() is checked");
  if (!outward.empty()) {  // one of them: a job each would be slow on a host of many (docker bridges)
    // The node is told our ranks' address on the route to it, as one on another machine would be.
    const std::string& host = outward[0];
    topology t;
    train_result r;
    const std::string logged = mixed_job(host, t, &r);
    INFO(logged);
    INFO(r.error);
    REQUIRE(r.ok);
    CHECK(logged.find("ring chunks to node tcp://" + host + ":") != std::string::npos);
  }
  {  // a node on ipc:// is on this machine: served on loopback, as before
    const std::string ep = "ipc:///tmp/ringmaster-test-topology-" + std::to_string(::getpid());
    test::daemon_process node({RINGMASTER_NODE_BIN}, ep, "cpu:1", RINGMASTER_DATA_DIR);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    topology local_node;
    local_node.connect(ep).place(1, {"", "cpu"}).place(1, {ep, "cpu"}).data_dir(RINGMASTER_DATA_DIR).limit(600, 100);
    const train_result r = local_node.train(test::small_job());
    INFO(r.error);
    CHECK(r.ok);
  }
  topology t;  // listen(): where the user says
  t.listen("tcp://127.0.0.1:0");
  train_result r;
  const std::string logged = mixed_job("127.0.0.1", t, &r);
  INFO(logged);
  REQUIRE(r.ok);
  CHECK(logged.find("ring chunks to node tcp://127.0.0.1:") != std::string::npos);
  topology bad;
  bad.listen("tcp://203.0.113.9:0").place(1, {"", "cpu"}).connect("tcp://127.0.0.1:1").place(1, {"tcp://127.0.0.1:1", "cpu"});
  const train_result refused = bad.train(test::small_job());
  CHECK(refused.invalid);
  CHECK(refused.error == "listen(): '203.0.113.9' is not an address of this machine: name an address of this machine that the nodes reach");
  topology everywhere;
  everywhere.listen("tcp://*:0").place(1, {"", "cpu"}).connect("tcp://127.0.0.1:1").place(1, {"tcp://127.0.0.1:1", "cpu"});
  CHECK(everywhere.train(test::small_job()).error == "listen(): name the address of this machine that the nodes reach (tcp://*:0 names every one)");
  topology unknown;  // no address toward it: named, not 127.0.0.1 in silence
  unknown.place(1, {"", "cpu"}).connect("tcp://no-such-host.invalid:1").place(1, {"tcp://no-such-host.invalid:1", "cpu"});
  CHECK(unknown.train(test::small_job()).error.rfind("cannot tell this machine's address toward node tcp://no-such-host.invalid:1", 0) == 0);
  topology odd;
  odd.listen("tcp://127.0.0.1:0", 70000).place(1, {"", "cpu"}).connect("tcp://127.0.0.1:1").place(1, {"tcp://127.0.0.1:1", "cpu"});
  CHECK(odd.train(test::small_job()).error == "listen(): the ring port must be 0-65535, not 70000");
  topology same;  // it failed as a busy port, not as the configuration it is
  same.listen("tcp://127.0.0.1:48950", 48950).place(1, {"", "cpu"}).connect("tcp://127.0.0.1:1").place(1, {"tcp://127.0.0.1:1", "cpu"});
  const train_result clash = same.train(test::small_job());
  CHECK(clash.invalid);
  CHECK(clash.error == "listen(): the ring port 48950 is the port of tcp://127.0.0.1:48950: ring chunks need a port of their own");
}

TEST_CASE("topology API: every rank here trains on data_dir()'s files, limit()ed, where no data is given", "[topology]") {
  // It failed "no training data", and limit() was passed over for data in memory.
  topology t;
  t.place(2, {"", "cpu"}).data_dir(RINGMASTER_DATA_DIR).limit(480, 100);
  const train_result r = t.train(test::small_job());
  INFO(r.error);
  REQUIRE(r.ok);
  REQUIRE(r.history.size() == 1);
  CHECK(r.history[0].samples == 480);
  topology nowhere;
  nowhere.place(1, {"", "cpu"}).data_dir("/nonexistent");
  const train_result refused = nowhere.train(test::small_job());
  CHECK(refused.invalid);
  CHECK(refused.error.find("/nonexistent") != std::string::npos);
}

TEST_CASE("topology API: settings a job cannot honour are refused, not passed over", "[topology]") {
  topology local;
  local.place(1, {"", "cpu"}).data_dir(RINGMASTER_DATA_DIR).limit(-5, -1);  // it trained on all 60,000
  train_result r = local.train(test::small_job());
  CHECK(r.invalid);
  CHECK(r.error == "limit(): sample counts must be 0 (all) or more, not -5 and -1");
  train_config many = test::small_job();
  many.threads = 100000;  // std::thread threw: the process aborted
  r = local.limit(60, 10).train(many);
  CHECK(r.error == "threads must be in 0..1024 (0: one per replica, at most one per core)");
  // Weights of one's own do not travel to nodes: they started from the seed's, in silence.
  train_config given = test::small_job();
  given.init_params = std::make_shared<const std::vector<float>>(784 * 64 + 64 + 64 * 10 + 10, 0.5f);
  remote_options ro;
  ro.nodes = {"tcp://127.0.0.1:1"};
  r = train_remote(given, ro);
  CHECK(r.invalid);
  CHECK(r.error.rfind("init_params do not travel to nodes", 0) == 0);
}

TEST_CASE("a rank's NaN loss stops a job with ranks here and on a node at its step, not at the evaluation", "[nodes][topology]") {
  // Each rank reports its own steps: the node's were behind this process's evaluation, which was blamed
  // ("the test loss became NaN in the evaluation after epoch 1") after a whole epoch trained on NaN.
  auto nodes = test::start_nodes(1, "cpu:1");
  topology t;
  t.connect(nodes[0]->endpoint).place(1, {"", "cpu"}).place(1, {nodes[0]->endpoint, "cpu"});
  t.data_dir(RINGMASTER_DATA_DIR).limit(2000, 500);
  train_config c = test::small_job();
  c.opt.lr = 1e30f;
  const train_result r = t.train(c);
  INFO(r.error);
  CHECK_FALSE(r.ok);
  CHECK(r.error.rfind("the loss became NaN at epoch 1, step ", 0) == 0);
  CHECK(r.history.empty());
}
