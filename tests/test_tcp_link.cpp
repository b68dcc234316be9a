// The TCP link to a ring port (net/tcp_link.hpp): messages go through whole, opened and in order, whether
// the receiving thread or a poller reads them and however full the socket gets; strangers, wrong keys,
// replayed logins and altered messages are refused with a clear word, and the real pair still gets in.
// Plain (--insecure), the same link carries the same frames unsealed, and a sealed pair never takes them.
#include <dlfcn.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <cerrno>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "net/tcp_link.hpp"
#include "tests/test_util.hpp"
#include "tests/tcp_util.hpp"

using namespace ringmaster;
using namespace ringmaster::tcp_test;
using namespace std::chrono_literals;

namespace {

// What a receiver got and what the port refused, for a test to wait on.
struct inbox {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::pair<wire::header, std::vector<float>>> got;
  std::vector<std::string> errors, refusals;
  std::vector<std::thread::id> threads;  // which thread handed on each message

  net::tcp_receiver::handler handler() {
    return [this](const wire::header& h, net::payload p) {
      std::vector<float> v(p.floats(), p.floats() + p.size / sizeof(float));
      std::lock_guard<std::mutex> lock(mu);
      got.emplace_back(h, std::move(v));
      threads.push_back(std::this_thread::get_id());
      cv.notify_all();
    };
  }
  net::tcp_receiver::error_handler on_error() {
    return [this](const std::string& e) {
      std::lock_guard<std::mutex> lock(mu);
      errors.push_back(e);
      cv.notify_all();
    };
  }
  net::tcp_port_options options() {
    net::tcp_port_options o;
    o.login_timeout = 300ms;
    o.refusal_window = 1000ms;
    o.on_refusal = [this](const std::string& e) {
      std::lock_guard<std::mutex> lock(mu);
      refusals.push_back(e);
      cv.notify_all();
    };
    return o;
  }
  template <class F>
  bool wait(F pred, std::chrono::milliseconds limit = 10s) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, limit, [&] { return pred(*this); });
  }
  size_t count() {
    std::lock_guard<std::mutex> lock(mu);
    return got.size();
  }
};

// A raw client of the port, to send whatever a test wants.
int raw_connect(int port) {
  const int s = test::loopback_connect(port);
  REQUIRE(s >= 0);
  return s;
}
void raw_send(int s, const std::vector<unsigned char>& bytes) {
  REQUIRE(send(s, bytes.data(), bytes.size(), MSG_NOSIGNAL) == ssize_t(bytes.size()));
}
// Whether the port closed the connection within `limit`.
bool closed_by_peer(int s, std::chrono::milliseconds limit) {
  timeval tv{long(limit.count() / 1000), long(limit.count() % 1000) * 1000};
  setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  char c;
  const ssize_t n = recv(s, &c, 1, 0);
  return n == 0 || (n < 0 && errno == ECONNRESET);  // reset: it closed with our bytes unread
}
// A sealed frame as the sender makes it: header, trailer, sealed payload.
std::vector<unsigned char> sealed_frame(net::sealer& seal, wire::header h, const std::vector<float>& payload) {
  h.payload_bytes = payload.size() * sizeof(float);
  const auto hb = wire::encode(h);
  std::vector<unsigned char> f(wire::kHeaderSize + net::kTrailerBytes + h.payload_bytes + 1);
  std::memcpy(f.data(), hb.data(), hb.size());
  REQUIRE(seal.seal(f.data(), wire::kHeaderSize, payload.data(), f.data() + wire::kHeaderSize + net::kTrailerBytes,
                    h.payload_bytes, f.data() + wire::kHeaderSize));
  f.pop_back();
  return f;
}
std::vector<unsigned char> login_frame(net::sealer& seal, uint64_t job, uint32_t sender) {
  wire::header h;
  h.type = wire::msg_type::hello;
  h.job_id = job;
  h.sender_rank = int32_t(sender);
  return sealed_frame(seal, h, {});
}

// A plain frame: header, trailer without a tag, payload.
std::vector<unsigned char> plain_frame(wire::header h, const std::vector<float>& payload, uint64_t job, uint32_t sender) {
  h.payload_bytes = payload.size() * sizeof(float);
  const auto hb = wire::encode(h);
  std::vector<unsigned char> f(wire::kHeaderSize + net::kTrailerBytes + h.payload_bytes);
  std::memcpy(f.data(), hb.data(), hb.size());
  net::write_trailer({job, sender, 0}, f.data() + wire::kHeaderSize);
  if (!payload.empty()) std::memcpy(f.data() + wire::kHeaderSize + net::kTrailerBytes, payload.data(), h.payload_bytes);
  return f;
}
std::vector<unsigned char> plain_login(uint64_t job, uint32_t sender) {
  wire::header h;
  h.type = wire::msg_type::hello;
  h.job_id = job;
  h.sender_rank = int32_t(sender);
  return plain_frame(h, {}, job, sender);
}

struct pair_fixture {
  inbox in;
  std::unique_ptr<net::tcp_port> port;
  std::shared_ptr<net::tcp_receiver> receiver;
  std::string endpoint;
  bool sealed;
  explicit pair_fixture(bool seal = true) : sealed(seal) {
    std::string err;
    port = net::tcp_port::bind("127.0.0.1", 0, in.options(), &err);
    REQUIRE(port);
    REQUIRE(port->port() > 0);
    endpoint = "tcp://127.0.0.1:" + std::to_string(port->port());
    receiver = port->expect(kJob, kSender, sealed ? std::make_shared<net::opener>(key_of(5), kJob, kSender) : nullptr,
                            in.handler(), in.on_error());
  }
  std::shared_ptr<net::tcp_sender> sender(std::function<void(const std::string&)> on_error = {}) {
    std::string err;
    auto s = net::tcp_sender::connect(endpoint, kJob, kSender, sealed ? std::make_shared<net::sealer>(key_of(5), kJob, kSender) : nullptr,
                                      std::move(on_error), &err);
    REQUIRE(s);
    return s;
  }
};

}  // namespace

TEST_CASE("tcp link: sealed or plain messages of every size arrive whole and in order, past a full socket", "[tcp_link]") {
  const bool sealed = GENERATE(true, false);
  INFO((sealed ? "sealed" : "plain"));
  pair_fixture f(sealed);
  auto s = f.sender();
  const std::vector<size_t> sizes = {0, 1, 3, 1024, 262144, 1 << 20};
  std::string err;
  int64_t step = 0;
  for (size_t n : sizes) REQUIRE(s->send(chunk_header(step++, n), floats_of(n, float(n)), &err));
  // Many 1 MiB messages at once: more than the socket holds, so most go to the sender's thread.
  for (int i = 0; i < 40; ++i) REQUIRE(s->send(chunk_header(step++, 1 << 18), floats_of(1 << 18, float(i)), &err));
  REQUIRE(f.in.wait([&](inbox& b) { return b.got.size() == size_t(step); }));
  for (size_t i = 0; i < f.in.got.size(); ++i) {
    const auto& [h, v] = f.in.got[i];
    CHECK(h.step == int64_t(i));
    const size_t n = i < sizes.size() ? sizes[i] : size_t(1) << 18;
    const float first = i < sizes.size() ? float(sizes[i]) : float(i - sizes.size());
    REQUIRE(v.size() == n);
    if (n) CHECK((v.front() == first && v.back() == first + float(n - 1)));
  }
  CHECK(f.in.errors.empty());
  CHECK(f.in.refusals.empty());
}

TEST_CASE("tcp link: a poller takes the messages on its own thread until it is done", "[tcp_link]") {
  pair_fixture f;
  auto s = f.sender();
  std::string err;
  std::thread writer([&] {
    std::this_thread::sleep_for(50ms);
    for (int i = 0; i < 200; ++i) s->send(chunk_header(i, 1024), floats_of(1024, float(i)), &err);
  });
  auto done = [&] { return f.in.count() == 200; };
  const auto until = std::chrono::steady_clock::now() + 5s;
  while (!done() && std::chrono::steady_clock::now() < until) {
    f.receiver->poll(until, [&] {
      std::lock_guard<std::mutex> lock(f.in.mu);
      return f.in.got.size() == 200;
    });
  }
  writer.join();
  REQUIRE(done());
  for (size_t i = 0; i < 200; ++i) CHECK(f.in.got[i].first.step == int64_t(i));
  // Taken here, not by the receiving thread (which may have taken some while this thread looked away).
  CHECK(std::count(f.in.threads.begin(), f.in.threads.end(), std::this_thread::get_id()) > 100);
}

TEST_CASE("tcp link: strangers, wrong keys and replayed logins are refused, and the pair still gets in", "[tcp_link]") {
  pair_fixture f;
  const int port = f.port->port();
  // Garbage where a login belongs: closed, and said.
  int s1 = raw_connect(port);
  raw_send(s1, std::vector<unsigned char>(92, 0x41));
  CHECK(closed_by_peer(s1, 2000ms));
  close(s1);
  // Nothing at all: closed after the login timeout.
  int s2 = raw_connect(port);
  CHECK(closed_by_peer(s2, 3000ms));
  close(s2);
  // A login sealed with another key, and one for a pair the port does not expect.
  net::sealer wrong(key_of(6), kJob, kSender), other_job(key_of(5), kJob + 1, kSender);
  int s3 = raw_connect(port);
  raw_send(s3, login_frame(wrong, kJob, kSender));
  CHECK(closed_by_peer(s3, 2000ms));
  close(s3);
  int s4 = raw_connect(port);
  raw_send(s4, login_frame(other_job, kJob + 1, kSender));
  CHECK(closed_by_peer(s4, 2000ms));
  close(s4);
  // A real login, recorded and played again: the counter has been used.
  net::sealer real(key_of(5), kJob, kSender);
  const auto login = login_frame(real, kJob, kSender);
  int s5 = raw_connect(port);
  raw_send(s5, login);
  std::this_thread::sleep_for(100ms);
  int s6 = raw_connect(port);
  raw_send(s6, login);
  CHECK(closed_by_peer(s6, 2000ms));
  close(s6);
  close(s5);
  REQUIRE(f.in.wait([](inbox& b) { return b.refusals.size() >= 5; }));
  std::string all;
  for (auto& r : f.in.refusals) all += r + "\n";
  INFO(all);
  CHECK(all.find("did not log in") != std::string::npos);
  CHECK(all.find("no login within") != std::string::npos);
  CHECK(all.find("bad tag") != std::string::npos);
  CHECK(all.find("of a job this node does not run") != std::string::npos);
  CHECK(all.find("replayed") != std::string::npos);
  // The real sender (its counters go on from where the raw one's ended: a sealer of its own starts at
  // 0, so use the raw one) still gets in and through.
  int s7 = raw_connect(port);
  raw_send(s7, login_frame(real, kJob, kSender));
  raw_send(s7, sealed_frame(real, chunk_header(0, 4), {1, 2, 3, 4}));
  REQUIRE(f.in.wait([](inbox& b) { return b.got.size() == 1; }));
  CHECK(f.in.got[0].second == std::vector<float>{1, 2, 3, 4});
  close(s7);
  CHECK(f.in.errors.empty());
}

TEST_CASE("tcp link: strangers who connect and say nothing cannot keep the pair out", "[tcp_link]") {
  pair_fixture f;
  std::vector<int> idle;
  for (int i = 0; i < 100; ++i) idle.push_back(raw_connect(f.port->port()));  // more than max_pending
  std::this_thread::sleep_for(50ms);
  const auto t0 = std::chrono::steady_clock::now();
  auto s = f.sender();
  std::string err;
  REQUIRE(s->send(chunk_header(0, 4), floats_of(4, 1), &err));
  REQUIRE(f.in.wait([](inbox& b) { return b.got.size() == 1; }, 2s));
  CHECK(std::chrono::steady_clock::now() - t0 < 1s);  // well before the strangers' logins time out
  for (int fd : idle) close(fd);
  REQUIRE(f.in.wait([](inbox& b) {
    for (auto& r : b.refusals)
      if (r.find("closed a connection before it logged in: more than 64 waited at once") != std::string::npos) return true;
    return false;
  }));
  // 5 lines a window; the rest are summed up once it is over, flood or no flood.
  REQUIRE(f.in.wait([](inbox& b) {
    for (auto& r : b.refusals)
      if (r.find("more refusals not logged in 1000 ms") != std::string::npos) return true;
    return false;
  }, 5s));
  std::lock_guard<std::mutex> lock(f.in.mu);
  CHECK(f.in.refusals.size() <= 12);  // not one line per stranger
}

TEST_CASE("tcp link: an altered or misdirected message closes the connection with a clear error", "[tcp_link]") {
  pair_fixture f;
  net::sealer real(key_of(5), kJob, kSender);
  SECTION("a flipped payload bit") {
    int s = raw_connect(f.port->port());
    raw_send(s, login_frame(real, kJob, kSender));
    auto frame = sealed_frame(real, chunk_header(0, 4), {1, 2, 3, 4});
    frame.back() ^= 1;
    raw_send(s, frame);
    REQUIRE(f.in.wait([](inbox& b) { return !b.errors.empty(); }));
    CHECK(f.in.errors[0].find("bad tag") != std::string::npos);
    CHECK(closed_by_peer(s, 2000ms));
    close(s);
  }
  SECTION("a header that is no chunk, or a payload over the limit") {
    int s = raw_connect(f.port->port());
    raw_send(s, login_frame(real, kJob, kSender));
    wire::header h = chunk_header(0, 0);
    const bool big = GENERATE(false, true);
    if (big) {
      h.elements = net::kMaxRingPayload / sizeof(float) + 1;
      h.payload_bytes = h.elements * sizeof(float);
    } else {
      h.type = wire::msg_type::weights;
    }
    const auto hb = wire::encode(h);
    std::vector<unsigned char> frame(hb.begin(), hb.end());
    frame.resize(frame.size() + net::kTrailerBytes);
    // The trailer names the pair: only the header is wrong.
    for (int i = 0; i < 8; ++i) frame[wire::kHeaderSize + size_t(i)] = static_cast<unsigned char>(kJob >> (8 * i));
    frame[wire::kHeaderSize + 8] = kSender;
    raw_send(s, frame);
    REQUIRE(f.in.wait([](inbox& b) { return !b.errors.empty(); }));
    CHECK(f.in.errors[0].find(big ? "over the limit" : "not a ring chunk") != std::string::npos);
    CHECK(closed_by_peer(s, 2000ms));
    close(s);
  }
  CHECK(f.in.got.empty());
}

TEST_CASE("tcp link: a sender whose port is closed says so once, and drops what it is given", "[tcp_link]") {
  std::string err;
  int free_port = 0;
  {  // a port nobody listens on
    auto p = net::tcp_port::bind("127.0.0.1", 0, {}, &err);
    REQUIRE(p);
    free_port = p->port();
  }
  std::mutex mu;
  std::vector<std::string> said;
  auto s = net::tcp_sender::connect("tcp://127.0.0.1:" + std::to_string(free_port), kJob, kSender,
                                    std::make_shared<net::sealer>(key_of(5), kJob, kSender),
                                    [&](const std::string& e) {
                                      std::lock_guard<std::mutex> lock(mu);
                                      said.push_back(e);
                                    },
                                    &err);
  REQUIRE(s);
  CHECK(s->send(chunk_header(0, 4), floats_of(4, 1), &err));
  const auto until = std::chrono::steady_clock::now() + 15s;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!said.empty() || std::chrono::steady_clock::now() > until) break;
    }
    std::this_thread::sleep_for(50ms);
  }
  std::lock_guard<std::mutex> lock(mu);
  REQUIRE(said.size() == 1);
  CHECK(said[0].find("cannot reach") != std::string::npos);
  CHECK(s->send(chunk_header(1, 4), floats_of(4, 1), &err));  // dropped, not an error
  CHECK_FALSE(net::tcp_sender::connect("udp://x:1", kJob, kSender, std::make_shared<net::sealer>(key_of(5), kJob, kSender), {}, &err));
  CHECK(err.find("not a tcp://HOST:PORT") != std::string::npos);
  CHECK(net::tcp_port::bind("127.0.0.1", free_port, {}, &err) != nullptr);  // the sender holds no port
  // A network interface, as ZeroMQ takes one in tcp://lo:P, binds to its address; an unknown name is said.
  auto on_lo = net::tcp_port::bind("lo", 0, {}, &err);
  REQUIRE(on_lo);
  const int lo_port = on_lo->port();
  const int c = test::loopback_connect(lo_port);
  CHECK(c >= 0);
  if (c >= 0) close(c);
  CHECK_FALSE(net::tcp_port::bind("no-such-interface", 0, {}, &err));
  CHECK(err.find("no-such-interface:0: ") == 0);
  CHECK(err.find("(neither a host address nor a network interface)") != std::string::npos);
}

TEST_CASE("tcp link: plain, a login needs only the pair's names, a sealed pair refuses it, and frames are checked", "[tcp_link]") {
  SECTION("a plain pair") {
    pair_fixture f(false);
    const int port = f.port->port();
    // A login for a pair the port does not expect, and one whose trailer names another node: refused.
    int s1 = raw_connect(port);
    raw_send(s1, plain_login(kJob + 1, kSender));
    CHECK(closed_by_peer(s1, 2000ms));
    close(s1);
    int s2 = raw_connect(port);
    auto bad = plain_login(kJob, kSender);
    bad[wire::kHeaderSize + 8] = kSender + 1;
    raw_send(s2, bad);
    CHECK(closed_by_peer(s2, 2000ms));
    close(s2);
    // The pair's login and a chunk; then a chunk whose trailer names another node closes the connection.
    int s3 = raw_connect(port);
    raw_send(s3, plain_login(kJob, kSender));
    raw_send(s3, plain_frame(chunk_header(0, 3), {7, 8, 9}, kJob, kSender));
    REQUIRE(f.in.wait([](inbox& b) { return b.got.size() == 1; }));
    CHECK(f.in.got[0].second == std::vector<float>{7, 8, 9});
    raw_send(s3, plain_frame(chunk_header(1, 1), {1}, kJob, kSender + 1));
    REQUIRE(f.in.wait([](inbox& b) { return !b.errors.empty(); }));
    CHECK(f.in.errors[0].find("plain connection from node 1: a message from node 2") != std::string::npos);
    CHECK(closed_by_peer(s3, 2000ms));
    close(s3);
    CHECK(f.in.got.size() == 1);
    REQUIRE(f.in.wait([](inbox& b) { return b.refusals.size() >= 2; }));
    CHECK(f.in.refusals[0].find("of a job this node does not run") != std::string::npos);
    CHECK(f.in.refusals[1].find("did not log in as a node") != std::string::npos);
    // Someone taking over a live connection with a login of its own (anyone can, plain) is said.
    auto s = f.sender();
    std::string err;
    REQUIRE(s->send(chunk_header(2, 1), floats_of(1, 4), &err));
    REQUIRE(f.in.wait([](inbox& b) { return b.got.size() == 2; }));
    int s4 = raw_connect(port);
    raw_send(s4, plain_login(kJob, kSender));
    REQUIRE(f.in.wait([](inbox& b) {
      return std::any_of(b.refusals.begin(), b.refusals.end(), [](const std::string& r) {
        return r.find("node 1 of job 77 logged in again from 127.0.0.1:") != std::string::npos &&
               r.find(": its earlier connection is closed") != std::string::npos;
      });
    }));
    raw_send(s4, plain_frame(chunk_header(3, 1), {9}, kJob, kSender));
    REQUIRE(f.in.wait([](inbox& b) { return b.got.size() == 3; }));
    CHECK(f.in.got[2].second == std::vector<float>{9});
    close(s4);
  }
  SECTION("a sealed pair takes no plain login, and no plain chunk after a real login") {
    pair_fixture f(true);
    int s1 = raw_connect(f.port->port());
    raw_send(s1, plain_login(kJob, kSender));
    CHECK(closed_by_peer(s1, 2000ms));
    close(s1);
    REQUIRE(f.in.wait([](inbox& b) { return !b.refusals.empty(); }));
    CHECK(f.in.refusals[0].find("a login as node 1 that failed: bad tag") != std::string::npos);
    net::sealer real(key_of(5), kJob, kSender);
    int s2 = raw_connect(f.port->port());
    raw_send(s2, login_frame(real, kJob, kSender));
    raw_send(s2, plain_frame(chunk_header(0, 2), {1, 2}, kJob, kSender));
    REQUIRE(f.in.wait([](inbox& b) { return !b.errors.empty(); }));
    CHECK(f.in.errors[0].find("sealed connection from node 1") != std::string::npos);
    CHECK(closed_by_peer(s2, 2000ms));
    close(s2);
    CHECK(f.in.got.empty());
  }
  SECTION("a plain pair takes no sealed login, and no sealed chunk after a plain login") {
    pair_fixture f(false);
    net::sealer keyed(key_of(5), kJob, kSender);  // a sender with keys, where this side runs --insecure
    int s1 = raw_connect(f.port->port());
    raw_send(s1, login_frame(keyed, kJob, kSender));
    CHECK(closed_by_peer(s1, 2000ms));
    close(s1);
    REQUIRE(f.in.wait([](inbox& b) { return !b.refusals.empty(); }));
    CHECK(f.in.refusals[0].find("a login as node 1: a sealed message on a plain link") != std::string::npos);
    int s2 = raw_connect(f.port->port());
    raw_send(s2, plain_login(kJob, kSender));
    raw_send(s2, sealed_frame(keyed, chunk_header(0, 2), {1, 2}));
    REQUIRE(f.in.wait([](inbox& b) { return !b.errors.empty(); }));
    CHECK(f.in.errors[0].find("plain connection from node 1: a sealed message on a plain link") != std::string::npos);
    CHECK(closed_by_peer(s2, 2000ms));
    close(s2);
    CHECK(f.in.got.empty());  // ciphertext never summed as gradients
  }
}

TEST_CASE("tcp link: plain payloads go from where they are, held until written, and a send as one is let go does not deadlock", "[tcp_link]") {
  pair_fixture f(false);
  auto s = f.sender();
  REQUIRE_FALSE(s->sealed());
  constexpr int kBig = 24;  // 1 MiB each: more than the socket takes at once, so most wait for the sender's thread
  std::vector<std::vector<float>> bufs(kBig, std::vector<float>(size_t(1) << 18));
  std::atomic<int> released{0};
  std::string err;
  net::tcp_sender* raw = s.get();
  for (int i = 0; i < kBig; ++i) {
    std::fill(bufs[size_t(i)].begin(), bufs[size_t(i)].end(), float(i));
    // As the ring driver's owner does: letting go ends an all-reduce, whose owner may send at once.
    auto owner = std::shared_ptr<const void>(bufs[size_t(i)].data(), [&released, raw, i](const void*) {
      ++released;
      std::string e;
      if (i == kBig - 1) raw->send(chunk_header(kBig, 2), floats_of(2, 5), &e);
    });
    REQUIRE(s->send(chunk_header(i, size_t(1) << 18), net::payload{bufs[size_t(i)].data(), bufs[size_t(i)].size() * sizeof(float), owner}, &err));
  }
  REQUIRE(f.in.wait([](inbox& b) { return b.got.size() == size_t(kBig + 1); }));
  CHECK(released.load() == kBig);
  for (int i = 0; i < kBig; ++i) {
    const auto& v = f.in.got[size_t(i)].second;
    CHECK((v.size() == (size_t(1) << 18) && v.front() == float(i) && v.back() == float(i)));
  }
  CHECK(f.in.got[kBig].second == std::vector<float>{5, 6});
  CHECK(f.in.errors.empty());
}

TEST_CASE("tcp link: dropping a sender whose connect hangs returns at once", "[tcp_link]") {
  // A listener whose backlog is full: the kernel drops further handshakes, so a connect waits.
  int port = 0;
  const int l = loopback_listener(0, &port);
  const int filler = raw_connect(port);
  std::string err;
  std::atomic<int> failures{0};
  auto s = net::tcp_sender::connect("tcp://127.0.0.1:" + std::to_string(port), kJob, kSender, nullptr,
                                    [&failures](const std::string&) { ++failures; }, &err);
  REQUIRE(s);
  std::this_thread::sleep_for(100ms);  // its first connect is under way
  const auto t0 = std::chrono::steady_clock::now();
  s.reset();
  CHECK(std::chrono::steady_clock::now() - t0 < 500ms);  // not the second a connect may wait
  CHECK(failures.load() == 0);  // its owner went: nobody to tell
  close(filler);
  close(l);
}