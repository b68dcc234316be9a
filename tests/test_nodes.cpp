// Node daemons as real processes on 127.0.0.1 (free ports found at run time), driven by train_remote:
// training across nodes, and nodes lost or launchers gone mid-job. What a node refuses hostile peers, and
// keys: test_nodes_security.cpp.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <atomic>
#include <climits>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <zmq.hpp>

#include "actors/job_plan.hpp"
#include "actors/remote_job.hpp"
#include "actors/topology.hpp"
#include "actors/training.hpp"
#include "tests/scale_layer.hpp"
#include "tests/test_data.hpp"
#include "tests/test_nodes.hpp"
#include "tests/test_util.hpp"
#include "tests/test_zmq.hpp"
#include "net/keys.hpp"
#include "net/seal.hpp"
#include "net/shm_link.hpp"
#include "net/wire.hpp"

using namespace ringmaster;
using namespace std::chrono_literals;

namespace {

using test::authenticate;
using test::endpoints;
using test::free_endpoint;
using test::job_id_of;
using test::load;
using test::logged_node;
using test::small_job;
using test::start_nodes;

}  // namespace

TEST_CASE("3 nodes x 2 replicas train exactly like 6 local replicas", "[nodes]") {
  auto nodes = start_nodes(3);
  remote_options ro;
  ro.nodes = endpoints(nodes);
  ro.replicas_per_node = 2;
  ro.limit_train = 3000;
  ro.limit_test = 500;
  train_result remote = train_remote(small_job(), ro);
  INFO(remote.error);
  REQUIRE(remote.ok);
  CHECK(remote.identical);
  REQUIRE(remote.checksums.size() == 6);
  CHECK(remote.history.size() == 1);
  CHECK(remote.history[0].samples == 3000);
  CHECK(remote.history[0].val_accuracy > 0.5);

  train_config local = small_job();
  local.replicas = 6;
  local.train = load("train", 3000);
  local.test = load("t10k", 500);
  train_result l = train(local);
  REQUIRE(l.ok);
  // The same ring order and the same shards: the same bits, and so also within 1e-5 of one replica.
  CHECK(l.checksums[0] == remote.checksums[0]);
  CHECK(l.weights == remote.weights);
  CHECK(l.history[0].val_accuracy == remote.history[0].val_accuracy);

  // The daemons stay up for the next job.
  train_result again = train_remote(small_job(), ro);
  REQUIRE(again.ok);
  CHECK(again.checksums[0] == remote.checksums[0]);
}

TEST_CASE("kill -9 of a node mid-job with abort_on_node_loss: the job fails within 2 s naming it, the others take the next job", "[nodes]") {
  auto nodes = start_nodes(3);
  remote_options ro;
  ro.nodes = endpoints(nodes);
  ro.replicas_per_node = 2;
  ro.abort_on_node_loss = true;
  train_config big;
  big.model = "784-256-10";
  big.global_batch = 60;
  big.epochs = 20;  // far longer than the test waits
  big.evaluate = false;
  std::chrono::steady_clock::time_point killed;
  std::atomic<bool> training{false};
  big.on_progress = [&](const progress&) { training = true; };
  std::atomic<double> named{-1};  // seconds from the kill to the launcher's line that names it
  ro.on_event = [&](const std::string& line) {
    if (line.find(" stopped answering: ") != std::string::npos && line.find("; the job fails (--on-node-loss abort)") != std::string::npos)
      named = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
  };
  std::thread killer([&] {
    // Kill once training runs (loading the data may take a while on a loaded machine).
    for (int i = 0; i < 600 && !training; ++i) std::this_thread::sleep_for(100ms);
    std::this_thread::sleep_for(500ms);
    killed = std::chrono::steady_clock::now();
    nodes[1]->stop(SIGKILL);
  });
  train_result r = train_remote(big, ro);
  const double after = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
  killer.join();
  INFO(r.error);
  CHECK_FALSE(r.ok);
  WARN("kill -9 to the launcher naming it: " << named << " s, to the job's end: " << after << " s");
  CHECK(named > 0);
  CHECK(named < 2);
  CHECK(after < 2.5);  // named within 2 s; then the job winds down
  CHECK(r.error.find(nodes[1]->endpoint) != std::string::npos);
  CHECK(r.error.find("ranks 2-3") != std::string::npos);

  remote_options survivors;
  survivors.nodes = {nodes[0]->endpoint, nodes[2]->endpoint};
  survivors.limit_train = 600;
  survivors.limit_test = 100;
  train_result next = train_remote(small_job(), survivors);
  INFO(next.error);
  CHECK(next.ok);
}

TEST_CASE("node daemon: a taken port is a clear error, SIGTERM a clean stop, bad nodes a clear error", "[nodes]") {
  const std::string ep = free_endpoint();
  test::daemon_process first({RINGMASTER_NODE_BIN}, ep, "cpu:2", RINGMASTER_DATA_DIR);
  std::this_thread::sleep_for(300ms);
  // Not test::run: its REQUIRE on popen would add an assertion this test never had.
  std::string cmd = std::string(RINGMASTER_NODE_BIN) + " --listen " + ep + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[512];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int st = pclose(p);
  CHECK(WEXITSTATUS(st) == 1);
  CHECK(out.find("address already in use") != std::string::npos);
  const int status = first.stop(SIGTERM);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);

  remote_options ro;
  ro.nodes = {free_endpoint()};  // nobody there
  ro.connect_timeout = 1000ms;
  train_result r = train_remote(small_job(), ro);
  CHECK_FALSE(r.ok);
  // A port nothing listens on, said as such, not as a matter of keys.
  CHECK(r.error == "node " + ro.nodes[0] + " did not answer within 1 s: nothing accepted a connection there (is ringmaster-node "
                   "running there? a firewall in the way?)");
  CHECK(r.wall_seconds >= 0.9);  // the second it waited: a setup that failed took its time too (it said 0)
  // An ipc path with no socket is named as such.
  ro.nodes = {"ipc:///tmp/ringmaster-no-such-node-" + std::to_string(::getpid())};
  r = train_remote(small_job(), ro);
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("node " + ro.nodes[0] + " did not answer within 1 s: there is no socket at " + ro.nodes[0].substr(6) +
                     " (is ringmaster-node running there?)") == 0);
}

TEST_CASE("nodes that refuse a job are all named at once, not the first alone", "[nodes]") {
  // Two of three daemons have no data where --data says (a cluster set up alike is wrong alike): the user
  // hears of both in one run, not of one per try.
  const std::string empty = "/tmp/ringmaster-test-no-data-" + std::to_string(::getpid());
  std::filesystem::create_directories(empty);
  test::daemons bare = test::start_daemons(2, {RINGMASTER_NODE_BIN}, "cpu:1", empty);
  const std::string good_log = empty + "-good.log";
  test::daemons good;
  good.push_back(std::make_unique<test::daemon_process>(std::vector<std::string>{RINGMASTER_NODE_BIN}, test::free_endpoint(), "cpu:1",
                                                        RINGMASTER_DATA_DIR, good_log));
  std::this_thread::sleep_for(300ms);
  remote_options ro;
  ro.nodes = {bare[0]->endpoint, good[0]->endpoint, bare[1]->endpoint};
  const auto t0 = std::chrono::steady_clock::now();
  const train_result r = train_remote(small_job(), ro);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(r.error);
  CHECK_FALSE(r.ok);
  CHECK(r.invalid);  // the data, as a launcher's own --data would be: exit 2, not "training failed" (was)
  for (const auto& d : bare)
    CHECK(r.error.find("node " + d->endpoint + ": " + empty + ": no train-images-idx3-ubyte[.gz] there (is --data the right folder?)") !=
          std::string::npos);
  CHECK(r.error.find(good[0]->endpoint) == std::string::npos);
  CHECK(took < 10);  // the good node answered: nobody waited out a timeout
  // The good node is told why the job it took ends (it was told "another node refused the job", even
  // when none had: one stopped, or never answered).
  std::string logged;
  for (int i = 0; i < 50 && logged.find(" ended: ") == std::string::npos; ++i)
    std::this_thread::sleep_for(100ms), logged = test::slurp(good_log);
  INFO(logged);
  const size_t ended = logged.find(" ended: the job could not start: node ");  // either bare node first
  CHECK(ended != std::string::npos);
  CHECK(logged.find(": " + empty + ": no train-images-idx3-ubyte", ended) != std::string::npos);
  std::filesystem::remove_all(empty);
  std::remove(good_log.c_str());
}

TEST_CASE("topology API: ranks here and on a node, one ring, equal to all ranks here", "[nodes][topology]") {
  auto nodes = start_nodes(1);
  topology t;
  t.connect(nodes[0]->endpoint);
  t.place(2, {"", "cpu"});                 // ranks 0-1 in this process
  t.place(2, {nodes[0]->endpoint, "cpu"}); // ranks 2-3 on the node
  t.data_dir(RINGMASTER_DATA_DIR).limit(2400, 300);
  train_config c = small_job();
  train_result mixed = t.train(c);
  INFO(mixed.error);
  REQUIRE(mixed.ok);
  CHECK(mixed.identical);
  REQUIRE(mixed.checksums.size() == 4);

  topology here;
  here.place(4, {"", "cpu"});
  train_config lc = small_job();
  lc.train = load("train", 2400);
  lc.test = load("t10k", 300);
  train_result local = here.train(lc);
  REQUIRE(local.ok);
  CHECK(local.weights == mixed.weights);

  topology bad;
  bad.place(1, {"tcp://127.0.0.1:1", "cpu"});
  CHECK(bad.train(small_job()).error.find("not connect()ed") != std::string::npos);
  // Data in memory for a job with a node: refused, not passed over for the data_dir()'s.
  const train_result given = t.train(lc);
  CHECK(!given.ok);
  CHECK(given.invalid);
  CHECK(given.error.find("a job with ranks on nodes reads its data on each node, from data_dir() (" + std::string(RINGMASTER_DATA_DIR) +
                         "): leave cfg.train and cfg.test unset") != std::string::npos);
}

TEST_CASE("topology API: ranks here and on a node build a layer of the program's own, here as on the node", "[nodes][topology]") {
  // The node is a daemon of the program's own that knows the layer (node_options::layers); the ranks here
  // once got a node service without cfg.layers: "bad model: layer 0: unknown layer type 'scale'".
  auto reg = std::make_shared<const layer_registry>(test::with_scale());
  node_options no;
  no.listen = "tcp://127.0.0.1:0";
  no.name = "with-scale";
  no.devices = "cpu:1";
  no.data_dir = RINGMASTER_DATA_DIR;
  no.layers = reg;
  no.log = [](const std::string&) {};
  node_service node(no);
  std::string err;
  REQUIRE(node.start(&err));
  train_config c = small_job();
  c.model = R"([{"type": "scale"}, {"type": "flatten"}, {"type": "dense", "units": 10}])";
  c.layers = reg;
  topology t;
  t.connect(node.endpoint());
  t.place(1, {"", "cpu"});
  t.place(1, {node.endpoint(), "cpu"});
  t.data_dir(RINGMASTER_DATA_DIR).limit(600, 100);
  const train_result mixed = t.train(c);
  INFO(mixed.error);
  REQUIRE(mixed.ok);
  CHECK(mixed.identical);
  topology here;
  here.place(2, {"", "cpu"});
  c.train = load("train", 600);
  c.test = load("t10k", 100);
  const train_result local = here.train(c);
  INFO(local.error);
  REQUIRE(local.ok);
  CHECK(local.weights == mixed.weights);
}

TEST_CASE("a node whose model takes seconds to build goes on answering meanwhile, and trains", "[nodes]") {
  // Building a job's model (and making its first weights: a second or more per 100M parameters) ran on the
  // node's bridge thread, which then sent no heartbeats: "fell silent while it set the job up" after 1.5 s.
  // Here a layer of the node's own takes 6 s to make (a launcher gives a node setting a job up 5 s for its
  // first word, then 1.5 s of silence).
  std::atomic<int> made{0};
  layer_registry slow = layer_registry::with_builtins();
  std::string err;
  REQUIRE(slow.add("scale", [&made](const json&, std::string*) -> std::unique_ptr<layer> {
    std::this_thread::sleep_for(6s);
    ++made;
    return std::make_unique<test::scale_layer>();
  }, &err));
  node_options no;
  no.listen = "tcp://127.0.0.1:0";
  no.name = "slow-build";
  no.devices = "cpu:1";
  no.data_dir = RINGMASTER_DATA_DIR;
  no.layers = std::make_shared<const layer_registry>(std::move(slow));
  no.log = [](const std::string&) {};
  node_service node(no);
  REQUIRE(node.start(&err));
  train_config c = small_job();
  c.epochs = 1;
  c.model = R"([{"type": "scale"}, {"type": "flatten"}, {"type": "dense", "units": 10}])";
  c.layers = std::make_shared<const layer_registry>(test::with_scale());
  topology t;
  t.connect(node.endpoint());
  t.place(1, {node.endpoint(), "cpu"});
  t.data_dir(RINGMASTER_DATA_DIR).limit(600, 100);
  const train_result remote = t.train(c);
  INFO(remote.error);
  REQUIRE(remote.ok);
  CHECK(made.load() >= 1);
  topology here;
  here.place(1, {"", "cpu"});
  c.train = load("train", 600);
  c.test = load("t10k", 100);
  const train_result local = here.train(c);
  INFO(local.error);
  REQUIRE(local.ok);
  CHECK(local.weights == remote.weights);
}

TEST_CASE("the cnn (conv, pooling, dropout) on 2 nodes x 1 replica equals 2 local replicas bit for bit", "[nodes][cnn]") {
  auto nodes = start_nodes(2, "cpu:1");
  train_config c;
  c.model = "cnn";  // its dropout masks come from (seed, epoch, sample): the same wherever a sample runs
  c.global_batch = 32;
  c.epochs = 1;
  remote_options ro;
  ro.nodes = endpoints(nodes);
  ro.limit_train = 640;
  ro.limit_test = 200;
  train_result remote = train_remote(c, ro);
  INFO(remote.error);
  REQUIRE(remote.ok);
  CHECK(remote.identical);
  REQUIRE(remote.checksums.size() == 2);
  CHECK(remote.history[0].samples == 640);

  train_config local = c;
  local.replicas = 2;
  local.train = load("train", 640);
  local.test = load("t10k", 200);
  train_result l = train(local);
  INFO(l.error);
  REQUIRE(l.ok);
  CHECK(l.checksums == remote.checksums);
  CHECK(l.weights == remote.weights);
  CHECK(l.model == remote.model);
  // Loss sums arrive in whatever order the replicas report: equal up to the order of the additions.
  CHECK(l.history[0].loss == Approx(remote.history[0].loss).epsilon(1e-12));
  CHECK(l.history[0].val_accuracy == remote.history[0].val_accuracy);
}

TEST_CASE("a seed of 2^63 or more travels whole: a node job equals the local job bit for bit", "[nodes]") {
  auto nodes = start_nodes(2, "cpu:1");
  train_config c = small_job();
  c.seed = (uint64_t(1) << 63) + 5;
  remote_options ro;
  ro.nodes = endpoints(nodes);
  ro.limit_train = 1200;
  ro.limit_test = 200;
  train_result remote = train_remote(c, ro);
  INFO(remote.error);
  REQUIRE(remote.ok);
  CHECK(remote.identical);

  train_config local = c;
  local.replicas = 2;
  local.train = load("train", 1200);
  local.test = load("t10k", 200);
  train_result l = train(local);
  REQUIRE(l.ok);
  CHECK(l.checksums == remote.checksums);
  CHECK(l.weights == remote.weights);
  // The seed counts: the largest int64 (what a node used to clamp it to) trains other weights.
  local.seed = uint64_t(INT64_MAX);
  train_result clamped = train(local);
  REQUIRE(clamped.ok);
  CHECK(clamped.weights != remote.weights);
}

TEST_CASE("a launcher that dies while its node sets up the job frees the node within 5 s", "[nodes]") {
  logged_node a("node-orphan");
  net::key_pair k;
  std::string err;
  REQUIRE(net::load_or_create_keys(net::default_key_dir(), &k, &err));
  train_config c = small_job();
  job_placement w;
  w.nodes = {{a.node->endpoint(), "", k.public_key}};
  w.rank_node = {0};
  w.devices = {"cpu"};
  w.limit_train = 600;
  w.limit_test = 100;
  job_plan plan;
  REQUIRE(make_job_plan(c, w, &plan, &err));
  plan.job_id = 4242;
  plan.recipient = 0;
  {
    // The "launcher": sends the job, then is gone without a word.
    zmq::context_t ctx;
    zmq::socket_t s(ctx, zmq::socket_type::dealer);
    s.set(zmq::sockopt::linger, 1000);
    authenticate(s);
    s.connect(a.node->endpoint());
    const std::string text = to_json(plan);
    wire::header h;
    h.type = wire::msg_type::job;
    h.job_id = plan.job_id;
    h.payload_bytes = text.size();
    test::send_raw(s, h, {zmq::buffer(text)});
  }
  const auto sent = std::chrono::steady_clock::now();
  // A stranger's heartbeats for that job keep nothing alive: only the job's launcher counts.
  std::atomic<bool> beating{true};
  std::thread forger([&] {
    zmq::context_t ctx;
    zmq::socket_t s(ctx, zmq::socket_type::dealer);
    s.set(zmq::sockopt::linger, 0);
    authenticate(s);
    s.connect(a.node->endpoint());
    wire::header h;
    h.type = wire::msg_type::heartbeat;
    h.job_id = 4242;
    const auto hb = wire::encode(h);
    while (beating) {
      s.send(zmq::buffer(hb.data(), hb.size()), zmq::send_flags::none);
      std::this_thread::sleep_for(100ms);
    }
  });
  // Gone without a word: its silence ends the job, or its connection, closed, as the node answers it.
  const std::string ended = a.wait_for("job 4242 ended: ", 10s);
  beating = false;
  forger.join();
  INFO(ended);
  CHECK((ended.find("ended: the launcher stopped answering") != std::string::npos ||
         ended.find("ended: its launcher's connection broke") != std::string::npos));
  const double freed = std::chrono::duration<double>(std::chrono::steady_clock::now() - sent).count();
  CHECK(freed < 5.0);
  CHECK_FALSE(a.node->busy());
}

TEST_CASE("a node stopped with SIGTERM or SIGHUP (its ssh session closed) tells the launcher so", "[nodes]") {
  auto nodes = start_nodes(2);
  remote_options ro;
  ro.nodes = endpoints(nodes);
  train_config big;
  big.model = "784-256-10";
  big.global_batch = 60;
  // Stopped once the second epoch runs, with 29 still to go: a fixed time after the start was not
  // enough once shared-memory rings got fast (the job had ended before the signal came).
  big.epochs = 30;
  big.evaluate = false;
  ro.limit_train = 12000;
  std::atomic<bool> training{false};
  int hup_status = -1;
  big.on_progress = [&](const progress& p) { training = training || p.epoch >= 1; };
  std::thread stopper([&] {
    for (int i = 0; i < 6000 && !training; ++i) std::this_thread::sleep_for(10ms);
    hup_status = nodes[1]->stop(SIGHUP);  // once it died without a word: the launcher heard only silence
  });
  train_result r = train_remote(big, ro);
  stopper.join();
  INFO(r.error);
  // Elastic by default: the job goes on without it, and the loss says why.
  REQUIRE(r.ok);
  REQUIRE(r.losses.size() == 1);
  CHECK(r.losses[0].node == nodes[1]->endpoint);
  CHECK(r.losses[0].why == "was stopped (SIGHUP)");
  CHECK((WIFEXITED(hup_status) && WEXITSTATUS(hup_status) == 0));
  // Abort on node loss: the job ends, saying so.
  auto more = start_nodes(2);
  ro.nodes = endpoints(more);
  ro.abort_on_node_loss = true;
  training = false;
  std::thread stopper2([&] {
    for (int i = 0; i < 6000 && !training; ++i) std::this_thread::sleep_for(10ms);
    more[1]->stop(SIGTERM);
  });
  r = train_remote(big, ro);
  stopper2.join();
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("node " + more[1]->endpoint + " (rank 1) was stopped (SIGTERM)") != std::string::npos);
}

TEST_CASE("a node daemon under nohup outlives SIGHUP, as nohup asks", "[nodes]") {
  const std::string log = "/tmp/ringmaster-test-nohup-" + std::to_string(getpid()) + ".log";
  std::remove(log.c_str());
  test::daemon_process d({"/usr/bin/nohup", RINGMASTER_NODE_BIN}, test::free_endpoint(), "cpu:1", RINGMASTER_DATA_DIR, log);
  std::this_thread::sleep_for(500ms);
  kill(d.pid, SIGHUP);
  std::this_thread::sleep_for(500ms);
  int status = 0;
  CHECK(waitpid(d.pid, &status, WNOHANG) == 0);  // still serving
  status = d.stop(SIGTERM);
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  std::ifstream in(log);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(text.find("SIGHUP") == std::string::npos);
  CHECK(text.find("SIGTERM received, shutting down") != std::string::npos);
  std::remove(log.c_str());
}

TEST_CASE("nodes on one host pass ring chunks through shared memory, bit for bit as over the network and as local",
          "[nodes][shm]") {
  logged_node a("node-a"), b("node-b"), c("node-c");
  logged_node* nodes[] = {&a, &b, &c};
  remote_options ro;
  for (logged_node* n : nodes) ro.nodes.push_back(n->node->endpoint());
  ro.limit_train = 1200;
  ro.limit_test = 200;
  train_result shm = train_remote(small_job(), ro);
  INFO(shm.error);
  REQUIRE(shm.ok);
  CHECK(shm.identical);
  for (int i = 0; i < 3; ++i) {
    CHECK(nodes[i]->wait_for("ring chunks to node " + ro.nodes[size_t((i + 1) % 3)] + " through shared memory") != "");
    // Each rank's right neighbour read its gradients where they are (net/shm_window.hpp), not a copy.
    const std::string said = nodes[i]->wait_for("rank " + std::to_string(i) + "'s gradients were read in place by its right neighbour: ");
    REQUIRE(said != "");
    const size_t at = said.find("neighbour: ") + 11;
    CHECK(std::strtoull(said.c_str() + at, nullptr, 10) > 0);
  }
  // The job's segments are gone with it, and no name under /dev/shm (which anyone may list) shows its id.
  const uint64_t id = job_id_of(a.wait_for(" started: "));
  char hex[32];
  std::snprintf(hex, sizeof hex, "%016llx", (unsigned long long)id);
  std::this_thread::sleep_for(200ms);  // the nodes end the job as the launcher says goodbye
  for (int r = 0; r < 3; ++r) CHECK_FALSE(std::filesystem::exists("/dev/shm" + net::shm_name({id, (r + 2) % 3, r})));
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm"))
    CHECK(e.path().filename().string().find(hex) == std::string::npos);

  // Over the network, sealed, as between hosts: the same bits.
  ro.shared_memory = false;
  train_result net = train_remote(small_job(), ro);
  INFO(net.error);
  REQUIRE(net.ok);
  CHECK(net.weights == shm.weights);
  CHECK(a.wait_for("ring chunks to node " + ro.nodes[1] + " sealed (" + net::kSealCipher + ")") != "");

  train_config local = small_job();
  local.replicas = 3;
  local.train = load("train", 1200);
  local.test = load("t10k", 200);
  train_result l = train(local);
  REQUIRE(l.ok);
  CHECK(l.weights == shm.weights);
}

TEST_CASE("a node daemon whose log reader stalls, and then is gone, goes on serving jobs", "[nodes]") {
  // Its stderr a FIFO of 4 KiB that the test does not read (a terminal stopped with Ctrl-S, `| less`):
  // before, the bridge thread blocked on a log line, and the node fell silent. Then the reader goes
  // (`| head`): before, SIGPIPE ended the daemon.
  const std::string fifo = "/tmp/ringmaster-test-log-" + std::to_string(getpid()) + ".fifo";
  std::remove(fifo.c_str());
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const int rfd = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  REQUIRE(rfd >= 0);
  ::fcntl(rfd, F_SETPIPE_SZ, 4096);
  test::daemon_process d({RINGMASTER_NODE_BIN}, free_endpoint(), "cpu:1", RINGMASTER_DATA_DIR, fifo);
  std::this_thread::sleep_for(300ms);
  remote_options ro;
  ro.nodes = {d.endpoint};
  ro.limit_train = 120;
  ro.limit_test = 60;
  for (int i = 0; i < 20; ++i) {  // 4 lines of 50-200 bytes a job: the pipe is full by the 15th
    train_result r = train_remote(small_job(), ro);
    INFO("job " << i << ": " << r.error);
    REQUIRE(r.ok);
  }
  // Read at last: the lines queued meanwhile come, in order.
  std::string got;
  auto ended = [&] {
    size_t n = 0;
    for (size_t at = got.find("ended: finished"); at != std::string::npos; at = got.find("ended: finished", at + 1)) ++n;
    return n;
  };
  for (auto until = std::chrono::steady_clock::now() + 5s; ended() < 20 && std::chrono::steady_clock::now() < until;) {
    char buf[4096];
    const ssize_t n = ::read(rfd, buf, sizeof buf);
    if (n > 0) got.append(buf, size_t(n));
    else std::this_thread::sleep_for(5ms);
  }
  INFO(got);
  CHECK(got.size() > 4096);
  CHECK(ended() == 20);
  CHECK(got.find("job ") < got.find("ended: finished"));
  ::close(rfd);  // the reader is gone
  train_result r = train_remote(small_job(), ro);
  INFO(r.error);
  CHECK(r.ok);
  const int status = d.stop(SIGTERM);
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));  // not ended by SIGPIPE (141 from a shell)
  std::remove(fifo.c_str());
}
