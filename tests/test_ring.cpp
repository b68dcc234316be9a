// Ring all-reduce: the pure schedule (no transport), then N reducer actors in one process.
#include <catch2/catch.hpp>
#include <atomic>
#include <deque>
#include <future>
#include <random>
#include <thread>

#include "actors/local_ring.hpp"
#include "actors/topology.hpp"
#include "actors/reducer.hpp"
#include "actors/ring_links.hpp"
#include "net/ring.hpp"

using namespace ringmaster;

namespace {

std::vector<size_t> lengths_for(int n) {
  return {0, 1, size_t(n > 1 ? n - 1 : 0), size_t(n + 1), 1000003, 4097};
}

// Inputs with integer values so the sum is exact and comparable with ==.
std::vector<std::vector<float>> make_inputs(int n, size_t len, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<float>> in(n, std::vector<float>(len));
  for (auto& v : in)
    for (auto& x : v) x = float(int(rng() % 2001) - 1000);
  return in;
}

std::vector<float> serial_sum(const std::vector<std::vector<float>>& in, size_t len) {
  std::vector<float> s(len, 0.0f);
  for (auto& v : in)
    for (size_t i = 0; i < len; ++i) s[i] += v[i];
  return s;
}

}  // namespace

TEST_CASE("chunks cover the buffer exactly once", "[ring]") {
  for (int n = 1; n <= 8; ++n)
    for (size_t len : lengths_for(n)) {
      size_t next = 0;
      for (int c = 0; c < n; ++c) {
        ring::chunk_range r = ring::chunk(len, n, c);
        CHECK(r.offset == next);
        next += r.count;
      }
      CHECK(next == len);
    }
}

TEST_CASE("ring schedule sums correctly with messages delivered in any interleaving", "[ring]") {
  for (int n = 1; n <= 8; ++n)
    for (size_t len : lengths_for(n)) {
      INFO("ranks " << n << " length " << len);
      auto bufs = make_inputs(n, len, unsigned(n * 1000 + len));
      const auto want = serial_sum(bufs, len);
      std::vector<ring::allreduce_state<>> st;
      for (int r = 0; r < n; ++r) st.emplace_back(r, n, bufs[r].data(), len);
      // In-flight messages per link (rank r -> r+1), delivered in a pseudo-random order of links.
      struct msg { int round; std::vector<float> data; };
      std::vector<std::deque<msg>> link(n);
      auto post = [&](int r, const ring::outgoing& o) {
        if (!o.send) return;
        const float* p = bufs[r].data() + o.range.offset;
        link[r].push_back({o.round, std::vector<float>(p, p + o.range.count)});
      };
      for (int r = 0; r < n; ++r) post(r, st[r].start());
      std::mt19937 rng(7);
      for (int guard = 0; guard < 100000; ++guard) {
        std::vector<int> busy;
        for (int r = 0; r < n; ++r)
          if (!link[r].empty()) busy.push_back(r);
        if (busy.empty()) break;
        const int from = busy[rng() % busy.size()], to = ring::right(from, n);
        msg m = std::move(link[from].front());
        link[from].pop_front();
        ring::outgoing next;
        REQUIRE(st[to].receive(m.round, m.data.data(), m.data.size(), &next));
        post(to, next);
      }
      for (int r = 0; r < n; ++r) {
        CHECK(st[r].done());
        CHECK(bufs[r] == want);
      }
    }
}

TEST_CASE("ring state rejects wrong rounds and sizes", "[ring]") {
  std::vector<float> buf(10, 1.0f);
  ring::allreduce_state<> st(0, 3, buf.data(), buf.size());
  st.start();
  std::vector<float> data(4, 1.0f);
  ring::outgoing next;
  CHECK_FALSE(st.receive(1, data.data(), 3, &next));  // round 1 before round 0
  CHECK_FALSE(st.receive(0, data.data(), 4, &next));  // chunk 2 has 3 elements
  CHECK(st.receive(0, data.data(), 3, &next));
  CHECK(next.send);
  CHECK(next.round == 1);
}

TEST_CASE("ring all-reduce between N reducer actors equals the serial sum", "[ring][actors]") {
  caf::actor_system_config cfg;
  cfg.set("logger.console", caf::atom("none"));
  caf::actor_system sys{cfg};
  // 12 and 24: chains of chunks passed on by one thread run deeper than deliver() goes, and hand over.
  for (int n : {1, 2, 3, 4, 5, 6, 7, 8, 12, 24}) {
    local_ring ring(sys, n);
    for (size_t len : lengths_for(n)) {
      INFO("ranks " << n << " length " << len);
      auto bufs = make_inputs(n, len, unsigned(n * 7 + len));
      const auto want = serial_sum(bufs, len);
      std::vector<float*> ptrs;
      for (auto& b : bufs) ptrs.push_back(b.data());
      REQUIRE(ring.allreduce(ptrs, len) == "");
      for (int r = 0; r < n; ++r) CHECK(bufs[r] == want);
    }
    // Float data: every rank ends with the same bits (each chunk is summed at one rank only).
    std::mt19937 rng(n);
    std::normal_distribution<float> d;
    std::vector<std::vector<float>> f(n, std::vector<float>(12345));
    std::vector<float*> ptrs;
    for (auto& v : f) {
      for (auto& x : v) x = d(rng);
      ptrs.push_back(v.data());
    }
    REQUIRE(ring.allreduce(ptrs, 12345) == "");
    for (int r = 1; r < n; ++r) CHECK(f[r] == f[0]);
  }
}

TEST_CASE("local_ring refuses null and overlapping buffers, odd sizes and timeouts, and a topology's ring may outlive the topology", "[ring][actors][topology]") {
  // Before: a null buffer was a SIGSEGV, one buffer given twice summed into itself (3 for 1 + 1), and a
  // topology destroyed before its ring waited for the ring's reducers for ever.
  auto t = std::make_unique<topology>();
  std::unique_ptr<local_ring> ring = t->ring(3);
  std::vector<float> a(100, 1.f), b(100, 1.f), c(100, 1.f);
  CHECK(ring->allreduce({a.data(), nullptr, c.data()}, 100) == "buffer 1 is null");
  CHECK(ring->allreduce({a.data(), b.data(), a.data()}, 100) == "buffers 0 and 2 overlap: each rank needs a buffer of its own");
  CHECK(ring->allreduce({a.data(), a.data() + 50, c.data()}, 100) == "buffers 0 and 1 overlap: each rank needs a buffer of its own");
  CHECK(a == std::vector<float>(100, 1.f));  // refused before anything ran
  CHECK(ring->allreduce({a.data(), a.data() + 50, b.data()}, 50) == "");  // halves of one vector: their own
  CHECK(a == std::vector<float>(100, 3.f));
  CHECK(std::vector<float>(b.begin(), b.begin() + 50) == std::vector<float>(50, 3.f));
  CHECK(b[50] == 1.f);
  std::vector<float> x(10, 1.f), y(10, 2.f), z(10, 3.f);
  CHECK(ring->allreduce({x.data(), y.data(), z.data()}, 10, std::chrono::milliseconds(0)) == "timeout must be positive, not 0 ms");
  for (int n : {-1, 0, 1025}) {  // -1 was std::length_error (abort), 0 a ring that "summed" anything
    std::unique_ptr<local_ring> odd = t->ring(n);
    CHECK(odd->allreduce({}, 4) == "a ring of " + std::to_string(n) + " ranks: expected 1..1024");
  }
  t.reset();  // the ring goes on
  CHECK(ring->allreduce({x.data(), y.data(), z.data()}, 10) == "");
  CHECK(x == std::vector<float>(10, 6.f));
  ring.reset();  // and ends the actor system with it
}

TEST_CASE("ring: a replica that polls for its ring's end adds the chunks into its own buffer itself", "[ring][actors]") {
  // In one process the rank that finished backward last used to do the adds and copies of every rank;
  // now a rank whose replica waits in poll_briefly does its own. Its all-reduce then ends on its own
  // thread, where it ended on the late rank's before.
  caf::actor_system_config cfg;
  cfg.set("logger.console", caf::atom("none"));
  caf::actor_system sys{cfg};
  caf::actor reducers[2];
  std::shared_ptr<reducer_port> ports[2];
  for (int r = 0; r < 2; ++r) {
    reducer_config rc;
    rc.rank = r;
    rc.size = 2;
    ports[r] = spawn_reducer(sys, rc, &reducers[r]);
  }
  join(*ports[0], make_port_link(ports[1]));
  join(*ports[1], make_port_link(ports[0]));
  set_poller(*ports[1], spin_until_done(), std::chrono::seconds(10));
  const size_t len = size_t(1) << 20;  // 4 MiB: the ring, several segments
  auto bufs = make_inputs(2, len, 11);
  const auto want = serial_sum(bufs, len);

  std::atomic<bool> done1{false};
  std::atomic<int> looks{0};  // rank 1's looks at its end: from the second on, it polls
  std::string error1 = "not ended";
  std::thread::id ended_on;
  std::thread early([&] {  // rank 1 is early: it asks, then polls
    reduce(*ports[1], tensor_view{bufs[1].data(), len, nullptr, nullptr}, 0, len, [&](const std::string& e) {
      error1 = e;
      ended_on = std::this_thread::get_id();
      done1 = true;
    });
    poll_briefly(*ports[1], [&] {
      ++looks;
      return done1.load();
    });
  });
  while (looks < 2) std::this_thread::yield();
  std::promise<std::string> end0;
  reduce(*ports[0], tensor_view{bufs[0].data(), len, nullptr, nullptr}, 0, len, [&](const std::string& e) { end0.set_value(e); });
  auto f = end0.get_future();
  REQUIRE(f.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  CHECK(f.get() == "");
  const std::thread::id early_id = early.get_id();
  early.join();
  REQUIRE(done1);
  CHECK(error1 == "");
  CHECK(ended_on == early_id);
  CHECK(bufs[0] == want);
  CHECK(bufs[1] == want);

  caf::scoped_actor self{sys};
  for (auto& p : ports) leave(*p);
  for (auto& a : reducers) self->send_exit(a, caf::exit_reason::user_shutdown);
  for (auto& a : reducers) self->wait_for(a);
}
