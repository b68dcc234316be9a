// Keys and ports of node daemons: who a node serves, known_nodes, --insecure on both sides, ring ports
// (plain, sealed, fixed, IPv6), nodes with keys of their own (test_nodes_security.cpp: hostile peers).
#include <sys/stat.h>

#include <catch2/catch.hpp>

#include "tests/node_peers.hpp"

using namespace ringmaster;
using namespace ringmaster::node_peers;
using namespace std::chrono_literals;

TEST_CASE("node daemons --insecure: ring chunks between hosts go plain to the ring ports, or through the bridges", "[nodes]") {
  logged_node a("node-a", "", true), b("node-b", "", true);
  CHECK(a.wait_for("(ring chunks from other hosts on port ").find(", plain)") != std::string::npos);  // insecure nodes have one too
  const bool ring_ports = GENERATE(true, false);
  INFO((ring_ports ? "ring ports" : "bridges"));
  remote_options ro;
  ro.insecure = true;
  ro.ring_ports = ring_ports;
  ro.nodes = {a.node->endpoint(), b.node->endpoint()};
  train_between_hosts(ro);  // as between hosts
  const std::string said = " plain (--insecure) at tcp://127.0.0.1:";
  CHECK((a.wait_for(said, ring_ports ? 10s : 0s) != "") == ring_ports);
  CHECK((b.wait_for(said, ring_ports ? 10s : 0s) != "") == ring_ports);
}

TEST_CASE("node daemon: --ring-port fixes the port ring chunks from other hosts go to, a taken or bad one is a clear error", "[nodes][keys]") {
  // The daemon with these arguments exits 2 at once, saying `says`.
  auto refused = [](const std::string& args, const std::string& says) {
    const test::run_result r = test::run("timeout 10 " + std::string(RINGMASTER_NODE_BIN) + " " + args);
    INFO(args << "\n" << r.out);
    CHECK(r.status == 2);
    CHECK(r.out.find(says) != std::string::npos);
  };
  const int port = test::free_port();
  test::daemon_process a({RINGMASTER_NODE_BIN, "--ring-port", std::to_string(port)}, free_endpoint(), "cpu:1", RINGMASTER_DATA_DIR);
  logged_node b("node-b");
  std::this_thread::sleep_for(300ms);
  CHECK(ring_port_of(a.endpoint) == std::to_string(port));  // what its hello_ack tells launchers
  // The two train together, b's chunks going to a on that port.
  remote_options ro;
  ro.nodes = {a.endpoint, b.node->endpoint()};
  train_between_hosts(ro);  // as between hosts
  CHECK(b.wait_for(std::string("sealed (") + net::kSealCipher + ") at tcp://127.0.0.1:" + std::to_string(port)) != "");

  const test::run_result taken = test::run(std::string(RINGMASTER_NODE_BIN) + " --listen " + free_endpoint() +
                                           " --ring-port " + std::to_string(port));
  CHECK(taken.status == 1);
  CHECK(taken.out.find("the ring port 127.0.0.1:" + std::to_string(port) + ": address already in use") != std::string::npos);
  // Its own listen port: once "address already in use" (exit 1), as if another program held it.
  refused(" --listen tcp://127.0.0.1:" + std::to_string(port) + " --ring-port " + std::to_string(port), "--ring-port " + std::to_string(port) + " is the --listen port: ring chunks need a port of their own");
  refused(" --listen " + free_endpoint() + " --ring-port 70000", "--ring-port must be a port number");
  refused(" --listen " + free_endpoint() + " --ring-poll-us -1", "--ring-poll-us must be 0-1000000");
  for (const char* t : {"0.5", "601", "nan", "inf"})
    refused(" --listen " + free_endpoint() + " --launcher-timeout " + t, "--launcher-timeout must be 1-600 (seconds)");
  refused(" --listen " + free_endpoint() + " --launcher-timeout 4s", "launcher-timeout");  // not a number at all
  refused(" --listen " + free_endpoint() + " --insecure extra", "unexpected argument");  // it served, the word ignored
  refused(" --listen ipc:///tmp/ringmaster-test-ring-port --ring-port " + std::to_string(port), "--ring-port needs a tcp:// --listen endpoint");
  // A key folder with --insecure was ignored: the node served without keys.
  refused(" --listen " + free_endpoint() + " --insecure --key-dir /tmp", "--key-dir and --insecure: a node run --insecure uses no keys");
  // The name is our links' routing id, which plans carry: too long a one is refused at once.
  refused(" --listen " + free_endpoint() + " --name " + std::string(201, 'n'), "--name must be at most 200 printable ASCII characters");
  // A port past 65535 would wrap to another one; an empty value is an unset variable, not the default.
  refused(" --listen tcp://127.0.0.1:99999", "--listen: 'tcp://127.0.0.1:99999': the port must be a number in 0-65535");
  // A host name: ZeroMQ would not listen on it, and the ring port was blamed (exit 1).
  refused(" --listen tcp://nosuchhost.invalid:5601", "--listen: 'nosuchhost.invalid' is neither an IP address nor a network interface");
  // An address of another machine: named as such (exit 2), not blamed on the ring port (exit 1).
  refused(" --listen tcp://192.0.2.1:5601", "--listen: '192.0.2.1' is not an address of this machine");
  // An IPv6 address without brackets: ZeroMQ said "No such device" (exit 1).
  refused(" --listen tcp://::1:5601", "write an IPv6 address in brackets, tcp://[::1]:5601");
  // A device kind no daemon has: a mistake in the command line (exit 2), not a failed start (exit 1).
  refused(" --listen " + free_endpoint() + " --devices gpu:0", "--devices gpu:0: unknown device kind 'gpu'");
  // A key folder that will not do: exit 2 as the launcher's (exit 1 once, as if it had failed to start).
  const std::string keys = "/tmp/ringmaster-test-node-keys-" + std::to_string(getpid());
  { std::ofstream(keys) << "not a folder"; }
  refused(" --listen " + free_endpoint() + " --key-dir " + keys, "--key-dir: ");
  unlink(keys.c_str());
  refused(" --listen " + free_endpoint() + " --key-dir ''", "--key-dir must not be empty");
  refused(" --listen " + free_endpoint() + " --data /nonexistent", "--data /nonexistent is not a folder");
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
  train_between_hosts(ro);  // as between hosts: each node's ring port, at [::1]
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
                     "give its key, --nodes " + node.node->endpoint() + "@KEY (in code: topology::connect(") != std::string::npos);

  // She gives its key, but the node does not accept hers: told so, and nothing of hers got through.
  ro.node_keys = {nk.public_key};
  r = train_remote(small_job(), ro);
  CHECK_FALSE(r.ok);
  CHECK(r.error == "node " + node.node->endpoint() + " refused our key: add our key.pub to its authorized_keys (if it is there, the file may be refused: see the node's log)");
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
  CHECK(r.invalid);  // the settings, not a node: exit 2 from a launcher
  // The node given a new key since (here: known_nodes records another): said with where the key we expect is.
  net::key_pair other;
  REQUIRE(net::load_or_create_keys(alice + "/other", &other, &err));
  std::ofstream(alice + "/known_nodes") << node.node->endpoint() << " " << other.public_key << "\n";
  ro.node_keys = {};
  r = train_remote(small_job(), ro);
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("The key we expect of it is the one recorded in " + alice + "/known_nodes: if it was given a new key on purpose, "
                     "remove its line there and give its key, --nodes " + node.node->endpoint() + "@KEY (in code: topology::connect(") != std::string::npos);
  std::ofstream(alice + "/known_nodes") << node.node->endpoint() << " " << nk.public_key << "\n";

  // A bad line put in authorized_keys while the node runs: the file is refused as a whole, and no key in it
  // (not even one just revoked) commands the node until it is fixed; then she trains again.
  std::ofstream(node_dir + "/authorized_keys") << ak.public_key << " alice@laptop\nnot-a-key\n";
  ro.node_keys = {};
  r = train_remote(small_job(), ro);
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("refused our key") != std::string::npos);
  CHECK(node.wait_for("authorized_keys refused, no other key may command this node") != "");
  // Whole at once (renamed into place): written in place, the node could read it empty, and said "0 keys".
  std::ofstream(node_dir + "/authorized_keys.new") << ak.public_key << "\n";
  REQUIRE(std::rename((node_dir + "/authorized_keys.new").c_str(), (node_dir + "/authorized_keys").c_str()) == 0);
  r = train_remote(small_job(), ro);
  INFO(r.error);
  CHECK(r.ok);
  const std::string again = node.wait_for("authorized_keys read again: 1 key");
  CHECK(again.substr(again.size() - std::min<size_t>(again.size(), 5)) == "1 key");
  // Its key folder opened to others while it runs (anyone could put their own authorized_keys there):
  // refused at once, as at start, until fixed.
  REQUIRE(chmod(node_dir.c_str(), 0777) == 0);
  r = train_remote(small_job(), ro);
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("refused our key") != std::string::npos);
  CHECK(node.wait_for("authorized_keys refused, no other key may command this node until it is fixed: " + node_dir +
                      " is writable by others") != "");
  REQUIRE(chmod(node_dir.c_str(), 0700) == 0);
  const size_t previous = node.logged();
  r = train_remote(small_job(), ro);
  CHECK(r.ok);
  REQUIRE(node.wait_for(" ended: ", 5s, previous) != "");  // logged a moment after the launcher has its result

  // The file written again in place with the same keys (`cat >`, scp, an editor), empty for a moment:
  // her running job goes on. Before, the node ended it at the next read.
  train_config long_job = small_job();
  long_job.epochs = 20000;  // far longer than the test: it ends by the revocation
  train_result revoked;
  const size_t before = node.logged();
  std::thread run([&] { revoked = train_remote(long_job, ro); });
  REQUIRE(node.wait_for("started: model 784-64-10", 10s, before) != "");
  {
    std::ofstream rewrite(node_dir + "/authorized_keys", std::ios::trunc);
    rewrite.flush();
    std::this_thread::sleep_for(200ms);
    rewrite << ak.public_key << "\n";
  }
  CHECK(node.wait_for(" ended: ", 1500ms, before) == "");
  CHECK(node.wait_for("ignored a message", 10ms, before) == "");  // its launcher was heard meanwhile (heartbeats, say)

  // Her key revoked while her job runs: the job ends a second or so later, and she is told why.
  const auto t0 = std::chrono::steady_clock::now();
  std::ofstream(node_dir + "/authorized_keys") << "# nobody\n";
  run.join();
  CHECK(std::chrono::steady_clock::now() - t0 < 4s);
  INFO(revoked.error);
  CHECK_FALSE(revoked.ok);
  CHECK(revoked.error.find("the launcher's key " + ak.public_key + " may no longer command this node (not in its authorized_keys)") !=
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
  // At once: the launcher watches its plain connections too (it waited out connect_timeout before).
  remote_options io = po;
  io.nodes = {node.node->endpoint()};
  const auto t_plain = std::chrono::steady_clock::now();
  r = train_remote(small_job(), io);
  CHECK(std::chrono::steady_clock::now() - t_plain < 2s);
  CHECK_FALSE(r.ok);
  INFO(r.error);
  CHECK((r.error.find("node " + node.node->endpoint() + " uses keys and we run --insecure: run both sides with --insecure, or neither") !=
             std::string::npos ||
         r.error.find("hangs up during the handshake: it uses keys and we run --insecure") != std::string::npos));
  CHECK(test::zmtp_greeting(port_of(node.node->endpoint()), "NULL"));
  CHECK(node.wait_for("refused a client that offers no keys (a launcher or node run --insecure?): this node runs with keys") != "");
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
  train_between_hosts(ro);  // as between hosts: the ring's chunks sealed between them
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
  const train_result r = train_remote(small_job(), by_node1);
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

TEST_CASE("keys: --print-key prints a program's public key, made on first use, before anything else is set up", "[keys]") {
  char tmpl[] = "/tmp/ringmaster-print-key-XXXXXX";
  REQUIRE(::mkdtemp(tmpl) != nullptr);
  const std::string dir = std::string(tmpl) + "/keys";
  const test::run_result launcher = test::run(std::string(RINGMASTER_MNIST_BIN) + " --print-key --key-dir " + dir);
  INFO(launcher.out);
  CHECK(launcher.status == 0);
  const std::string pub = test::slurp(dir + "/key.pub");
  REQUIRE(pub.size() == 41);  // 40 Z85 characters and a newline
  CHECK(launcher.out == pub);
  // The node's, from the same folder (a shared home): the same key, without --listen.
  const test::run_result node = test::run(std::string(RINGMASTER_NODE_BIN) + " --print-key --key-dir " + dir);
  CHECK(node.status == 0);
  CHECK(node.out == pub);
  for (const std::string bin : {RINGMASTER_MNIST_BIN, RINGMASTER_NODE_BIN}) {
    CHECK(test::run(bin + " --print-key --key-dir " + dir + " > /dev/full").status == 1);  // nothing was printed
    const test::run_result insecure = test::run(bin + " --print-key --insecure");
    INFO(insecure.out);
    CHECK(insecure.status == 2);
    CHECK(insecure.out.find("--print-key: an --insecure ") != std::string::npos);
  }
  std::filesystem::remove_all(tmpl);
}
