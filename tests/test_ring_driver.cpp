// The ring driver (net/ring_driver.hpp) with no transport: N drivers joined by in-memory links whose
// messages are delivered in random interleavings. Every path (ring, segments, buckets, small buffers)
// must give the bits of the ring's summation order, and every malformed message must be refused.
#include <catch2/catch.hpp>
#include <cstring>
#include <deque>
#include <random>

#include "net/ring_driver.hpp"

using namespace ringmaster;

namespace {

// copying: done with the sender's floats when send returns (as the shared-memory link is), so the
// driver may send its own buffer and change it at once.
struct queue_link : ring::link {
  std::deque<ring::message> q;
  bool copying = false;
  std::string send(ring::message m) override {
    if (copying) {
      auto v = std::make_shared<std::vector<float>>(m.data, m.data + m.count);
      m.data = v->data();
      m.owner = v;
    }
    q.push_back(std::move(m));
    return "";
  }
  bool copies_at_send() const override { return copying; }
};

// The ring's order: element i of chunk c is ((x_c + x_c+1) + x_c+2) + ...
std::vector<float> ring_order_sum(const std::vector<std::vector<float>>& x, size_t total) {
  const int n = int(x.size());
  std::vector<float> s(total);
  for (int c = 0; c < n; ++c) {
    const ring::chunk_range r = ring::chunk(total, n, c);
    for (size_t i = r.offset; i < r.offset + r.count; ++i) {
      float acc = x[size_t(c)][i];
      for (int k = 1; k < n; ++k) acc += x[size_t(ring::mod(c + k, n))][i];
      s[i] = acc;
    }
  }
  return s;
}

struct ring_of_drivers {
  std::vector<std::unique_ptr<queue_link>> links;
  std::vector<std::unique_ptr<ring::driver>> d;
  ring_of_drivers(int n, ring::driver_options o, bool copying = false) {
    for (int r = 0; r < n; ++r) links.push_back(std::make_unique<queue_link>());
    for (auto& l : links) l->copying = copying;
    for (int r = 0; r < n; ++r)
      d.push_back(std::make_unique<ring::driver>(r, n, links[size_t(r)].get(), std::make_unique<ring::host_loop_ops>(), o));
  }
  // Delivers messages in a random order of links until none is left; "" or the first error.
  std::string run(std::mt19937& rng) {
    const int n = int(d.size());
    for (;;) {
      std::vector<int> ready;
      for (int r = 0; r < n; ++r)
        if (!links[size_t(r)]->q.empty()) ready.push_back(r);
      if (ready.empty()) return "";
      const int r = ready[rng() % ready.size()];
      ring::message m = std::move(links[size_t(r)]->q.front());
      links[size_t(r)]->q.pop_front();
      if (std::string e = d[size_t(ring::right(r, n))]->receive(std::move(m)); !e.empty()) return e;
    }
  }
};

}  // namespace

TEST_CASE("ring driver: any buckets, segments and path give the ring's bits", "[ring_driver]") {
  std::mt19937 rng(7);
  for (int n = 1; n <= 5; ++n)
    for (size_t total : {size_t(0), size_t(1), size_t(n + 1), size_t(1000), size_t(40000)})
      for (size_t segment : {size_t(3), size_t(1000), size_t(1) << 18})
        for (size_t small : {size_t(0), size_t(1) << 20})
        for (bool copying : {false, true}) {
          INFO("ranks " << n << " length " << total << " segment " << segment << " small " << small << " copying " << copying);
          std::vector<std::vector<float>> x(static_cast<size_t>(n), std::vector<float>(total));
          std::normal_distribution<float> g(0.f, 1.f);
          for (auto& v : x)
            for (auto& f : v) f = g(rng) * 1e3f;
          const std::vector<float> want = ring_order_sum(x, total);
          // Buckets: random cuts of [0, total), reduced last bucket first as backward produces them.
          std::vector<size_t> cuts{0, total};
          for (int k = 0; k < 3 && total > 0; ++k) cuts.push_back(rng() % (total + 1));
          std::sort(cuts.begin(), cuts.end());
          ring::driver_options o;
          o.segment_elems = segment;
          o.small_bytes = o.pair_small_bytes = small;
          o.copy_below = (n % 2) ? 0 : 1024;
          ring_of_drivers ring(n, o, copying);
          int64_t seq = 0;
          for (size_t b = cuts.size() - 1; b > 0; --b, ++seq) {
            // Ranks start in a random order: messages for a rank not there yet wait.
            std::vector<int> order(static_cast<size_t>(n));
            for (int r = 0; r < n; ++r) order[size_t(r)] = r;
            std::shuffle(order.begin(), order.end(), rng);
            for (int r : order) REQUIRE(ring.d[size_t(r)]->start(seq, x[size_t(r)].data(), total, cuts[b - 1], cuts[b]) == "");
            REQUIRE(ring.run(rng) == "");
            for (auto& dr : ring.d) {
              REQUIRE(dr->finished());
              dr->finish();
            }
          }
          for (int r = 0; r < n; ++r) CHECK((total == 0 || std::memcmp(x[size_t(r)].data(), want.data(), total * sizeof(float)) == 0));
        }
}

TEST_CASE("ring driver: the buffer is busy until the right neighbour lets go of it", "[ring_driver]") {
  ring::driver_options o;
  o.copy_below = 0;  // every send reads our buffer in place
  o.small_bytes = o.pair_small_bytes = 0;
  int released = 0;
  queue_link l0, l1;
  ring::driver d0(0, 2, &l0, std::make_unique<ring::host_loop_ops>(), o, [&] { ++released; });
  ring::driver d1(1, 2, &l1, std::make_unique<ring::host_loop_ops>(), o);
  std::vector<float> a(100, 1.f), b(100, 2.f);
  REQUIRE(d0.start(0, a.data(), 100, 0, 100) == "");
  REQUIRE(d1.start(0, b.data(), 100, 0, 100) == "");
  // Round 0 both ways, then round 1 both ways; hold rank 1's last message from rank 0.
  REQUIRE(d1.receive(std::move(l0.q.front())) == "");
  l0.q.pop_front();
  REQUIRE(d0.receive(std::move(l1.q.front())) == "");
  l1.q.pop_front();
  REQUIRE(d0.receive(std::move(l1.q.front())) == "");
  l1.q.pop_front();
  CHECK(d0.rounds_done());
  CHECK_FALSE(d0.finished());  // rank 1 has not read our last chunk yet
  CHECK(d0.waiting_for().find("right neighbour") != std::string::npos);
  CHECK(released == 0);
  REQUIRE(d1.receive(std::move(l0.q.front())) == "");
  l0.q.pop_front();
  CHECK(released == 1);
  CHECK(d0.finished());
  CHECK(a == std::vector<float>(100, 3.f));
  CHECK(b == std::vector<float>(100, 3.f));
}

// A link that lends what it delivers, as the shared-memory link does (its space goes back to the sender
// only when let go): the driver must let go of every lent message of the running all-reduce by the time
// receive() returns, or a long ring's windows would fill the segment and wait behind each other for good.
TEST_CASE("ring driver: what a link lends is let go of, or copied, before receive returns", "[ring_driver]") {
  std::mt19937 rng(11);
  for (int n = 2; n <= 6; ++n)
    for (size_t small : {size_t(0), size_t(1) << 20}) {
      INFO("ranks " << n << " small " << small);
      const size_t total = 3000;
      ring::driver_options o;
      o.segment_elems = 700;
      o.small_bytes = o.pair_small_bytes = small;
      o.copy_below = 0;
      ring_of_drivers ring(n, o, true);
      std::vector<std::vector<float>> x(static_cast<size_t>(n), std::vector<float>(total));
      std::normal_distribution<float> g(0.f, 1.f);
      for (auto& v : x)
        for (auto& f : v) f = g(rng);
      const std::vector<float> want = ring_order_sum(x, total);
      for (int r = 0; r < n; ++r) REQUIRE(ring.d[size_t(r)]->start(0, x[size_t(r)].data(), total, 0, total) == "");
      size_t delivered = 0;
      for (;;) {
        std::vector<int> ready;
        for (int r = 0; r < n; ++r)
          if (!ring.links[size_t(r)]->q.empty()) ready.push_back(r);
        if (ready.empty()) break;
        const int r = ready[rng() % ready.size()];
        ring::message m = std::move(ring.links[size_t(r)]->q.front());
        ring.links[size_t(r)]->q.pop_front();
        m.lent = true;  // the link's copy, lent
        std::weak_ptr<const void> lent = m.owner;
        REQUIRE(ring.d[size_t(ring::right(r, n))]->receive(std::move(m)) == "");
        CHECK(lent.expired());
        ++delivered;
      }
      CHECK(delivered > 0);
      for (int r = 0; r < n; ++r) {
        REQUIRE(ring.d[size_t(r)]->finished());
        CHECK(std::memcmp(x[size_t(r)].data(), want.data(), total * sizeof(float)) == 0);
      }
    }
}

TEST_CASE("ring driver: malformed and misdirected messages are refused with a reason", "[ring_driver]") {
  ring::driver_options o;
  o.job = 9;
  o.small_bytes = o.pair_small_bytes = 0;
  o.max_early = 2;
  queue_link l;
  std::vector<float> buf(64, 1.f), junk(64, 5.f);
  auto fresh = [&] {
    auto d = std::make_unique<ring::driver>(1, 3, &l, std::make_unique<ring::host_loop_ops>(), o);
    REQUIRE(d->start(0, buf.data(), 64, 0, 64) == "");
    return d;
  };
  auto msg = [&](int sender, int64_t seq, int round, int segment, size_t count) {
    return ring::message{9, seq, sender, round, segment, false, junk.data(), count, nullptr, -1};
  };
  // Rank 1 of 3 receives chunk 0 (22 floats of 64) in round 0 from rank 0.
  CHECK(fresh()->receive(msg(0, 0, 0, 0, 22)) == "");
  CHECK(fresh()->receive(msg(2, 0, 0, 0, 22)).find("not the left neighbour") != std::string::npos);
  auto other_job = msg(0, 0, 0, 0, 22);
  other_job.job = 8;
  CHECK(fresh()->receive(other_job).find("job 8") != std::string::npos);
  CHECK(fresh()->receive(msg(0, 0, 0, 0, 21)).find("does not fit") != std::string::npos);
  CHECK(fresh()->receive(msg(0, 0, 1, 0, 22)).find("does not fit") != std::string::npos);
  CHECK(fresh()->receive(msg(0, 0, 0, 7, 22)).find("segments") != std::string::npos);
  auto whole = msg(0, 0, 0, 0, 64);
  whole.whole = true;
  CHECK(fresh()->receive(whole).find("wrong kind") != std::string::npos);
  auto d = fresh();
  for (int k = 1; k <= 2; ++k) CHECK(d->receive(msg(0, 1, 0, 0, 22)) == "");  // the next all-reduce's: held
  CHECK(d->receive(msg(0, 1, 0, 0, 22)).find("more than 2 messages") != std::string::npos);
  CHECK(fresh()->receive(msg(0, 2, 0, 0, 22)).find("more than one ahead") != std::string::npos);
  auto e = fresh();
  CHECK(e->receive(msg(0, 0, 0, 0, 22)) == "");
  CHECK(e->receive(msg(0, 0, 0, 0, 22)).find("does not fit") != std::string::npos);  // a replay
  e->finish();
  CHECK(e->receive(msg(0, 0, 1, 0, 22)).find("has ended") != std::string::npos);
  CHECK(e->start(0, buf.data(), 64, 0, 64).find("after") != std::string::npos);
  CHECK(e->start(1, buf.data(), 64, 10, 65).find("window") != std::string::npos);
}
