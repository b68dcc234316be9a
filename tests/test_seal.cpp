// Sealed ring chunks (net/seal.hpp): pair keys, AES-128-OCB sealing and opening, and a bridge's sealed
// listener, which takes only what a registered pair sealed.
#include <catch2/catch.hpp>
#include <condition_variable>
#include <cstring>
#include <future>
#include <mutex>
#include <random>
#include <thread>
#include <vector>
#include <zmq.h>
#include <zmq.hpp>

#include "net/bridge.hpp"
#include "net/seal.hpp"
#include "tests/test_util.hpp"
#include "tests/test_zmq.hpp"

using namespace ringmaster;
using namespace std::chrono_literals;

namespace {

net::key_pair fresh_keys() {
  char pub[41], sec[41];
  REQUIRE(zmq_curve_keypair(pub, sec) == 0);
  return {pub, sec};
}

net::seal_key derive(const net::key_pair& mine, const std::string& theirs, const std::string& salt, uint64_t job,
                     uint32_t a, uint32_t b, uint32_t life_a = 0, uint32_t life_b = 0) {
  net::seal_key k{};
  std::string err;
  INFO(err);
  REQUIRE(net::pair_key(mine, theirs, salt, job, a, b, life_a, life_b, &k, &err));
  return k;
}

struct sealed_message {
  wire::header_bytes header;
  std::vector<unsigned char> payload;
  unsigned char trailer[net::kTrailerBytes];
};

sealed_message seal_one(net::sealer& s, const std::vector<float>& data, uint64_t job) {
  wire::header h;
  h.type = wire::msg_type::chunk;
  h.job_id = job;
  h.sender_rank = 0;
  h.elements = data.size();
  h.payload_bytes = data.size() * sizeof(float);
  sealed_message m;
  m.header = wire::encode(h);
  m.payload.resize(h.payload_bytes);
  REQUIRE(s.seal(m.header.data(), m.header.size(), data.data(), m.payload.data(), m.payload.size(), m.trailer));
  return m;
}

bool open_one(net::opener& o, sealed_message m, std::vector<float>* out, std::string* err) {
  if (!o.open(m.header.data(), m.header.size(), m.payload.data(), m.payload.size(), m.trailer, err)) return false;
  out->resize(m.payload.size() / sizeof(float));
  std::memcpy(out->data(), m.payload.data(), m.payload.size());
  return true;
}

}  // namespace

TEST_CASE("seal: two nodes derive one pair key, which is the job's and the pair's own") {
  const auto a = fresh_keys(), b = fresh_keys(), c = fresh_keys();
  const std::string salt = net::make_seal_salt(), other_salt = net::make_seal_salt();
  REQUIRE(net::is_seal_salt(salt));
  CHECK(salt != other_salt);
  const auto ab = derive(a, b.public_key, salt, 7, 0, 1);
  CHECK(derive(b, a.public_key, salt, 7, 1, 0) == ab);  // both ends, in either order
  CHECK(derive(a, c.public_key, salt, 7, 0, 2) != ab);  // another peer
  CHECK(derive(a, b.public_key, other_salt, 7, 0, 1) != ab);  // another salt
  CHECK(derive(a, b.public_key, salt, 8, 0, 1) != ab);  // another job
  CHECK(derive(a, b.public_key, salt, 7, 0, 2) != ab);  // other node numbers
  // A node taken back in its life 3 has keys of that life with each other node, both ends agree.
  const auto rejoined = derive(a, b.public_key, salt, 7, 0, 1, 0, 3);
  CHECK(rejoined != ab);
  CHECK(derive(b, a.public_key, salt, 7, 1, 0, 3, 0) == rejoined);
  CHECK(derive(a, b.public_key, salt, 7, 0, 1, 3, 0) != rejoined);  // the life goes with its node
  CHECK(derive(a, b.public_key, salt, 7, 0, 1, 0, 5) != rejoined);  // a later life: other keys again
  // Nodes sharing one key pair (a shared home) still get a key per pair of node numbers.
  CHECK(derive(a, a.public_key, salt, 7, 0, 1) != derive(a, a.public_key, salt, 7, 0, 2));

  net::seal_key k;
  std::string err;
  CHECK_FALSE(net::pair_key(a, "not a key", salt, 7, 0, 1, 0, 0, &k, &err));
  CHECK(err == "the peer's public key is not a Z85 key");
  CHECK_FALSE(net::pair_key(a, b.public_key, "00", 7, 0, 1, 0, 0, &k, &err));
  CHECK(err == "the seal salt is not 64 hex digits");
  // A public key of small order (all zeros) would make the shared secret known: refused.
  char zero_z85[41];
  const unsigned char zeros[32] = {};
  REQUIRE(zmq_z85_encode(zero_z85, zeros, 32) != nullptr);
  CHECK_FALSE(net::pair_key(a, zero_z85, salt, 7, 0, 1, 0, 0, &k, &err));
}

TEST_CASE("seal: payloads of any length round-trip, and each key seals only so many messages before the next takes over") {
  const auto a = fresh_keys(), b = fresh_keys();
  const std::string salt = net::make_seal_salt();
  const auto k = derive(a, b.public_key, salt, 5, 0, 1);
  std::mt19937 rng(2);
  // OCB holds back a last partial block: lengths that are no multiple of its 16 bytes come out whole too.
  net::sealer s(k, 5, 0);
  net::opener o(k, 5, 0);
  for (size_t n : {0, 1, 3, 4, 5, 257, 1001}) {
    std::vector<float> data(n);
    for (float& x : data) x = std::uniform_real_distribution<float>(-1, 1)(rng);
    std::vector<float> got;
    std::string err;
    INFO(n << " floats: " << err);
    CHECK(open_one(o, seal_one(s, data, 5), &got, &err));
    CHECK(got == data);
  }
  // A sealer moving on to a new key every 3 messages: an opener that does the same opens all of them, one
  // that keeps the first key opens only the first three.
  net::sealer rotating(k, 5, 0, 3);
  net::opener follows(k, 5, 0, 3), stays(k, 5, 0);
  std::vector<float> data(33, 1.5f);
  for (int i = 0; i < 10; ++i) {
    const sealed_message m = seal_one(rotating, data, 5);
    std::vector<float> got;
    std::string err;
    INFO("message " << i);
    CHECK(open_one(follows, m, &got, &err));
    CHECK(got == data);
    CHECK(open_one(stays, m, &got, &err) == (i < 3));
  }
}

TEST_CASE("seal: a sealed message opens once, unaltered, and nothing forged, altered or replayed opens") {
  const auto a = fresh_keys(), b = fresh_keys();
  const std::string salt = net::make_seal_salt();
  const auto k = derive(a, b.public_key, salt, 42, 0, 1);
  net::sealer from_a(k, 42, 0);
  net::opener at_b(derive(b, a.public_key, salt, 42, 1, 0), 42, 0);
  std::vector<float> data(1000);
  std::mt19937 rng(1);
  for (float& x : data) x = std::uniform_real_distribution<float>(-1, 1)(rng);

  const sealed_message first = seal_one(from_a, data, 42);
  CHECK(std::memcmp(first.payload.data(), data.data(), first.payload.size()) != 0);  // not in the clear
  std::vector<float> got;
  std::string err;
  REQUIRE(open_one(at_b, first, &got, &err));
  CHECK(got == data);
  // The same message again: a replay.
  CHECK_FALSE(open_one(at_b, first, &got, &err));
  CHECK(err.find("replayed") != std::string::npos);

  // Each altered part of a fresh message is refused; the message itself still opens afterwards (a
  // failed attempt does not move the counter).
  const sealed_message next = seal_one(from_a, data, 42);
  sealed_message bad = next;
  bad.payload[17] ^= 1;
  CHECK_FALSE(open_one(at_b, bad, &got, &err));
  CHECK(err.find("bad tag") != std::string::npos);
  bad = next;
  bad.header[16] ^= 1;  // the step
  CHECK_FALSE(open_one(at_b, bad, &got, &err));
  bad = next;
  bad.trailer[net::kTrailerBytes - 1] ^= 1;  // the tag
  CHECK_FALSE(open_one(at_b, bad, &got, &err));
  bad = next;
  bad.trailer[19] ^= 0x40;  // the counter, made larger: only the tag can tell
  CHECK_FALSE(open_one(at_b, bad, &got, &err));
  CHECK(err.find("bad tag") != std::string::npos);
  bad = next;
  bad.trailer[0] ^= 1;  // the job
  CHECK_FALSE(open_one(at_b, bad, &got, &err));
  CHECK(err == "sealed for another job or sender");
  bad = next;
  bad.trailer[8] = 5;  // another sender
  CHECK_FALSE(open_one(at_b, bad, &got, &err));
  CHECK(err == "sealed for another job or sender");
  REQUIRE(open_one(at_b, next, &got, &err));
  CHECK(got == data);

  // Sealed with another key (a third node posing as node 0): refused.
  const auto c = fresh_keys();
  net::sealer from_c(derive(c, b.public_key, salt, 42, 0, 1), 42, 0);
  for (int i = 0; i < 100; ++i) seal_one(from_c, data, 42);  // its counter ahead of b's, so only the key can refuse it
  CHECK_FALSE(open_one(at_b, seal_one(from_c, data, 42), &got, &err));
  CHECK(err.find("bad tag") != std::string::npos);
  // What b sends a back (the other direction) is sealed under the same key, but it is not a's to take as
  // its own, and b's own message reflected to b is refused: the sender's number is in the nonce.
  net::sealer from_b(derive(b, a.public_key, salt, 42, 1, 0), 42, 1);
  sealed_message reflected = seal_one(from_b, data, 42);
  CHECK_FALSE(open_one(at_b, reflected, &got, &err));
  CHECK(err == "sealed for another job or sender");
  net::opener at_a(k, 42, 1);
  CHECK(open_one(at_a, reflected, &got, &err));
  CHECK(got == data);
  // A counter at its end is never taken (the next one would wrap).
  sealed_message last = seal_one(from_a, data, 42);
  std::memset(last.trailer + 12, 0xff, 8);
  CHECK_FALSE(open_one(at_b, last, &got, &err));
  CHECK(err.find("replayed") != std::string::npos);
}

namespace {

struct inbox {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::pair<net::peer_info, std::vector<float>>> got;
  std::vector<net::bridge_error> errors;
  void attach(net::bridge& b) {
    b.set_handler([this](const net::peer_info& f, const wire::header& h, net::payload p) {
      std::lock_guard<std::mutex> lock(mu);
      got.push_back({f, std::vector<float>(p.floats(), p.floats() + h.elements)});
      cv.notify_all();
    });
    b.set_error_handler([this](const net::bridge_error& e) {
      std::lock_guard<std::mutex> lock(mu);
      errors.push_back(e);
      cv.notify_all();
    });
  }
  template <class P>
  bool wait(P p) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, 5s, p);
  }
};

// A bridge with keys (accepting no CURVE client) and a sealed listener on loopback, collecting what it gets.
struct sealed_server {
  net::key_pair keys = fresh_keys();
  inbox got;  // before the bridge, whose thread hands it messages until the bridge goes
  std::unique_ptr<net::bridge> br;
  std::string endpoint;  // the sealed listener's
  explicit sealed_server(int max_connections = 0) {
    net::bridge_options o;
    o.keys = keys;
    o.authorize = [](const std::string&) { return false; };
    o.sealed_listener = true;
    o.max_connections = max_connections;
    br = std::make_unique<net::bridge>(o);
    got.attach(*br);
    std::string err;
    REQUIRE(br->start("tcp://127.0.0.1:0", &err));
    REQUIRE(br->sealed_port() > 0);
    endpoint = "tcp://127.0.0.1:" + std::to_string(br->sealed_port());
  }
};

}  // namespace

TEST_CASE("a bridge whose sealed port is taken fails to start with the reason and frees its other port") {
  sealed_server taker;  // holds a sealed port
  net::bridge_options o;
  o.keys = fresh_keys();
  o.authorize = [](const std::string&) { return false; };
  o.sealed_listener = true;
  o.sealed_port = taker.br->sealed_port();
  net::bridge br(o);
  const std::string ep = "tcp://127.0.0.1:" + std::to_string(test::free_port());
  std::string err;
  CHECK_FALSE(br.start(ep, &err));  // returns, rather than hanging on a context with a socket left open
  CHECK(err == taker.endpoint + " (the sealed port): address already in use");
  CHECK_FALSE(br.running());
  CHECK(br.sealed_port() == 0);
  // Its listening port was closed again: another bridge takes it.
  net::bridge other;
  CHECK(other.start(ep, &err));
}

TEST_CASE("a bridge's sealed listener takes what a registered pair sealed, named by its key, and drops the rest") {
  sealed_server server;
  net::bridge& bb = *server.br;
  inbox& at_b = server.got;
  const std::string& sealed_ep = server.endpoint;
  const auto a = fresh_keys(), b = server.keys;
  const std::string salt = net::make_seal_salt();
  std::string err;
  bb.add_opener(9, 0, std::make_shared<net::opener>(derive(b, a.public_key, salt, 9, 1, 0), 9, 0), a.public_key);

  net::bridge_options oa;
  oa.keys = a;
  net::bridge ba(oa);
  REQUIRE(ba.start("", &err));
  const int peer = ba.connect_sealed(sealed_ep, std::make_shared<net::sealer>(derive(a, b.public_key, salt, 9, 0, 1), 9, 0), &err);
  REQUIRE(peer >= 0);
  // Large and small payloads, the large ones sent without a copy by the caller.
  std::vector<size_t> sizes = {1, 5, 4096, 300000};
  for (size_t n : sizes) {
    auto v = std::make_shared<std::vector<float>>(n);
    for (size_t i = 0; i < n; ++i) (*v)[i] = float(i) * 0.5f + float(n);
    wire::header h;
    h.type = wire::msg_type::chunk;
    h.job_id = 9;
    h.sender_rank = 0;
    h.elements = n;
    REQUIRE(ba.send(peer, h, net::payload::of(v), &err));
  }
  REQUIRE(at_b.wait([&] { return at_b.got.size() == sizes.size(); }));
  for (size_t i = 0; i < sizes.size(); ++i) {
    const auto& [from, floats] = at_b.got[i];
    CHECK(from.sealed);
    CHECK(from.key == a.public_key);
    REQUIRE(floats.size() == sizes[i]);
    CHECK(floats.back() == float(sizes[i] - 1) * 0.5f + float(sizes[i]));
  }

  // A stranger on the sealed port cannot log in: without the pair's token (or with none) it is refused at
  // the handshake and nothing it sends arrives.
  zmq::context_t ctx;
  std::vector<std::unique_ptr<zmq::socket_t>> refused;
  for (const char* token : {"", "0123456789abcdef0123456789abcdef"}) {
    refused.push_back(std::make_unique<zmq::socket_t>(ctx, zmq::socket_type::dealer));
    zmq::socket_t& t = *refused.back();
    t.set(zmq::sockopt::linger, 0);
    if (*token) {
      t.set(zmq::sockopt::plain_username, std::string("9:0"));
      t.set(zmq::sockopt::plain_password, std::string(token));
    }
    t.connect(sealed_ep);
    const float junk[4] = {1e30f, 1e30f, 1e30f, 1e30f};
    wire::header j;
    j.type = wire::msg_type::chunk;
    j.job_id = 9;
    j.elements = 4;
    j.payload_bytes = 16;
    unsigned char tr[net::kTrailerBytes] = {9};
    test::send_raw(t, j, {zmq::buffer(junk, sizeof junk), zmq::buffer(tr, sizeof tr)});
  }
  REQUIRE(at_b.wait([&] { return !at_b.errors.empty(); }));
  std::this_thread::sleep_for(500ms);  // both keep trying
  {
    std::lock_guard<std::mutex> lock(at_b.mu);
    CHECK(at_b.got.size() == sizes.size());
    REQUIRE(at_b.errors.size() == 1);  // the refusal, once for the address
    CHECK(at_b.errors[0].kind == net::fault::unauthorized);
    CHECK(at_b.errors[0].message.find("on the sealed port") != std::string::npos);
    at_b.errors.clear();
  }
  // One that learnt the token (it travels in the clear) gets in, but without the key nothing it sends is
  // taken: plain frames, a made-up trailer, a pair nobody registered. Each is dropped with its reason, and
  // the bridge keeps taking the real pair's messages.
  zmq::socket_t s(ctx, zmq::socket_type::dealer);
  s.set(zmq::sockopt::linger, 0);
  s.set(zmq::sockopt::plain_username, std::string("9:0"));
  s.set(zmq::sockopt::plain_password, net::port_token(derive(b, a.public_key, salt, 9, 1, 0)));
  s.connect(sealed_ep);
  wire::header h;
  h.type = wire::msg_type::chunk;
  h.job_id = 9;
  h.sender_rank = 0;
  h.elements = 4;
  h.payload_bytes = 16;
  const float junk[4] = {1e30f, 1e30f, 1e30f, 1e30f};
  test::send_raw(s, h, {zmq::buffer(junk, sizeof junk)});  // no trailer
  unsigned char trailer[net::kTrailerBytes] = {9};          // job 9, sender 0, counter 0, no real tag
  trailer[12] = 200;
  test::send_raw(s, h, {zmq::buffer(junk, sizeof junk), zmq::buffer(trailer, sizeof trailer)});
  trailer[8] = 3;  // sender 3: not a registered pair
  test::send_raw(s, h, {zmq::buffer(junk, sizeof junk), zmq::buffer(trailer, sizeof trailer)});
  REQUIRE(at_b.wait([&] { return at_b.errors.size() >= 3; }));
  {
    std::lock_guard<std::mutex> lock(at_b.mu);
    CHECK(at_b.errors[0].message.find("no trailer") != std::string::npos);
    CHECK(at_b.errors[1].message.find("bad tag") != std::string::npos);
    CHECK(at_b.errors[2].message.find("which we do not expect") != std::string::npos);
    CHECK(at_b.got.size() == sizes.size());
  }
  auto last = std::make_shared<std::vector<float>>(3, 2.0f);
  h.elements = 3;
  REQUIRE(ba.send(peer, h, net::payload::of(last), &err));
  REQUIRE(at_b.wait([&] { return at_b.got.size() == sizes.size() + 1; }));
  // Once the job's pairs are gone, their messages are too.
  bb.remove_openers(9);
  std::promise<void> removed;  // posted work and arriving messages are not ordered: wait for it
  REQUIRE(bb.post([&] { removed.set_value(); }));
  REQUIRE(removed.get_future().wait_for(5s) == std::future_status::ready);
  REQUIRE(ba.send(peer, h, net::payload::of(last), &err));
  REQUIRE(at_b.wait([&] { return at_b.errors.size() >= 4; }));
  CHECK(at_b.got.size() == sizes.size() + 1);
  ba.stop();
  bb.stop();
}

TEST_CASE("a bridge's sealed port holds its connections to max_connections, as its listener does") {
  sealed_server server(2);
  net::bridge& bb = *server.br;
  inbox& at_b = server.got;
  const auto a = fresh_keys(), b = server.keys;
  const std::string salt = net::make_seal_salt();
  const auto key = derive(b, a.public_key, salt, 9, 1, 0);
  bb.add_opener(9, 0, std::make_shared<net::opener>(key, 9, 0), a.public_key);
  zmq::context_t ctx;
  std::vector<std::unique_ptr<zmq::socket_t>> strangers;
  for (int i = 0; i < 6; ++i) {  // connections that logged in (the token is no secret from the wire)
    strangers.push_back(std::make_unique<zmq::socket_t>(ctx, zmq::socket_type::dealer));
    strangers.back()->set(zmq::sockopt::linger, 0);
    strangers.back()->set(zmq::sockopt::plain_username, std::string("9:0"));
    strangers.back()->set(zmq::sockopt::plain_password, net::port_token(key));
    strangers.back()->connect("tcp://127.0.0.1:" + std::to_string(bb.sealed_port()));
    std::this_thread::sleep_for(50ms);  // one at a time, so the count is seen before the next handshake
  }
  REQUIRE(at_b.wait([&] { return !at_b.errors.empty(); }));
  std::lock_guard<std::mutex> lock(at_b.mu);
  CHECK(at_b.errors[0].kind == net::fault::overloaded);
  CHECK(at_b.errors[0].message.find("over the limit of 2") != std::string::npos);
  CHECK(at_b.errors.size() == 1);  // reported once a minute at most
}

TEST_CASE("a sealed connection to a closed port is reported within seconds, naming the port") {
  const auto a = fresh_keys(), b = fresh_keys();
  net::bridge_options oa;
  oa.keys = a;
  net::bridge ba(oa);
  inbox at_a;
  at_a.attach(ba);
  std::string err;
  REQUIRE(ba.start("", &err));
  const std::string closed = test::free_endpoint();  // nobody listens there
  const auto key = derive(a, b.public_key, net::make_seal_salt(), 9, 0, 1);
  const auto t0 = std::chrono::steady_clock::now();
  const int peer = ba.connect_sealed(closed, std::make_shared<net::sealer>(key, 9, 0), &err);
  REQUIRE(peer >= 0);
  REQUIRE(at_a.wait([&] { return !at_a.errors.empty(); }));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::lock_guard<std::mutex> lock(at_a.mu);
  CHECK(at_a.errors[0].kind == net::fault::handshake_failed);
  CHECK(at_a.errors[0].from.peer == peer);
  CHECK(at_a.errors[0].message.find("cannot reach " + closed + " (a sealed port)") != std::string::npos);
  CHECK(seconds < 5);
  ba.stop();
}

TEST_CASE("a sealed peer that goes away after it was reached is not reported as a closed port") {
  // Its loss is the launcher's news (a node lost, an elastic job going on): not a link to fail at once.
  const auto a = fresh_keys();
  auto server = std::make_unique<sealed_server>();
  const std::string salt = net::make_seal_salt();
  const auto key = derive(a, server->keys.public_key, salt, 9, 0, 1);
  server->br->add_opener(9, 0, std::make_shared<net::opener>(key, 9, 0), a.public_key);
  net::bridge_options oa;
  oa.keys = a;
  net::bridge ba(oa);
  inbox at_a;
  at_a.attach(ba);
  std::string err;
  REQUIRE(ba.start("", &err));
  const int peer = ba.connect_sealed(server->endpoint, std::make_shared<net::sealer>(key, 9, 0), &err);
  REQUIRE(peer >= 0);
  wire::header h;
  h.type = wire::msg_type::chunk;
  h.job_id = 9;
  h.sender_rank = 0;
  h.elements = 2;
  REQUIRE(ba.send(peer, h, net::payload::of(std::make_shared<std::vector<float>>(2, 1.0f)), &err));
  REQUIRE(server->got.wait([&] { return !server->got.got.empty(); }));
  server.reset();  // gone: its port now refuses every reconnect
  std::this_thread::sleep_for(3500ms);  // well past the ~2 s a never-reached port is given
  std::lock_guard<std::mutex> lock(at_a.mu);
  for (const auto& e : at_a.errors) CHECK(e.message.find("cannot reach") == std::string::npos);
  ba.stop();
}
