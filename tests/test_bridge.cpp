// The bridge: real sockets on 127.0.0.1 (ports chosen at run time) and ipc. Every wait has a deadline.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>
#include <zmq.hpp>

#include "net/bridge.hpp"

using namespace ringmaster;
using namespace std::chrono_literals;
using net::bridge;
using net::payload;
using net::peer_info;
using wire::msg_type;

namespace {

struct received {
  peer_info from;
  wire::header h;
  std::vector<unsigned char> bytes;
};

// Collects what a bridge's handlers see, for the test thread to wait on.
struct inbox {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<received> messages;
  std::vector<net::bridge_error> errors;

  void attach(bridge& b) {
    b.set_handler([this](const peer_info& f, const wire::header& h, payload p) {
      const auto* c = static_cast<const unsigned char*>(p.data);
      std::lock_guard<std::mutex> lock(mu);
      messages.push_back({f, h, std::vector<unsigned char>(c, c + p.size)});
      cv.notify_all();
    });
    b.set_error_handler([this](const net::bridge_error& e) {
      std::lock_guard<std::mutex> lock(mu);
      errors.push_back(e);
      cv.notify_all();
    });
  }
  bool wait_messages(size_t n, std::chrono::milliseconds t = 5s) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, t, [&] { return messages.size() >= n; });
  }
  bool wait_errors(size_t n, std::chrono::milliseconds t = 5s) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, t, [&] { return errors.size() >= n; });
  }
};

wire::header chunk_header(size_t floats, int rank = 0) {
  wire::header h;
  h.type = msg_type::chunk;
  h.sender_rank = rank;
  h.elements = floats;
  return h;
}

std::shared_ptr<const std::vector<float>> pattern(size_t n, float base) {
  auto v = std::make_shared<std::vector<float>>(n);
  for (size_t i = 0; i < n; ++i) (*v)[i] = base + float(i % 1000);
  return v;
}

bool same_floats(const std::vector<unsigned char>& bytes, const std::vector<float>& want) {
  return bytes.size() == want.size() * sizeof(float) &&
         std::memcmp(bytes.data(), want.data(), bytes.size()) == 0;
}

zmq::message_t frame(const void* p, size_t n) { return zmq::message_t(p, n); }

}  // namespace

TEST_CASE("bridge: two bridges exchange payloads both ways over tcp", "[bridge]") {
  inbox ia, ib;
  bridge a, b;
  ia.attach(a);
  ib.attach(b);
  std::string err;
  REQUIRE(a.start("tcp://127.0.0.1:0", &err));
  REQUIRE(b.start("tcp://127.0.0.1:0", &err));
  CHECK(a.endpoint().rfind("tcp://127.0.0.1:", 0) == 0);
  CHECK(a.endpoint() != "tcp://127.0.0.1:0");

  // a -> b: a large zero-copy payload, a small copied one, and one without payload.
  const int to_b = a.connect(b.endpoint(), &err);
  REQUIRE(to_b >= 0);
  auto big = pattern(1 << 20, 1.0f);  // 4 MiB
  std::weak_ptr<const std::vector<float>> big_alive = big;
  REQUIRE(a.send(to_b, chunk_header(big->size(), 7), payload::of(big), &err));
  big.reset();  // the bridge keeps it alive until ZeroMQ is done with it
  wire::header job;
  job.type = msg_type::job;
  REQUIRE(a.send(to_b, job, payload::copy_of("model=mlp\n"), &err));
  wire::header hb;
  hb.type = msg_type::heartbeat;
  REQUIRE(a.send(to_b, hb));
  REQUIRE(ib.wait_messages(3));

  std::vector<received> at_b;
  {
    std::lock_guard<std::mutex> lock(ib.mu);
    at_b = ib.messages;
  }
  CHECK(at_b[0].h.type == msg_type::chunk);
  CHECK(at_b[0].h.sender_rank == 7);
  CHECK(at_b[0].from.peer == -1);
  CHECK(at_b[0].from.identity == a.name());
  CHECK(same_floats(at_b[0].bytes, *pattern(1 << 20, 1.0f)));
  CHECK(std::string(at_b[1].bytes.begin(), at_b[1].bytes.end()) == "model=mlp\n");
  CHECK(at_b[2].h.type == msg_type::heartbeat);
  CHECK(at_b[2].bytes.empty());
  // ZeroMQ has released the zero-copy buffer.
  for (int i = 0; i < 500 && !big_alive.expired(); ++i) std::this_thread::sleep_for(10ms);
  CHECK(big_alive.expired());

  // b -> a: a reply by identity through b's ROUTER comes back on a's DEALER.
  auto back = pattern(300000, 5.0f);
  REQUIRE(b.reply(at_b[0].from, chunk_header(back->size(), 1), payload::of(back), &err));
  REQUIRE(ia.wait_messages(1));
  {
    std::lock_guard<std::mutex> lock(ia.mu);
    CHECK(ia.messages[0].from.peer == to_b);
    CHECK(same_floats(ia.messages[0].bytes, *back));
  }
  // b -> a on b's own connection.
  const int to_a = b.connect(a.endpoint(), &err);
  REQUIRE(to_a >= 0);
  REQUIRE(b.send(to_a, chunk_header(back->size(), 1), payload::of(back), &err));
  REQUIRE(ia.wait_messages(2));
  {
    std::lock_guard<std::mutex> lock(ia.mu);
    CHECK(ia.messages[1].from.identity == b.name());
    CHECK(same_floats(ia.messages[1].bytes, *back));
  }
  CHECK(ia.errors.empty());
  CHECK(ib.errors.empty());
  CHECK(a.dropped() == 0);
}

TEST_CASE("bridge: ipc endpoints and many sending threads", "[bridge]") {
  const std::string path = "ipc:///tmp/ringmaster-test-" + std::to_string(getpid()) + ".ipc";
  inbox ib;
  bridge a, b;
  ib.attach(b);
  std::string err;
  REQUIRE(b.start(path, &err));
  CHECK(b.endpoint() == path);
  REQUIRE(a.start("", &err));  // a only dials out
  const int peer = a.connect(path, &err);
  REQUIRE(peer >= 0);
  constexpr int threads = 4, each = 500;
  std::vector<std::thread> senders;
  for (int t = 0; t < threads; ++t)
    senders.emplace_back([&, t] {
      for (int i = 0; i < each; ++i) {
        wire::header h;
        h.type = msg_type::report;
        h.sender_rank = t;
        h.step = i;
        a.send(peer, h);
      }
    });
  for (auto& s : senders) s.join();
  REQUIRE(ib.wait_messages(threads * each, 10s));
  {
    // Per sending thread, order is kept.
    std::lock_guard<std::mutex> lock(ib.mu);
    std::vector<int64_t> next(threads, 0);
    for (const auto& m : ib.messages) {
      REQUIRE(m.h.sender_rank >= 0);
      REQUIRE(m.h.sender_rank < threads);
      CHECK(m.h.step == next[m.h.sender_rank]++);
    }
  }
  // The socket file goes away with the bridge.
  const std::string file = path.substr(6);
  CHECK(access(file.c_str(), F_OK) == 0);
  b.stop();
  CHECK(access(file.c_str(), F_OK) != 0);
}

namespace {

// path as a Unix socket's address.
sockaddr_un unix_address(const std::string& path) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::snprintf(a.sun_path, sizeof a.sun_path, "%s", path.c_str());
  return a;
}

// A Unix stream socket bound to `path` (its file made), or -1.
int bound_unix_socket(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  const sockaddr_un a = unix_address(path);
  if (fd >= 0 && bind(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

}  // namespace

TEST_CASE("bridge: an ipc path that holds a file or a live socket is refused and left alone, a stale socket is taken", "[bridge]") {
  const std::string file = "/tmp/ringmaster-test-owned-" + std::to_string(getpid()) + ".ipc";
  const std::string path = "ipc://" + file;
  std::string err;
  {
    // Someone's file: libzmq would unlink it before binding.
    { std::ofstream(file) << "precious"; }
    bridge b;
    CHECK_FALSE(b.start(path, &err));
    CHECK(err.find("a file that is not a socket is there; it is left alone") != std::string::npos);
    std::ifstream in(file);
    std::string text;
    in >> text;
    CHECK(text == "precious");
    unlink(file.c_str());
  }
  {
    // A daemon serving there now: a second one must not take its endpoint, and the first keeps serving.
    inbox ia;
    bridge a, b, c;
    ia.attach(a);
    REQUIRE(a.start(path, &err));
    CHECK_FALSE(b.start(path, &err));
    CHECK(err.find("another process is listening there") != std::string::npos);
    b.stop();  // a bridge that never started removes nothing
    REQUIRE(c.start("", &err));
    const int peer = c.connect(path, &err);
    REQUIRE(peer >= 0);
    wire::header h;
    h.type = msg_type::report;
    c.send(peer, h);
    CHECK(ia.wait_messages(1, 10s));
    // Someone else's socket put there after ours was removed stays when we stop (it may even have our
    // inode number: they are reused at once).
    unlink(file.c_str());
    const int theirs = bound_unix_socket(file);
    REQUIRE(theirs >= 0);
    a.stop();
    CHECK(access(file.c_str(), F_OK) == 0);
    close(theirs);
    unlink(file.c_str());
  }
  {
    // A listener that accepts nothing and whose queue is full (a stopped daemon): refused, not waited on.
    const int fd = bound_unix_socket(file);
    REQUIRE(fd >= 0);
    REQUIRE(listen(fd, 0) == 0);
    const sockaddr_un a = unix_address(file);
    std::vector<int> queued;
    for (int i = 0; i < 8; ++i) {
      const int c = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0);
      if (connect(c, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0) {
        close(c);
        break;
      }
      queued.push_back(c);
    }
    bridge b;
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_FALSE(b.start(path, &err));
    CHECK(std::chrono::steady_clock::now() - t0 < 2s);
    CHECK(err.find("another process is listening there") != std::string::npos);
    for (int c : queued) close(c);
    close(fd);
    unlink(file.c_str());
  }
  {
    // A socket left by a process that is gone (nothing accepts on it): taken.
    const int fd = bound_unix_socket(file);
    REQUIRE(fd >= 0);
    close(fd);  // the file stays
    REQUIRE(access(file.c_str(), F_OK) == 0);
    bridge b;
    CHECK(b.start(path, &err));
    b.stop();
    CHECK(access(file.c_str(), F_OK) != 0);
  }
}

TEST_CASE("bridge: garbage from a raw socket is dropped and the bridge keeps serving", "[bridge]") {
  inbox ib;
  bridge b;
  ib.attach(b);
  std::string err;
  REQUIRE(b.start("tcp://127.0.0.1:0", &err));

  zmq::context_t ctx;
  zmq::socket_t raw(ctx, zmq::socket_type::dealer);
  raw.set(zmq::sockopt::linger, 0);
  raw.set(zmq::sockopt::rcvtimeo, 5000);
  raw.connect(b.endpoint());

  wire::header good_h = chunk_header(2);
  good_h.payload_bytes = 8;
  const auto good = wire::encode(good_h);
  const float two[2] = {1.5f, 2.5f};
  std::mt19937 rng(99);
  std::vector<unsigned char> noise(300);
  for (auto& c : noise) c = static_cast<unsigned char>(rng());

  // 1. one frame of random bytes
  raw.send(frame(noise.data(), noise.size()), zmq::send_flags::none);
  // 2. five frames
  for (int i = 0; i < 4; ++i) raw.send(frame(good.data(), good.size()), zmq::send_flags::sndmore);
  raw.send(frame(good.data(), good.size()), zmq::send_flags::none);
  // 3. bad magic
  auto bad = good;
  bad[0] ^= 0xff;
  raw.send(frame(bad.data(), bad.size()), zmq::send_flags::sndmore);
  raw.send(frame(two, sizeof two), zmq::send_flags::none);
  // 4. header says 2 floats, payload frame has 3 bytes
  raw.send(frame(good.data(), good.size()), zmq::send_flags::sndmore);
  raw.send(frame(two, 3), zmq::send_flags::none);
  // 5. header says a payload, none comes
  raw.send(frame(good.data(), good.size()), zmq::send_flags::none);
  // 6. an empty frame
  raw.send(frame(nullptr, 0), zmq::send_flags::none);
  // 7. a hello in the next protocol version: refused with a message naming both versions
  wire::header v2;
  v2.type = msg_type::hello;
  v2.version = wire::kProtocolVersion + 1;
  const auto v2b = wire::encode(v2);
  raw.send(frame(v2b.data(), v2b.size()), zmq::send_flags::none);
  // 8. then a valid message
  raw.send(frame(good.data(), good.size()), zmq::send_flags::sndmore);
  raw.send(frame(two, sizeof two), zmq::send_flags::none);

  REQUIRE(ib.wait_messages(1));
  REQUIRE(ib.wait_errors(7));
  {
    std::lock_guard<std::mutex> lock(ib.mu);
    REQUIRE(ib.messages.size() == 1);
    CHECK(ib.messages[0].bytes.size() == sizeof two);
    CHECK(std::memcmp(ib.messages[0].bytes.data(), two, sizeof two) == 0);
    REQUIRE(ib.errors.size() == 7);
    CHECK(ib.errors[0].message == "header frame is 300 bytes, expected 56");
    CHECK(ib.errors[1].message == "5 frames, expected a header and at most one payload");
    CHECK(ib.errors[2].message.rfind("bad magic", 0) == 0);
    CHECK(ib.errors[3].message == "chunk payload frame is 3 bytes, header says 8");
    CHECK(ib.errors[4].message == "chunk payload frame is 0 bytes, header says 8");
    CHECK(ib.errors[5].message == "header frame is 0 bytes, expected 56");
    CHECK(ib.errors[6].kind == net::fault::version_mismatch);
    CHECK(ib.errors[6].message == "protocol version " + std::to_string(wire::kProtocolVersion + 1) + ", this build speaks " + std::to_string(wire::kProtocolVersion));
    for (int i = 0; i < 6; ++i) CHECK(ib.errors[i].kind == net::fault::malformed);
  }
  CHECK(b.dropped() == 7);

  // The refusal of the version-2 hello came back to the raw socket.
  zmq::message_t hdr, body;
  REQUIRE(raw.recv(hdr));
  REQUIRE(hdr.more());
  REQUIRE(raw.recv(body));
  wire::header h;
  REQUIRE(wire::decode(hdr.data(), hdr.size(), &h, &err));
  CHECK(h.type == msg_type::error);
  CHECK(body.to_string() == "protocol version " + std::to_string(wire::kProtocolVersion + 1) + ", this build speaks " + std::to_string(wire::kProtocolVersion));
}

TEST_CASE("bridge: binding a port twice is a clear error, not a crash", "[bridge]") {
  bridge a, b;
  std::string err;
  REQUIRE(a.start("tcp://127.0.0.1:0", &err));
  const std::string ep = a.endpoint();
  CHECK_FALSE(b.start(ep, &err));
  CHECK(err == ep + ": address already in use");
  CHECK_FALSE(b.running());
  // A malformed endpoint is an error too, and the same bridge can then start elsewhere.
  CHECK_FALSE(b.start("tcp://nonsense", &err));
  CHECK(err.rfind("tcp://nonsense: ", 0) == 0);
  CHECK(b.start("tcp://127.0.0.1:0", &err));
}

TEST_CASE("bridge: invalid sends, sends after stop and unknown peers fail cleanly", "[bridge]") {
  inbox ia;
  bridge a;
  ia.attach(a);
  std::string err;
  wire::header h = chunk_header(3);  // 3 floats, but the payload below is 8 bytes
  CHECK_FALSE(a.send(0, h, payload::copy_of("12345678"), &err));
  CHECK(err == "chunk message says 3 floats but 8 payload bytes");
  wire::header ok;
  ok.type = msg_type::heartbeat;
  CHECK_FALSE(a.send(0, ok, {}, &err));
  CHECK(err == "bridge not running");
  CHECK(a.connect("tcp://127.0.0.1:1", &err) == -1);
  REQUIRE(a.start("", &err));
  CHECK_FALSE(a.set_handler(nullptr));  // handlers are fixed once running
  CHECK(a.connect("bogus://x", &err) == -1);
  CHECK(err.rfind("bogus://x: ", 0) == 0);
  CHECK(a.send(42, ok));  // accepted, then reported on the bridge thread
  REQUIRE(ia.wait_errors(1));
  CHECK(ia.errors[0].kind == net::fault::send_failed);
  a.stop();
  a.stop();
  CHECK_FALSE(a.running());
  CHECK_FALSE(a.send(0, ok, {}, &err));
}

TEST_CASE("bridge: a client that never reads its replies holds up only its own, and only so many", "[bridge]") {
  net::bridge_options o;
  o.hwm = 4;                         // ZeroMQ's queue to a client is full after a few replies
  o.kernel_buffer_bytes = 64 << 10;  // and so are the kernel's buffers
  std::mutex mu;
  std::vector<net::bridge_error> errors;
  const auto reply = pattern(4096, 1.0f);  // 16 KB a reply
  bridge b(o);  // after what its handlers touch: it stops before they go
  b.set_handler([&](const peer_info& from, const wire::header&, payload) { b.reply(from, chunk_header(4096), payload::of(reply)); });
  b.set_error_handler([&](const net::bridge_error& e) {
    std::lock_guard<std::mutex> lock(mu);
    errors.push_back(e);
  });
  std::string err;
  REQUIRE(b.start("tcp://127.0.0.1:0", &err));

  zmq::context_t ctx;
  zmq::socket_t silent(ctx, zmq::socket_type::dealer);  // asks and asks, and never reads
  silent.set(zmq::sockopt::linger, 0);
  silent.set(zmq::sockopt::rcvhwm, 1);
  silent.set(zmq::sockopt::rcvbuf, 64 << 10);
  silent.connect(b.endpoint());
  wire::header ask = chunk_header(1);
  ask.payload_bytes = sizeof(float);
  const auto ask_bytes = wire::encode(ask);
  const float one = 1.0f;
  for (int i = 0; i < 6000; ++i) {
    silent.send(frame(ask_bytes.data(), ask_bytes.size()), zmq::send_flags::sndmore);
    silent.send(frame(&one, sizeof one), zmq::send_flags::none);
  }
  // Its replies fill what they may: past the limit they are dropped, said once.
  const auto over = [&] {
    std::lock_guard<std::mutex> lock(mu);
    return std::count_if(errors.begin(), errors.end(), [](const net::bridge_error& e) {
      return e.kind == net::fault::overloaded && e.message.find("does not take its replies") != std::string::npos;
    });
  };
  for (int i = 0; i < 1000 && over() == 0; ++i) std::this_thread::sleep_for(10ms);
  CHECK(over() == 1);

  // Another client is answered at once all the same.
  zmq::socket_t other(ctx, zmq::socket_type::dealer);
  other.set(zmq::sockopt::linger, 0);
  other.set(zmq::sockopt::rcvtimeo, 3000);
  other.connect(b.endpoint());
  other.send(frame(ask_bytes.data(), ask_bytes.size()), zmq::send_flags::sndmore);
  other.send(frame(&one, sizeof one), zmq::send_flags::none);
  zmq::message_t hdr, body;
  REQUIRE(other.recv(hdr));
  REQUIRE(hdr.more());
  REQUIRE(other.recv(body));
  CHECK(body.size() == 4096 * sizeof(float));
  CHECK(over() == 1);
}

TEST_CASE("bridge: without keys too, clients past max_connections are refused, and a silent connection is dropped", "[bridge]") {
  net::bridge_options o;
  o.max_connections = 2;
  std::mutex mu;
  std::vector<net::bridge_error> errors;
  bridge b(o);
  b.set_handler([&](const peer_info& from, const wire::header&, payload) { b.reply(from, chunk_header(1), payload::of(pattern(1, 7.0f))); });
  b.set_error_handler([&](const net::bridge_error& e) {
    std::lock_guard<std::mutex> lock(mu);
    errors.push_back(e);
  });
  std::string err;
  REQUIRE(b.start("tcp://127.0.0.1:0", &err));
  wire::header ask = chunk_header(1);
  ask.payload_bytes = sizeof(float);
  const auto ask_bytes = wire::encode(ask);
  const float one = 1.0f;
  zmq::context_t ctx;
  // Whether a new client is answered.
  const auto answered = [&](zmq::socket_t& s) {
    s.set(zmq::sockopt::linger, 0);
    s.set(zmq::sockopt::rcvtimeo, 1500);
    s.connect(b.endpoint());
    s.send(frame(ask_bytes.data(), ask_bytes.size()), zmq::send_flags::sndmore);
    s.send(frame(&one, sizeof one), zmq::send_flags::none);
    zmq::message_t m;
    bool got = bool(s.recv(m));
    while (got && m.more()) got = bool(s.recv(m));
    return got;
  };
  zmq::socket_t c1(ctx, zmq::socket_type::dealer), c2(ctx, zmq::socket_type::dealer), c3(ctx, zmq::socket_type::dealer);
  CHECK(answered(c1));
  CHECK(answered(c2));
  CHECK_FALSE(answered(c3));
  {
    std::lock_guard<std::mutex> lock(mu);
    CHECK(std::any_of(errors.begin(), errors.end(), [](const net::bridge_error& e) {
      return e.kind == net::fault::overloaded && e.message.find("over the limit of 2: refusing new clients") != std::string::npos;
    }));
  }
  c3.close();

  // A TCP connection that never says hello holds its file descriptor 3 s at most.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(std::stoi(b.endpoint().substr(b.endpoint().rfind(':') + 1))));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  timeval tv{6, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  char buf[256];
  const auto t0 = std::chrono::steady_clock::now();
  ssize_t r;
  while ((r = recv(fd, buf, sizeof buf, 0)) > 0) {  // the greeting comes first; then the close
  }
  CHECK(r == 0);
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  close(fd);
}

TEST_CASE("bridge: one connection's many slow messages do not hold up another's for long", "[bridge]") {
  // A launcher's handler took 150 ms for each 16 MB piece of one node's final weights; the bridge read 64
  // of them (10 s) before the other node's heartbeats, and took that node for lost.
  // What the handlers touch is declared first: the bridges (their threads) go before it, a failed
  // REQUIRE included.
  inbox ia, ib;
  std::atomic<int> from_a{0};
  std::atomic<int64_t> b_seen_at{0}, a_before_b{-1};
  std::atomic<int> to_a{-1};
  bridge l, a, b;
  ia.attach(a);
  ib.attach(b);
  std::string err;
  REQUIRE(a.start("tcp://127.0.0.1:0", &err));
  REQUIRE(b.start("tcp://127.0.0.1:0", &err));
  l.set_handler([&](const peer_info& f, const wire::header&, payload) {
    if (f.peer == to_a) {
      std::this_thread::sleep_for(20ms);
      ++from_a;
    } else {
      a_before_b = from_a.load();
      b_seen_at = std::chrono::steady_clock::now().time_since_epoch().count();
    }
  });
  REQUIRE(l.start("", &err));
  to_a = l.connect(a.endpoint(), &err);
  const int to_b = l.connect(b.endpoint(), &err);
  REQUIRE(to_a.load() >= 0);
  REQUIRE(to_b >= 0);
  wire::header hb;
  hb.type = msg_type::heartbeat;
  REQUIRE(l.send(to_a.load(), hb));
  REQUIRE(l.send(to_b, hb));
  REQUIRE(ia.wait_messages(1));
  REQUIRE(ib.wait_messages(1));
  peer_info back_a, back_b;
  {
    std::lock_guard<std::mutex> la(ia.mu), lb(ib.mu);
    back_a = ia.messages[0].from, back_b = ib.messages[0].from;
  }
  for (int i = 0; i < 100; ++i) REQUIRE(a.reply(back_a, hb));
  while (from_a.load() == 0) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(100ms);  // a's messages are all in; l is some way into them
  const auto sent = std::chrono::steady_clock::now();
  REQUIRE(b.reply(back_b, hb));
  for (int i = 0; i < 500 && b_seen_at.load() == 0; ++i) std::this_thread::sleep_for(10ms);
  REQUIRE(b_seen_at.load() != 0);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::duration(b_seen_at.load()) - sent.time_since_epoch()).count();
  INFO("b's message waited " << waited << " s, behind " << a_before_b.load() << " of a's 100");
  CHECK(waited < 0.5);  // 64 of a's, 1.28 s, before
  CHECK(a_before_b.load() < 30);
  l.stop();
}
