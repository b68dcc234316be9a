// CurveZMQ links: key files (net/keys.hpp) and bridges that encrypt and let in only the keys they accept.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>
#include <set>
#include <thread>
#include <zmq.h>

#include "net/bridge.hpp"
#include "net/keys.hpp"
#include "tests/test_util.hpp"

using namespace ringmaster;
using namespace std::chrono_literals;

namespace {

std::string temp_dir() { return test::temp_dir("keys"); }

// Whether this machine has the IPv6 loopback address (a container may have no IPv6 at all).
bool ipv6_loopback() {
  const int fd = ::socket(AF_INET6, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  const bool ok = ::bind(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return ok;
}

net::key_pair fresh_keys() {
  char pub[41], sec[41];
  REQUIRE(zmq_curve_keypair(pub, sec) == 0);
  return {pub, sec};
}

struct collected {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::pair<net::peer_info, wire::header>> messages;
  std::vector<net::bridge_error> errors;

  void attach(net::bridge& b) {
    b.set_handler([this](const net::peer_info& f, const wire::header& h, net::payload) {
      std::lock_guard<std::mutex> lock(mu);
      messages.push_back({f, h});
      cv.notify_all();
    });
    b.set_error_handler([this](const net::bridge_error& e) {
      std::lock_guard<std::mutex> lock(mu);
      errors.push_back(e);
      cv.notify_all();
    });
  }
  template <class Pred>
  bool wait(Pred p, std::chrono::milliseconds t = 5s) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, t, [&] { return p(); });
  }
};

// A server listening on a free loopback port, what reaches it collected in `seen`.
void listen_on_loopback(net::bridge& server, collected& seen) {
  seen.attach(server);
  std::string err;
  REQUIRE(server.start("tcp://127.0.0.1:0", &err));
}

wire::header hello() {
  wire::header h;
  h.type = wire::msg_type::hello;
  return h;
}

}  // namespace

TEST_CASE("a key directory is made on first use, its parents too, kept private, and read back the same") {
  const std::string dir = temp_dir() + "/home/user/keys";  // as mkdir -p (it said "No such file or directory")
  net::key_pair a, b;
  std::string err;
  REQUIRE(net::load_or_create_keys(dir, &a, &err));
  CHECK(net::is_key(a.public_key));
  CHECK(net::is_key(a.secret_key));
  struct stat st {};
  REQUIRE(stat((dir + "/key").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  REQUIRE(stat(dir.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0700);
  REQUIRE(net::load_or_create_keys(dir, &b, &err));
  CHECK(a.public_key == b.public_key);
  CHECK(a.secret_key == b.secret_key);
  // Named with a slash at its end, under umask 002: the folder is still made private (0775 was refused).
  const std::string slashed = temp_dir() + "/a/keys/";
  const mode_t was = umask(002);
  const bool made = net::load_or_create_keys(slashed, &b, &err);
  umask(was);
  INFO(err);
  CHECK(made);
  REQUIRE(stat(slashed.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0700);
  std::ifstream pub(dir + "/key.pub");
  std::string line;
  std::getline(pub, line);
  CHECK(line == a.public_key);

  // Two processes' worth of first use at once end with one pair.
  const std::string dir2 = temp_dir() + "/keys";
  std::vector<net::key_pair> got(4);
  std::vector<std::thread> ts;
  for (auto& k : got) ts.emplace_back([&k, &dir2] { std::string e; net::load_or_create_keys(dir2, &k, &e); });
  for (auto& t : ts) t.join();
  for (auto& k : got) CHECK(k.public_key == got[0].public_key);

  // A secret key others can read is refused, as ssh refuses it.
  REQUIRE(chmod((dir + "/key").c_str(), 0644) == 0);
  CHECK_FALSE(net::load_or_create_keys(dir, &b, &err));
  CHECK(err.find("too open") != std::string::npos);
  REQUIRE(chmod((dir + "/key").c_str(), 0600) == 0);
  // So is another user's, even one only we may read (root can give it away; CI runs as root).
  if (geteuid() == 0) {
    REQUIRE(chown((dir + "/key").c_str(), 4242, -1) == 0);
    CHECK_FALSE(net::load_or_create_keys(dir, &b, &err));
    CHECK(err == dir + "/key belongs to another user (uid 4242): refusing to use it as our secret key");
    REQUIRE(chown((dir + "/key").c_str(), 0, -1) == 0);
    REQUIRE(net::load_or_create_keys(dir, &b, &err));
  } else {
    WARN("not root: the test of a key file owned by another user needs to give one away");
  }
  // A key.pub of another key is refused.
  std::ofstream(dir + "/key.pub") << fresh_keys().public_key << "\n";
  CHECK_FALSE(net::load_or_create_keys(dir, &b, &err));
  CHECK(err.find("does not belong") != std::string::npos);
}

TEST_CASE("authorized_keys and known_nodes files are read line by line, with errors naming the line") {
  const std::string dir = temp_dir();
  const auto k1 = fresh_keys(), k2 = fresh_keys();
  std::set<std::string> keys;
  std::string err;
  REQUIRE(net::read_authorized_keys(dir + "/none", &keys, &err));  // missing: empty
  CHECK(keys.empty());
  std::ofstream(dir + "/authorized_keys") << "# launchers\n\n" << k1.public_key << " alice@a\n" << k2.public_key << "\n";
  REQUIRE(net::read_authorized_keys(dir + "/authorized_keys", &keys, &err));
  CHECK(keys == std::set<std::string>{k1.public_key, k2.public_key});
  std::ofstream(dir + "/authorized_keys", std::ios::app) << "not-a-key\n";
  CHECK_FALSE(net::read_authorized_keys(dir + "/authorized_keys", &keys, &err));
  CHECK(err == dir + "/authorized_keys:5: not a Z85 public key (40 characters)");
  // As a Windows editor saves it: a byte-order mark and CRLF line ends.
  std::ofstream(dir + "/authorized_keys") << "\xEF\xBB\xBF" << k1.public_key << " alice@a\r\n" << k2.public_key << "\r\n";
  REQUIRE(net::read_authorized_keys(dir + "/authorized_keys", &keys, &err));
  CHECK(keys == std::set<std::string>{k1.public_key, k2.public_key});

  const std::string known = dir + "/known_nodes", ep = "tcp://10.0.0.1:5601";
  std::string key;
  bool record = false;
  // Nothing known, nothing given: a node sharing our key directory.
  REQUIRE(net::expected_node_key(known, ep, "", k1.public_key, &key, &record, &err));
  CHECK((key == k1.public_key && !record));
  // Given on the command line: used, and to be recorded.
  REQUIRE(net::expected_node_key(known, ep, k2.public_key, k1.public_key, &key, &record, &err));
  CHECK((key == k2.public_key && record));
  REQUIRE(net::record_known_node(known, ep, k2.public_key, &err));
  // Recorded: used without being given; a different one given is refused.
  REQUIRE(net::expected_node_key(known, ep, "", k1.public_key, &key, &record, &err));
  CHECK((key == k2.public_key && !record));
  CHECK_FALSE(net::expected_node_key(known, ep, k1.public_key, k1.public_key, &key, &record, &err));
  CHECK(err.find("differs from the one recorded in " + known + ":1") != std::string::npos);

  // A hand-edited file without its last newline: the next record still starts its own line.
  std::ofstream(known, std::ios::app) << "tcp://10.0.0.2:5601 " << k1.public_key;
  REQUIRE(net::record_known_node(known, "tcp://10.0.0.3:5601", k1.public_key, &err));
  REQUIRE(net::expected_node_key(known, "tcp://10.0.0.3:5601", "", k2.public_key, &key, &record, &err));
  CHECK(key == k1.public_key);
  // The same key twice is one record; a second, different key for an endpoint is not guessed between.
  REQUIRE(net::record_known_node(known, "tcp://10.0.0.3:5601", k1.public_key, &err));
  REQUIRE(net::expected_node_key(known, "tcp://10.0.0.3:5601", "", k2.public_key, &key, &record, &err));
  CHECK(key == k1.public_key);
  REQUIRE(net::record_known_node(known, ep, k1.public_key, &err));  // line 5, after ep's line 1
  CHECK_FALSE(net::expected_node_key(known, ep, "", k1.public_key, &key, &record, &err));
  CHECK(err == known + ":1 and :5 record different keys for " + ep + "; remove the one that is no longer right and try again");
  // What decides whom we trust must be writable by us only (ssh's StrictModes).
  REQUIRE(chmod(known.c_str(), 0666) == 0);
  CHECK_FALSE(net::expected_node_key(known, ep, "", k1.public_key, &key, &record, &err));
  CHECK(err.find("is writable by others") != std::string::npos);
  std::ofstream(dir + "/authorized_keys2") << k1.public_key << "\n";
  REQUIRE(chmod((dir + "/authorized_keys2").c_str(), 0620) == 0);
  CHECK_FALSE(net::read_authorized_keys(dir + "/authorized_keys2", &keys, &err));
  CHECK(err.find("is writable by its group: refusing to trust it (chmod go-w") != std::string::npos);  // not by others
  const std::string open_dir = temp_dir();
  REQUIRE(chmod(open_dir.c_str(), 0777) == 0);
  net::key_pair kp;
  CHECK_FALSE(net::load_or_create_keys(open_dir, &kp, &err));
  CHECK(err.find("is writable by others") != std::string::npos);

  std::string endpoint;
  REQUIRE(net::split_endpoint_key(ep + "@" + k1.public_key, &endpoint, &key, &err));
  CHECK((endpoint == ep && key == k1.public_key));
  REQUIRE(net::split_endpoint_key("ipc://@abstract", &endpoint, &key, &err));
  CHECK((endpoint == "ipc://@abstract" && key.empty()));
  CHECK_FALSE(net::split_endpoint_key(ep + "@short", &endpoint, &key, &err));
}

TEST_CASE("encrypted bridges: an accepted key talks and is named, a refused or wrong key gets nothing through") {
  REQUIRE(net::curve_available());
  const auto server_keys = fresh_keys(), friend_keys = fresh_keys(), stranger_keys = fresh_keys();
  net::bridge_options so;
  so.keys = server_keys;
  so.authorize = [&](const std::string& k) { return k == friend_keys.public_key; };
  net::bridge server(so);
  collected at_server;
  listen_on_loopback(server, at_server);
  std::string err;

  auto client = [](net::key_pair keys) {
    net::bridge_options o;
    o.keys = keys;
    return std::make_unique<net::bridge>(o);
  };
  auto friendly = client(friend_keys), stranger = client(stranger_keys), confused = client(friend_keys);
  auto plain = std::make_unique<net::bridge>();
  collected at_friend, at_stranger, at_confused, at_plain;
  at_friend.attach(*friendly);
  at_stranger.attach(*stranger);
  at_confused.attach(*confused);
  at_plain.attach(*plain);
  for (auto* b : {friendly.get(), stranger.get(), confused.get(), plain.get()}) REQUIRE(b->start("", &err));

  // Without the server's key there is no connection at all.
  CHECK(friendly->connect(server.endpoint(), "", &err) < 0);
  CHECK(err.find("no public key") != std::string::npos);

  const int f = friendly->connect(server.endpoint(), server_keys.public_key, &err);
  const int s = stranger->connect(server.endpoint(), server_keys.public_key, &err);
  const int c = confused->connect(server.endpoint(), fresh_keys().public_key, &err);  // expects another server
  const int p = plain->connect(server.endpoint(), &err);
  REQUIRE((f >= 0 && s >= 0 && c >= 0 && p >= 0));
  for (int i = 0; i < 3; ++i) {
    stranger->send(s, hello());
    confused->send(c, hello());
    plain->send(p, hello());
  }
  REQUIRE(friendly->send(f, hello(), {}, &err));
  REQUIRE(at_server.wait([&] { return !at_server.messages.empty(); }));
  // The friend is named by the key it proved it holds, and is answered.
  CHECK(at_server.messages[0].first.key == friend_keys.public_key);
  wire::header ack;
  ack.type = wire::msg_type::hello_ack;
  REQUIRE(server.reply(at_server.messages[0].first, ack, {}, &err));
  REQUIRE(at_friend.wait([&] { return !at_friend.messages.empty(); }));
  CHECK(at_friend.messages[0].first.key == server_keys.public_key);

  // The stranger is told its key is refused; the server logs it once.
  REQUIRE(at_stranger.wait([&] { return !at_stranger.errors.empty(); }));
  CHECK(at_stranger.errors[0].kind == net::fault::handshake_failed);
  CHECK(at_stranger.errors[0].message.find("refused our key") != std::string::npos);
  // A client that offers no keys is logged (its mechanism always reaches the server this way).
  CHECK(test::zmtp_greeting(std::stoi(server.endpoint().substr(server.endpoint().rfind(':') + 1)), "NULL"));
  std::this_thread::sleep_for(1500ms);  // the stranger, the confused and the plain client keep retrying
  {
    std::lock_guard<std::mutex> lock(at_server.mu);
    CHECK(at_server.messages.size() == 1);  // nothing but the friend's hello got through
    int refusals = 0, plain = 0;
    for (auto& e : at_server.errors)
      if (e.kind == net::fault::keys_mismatch) {
        ++plain;  // the plain clients, once (at most once a minute)
        CHECK(e.message.find("refused a client that offers no keys") != std::string::npos);
      } else if (e.kind == net::fault::unauthorized) {
        ++refusals;
        CHECK(e.message.find(stranger_keys.public_key) != std::string::npos);
      }
    CHECK(refusals == 1);
    CHECK(plain == 1);
  }
  // A client expecting another server key never hears from this one.
  CHECK(at_confused.messages.empty());
  CHECK(at_plain.messages.empty());
  for (auto* b : {friendly.get(), stranger.get(), confused.get(), plain.get()}) b->stop();
  server.stop();
}

TEST_CASE("a peer that let us in and is started again without keys, or with another key, fails no link of ours and is named once", "[keys]") {
  // A node killed and started again on its port, by mistake --insecure or with a fresh key folder: its
  // neighbours' reconnects fail their handshakes, which is a lost node's to say (the launcher's), not a
  // fault of their own links (before, one ended a job that goes on without a lost node).
  REQUIRE(net::curve_available());
  const auto server_keys = fresh_keys(), client_keys = fresh_keys();
  for (const bool plain_again : {true, false}) {
    INFO((plain_again ? "started again --insecure" : "started again with another key"));
    net::bridge_options so;
    so.keys = server_keys;
    so.authorize = [&](const std::string& k) { return k == client_keys.public_key; };
    auto server = std::make_unique<net::bridge>(so);
    collected at_server, at_client;
    listen_on_loopback(*server, at_server);
    const std::string endpoint = server->endpoint();
    net::bridge_options co;
    co.keys = client_keys;
    net::bridge client(co);
    at_client.attach(client);
    std::string err;
    REQUIRE(client.start("", &err));
    const int id = client.connect(endpoint, server_keys.public_key, &err);
    REQUIRE(id >= 0);
    REQUIRE(client.send(id, hello(), {}, &err));
    REQUIRE(at_server.wait([&] { return !at_server.messages.empty(); }));
    server->stop();
    server.reset();
    net::bridge_options again;
    if (!plain_again) again.keys = fresh_keys();
    net::bridge restarted(again);
    collected at_restarted;
    at_restarted.attach(restarted);
    REQUIRE(restarted.start(endpoint, &err));
    for (int i = 0; i < 60 && at_client.wait([&] { return !at_client.errors.empty(); }, 150ms) == false; ++i)
      client.send(id, hello());  // reconnects meet the new server
    std::this_thread::sleep_for(1s);  // and go on failing: said once
    {
      // One word that it changed, for the launcher to tell its user, and no failure of the link.
      std::lock_guard<std::mutex> lock(at_client.mu);
      std::string said;
      for (auto& e : at_client.errors) said += std::string(net::fault_name(e.kind)) + ": " + e.message + "\n";
      INFO(said);
      REQUIRE(at_client.errors.size() == 1);
      CHECK(at_client.errors[0].kind == net::fault::peer_changed);
      CHECK(at_client.errors[0].from.peer == id);
      // (A server without keys mostly hangs up on a client with keys, its mechanism's mismatch seen there;
      // at times the client sees the mismatch itself.)
      const std::string hangs_up = endpoint + " let us in before, and now hangs up during the handshake: it holds another key than the "
                                              "one we know for it (a new key folder?), runs without keys (--insecure), or is flooded with "
                                              "connections";
      const std::string& said_once = at_client.errors[0].message;
      CHECK((said_once == hangs_up || (plain_again && said_once == endpoint + " let us in before, and now runs without keys (--insecure)")));
    }
    CHECK(at_restarted.messages.empty());  // and nothing got through
    restarted.stop();
    client.stop();
  }
}

TEST_CASE("a launcher's links carry routing ids of their own: a peer cannot take over its link to another", "[keys]") {
  // A ROUTER hands a routing id to the newest connection that shows it. Were a launcher's id the same on
  // every link, a node of its job (which sees it) could connect to another node under it, with any key that
  // node accepts, and read that node's answers to the launcher (heartbeats, reports, weights).
  REQUIRE(net::curve_available());
  const auto a_keys = fresh_keys(), b_keys = fresh_keys(), launcher_keys = fresh_keys(), mole_keys = fresh_keys();
  auto node = [&](const net::key_pair& keys) {
    net::bridge_options o;
    o.keys = keys;
    o.authorize = [&](const std::string& k) { return k == launcher_keys.public_key || k == mole_keys.public_key; };
    return std::make_unique<net::bridge>(o);
  };
  auto a = node(a_keys), b = node(b_keys);
  net::bridge_options lo;
  lo.keys = launcher_keys;
  lo.connection_ids = true;
  net::bridge launcher(lo);
  collected at_a, at_b, at_launcher, at_mole;
  at_a.attach(*a);
  at_b.attach(*b);
  at_launcher.attach(launcher);
  std::string err;
  REQUIRE(a->start("tcp://127.0.0.1:0", &err));
  REQUIRE(b->start("tcp://127.0.0.1:0", &err));
  REQUIRE(launcher.start("", &err));
  const int to_a = launcher.connect(a->endpoint(), a_keys.public_key, &err);
  const int to_b = launcher.connect(b->endpoint(), b_keys.public_key, &err);
  REQUIRE((to_a >= 0 && to_b >= 0));
  REQUIRE(launcher.send(to_a, hello(), {}, &err));
  REQUIRE(launcher.send(to_b, hello(), {}, &err));
  REQUIRE(at_a.wait([&] { return !at_a.messages.empty(); }));
  REQUIRE(at_b.wait([&] { return !at_b.messages.empty(); }));
  const net::peer_info seen_by_a = at_a.messages[0].first, seen_by_b = at_b.messages[0].first;
  CHECK(seen_by_a.identity.rfind(launcher.name() + ":", 0) == 0);
  CHECK(seen_by_b.identity.rfind(launcher.name() + ":", 0) == 0);
  CHECK(seen_by_a.identity != seen_by_b.identity);

  // Node a's operator turns mole: it connects to b under the id the launcher uses with a.
  net::bridge_options mo;
  mo.keys = mole_keys;
  mo.name = seen_by_a.identity;
  net::bridge mole(mo);
  at_mole.attach(mole);
  REQUIRE(mole.start("", &err));
  const int m = mole.connect(b->endpoint(), b_keys.public_key, &err);
  REQUIRE(m >= 0);
  REQUIRE(mole.send(m, hello(), {}, &err));
  REQUIRE(at_b.wait([&] { return at_b.messages.size() >= 2; }));
  CHECK(at_b.messages[1].first.key == mole_keys.public_key);

  // b's answer to the launcher still reaches the launcher, and only it.
  wire::header ack;
  ack.type = wire::msg_type::hello_ack;
  REQUIRE(b->reply(seen_by_b, ack, {}, &err));
  REQUIRE(at_launcher.wait([&] { return !at_launcher.messages.empty(); }));
  CHECK(at_launcher.messages[0].first.key == b_keys.public_key);
  std::this_thread::sleep_for(200ms);
  {
    std::lock_guard<std::mutex> lock(at_mole.mu);
    CHECK(at_mole.messages.empty());
  }
  for (net::bridge* x : {&mole, &launcher, b.get(), a.get()}) x->stop();
}

TEST_CASE("a bridge with a connection limit refuses clients over it at the handshake, saying so once", "[keys]") {
  const auto server_keys = fresh_keys(), client_keys = fresh_keys();
  net::bridge_options so;
  so.keys = server_keys;
  so.max_connections = 2;
  so.authorize = [&](const std::string& k) { return k == client_keys.public_key; };
  net::bridge server(so);
  collected at_server;
  listen_on_loopback(server, at_server);
  std::string err;
  std::vector<std::unique_ptr<net::bridge>> clients;
  std::vector<std::unique_ptr<collected>> seen;
  for (int i = 0; i < 3; ++i) {
    net::bridge_options o;
    o.keys = client_keys;
    clients.push_back(std::make_unique<net::bridge>(o));
    seen.push_back(std::make_unique<collected>());
    seen.back()->attach(*clients.back());
    REQUIRE(clients.back()->start("", &err));
    const int p = clients.back()->connect(server.endpoint(), server_keys.public_key, &err);
    REQUIRE(p >= 0);
    REQUIRE(clients.back()->send(p, hello(), {}, &err));
    if (i < 2) REQUIRE(at_server.wait([&] { return at_server.messages.size() == size_t(i + 1); }));
  }
  REQUIRE(seen[2]->wait([&] { return !seen[2]->errors.empty(); }));
  CHECK(seen[2]->errors[0].message.find("too many connections") != std::string::npos);
  CHECK(seen[2]->errors[0].retrying);  // libzmq keeps knocking, and gets in once there is room
  std::this_thread::sleep_for(500ms);  // it keeps knocking
  std::lock_guard<std::mutex> lock(at_server.mu);
  CHECK(at_server.messages.size() == 2);
  int reports = 0;
  for (auto& e : at_server.errors) reports += e.kind == net::fault::overloaded;
  CHECK(reports == 1);
}

TEST_CASE("a stranger on one host who holds connections open does not crowd out a client from another", "[keys]") {
  const auto server_keys = fresh_keys(), client_keys = fresh_keys();
  net::bridge_options so;
  so.keys = server_keys;
  so.max_connections = 4;  // one address counts for at most 1 against a client from elsewhere
  so.authorize = [&](const std::string& k) { return k == client_keys.public_key; };
  net::bridge server(so);
  collected at_server;
  listen_on_loopback(server, at_server);
  std::string err;
  const std::string ep = server.endpoint();
  const int port = std::stoi(ep.substr(ep.rfind(':') + 1));
  // 8 connections from 127.0.0.2 that never say a word: twice the limit, each held until its handshake
  // times out (3 s).
  std::vector<int> held;
  for (int i = 0; i < 8; ++i) {
    held.push_back(test::loopback_connect_from("127.0.0.2", port));
    REQUIRE(held.back() >= 0);
  }
  std::this_thread::sleep_for(300ms);  // the server has counted them
  net::bridge_options o;
  o.keys = client_keys;
  net::bridge client(o);
  collected seen;
  seen.attach(client);
  REQUIRE(client.start("", &err));
  const int p = client.connect(ep, server_keys.public_key, &err);
  REQUIRE(p >= 0);
  REQUIRE(client.send(p, hello(), {}, &err));
  // At once, not once the stranger's handshakes have timed out (libzmq would knock again then).
  CHECK(at_server.wait([&] { return !at_server.messages.empty(); }, 2s));
  {
    std::lock_guard<std::mutex> lock(seen.mu);
    CHECK(seen.errors.empty());
  }
  for (int fd : held) ::close(fd);
  client.stop();
  server.stop();
}

TEST_CASE("endpoints as users type them: ports in range, ZeroMQ's forms kept") {
  std::string err;
  for (const char* ok : {"tcp://127.0.0.1:5601", "tcp://*:5601", "tcp://[::1]:5601", "tcp://eth0:5601", "tcp://eth0;host:5601",
                         "tcp://h:65535", "ipc:///tmp/node", "ipc://@abstract", "ipc:///home/j\xC3\xB6rg/node"}) {
    INFO(ok);
    CHECK(net::check_endpoint(ok, false, &err));
  }
  CHECK(net::check_endpoint("tcp://127.0.0.1:0", true, &err));
  CHECK(net::check_endpoint("tcp://127.0.0.1:*", true, &err));
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"tcp://127.0.0.1:99999", "the port must be a number in 1-65535"},
      {"tcp://127.0.0.1:655350000000000000000", "the port is not a number in 1-65535"},
      {"tcp://127.0.0.1:0", "the port must be a number in 1-65535"},
      {"tcp://127.0.0.1:*", "the port is not a number"},
      {"tcp://127.0.0.1:-1", "the port is not a number"},
      {"tcp://127.0.0.1:", "the port must be a number"},
      {"tcp://127.0.0.1", "is not tcp://HOST:PORT"},
      {"tcp://", "is not tcp://HOST:PORT"},
      {"tcp://:5601", "is not tcp://HOST:PORT"},
      {"ipc://", "names no path"},
      {"tcp://127.0.0.1:017601", "write the port without leading zeros"},
      {"udp://h:1", "is not a tcp:// or ipc:// endpoint"},
      {"tcp://::1:5601", "write an IPv6 address in brackets, tcp://[::1]:5601"},
      {"tcp://[::1:5601", "write an IPv6 address in brackets, tcp://[::1]:5601"},
      {"tcp://h\xc3\xb4st:1", "an endpoint is printable ASCII without spaces"},  // a plan could not carry it
      {"tcp://a b:1", "an endpoint is printable ASCII without spaces"},
      {"ipc:///tmp/a b", "a path without spaces or control characters"},
  };
  for (const auto& [endpoint, says] : bad) {
    INFO(endpoint);
    CHECK_FALSE(net::check_endpoint(endpoint, false, &err));
    CHECK(err.find(says) != std::string::npos);
  }
  // What ZeroMQ listens on: *, an address, an interface; not a host name.
  for (const char* ok : {"tcp://*:1", "tcp://0.0.0.0:1", "tcp://127.0.0.1:1", "tcp://[fe80::1%lo]:1", "tcp://lo:1", "ipc:///tmp/x"}) {
    INFO(ok);
    CHECK(net::check_listen_host(ok, &err));
  }
  // IPv6 where this machine has it (a container may not): ::1 is ours, a documentation address is not.
  const bool v6 = ipv6_loopback();
  CHECK(net::check_listen_host("tcp://[::1]:1", &err) == v6);
  if (v6) CHECK_FALSE(net::check_listen_host("tcp://[2001:db8::1]:1", &err));
  for (const char* name : {"tcp://localhost:1", "tcp://nosuchhost.invalid:1", "tcp://127.0.0.1.5:1"}) {
    INFO(name);
    CHECK_FALSE(net::check_listen_host(name, &err));
    CHECK(err.find("is neither an IP address nor a network interface of this machine") != std::string::npos);
  }
  // A launcher's nodes: a name that does not resolve is said at once (.invalid never does); addresses,
  // names that resolve and ipc paths pass.
  CHECK_FALSE(net::check_host_resolves("tcp://nosuchhost.invalid:1", &err));
  CHECK(err == "'tcp://nosuchhost.invalid:1': no host is named 'nosuchhost.invalid' (the name does not resolve)");
  for (const char* ok : {"tcp://localhost:1", "tcp://127.0.0.1:1", "tcp://[::1]:1", "tcp://lo;127.0.0.1:1", "tcp://lo;localhost:1", "ipc:///tmp/x"}) {
    INFO(ok);
    CHECK(net::check_host_resolves(ok, &err));
  }
  // An address, but of another machine (TEST-NET and IPv6 documentation addresses are nobody's).
  CHECK_FALSE(net::check_listen_host("tcp://192.0.2.1:1", &err));
  CHECK(err.find("'192.0.2.1' is not an address of this machine") != std::string::npos);
}

TEST_CASE("is_key agrees with libzmq's Z85 decoder") {
  const auto k = fresh_keys();
  CHECK(net::is_key(k.public_key));
  for (int i = 0; i < 20; ++i) {  // and decode_key gives libzmq's bytes
    const auto pair = fresh_keys();
    uint8_t ours[32], theirs[32];
    REQUIRE(net::decode_key(pair.secret_key, ours));
    REQUIRE(zmq_z85_decode(theirs, pair.secret_key.c_str()) != nullptr);
    CHECK(std::memcmp(ours, theirs, 32) == 0);
  }
  std::string big(40, '#');  // '#' is 84: every group is 85^5 - 1, over 2^32
  uint8_t out[32];
  CHECK_FALSE(net::is_key(big));
  CHECK(zmq_z85_decode(out, big.c_str()) == nullptr);
  std::string bad = k.public_key;
  bad[7] = ' ';
  CHECK_FALSE(net::is_key(bad));
  CHECK_FALSE(net::is_key(k.public_key.substr(1)));
}
