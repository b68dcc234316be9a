// The TCP link's sender dropped or aborted mid-way (net/tcp_link.hpp): while its connect hangs, while its
// host name lookup hangs, or with plain payloads queued behind a neighbour that stopped reading, it
// returns at once, connects nowhere later and lets go of what it held.
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

// A host name whose lookup hangs, as behind a DNS server that does not answer: this test binary's
// getaddrinfo (it comes before libc's) holds "hung-lookup.invalid" until the test lets it go, then finds
// it at 127.0.0.1; every other name goes straight to libc's. (Interposing needs this one global.)
struct hung_lookups {
  std::mutex mu;
  std::condition_variable cv;
  bool free = false;
  int waiting = 0, ended = 0;
};
hung_lookups& lookups() {
  static hung_lookups h;
  return h;
}

// Lets a held lookup go and joins the thread that would have: on every way out of the test, so a
// failed check neither leaves a thread blocked in the lookup nor a joinable std::thread behind.
struct release_lookups {
  std::thread& rescue;
  ~release_lookups() {
    hung_lookups& h = lookups();
    {
      std::lock_guard<std::mutex> lock(h.mu);
      h.free = true;
    }
    h.cv.notify_all();
    if (rescue.joinable()) rescue.join();
  }
};

}  // namespace

extern "C" int getaddrinfo(const char* node, const char* service, const addrinfo* hints, addrinfo** res) {
  using fn = int (*)(const char*, const char*, const addrinfo*, addrinfo**);
  static const fn libc = reinterpret_cast<fn>(dlsym(RTLD_NEXT, "getaddrinfo"));
  if (!node || std::strcmp(node, "hung-lookup.invalid") != 0) return libc(node, service, hints, res);
  hung_lookups& h = lookups();
  {
    std::unique_lock<std::mutex> lock(h.mu);
    ++h.waiting;
    h.cv.notify_all();
    h.cv.wait(lock, [&h] { return h.free; });
  }
  const int e = libc("127.0.0.1", service, hints, res);  // found, at last
  std::lock_guard<std::mutex> lock(h.mu);
  --h.waiting;
  ++h.ended;
  h.cv.notify_all();
  return e;
}

TEST_CASE("tcp link: dropping a sender whose host name lookup hangs returns at once, and lets go of what it held", "[tcp_link]") {
  // The name is found, late, at a port that listens: a sender dropped meanwhile must not connect then.
  int port = 0;
  const int l = loopback_listener(4, &port);
  hung_lookups& h = lookups();
  std::thread rescue;
  release_lookups release{rescue};
  std::string err;
  std::atomic<int> failures{0};
  auto s = net::tcp_sender::connect("tcp://hung-lookup.invalid:" + std::to_string(port), kJob, kSender,
                                    nullptr, [&failures](const std::string&) { ++failures; }, &err);
  REQUIRE(s);
  {
    std::unique_lock<std::mutex> lock(h.mu);
    REQUIRE(h.cv.wait_for(lock, 5s, [&h] { return h.waiting == 1; }));
  }
  auto v = std::make_shared<std::vector<float>>(1000, 1.0f);
  REQUIRE(s->send(chunk_header(1, v->size()), net::payload::of(v), &err));  // plain: held until written
  CHECK(v.use_count() == 2);
  // Should the drop wait for the lookup after all, the lookup ends in 2 s: the check fails, nothing hangs.
  rescue = std::thread([&h] {
    std::unique_lock<std::mutex> lock(h.mu);
    if (!h.cv.wait_for(lock, 2s, [&h] { return h.free; })) h.free = true, h.cv.notify_all();
  });
  const auto t0 = std::chrono::steady_clock::now();
  s.reset();
  CHECK(std::chrono::steady_clock::now() - t0 < 200ms);
  CHECK(v.use_count() == 1);  // let go of by the destructor, not when the lookup ends
  {
    std::unique_lock<std::mutex> lock(h.mu);
    h.free = true;
    h.cv.notify_all();
    REQUIRE(h.cv.wait_for(lock, 5s, [&h] { return h.ended == 1; }));
  }
  pollfd p{l, POLLIN, 0};
  CHECK(::poll(&p, 1, 300) == 0);  // the lookup ended after its owner went: nobody is connected to
  CHECK(failures.load() == 0);     // and nobody is told
  close(l);
}

TEST_CASE("tcp link: an aborted sender stops connecting: nothing connects later and nobody is told", "[tcp_link]") {
  // A port nobody listens on yet: the sender's connects are refused, and it retries.
  const int l = socket(AF_INET, SOCK_STREAM, 0);
  const int on = 1;
  setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(bind(l, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  socklen_t len = sizeof a;
  getsockname(l, reinterpret_cast<sockaddr*>(&a), &len);
  std::string err;
  std::atomic<int> failures{0};
  auto s = net::tcp_sender::connect("tcp://127.0.0.1:" + std::to_string(ntohs(a.sin_port)), kJob, kSender, nullptr,
                                    [&failures](const std::string&) { ++failures; }, &err);
  REQUIRE(s);
  std::this_thread::sleep_for(100ms);  // its first connect was refused; it waits to try again
  s->abort();
  REQUIRE(listen(l, 4) == 0);  // the port opens: an aborted sender must not come, or not stay
  pollfd p{l, POLLIN, 0};
  if (::poll(&p, 1, 1000) > 0) {  // four retry pauses' worth; a connect under way as abort came may land,
    const int c = accept(l, nullptr, nullptr);  // but is closed at once, and never logs in
    REQUIRE(c >= 0);
    timeval tv{2, 0};
    setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char b;
    CHECK(recv(c, &b, 1, 0) == 0);
    close(c);
  }
  CHECK(failures.load() == 0);
  s.reset();
  close(l);
}

TEST_CASE("tcp link: abort lets go of plain payloads queued behind a neighbour that stopped reading", "[tcp_link]") {
  // A listener that takes the connection and never reads from it.
  int port = 0;
  const int l = loopback_listener(4, &port);
  std::string err;
  auto s = net::tcp_sender::connect("tcp://127.0.0.1:" + std::to_string(port), kJob, kSender, nullptr, {}, &err);
  REQUIRE(s);
  const int silent = accept(l, nullptr, nullptr);
  REQUIRE(silent >= 0);
  constexpr int kBig = 64;  // 64 MiB: far more than the socket buffers hold
  std::vector<float> buf(size_t(1) << 18, 1.0f);
  std::atomic<int> released{0};
  for (int i = 0; i < kBig; ++i) {
    auto owner = std::shared_ptr<const void>(buf.data(), [&released](const void*) { ++released; });
    REQUIRE(s->send(chunk_header(i, buf.size()), net::payload{buf.data(), buf.size() * sizeof(float), owner}, &err));
  }
  std::this_thread::sleep_for(200ms);
  REQUIRE(released.load() < kBig);  // the rest wait for the silent reader, holding the buffer
  s->abort();
  CHECK(released.load() == kBig);  // let go at once: the caller may free the buffer now
  auto late = std::shared_ptr<const void>(buf.data(), [&released](const void*) { ++released; });
  CHECK(s->send(chunk_header(kBig, buf.size()), net::payload{buf.data(), buf.size() * sizeof(float), late}, &err));
  late.reset();
  CHECK(released.load() == kBig + 1);  // dropped, not queued
  s.reset();
  close(silent);
  close(l);
}
