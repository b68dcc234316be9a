// The training path's ring all-reduce across processes (reducers over the ZeroMQ link): N ranks as threads in one process (each with its own bridge and
// ZeroMQ context, talking over tcp loopback or ipc exactly as separate processes would), then failures.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <condition_variable>
#include <future>
#include <mutex>
#include <random>
#include <thread>
#include <zmq.h>
#include <zmq.hpp>

#include "actors/process_ring.hpp"
#include "tests/test_util.hpp"
#include "net/seal.hpp"

using namespace ringmaster;
using namespace std::chrono_literals;

namespace {

using clock_type = std::chrono::steady_clock;

void quiet(const net::bridge_error&) {}

process_ring_options small_segments() {
  process_ring_options o;
  o.segment_bytes = 4096;  // many pieces even for small buffers: exercises the pipelining
  o.timeout = 5s;
  o.handshake_timeout = 10s;
  return o;
}

// Builds N connected rings: each binds `listen` (port 0 or an ipc path), then all connect.
std::vector<std::unique_ptr<process_ring>> make_rings(int n, const std::string& transport, process_ring_options o) {
  std::vector<std::unique_ptr<process_ring>> rings;
  std::vector<std::string> eps;
  std::string err;
  for (int r = 0; r < n; ++r) {
    rings.push_back(std::make_unique<process_ring>(r, n, o));
    // shm: a port of our choosing, as the segment is named by the endpoint the left neighbour connects to.
    const std::string ep = transport == "ipc" ? "ipc:///tmp/ringmaster-ring-" + std::to_string(getpid()) +
                                                    "-" + std::to_string(r) + ".ipc"
                           : transport == "shm" ? test::free_endpoint()
                                                : "tcp://127.0.0.1:0";
    REQUIRE(rings[r]->listen(ep, &err));
    eps.push_back(rings[r]->endpoint());
  }
  std::vector<std::future<std::string>> done;
  for (int r = 0; r < n; ++r)
    done.push_back(std::async(std::launch::async, [&, r] {
      std::string e;
      return rings[r]->connect(eps, &e) ? std::string() : e;
    }));
  for (auto& f : done) REQUIRE(f.get() == "");
  return rings;
}

// Runs one all-reduce on every rank at once; returns each rank's error ("" on success).
std::vector<std::string> allreduce_all(std::vector<std::unique_ptr<process_ring>>& rings,
                                       std::vector<std::vector<float>>& bufs) {
  std::vector<std::future<std::string>> done;
  for (size_t r = 0; r < rings.size(); ++r)
    done.push_back(std::async(std::launch::async, [&, r] { return rings[r]->allreduce(bufs[r].data(), bufs[r].size()); }));
  std::vector<std::string> out;
  for (auto& f : done) out.push_back(f.get());
  return out;
}

}  // namespace

TEST_CASE("process_ring: sums exactly for 1-4 ranks, many lengths, repeated steps", "[process_ring]") {
  for (const std::string transport : {"tcp", "ipc", "shm"})
    for (size_t small_bytes : {size_t(0), size_t(8192)})
    for (int n = 1; n <= 4; ++n) {
      if (transport != "tcp" && n != 3 && !(transport == "shm" && n == 2)) continue;  // ipc once, shm twice
      // small_bytes 0: always the segmented ring; 8192: buffers up to 2048 floats go whole.
      process_ring_options o = small_segments();
      o.small_bytes = small_bytes;
      o.shared_memory = transport == "shm";
      auto rings = make_rings(n, transport, o);
      for (auto& ring : rings) CHECK(ring->through_shared_memory() == (transport == "shm"));
      // 0 and 1 (empty chunks), fewer than n, one piece, many pieces with a ragged end.
      for (size_t len : {size_t(0), size_t(1), size_t(n + 1), size_t(1000), size_t(2048), size_t(2049),
                         size_t(100003)}) {
        INFO(transport << ": " << n << " ranks, " << len << " floats, small_bytes " << small_bytes);
        for (int step = 0; step < 2; ++step) {
          std::mt19937 rng(unsigned(len * 31 + n * 7 + step));
          std::vector<std::vector<float>> bufs(n, std::vector<float>(len));
          std::vector<float> want(len, 0.0f);
          for (auto& b : bufs)
            for (size_t i = 0; i < len; ++i) {
              b[i] = float(int(rng() % 2001) - 1000);  // integers: the sum is exact in any order
              want[i] += b[i];
            }
          for (const auto& e : allreduce_all(rings, bufs)) REQUIRE(e == "");
          for (int r = 0; r < n; ++r) CHECK(bufs[r] == want);
        }
      }
    }
}

TEST_CASE("process_ring: buffers the right neighbour reads in place through shared memory sum exactly, step after step", "[process_ring][shm]") {
  for (int n : {2, 3})
    for (size_t small_bytes : {size_t(0), size_t(8192)}) {
      process_ring_options o = small_segments();
      o.segment_bytes = 64 * 1024;  // the driver copies sends under 16 KB itself: these go by reference
      o.small_bytes = small_bytes;
      o.shared_memory = true;
      auto rings = make_rings(n, "shm", o);
      const size_t most = 100003;
      std::vector<float*> bufs;
      std::string err;
      for (auto& ring : rings) {
        bufs.push_back(ring->shared_buffer(most, &err));
        INFO(err);
        REQUIRE(bufs.back());
      }
      for (size_t len : {size_t(1), size_t(n + 1), size_t(2048), size_t(2049), most}) {
        INFO(n << " ranks, " << len << " floats, small_bytes " << small_bytes);
        for (int step = 0; step < 3; ++step) {
          std::mt19937 rng(unsigned(len * 31 + n * 7 + step));
          std::vector<float> want(len, 0.0f);
          for (float* b : bufs)
            for (size_t i = 0; i < len; ++i) {
              b[i] = float(int(rng() % 2001) - 1000);  // integers: the sum is exact in any order
              want[i] += b[i];
            }
          std::vector<std::future<std::string>> done;
          for (int r = 0; r < n; ++r) done.push_back(std::async(std::launch::async, [&, r] { return rings[r]->allreduce(bufs[r], len); }));
          for (auto& f : done) REQUIRE(f.get() == "");
          for (int r = 0; r < n; ++r) CHECK(std::vector<float>(bufs[r], bufs[r] + len) == want);
        }
      }
      for (auto& ring : rings) CHECK(ring->buffer_read_in_place());
    }
}

TEST_CASE("process_ring: with keys, over CurveZMQ or sealed, sums exactly, and each rank takes only its left neighbour", "[process_ring][keys]") {
  // Each rank its own key pair, as on separate machines.
  const int n = 3;
  std::vector<net::key_pair> keys(n);
  std::vector<std::string> publics;
  for (auto& k : keys) {
    char pub[41], sec[41];
    REQUIRE(zmq_curve_keypair(pub, sec) == 0);
    k = {pub, sec};
    publics.push_back(pub);
  }
  for (const bool sealed : {false, true}) {
    INFO((sealed ? "sealed" : "CurveZMQ"));
    std::vector<std::unique_ptr<process_ring>> rings;
    std::vector<std::string> eps;
    std::string err;
    const std::string salt = net::make_seal_salt();
    for (int r = 0; r < n; ++r) {
      process_ring_options o = small_segments();
      o.bridge.keys = keys[size_t(r)];
      o.public_keys = publics;
      if (sealed) o.seal_salt = salt;
      rings.push_back(std::make_unique<process_ring>(r, n, o));
      REQUIRE(rings.back()->listen("tcp://127.0.0.1:0", &err));
      eps.push_back(rings.back()->endpoint());
    }
    std::vector<std::future<std::string>> done;
    for (int r = 0; r < n; ++r)
      done.push_back(std::async(std::launch::async, [&, r] {
        std::string e;
        return rings[size_t(r)]->connect(eps, &e) ? std::string() : e;
      }));
    for (auto& f : done) REQUIRE(f.get() == "");
    for (size_t len : {size_t(1), size_t(5000), size_t(300001)}) {
      std::vector<std::vector<float>> bufs(n, std::vector<float>(len));
      std::vector<float> want(len, 0.0f);
      for (int r = 0; r < n; ++r)
        for (size_t i = 0; i < len; ++i) {
          bufs[size_t(r)][i] = float((i * 7 + size_t(r) * 13) % 1001);
          want[i] += bufs[size_t(r)][i];
        }
      for (const auto& e : allreduce_all(rings, bufs)) REQUIRE(e == "");
      for (int r = 0; r < n; ++r) CHECK(bufs[size_t(r)] == want);
    }
    // Rank 1 holds a key of this ring, but rank 0 lets in only its left neighbour's (rank 2's).
    net::bridge_options bo;
    bo.keys = keys[1];
    net::bridge intruder(bo);
    std::mutex mu;
    std::condition_variable cv;
    std::string refused;
    intruder.set_error_handler([&](const net::bridge_error& e) {
      std::lock_guard<std::mutex> lock(mu);
      if (e.kind == net::fault::handshake_failed) refused = e.message;
      cv.notify_all();
    });
    REQUIRE(intruder.start("", &err));
    REQUIRE(intruder.connect(eps[0], publics[0], &err) >= 0);
    std::unique_lock<std::mutex> lock(mu);
    CHECK(cv.wait_for(lock, 5s, [&] { return !refused.empty(); }));
    CHECK(refused.find("refused our key") != std::string::npos);
    lock.unlock();
    intruder.stop();
  }
  // A rank that holds another key than the ring expects never gets in: its right neighbour refuses it.
  process_ring_options o = small_segments();
  o.handshake_timeout = 2s;
  std::vector<std::unique_ptr<process_ring>> pair;
  std::vector<std::string> eps;
  std::string err;
  for (int r = 0; r < 2; ++r) {
    o.bridge.keys = keys[size_t(r)];
    o.public_keys = {publics[0], publics[2]};  // rank 1 is said to hold key 2: rank 0 lets nobody else in
    pair.push_back(std::make_unique<process_ring>(r, 2, o));
    REQUIRE(pair.back()->listen("tcp://127.0.0.1:0", &err));
    eps.push_back(pair.back()->endpoint());
  }
  auto f0 = std::async(std::launch::async, [&] { std::string e; return pair[0]->connect(eps, &e) ? std::string() : e; });
  auto f1 = std::async(std::launch::async, [&] { std::string e; return pair[1]->connect(eps, &e) ? std::string() : e; });
  const std::string e0 = f0.get(), e1 = f1.get();
  CHECK(e1.find("refused our key") != std::string::npos);  // rank 0 refused rank 1's key
  CHECK(e0.find("hangs up during the handshake") != std::string::npos);  // rank 1 is not who rank 0 expects
}

TEST_CASE("process_ring: a dead peer makes allreduce fail within the timeout", "[process_ring]") {
  process_ring_options o = small_segments();
  o.timeout = 1s;
  o.on_error = quiet;
  auto rings = make_rings(3, "tcp", o);
  std::vector<float> buf(50000, 1.0f);
  rings[2].reset();  // rank 2 dies after the handshake
  const auto t0 = clock_type::now();
  auto f0 = std::async(std::launch::async, [&] { return rings[0]->allreduce(buf.data(), buf.size()); });
  std::vector<float> buf1(50000, 1.0f);
  const std::string e1 = rings[1]->allreduce(buf1.data(), buf1.size());
  const std::string e0 = f0.get();
  const double secs = std::chrono::duration<double>(clock_type::now() - t0).count();
  CHECK(secs < 8.0);
  CHECK_FALSE(e0.empty());
  CHECK_FALSE(e1.empty());
  // Rank 0 (left of the dead rank... receives from it) times out; rank 1 may time out or hear rank 0's abort.
  CHECK(e0.find("no progress for") != std::string::npos);
  CHECK(e0.find("waits for rank 2 (the left neighbour)") != std::string::npos);
  CHECK(rings[0]->allreduce(buf.data(), buf.size()).rfind("ring failed earlier: ", 0) == 0);
}

TEST_CASE("process_ring: through shared memory, a dead peer makes allreduce fail within the timeout", "[process_ring][shm]") {
  process_ring_options o = small_segments();
  o.timeout = 1s;
  o.on_error = quiet;
  o.shared_memory = true;
  auto rings = make_rings(3, "shm", o);
  for (auto& ring : rings) REQUIRE(ring->through_shared_memory());
  std::vector<float> buf(50000, 1.0f), buf1(50000, 1.0f);
  rings[2].reset();  // rank 2 dies after the handshake: its segment goes, rank 1's sends are dropped
  const auto t0 = clock_type::now();
  auto f0 = std::async(std::launch::async, [&] { return rings[0]->allreduce(buf.data(), buf.size()); });
  const std::string e1 = rings[1]->allreduce(buf1.data(), buf1.size());
  const std::string e0 = f0.get();
  CHECK(std::chrono::duration<double>(clock_type::now() - t0).count() < 8.0);
  CHECK(e0.find("waits for rank 2 (the left neighbour)") != std::string::npos);
  CHECK_FALSE(e1.empty());
}

TEST_CASE("process_ring: a neighbour that never joins the all-reduce is a timeout", "[process_ring]") {
  process_ring_options o;
  o.timeout = 500ms;
  o.on_error = quiet;
  auto rings = make_rings(2, "tcp", o);
  std::vector<float> buf(1000, 1.0f);
  const auto t0 = clock_type::now();
  const std::string e = rings[0]->allreduce(buf.data(), buf.size());
  CHECK(std::chrono::duration<double>(clock_type::now() - t0).count() < 4.0);
  CHECK(e.find("no progress for") != std::string::npos);
  CHECK(e.find("rank 1 (the left neighbour)") != std::string::npos);
}

TEST_CASE("process_ring: handshake errors are clear and bounded", "[process_ring]") {
  process_ring_options o;
  o.handshake_timeout = 700ms;
  o.on_error = quiet;
  std::string err;

  SECTION("nobody there") {
    process_ring r0(0, 2, o);
    REQUIRE(r0.listen("tcp://127.0.0.1:0", &err));
    // Port 1 on loopback: nobody listens, the dealer keeps retrying in the background.
    CHECK_FALSE(r0.connect({r0.endpoint(), "tcp://127.0.0.1:1"}, &err));
    CHECK(err.find("handshake timed out after 700 ms") != std::string::npos);
    CHECK(err.find("rank 1 at tcp://127.0.0.1:1") != std::string::npos);
  }

  SECTION("a neighbour in the next protocol version is refused, naming both versions") {
    o.handshake_timeout = 10s;
    process_ring r0(0, 2, o);
    REQUIRE(r0.listen("tcp://127.0.0.1:0", &err));
    zmq::context_t ctx;
    // The fake rank 1: a ROUTER for r0 to dial, and a DEALER that says hello in the next version.
    zmq::socket_t router(ctx, zmq::socket_type::router), dealer(ctx, zmq::socket_type::dealer);
    router.set(zmq::sockopt::linger, 0);
    dealer.set(zmq::sockopt::linger, 0);
    dealer.set(zmq::sockopt::rcvtimeo, 5000);
    router.bind("tcp://127.0.0.1:0");
    const std::string fake_ep = router.get(zmq::sockopt::last_endpoint);
    dealer.connect(r0.endpoint());
    wire::header h;
    h.type = wire::msg_type::hello;
    h.version = wire::kProtocolVersion + 1;
    h.job_id = 1;
    h.sender_rank = 1;
    const auto hb = wire::encode(h);
    dealer.send(zmq::message_t(hb.data(), hb.size()), zmq::send_flags::none);
    const auto t0 = clock_type::now();
    CHECK_FALSE(r0.connect({r0.endpoint(), fake_ep}, &err));
    const std::string want = "protocol version " + std::to_string(wire::kProtocolVersion + 1) +
                             ", this build speaks " + std::to_string(wire::kProtocolVersion);
    CHECK(err == want);
    CHECK(std::chrono::duration<double>(clock_type::now() - t0).count() < 5.0);
    zmq::message_t reply;
    REQUIRE(dealer.recv(reply));
    std::vector<zmq::message_t> parts;
    while (reply.more()) {
      parts.emplace_back();
      REQUIRE(dealer.recv(parts.back()));
      if (!parts.back().more()) break;
    }
    REQUIRE(parts.size() == 1);
    CHECK(parts[0].to_string() == want);
  }

  SECTION("a hello from another job is refused by both sides") {
    process_ring r0(0, 2, o);
    REQUIRE(r0.listen("tcp://127.0.0.1:0", &err));
    process_ring_options other = o;
    other.job_id = 99;
    process_ring r1(1, 2, other);
    REQUIRE(r1.listen("tcp://127.0.0.1:0", &err));
    const std::vector<std::string> eps{r0.endpoint(), r1.endpoint()};
    auto f1 = std::async(std::launch::async, [&] {
      std::string e;
      r1.connect(eps, &e);
      return e;
    });
    CHECK_FALSE(r0.connect(eps, &err));
    const std::string e1 = f1.get();
    CHECK(e1.find("refused us: hello for job 99, this ring runs job 1") != std::string::npos);
  }
}
