// The shared-memory link (net/shm_link.hpp): messages go through whole and in order, a full buffer never
// blocks a sender, a segment that is not ours alone or not for this ring is refused, and whatever the
// other side writes into the segment, the receiver drops the link with a clear error instead of reading
// astray.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "net/shm_link.hpp"
#include "net/shm_window.hpp"
#include "tests/shm_util.hpp"

using namespace ringmaster;
using namespace ringmaster::shm_test;
using namespace std::chrono_literals;

TEST_CASE("shm link: messages of every size arrive whole and in order, many times round the buffer", "[shm]") {
  const net::shm_stamp s = fresh_stamp();
  std::string error;
  auto rx = net::shm_receiver::create(s, &error);
  REQUIRE(rx);
  inbox in;
  in.start(*rx);
  bool missing = true;
  auto tx = net::shm_sender::open(s, &error, &missing);
  INFO(error);
  REQUIRE(tx);
  CHECK_FALSE(missing);
  // The sender removed the name: no one else can open the segment now.
  CHECK_FALSE(net::shm_sender::open(s, &error, &missing));
  CHECK(missing);

  // Sizes from empty to the largest a message may carry, 100 MiB in all: the buffer (16 MiB) wraps often.
  std::vector<size_t> sizes = {0, 1, 15, 16, 17, 1000, 4096, 100000, net::kShmMaxPayload / 4};
  std::mt19937 gen(7);
  while (sizes.size() < 120) sizes.push_back(std::uniform_int_distribution<size_t>(0, net::kShmMaxPayload / 4)(gen));
  for (size_t i = 0; i < sizes.size(); ++i)
    REQUIRE(tx->send(chunk_header(s, int64_t(i), sizes[i]), floats_of(sizes[i], float(i)), &error));
  REQUIRE(in.wait_messages(sizes.size()));
  CHECK(in.errors.empty());
  for (size_t i = 0; i < sizes.size(); ++i) {
    const auto& [h, v] = in.got[i];
    CHECK(h.step == int64_t(i));
    CHECK(h.sender_rank == s.sender_rank);
    REQUIRE(v.size() == sizes[i]);
    // Every float: records of other sizes went through the same space before.
    size_t wrong = 0;
    for (size_t k = 0; k < v.size(); ++k) wrong += v[k] != float(i) + float(k);
    CHECK(wrong == 0);
  }
}

TEST_CASE("shm link: a sender never waits for a slow receiver, and its queue drains in order", "[shm]") {
  pair_link l;
  const net::shm_stamp& s = l.stamp;
  auto& rx = l.rx;
  auto& tx = l.tx;
  std::string error;
  // 24 of the largest messages before anyone reads: six times the buffer.
  const size_t n = net::kShmMaxPayload / sizeof(float);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 24; ++i) REQUIRE(tx->send(chunk_header(s, i, n), floats_of(n, float(i)), &error));
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);  // copies, never a wait for the receiver
  inbox in;
  in.start(*rx);
  REQUIRE(in.wait_messages(24, 30s));
  for (int i = 0; i < 24; ++i) {
    CHECK(in.got[size_t(i)].first.step == i);
    CHECK(in.got[size_t(i)].second[n - 1] == float(i) + float(n - 1));
  }
  // Too large for the link: refused at once, nothing sent.
  CHECK_FALSE(tx->send(chunk_header(s, 99, n + 1), floats_of(n + 1, 0), &error));
  CHECK(error.find("over the shared-memory link's limit") != std::string::npos);
}

TEST_CASE("shm link: a waiting thread polls messages in itself, and the receiving thread takes over after", "[shm]") {
  pair_link l;
  std::mutex mu;
  std::vector<std::pair<int64_t, std::thread::id>> got;  // step, and the thread that handed it on
  l.rx->start(
      [&](const wire::header& h, net::payload p) {
        std::lock_guard<std::mutex> lock(mu);
        if (h.elements == 3 && p.floats()[2] == float(h.step) + 2) got.emplace_back(h.step, std::this_thread::get_id());
      },
      [](const std::string&) {});
  const auto count = [&] {
    std::lock_guard<std::mutex> lock(mu);
    return got.size();
  };
  std::string error;
  // Nothing comes: a poll gives up at its deadline. The thread looks for records as it starts or wakes,
  // holding the link a moment: a poll then returns at once. So a few tries, one of which must wait.
  auto t0 = std::chrono::steady_clock::now();
  bool waited = false;
  for (int k = 0; k < 20 && !waited; ++k) {
    t0 = std::chrono::steady_clock::now();
    CHECK_FALSE(l.rx->poll(t0 + 20ms, [&] { return count() > 0; }));
    waited = std::chrono::steady_clock::now() - t0 >= 20ms;
  }
  CHECK(waited);
  // Done already: true at once.
  CHECK(l.rx->poll(std::chrono::steady_clock::now() + 1s, [] { return true; }));
  // Done by another thread while nothing comes (sends let go, a strand that ran elsewhere): the poll
  // sees it then, not at its deadline. (A try that meets the thread's brief look returns false at once.)
  bool ended_early = false;
  for (int k = 0; k < 5 && !ended_early; ++k) {
    std::atomic<bool> flag{false};
    std::thread other([&] {
      std::this_thread::sleep_for(2ms);
      flag = true;
    });
    t0 = std::chrono::steady_clock::now();
    ended_early = l.rx->poll(t0 + 300ms, [&] { return flag.load(); }) && std::chrono::steady_clock::now() - t0 < 250ms;
    other.join();
  }
  CHECK(ended_early);
  // Rounds of one message taken by a poller and one left to the thread. A wake-up the thread misses costs
  // it 100 ms (its futex's timeout): 40 of them would take 4 s.
  t0 = std::chrono::steady_clock::now();
  int polled = 0;
  for (int64_t i = 0; i < 80; i += 2) {
    std::thread later([&, i] {
      std::this_thread::sleep_for(1ms);
      REQUIRE(l.tx->send(chunk_header(l.stamp, i, 3), floats_of(3, float(i)), &error));
    });
    polled += l.rx->poll(std::chrono::steady_clock::now() + 5s, [&] { return count() > size_t(i); });
    later.join();
    REQUIRE(l.tx->send(chunk_header(l.stamp, i + 1, 3), floats_of(3, float(i + 1)), &error));
    for (auto until = std::chrono::steady_clock::now() + 5s; count() < size_t(i) + 2 && std::chrono::steady_clock::now() < until;)
      std::this_thread::sleep_for(50us);
    REQUIRE(count() == size_t(i) + 2);
  }
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);
  CHECK(polled >= 30);  // the thread may be handing one on when a poll starts: then it takes that one
  size_t mine = 0;
  for (size_t k = 0; k < got.size(); ++k) {
    CHECK(got[k].first == int64_t(k));
    mine += got[k].second == std::this_thread::get_id();
  }
  CHECK(mine >= 30);
  CHECK(mine <= 40);  // the odd ones came while nobody polled: the thread's
}

TEST_CASE("shm link: a record that comes as a poll ends is never left for the futex's timeout", "[shm]") {
  // A poller takes message 2i; 2i+1 follows at once and is the thread's, which the sender may have woken
  // for 2i just as the poll ends. Reading the futex word after what it guards, the thread slept through
  // the poller's wake-up: 1-11 of 600,000 rounds then waited the full 100 ms. The receiver counts such
  // sleeps itself; a round's time alone also grows when this shared machine stalls a thread.
  pair_link l;
  std::atomic<int64_t> n{0};
  l.rx->start([&](const wire::header&, net::payload) { n.fetch_add(1); }, [](const std::string&) {});
  std::mt19937 gen(11);
  std::string error;
  double worst_ms = 0;
  for (int64_t i = 0; i < 300000; ++i) {
    REQUIRE(l.tx->send(chunk_header(l.stamp, 2 * i, 0), {}, &error));
    for (int k = int(gen() % 200); k > 0; --k) std::atomic_signal_fence(std::memory_order_seq_cst);
    REQUIRE(l.tx->send(chunk_header(l.stamp, 2 * i + 1, 0), {}, &error));
    l.rx->poll(std::chrono::steady_clock::now() + 300us, [&] { return n.load() >= 2 * i + 1; });
    const auto t0 = std::chrono::steady_clock::now();
    while (n.load() < 2 * i + 2 && std::chrono::steady_clock::now() - t0 < 5s) std::this_thread::yield();
    worst_ms = std::max(worst_ms, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  CHECK(n.load() == 600000);
  CHECK(l.rx->missed_wakeups() == 0);
  CHECK(worst_ms < 1000);  // nothing waits for long
}

TEST_CASE("shm link: when the receiver is gone, sends are dropped and nothing hangs", "[shm]") {
  pair_link l;
  const net::shm_stamp& s = l.stamp;
  auto& rx = l.rx;
  auto& tx = l.tx;
  std::string error;
  const size_t n = net::kShmMaxPayload / sizeof(float);
  for (int i = 0; i < 8; ++i) REQUIRE(tx->send(chunk_header(s, i, n), floats_of(n, 0), &error));  // most wait in the queue
  const auto t0 = std::chrono::steady_clock::now();
  rx.reset();
  CHECK(tx->send(chunk_header(s, 9, 10), floats_of(10, 0), &error));  // dropped, as to a vanished peer
  tx.reset();
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);
}

TEST_CASE("shm link: a payload is lent in place, and its space goes back only once it and those before it are let go", "[shm]") {
  // Before the link: its receiving thread uses these until the link is gone.
  std::mutex mu;
  std::condition_variable cv;
  std::vector<net::payload> held;  // what the receiver handed on, not let go yet
  std::vector<std::string> errors;
  pair_link l;
  const net::shm_stamp& s = l.stamp;
  l.rx->start(
      [&](const wire::header&, net::payload p) {
        std::lock_guard<std::mutex> lock(mu);
        held.push_back(std::move(p));
        cv.notify_all();
      },
      [&](const std::string& why) {
        std::lock_guard<std::mutex> lock(mu);
        errors.push_back(why);
        cv.notify_all();
      });
  const auto arrived = [&](size_t n, std::chrono::milliseconds t) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, t, [&] { return held.size() >= n; });
  };
  const auto intact = [](const net::payload& p, float first) {
    size_t wrong = 0;
    for (size_t k = 0; k < p.size / sizeof(float); ++k) wrong += p.floats()[k] != first + float(k);
    return wrong == 0;
  };
  // Three of the largest messages take 6 of the 8 MiB; the fourth and fifth wait in the sender's queue.
  const size_t n = net::kShmMaxPayload / sizeof(float);
  std::string error;
  for (int i = 0; i < 5; ++i) REQUIRE(l.tx->send(chunk_header(s, i, n), floats_of(n, float(i) * 10), &error));
  REQUIRE(arrived(3, 10s));
  {
    std::lock_guard<std::mutex> lock(mu);
    REQUIRE(held.size() == 3);
    CHECK(held[0].lent);
    CHECK(held[0].owner);
  }
  // Letting go of the second frees nothing while the first is still read: the sender goes on waiting.
  {
    std::lock_guard<std::mutex> lock(mu);
    held[1] = net::payload{};
  }
  CHECK_FALSE(arrived(4, 300ms));
  CHECK(intact(held[0], 0));
  CHECK(intact(held[2], 20));
  // The first let go: the space of both goes back, and the queue drains.
  {
    std::lock_guard<std::mutex> lock(mu);
    held[0] = net::payload{};
  }
  REQUIRE(arrived(5, 10s));
  CHECK(intact(held[2], 20));  // still lent, never written over
  CHECK(intact(held[3], 30));
  CHECK(intact(held[4], 40));
  CHECK(errors.empty());
  // A payload outlives its receiver: the mapping goes with the last one.
  l.tx.reset();
  l.rx.reset();
  CHECK(intact(held[4], 40));
  held.clear();
}

TEST_CASE("shm link: a sender that writes over space still lent out is refused", "[shm]") {
  std::mutex mu;  // before the link: its receiving thread uses these until the link is gone
  std::condition_variable cv;
  net::payload kept;
  std::string why;
  const net::shm_stamp s = fresh_stamp();
  std::string error;
  bool missing = false;
  auto rx = net::shm_receiver::create(s, &error);
  REQUIRE(rx);
  raw_segment raw(s);  // before the sender opens it and removes the name
  auto tx = net::shm_sender::open(s, &error, &missing);
  REQUIRE(tx);
  rx->start(
      [&](const wire::header&, net::payload p) {
        std::lock_guard<std::mutex> lock(mu);
        kept = std::move(p);
        cv.notify_all();
      },
      [&](const std::string& w) {
        std::lock_guard<std::mutex> lock(mu);
        why = w;
        cv.notify_all();
      });
  REQUIRE(tx->send(chunk_header(s, 0, 1000), floats_of(1000, 0), &error));
  {
    std::unique_lock<std::mutex> lock(mu);
    REQUIRE(cv.wait_for(lock, 10s, [&] { return kept.owner != nullptr; }));
  }
  // The first record (4064 bytes) is still lent: a head a whole buffer past it writes over it.
  raw.set_head(net::kShmCapacity + 64);
  std::unique_lock<std::mutex> lock(mu);
  REQUIRE(cv.wait_for(lock, 5s, [&] { return !why.empty(); }));
  CHECK(why.find("wrote over space still lent out") != std::string::npos);
  lock.unlock();
  rx.reset();
}

TEST_CASE("shm link: a segment that is not ours alone or not for this ring is refused", "[shm]") {
  std::string error;
  bool missing = false;
  // None at all: the usual case when the receiver runs on another host.
  CHECK_FALSE(net::shm_sender::open(fresh_stamp(), &error, &missing));
  CHECK(missing);

  // The right name, made by someone else's rules: readable by others.
  const net::shm_stamp s = fresh_stamp();
  const std::string name = net::shm_name(s);
  int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0644);
  REQUIRE(fd >= 0);
  fchmod(fd, 0644);
  REQUIRE(ftruncate(fd, off_t(4096 + net::kShmCapacity)) == 0);
  close(fd);
  CHECK_FALSE(net::shm_sender::open(s, &error, &missing));
  CHECK_FALSE(missing);
  CHECK(error.find("not a segment of ours alone") != std::string::npos);
  // A receiver cannot take a name that is there already.
  CHECK_FALSE(net::shm_receiver::create(s, &error));
  CHECK(error.find("File exists") != std::string::npos);
  shm_unlink(name.c_str());

  // A real segment, but for another sender rank.
  auto rx = net::shm_receiver::create(s, &error);
  REQUIRE(rx);
  net::shm_stamp other = s;
  other.sender_rank = 5;
  CHECK_FALSE(net::shm_sender::open(other, &error, &missing));
  CHECK(error.find("not the segment for this ring") != std::string::npos);
  // The name is gone with the receiver.
  rx.reset();
  CHECK_FALSE(net::shm_sender::open(s, &error, &missing));
  CHECK(missing);
}

TEST_CASE("shm link: whatever a broken sender writes, the receiver says so and reads nothing astray", "[shm]") {
  struct broken_case {
    const char* what;
    std::function<void(raw_segment&, const net::shm_stamp&)> write;
    const char* expect;
  };
  const std::vector<broken_case> cases = {
      {"head past the buffer", [](raw_segment& r, const net::shm_stamp&) { r.set_head(net::kShmCapacity + 64); },
       "outside the buffer"},
      {"a record length not a multiple of 64",
       [](raw_segment& r, const net::shm_stamp& s) {
         r.record(0, 100, chunk_header(s, 0, 0));
         r.set_head(128);
       },
       "does not fit"},
      {"a record longer than what was written",
       [](raw_segment& r, const net::shm_stamp& s) {
         r.record(0, 1 << 20, chunk_header(s, 0, 0));
         r.set_head(64);
       },
       "does not fit"},
      {"a bad header",
       [](raw_segment& r, const net::shm_stamp& s) {
         wire::header h = chunk_header(s, 0, 0);
         h.step = -1;
         r.record(0, 64, h);
         r.set_head(64);
       },
       "bad header"},
      {"a payload larger than its record",
       [](raw_segment& r, const net::shm_stamp& s) {
         wire::header h = chunk_header(s, 0, 1000);
         h.payload_bytes = 4000;
         r.record(0, 128, h);
         r.set_head(128);
       },
       "in a record of 128"},
      {"padding at the start", [](raw_segment& r, const net::shm_stamp&) {
         const uint64_t pad = ~uint64_t(0);
         std::memcpy(r.at(4096), &pad, 8);
         r.set_head(64);
       },
       "padding record at the start"},
  };
  for (const broken_case& c : cases) {
    SECTION(c.what) {
      const net::shm_stamp s = fresh_stamp();
      std::string error;
      auto rx = net::shm_receiver::create(s, &error);
      REQUIRE(rx);
      inbox in;
      in.start(*rx);
      raw_segment raw(s);
      c.write(raw, s);
      const std::string why = in.wait_error();
      INFO(why);
      CHECK(why.find(c.expect) != std::string::npos);
      CHECK(in.got.empty());
      // A sender that comes now finds the segment in use or closed, never a half-read one.
      bool missing = false;
      CHECK_FALSE(net::shm_sender::open(s, &error, &missing));
    }
  }
}

TEST_CASE("shm link: segments whose receiver is gone are swept, live ones and strangers' files stay", "[shm]") {
  std::string error;
  const net::shm_stamp live = fresh_stamp(), dead = fresh_stamp(), fifo = fresh_stamp();
  auto keep = net::shm_receiver::create(live, &error);
  REQUIRE(keep);
  // What a receiver killed with SIGKILL leaves: a stamped segment that nobody holds a lock on.
  {
    const int fd = shm_open(net::shm_name(dead).c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    REQUIRE(fd >= 0);
    REQUIRE(ftruncate(fd, off_t(4096 + net::kShmCapacity)) == 0);
    const uint64_t magic = 0x4d48535f474e4952ull;  // "RING_SHM" (net/shm_segment.hpp)
    REQUIRE(pwrite(fd, &magic, sizeof magic, 0) == ssize_t(sizeof magic));
    close(fd);
  }
  // A FIFO under one of our names (anyone may make one in /dev/shm): no hang, left alone.
  const std::string fifo_path = "/dev/shm" + net::shm_name(fifo);
  REQUIRE(mkfifo(fifo_path.c_str(), 0600) == 0);
  CHECK(net::sweep_segments() >= 1);
  bool missing = false;
  CHECK_FALSE(net::shm_sender::open(dead, &error, &missing));
  CHECK(missing);
  CHECK_FALSE(net::shm_sender::open(fifo, &error, &missing));  // not a plain file: refused, not hung
  CHECK(error.find("not a segment of ours alone") != std::string::npos);
  unlink(fifo_path.c_str());
  auto tx = net::shm_sender::open(live, &error, &missing);
  CHECK(tx);
  // Ours: this boot of this machine, its /dev/shm and our user.
  const std::string host = net::host_id();
  CHECK(host.size() > 36);
  CHECK(host.substr(host.rfind('/') + 1) == std::to_string(geteuid()));
}

TEST_CASE("shm link: a segment's name shows other local users neither the job's id nor the rank", "[shm]") {
  const net::shm_stamp s{0x0123456789abcdefull, 3, 4};
  const std::string name = net::shm_name(s);
  const std::string prefix = "/ringmaster." + std::to_string(geteuid()) + ".";
  REQUIRE(name.rfind(prefix, 0) == 0);
  const std::string rest = name.substr(prefix.size());
  CHECK(rest.size() == 24);
  CHECK(rest.find_first_not_of("0123456789abcdef") == std::string::npos);
  CHECK(name.find("0123456789abcdef") == std::string::npos);
  CHECK(net::shm_name(s) == name);                                      // both ends find it
  CHECK(net::shm_name({s.job, 3, 5}) != name);                          // each receiver its own
  CHECK(net::shm_name({s.job + 1, 3, 4}) != name);                      // each ring its own
  CHECK(net::shm_name({s.job, 7, 4}) == name);                          // the sender is the stamp's, not the name's
}
