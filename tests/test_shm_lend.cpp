// The shared-memory link lending in place (net/shm_window.hpp): a payload in a lent window goes by
// reference, its owner is held until it is read and let go after, whoever polls; a reference outside what
// was lent breaks the link; owners let go as messages queue may send on the link again without a deadlock.
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

namespace {


// Waits for what a sender's thread or the receiver's does.
bool eventually(const std::function<bool()>& f, std::chrono::milliseconds t = 5s) {
  const auto until = std::chrono::steady_clock::now() + t;
  while (!f()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

// A receiver that keeps what it is handed until the test lets go.
struct keeper {
  std::mutex mu;
  std::vector<net::payload> held;
  std::vector<std::string> errors;
  void start(net::shm_receiver& r) {
    r.start(
        [this](const wire::header&, net::payload p) {
          std::lock_guard<std::mutex> lock(mu);
          held.push_back(std::move(p));
        },
        [this](const std::string& why) {
          std::lock_guard<std::mutex> lock(mu);
          errors.push_back(why);
        });
  }
  size_t count() {
    std::lock_guard<std::mutex> lock(mu);
    return held.size();
  }
  std::string error() {
    std::lock_guard<std::mutex> lock(mu);
    return errors.empty() ? "" : errors[0];
  }
  void let_go(size_t i) {
    std::lock_guard<std::mutex> lock(mu);
    REQUIRE(i < held.size());  // a payload not taken yet cannot be let go
    held[i] = net::payload{};
  }
};

}  // namespace

TEST_CASE("shm link: a sender destroyed by an owner its own thread lets go of ends cleanly", "[shm]") {
  // A ring's last reference to its link can go with the last owner of a sent buffer, which the sender's
  // thread lets go of: the sender is then destroyed on its own thread, which cannot join itself (this
  // ended the process with "Resource deadlock avoided").
  keeper k;
  pair_link l;
  std::string error;
  auto w = net::shm_window::create(4096 * sizeof(float), &error);
  REQUIRE(w);
  k.start(*l.rx);
  l.tx->lend(w);
  REQUIRE(eventually([&] { return l.tx->lending() == net::shm_sender::window_state::taken; }));
  auto gone = std::make_shared<std::atomic<bool>>(false);
  auto on_thread = std::make_shared<std::atomic<bool>>(false);
  const std::thread::id test_thread = std::this_thread::get_id();
  std::shared_ptr<const void> owner(w->floats(), [&l, gone, on_thread, test_thread](const void*) {
    *on_thread = std::this_thread::get_id() != test_thread;
    l.tx.reset();
    *gone = true;
  });
  REQUIRE(l.tx->send(chunk_header(l.stamp, 0, 100), net::payload{w->floats(), 100 * sizeof(float), std::move(owner)}, &error, true));
  REQUIRE(eventually([&] { return k.count() == 1; }));
  l.tx->await_release();  // no reaper: the sender's thread lets the owner go once the receiver has read
  k.let_go(0);
  CHECK(eventually([&] { return gone->load(); }, 2s));
  CHECK(on_thread->load());
  CHECK(k.error().empty());
}

TEST_CASE("shm link: messages in place in a lent window go by reference, and their owners are held until read", "[shm]") {
  keeper k;  // before the link: its thread hands payloads to it
  pair_link l;
  const net::shm_stamp& s = l.stamp;
  std::string error;
  const size_t n = 1000;
  auto w = net::shm_window::create(64 * 1024 * sizeof(float), &error);
  REQUIRE(w);
  float* g = w->floats();
  for (size_t i = 0; i < 64 * 1024; ++i) g[i] = float(i);
  k.start(*l.rx);
  CHECK(l.tx->lending() == net::shm_sender::window_state::none);
  l.tx->lend(w);
  REQUIRE(eventually([&] { return l.tx->lending() == net::shm_sender::window_state::taken; }));

  auto released = std::make_shared<std::atomic<int>>(0);
  const auto owner = [&] { return std::shared_ptr<const void>(g, [released](const void*) { ++*released; }); };
  // In place and inside the window: a reference. The receiver reads our memory itself, so what we write
  // there shows (no copy), and we hold the owner until it lets go.
  REQUIRE(l.tx->send(chunk_header(s, 0, n), net::payload{g + 1024, n * sizeof(float), owner()}, &error, true));
  REQUIRE(eventually([&] { return k.count() == 1; }));
  CHECK(k.held[0].lent);
  CHECK(k.held[0].floats()[0] == 1024.0f);
  CHECK(k.held[0].floats()[n - 1] == float(1024 + n - 1));
  g[1024] = -1.0f;
  CHECK(k.held[0].floats()[0] == -1.0f);
  CHECK(l.tx->held() == 1);
  l.tx->reap();
  CHECK(*released == 0);  // still read
  k.let_go(0);
  l.tx->reap();
  CHECK(*released == 1);
  CHECK(l.tx->held() == 0);

  // Not in place, or not inside the window: copied as before (a later change does not show).
  REQUIRE(l.tx->send(chunk_header(s, 1, n), net::payload{g, n * sizeof(float), owner()}, &error, false));
  auto outside = floats_of(n, 5.0f);
  REQUIRE(l.tx->send(chunk_header(s, 2, n), outside, &error, true));
  REQUIRE(eventually([&] { return k.count() == 3; }));
  g[0] = -2.0f;
  CHECK(k.held[1].floats()[0] == 0.0f);
  CHECK(k.held[2].floats()[0] == 5.0f);
  CHECK(*released == 2);  // the copy's owner went at once
  CHECK(l.tx->held() == 0);
  k.let_go(1);
  k.let_go(2);

  // With no one reaping, the sender's thread lets the owner go once the receiver has read, when asked.
  REQUIRE(l.tx->send(chunk_header(s, 3, n), net::payload{g + 4096, n * sizeof(float), owner()}, &error, true));
  REQUIRE(eventually([&] { return k.count() == 4; }));
  l.tx->await_release();
  std::this_thread::sleep_for(50ms);
  CHECK(*released == 2);
  k.let_go(3);
  CHECK(eventually([&] { return *released == 3; }, 2s));
  // And while a reaper lives, the thread leaves it to the reaper.
  {
    net::shm_sender::reaper r(*l.tx);
    REQUIRE(l.tx->send(chunk_header(s, 4, n), net::payload{g + 8192, n * sizeof(float), owner()}, &error, true));
    REQUIRE(eventually([&] { return k.count() == 5; }));
    l.tx->await_release();
    k.let_go(4);
    std::this_thread::sleep_for(150ms);
    CHECK(*released == 3);
  }
  CHECK(*released == 4);  // the reaper's end let it go
  CHECK(k.error().empty());
  // A sender gone lets go of what it holds.
  REQUIRE(l.tx->send(chunk_header(s, 5, n), net::payload{g, n * sizeof(float), owner()}, &error, true));
  REQUIRE(eventually([&] { return k.count() == 6; }));
  l.tx.reset();
  CHECK(*released == 5);
  l.rx.reset();
}

TEST_CASE("shm link: a reference outside what the sender lent, or to memory it never lent, breaks the link", "[shm]") {
  const size_t n = 16;
  // A reference record to n floats at `at` of the sender's window, written as a hostile sender would:
  // its length has bit 62 set, its payload is the offset (net/shm_segment.hpp).
  const auto forge_reference = [&](pair_link& l, uint64_t at) {
    wire::header h = chunk_header(l.stamp, 0, n);
    h.payload_bytes = n * sizeof(float);
    l.raw->record(0, 128 | uint64_t(1) << 62, h);
    std::memcpy(l.raw->at(4096 + 64), &at, sizeof at);
    l.raw->set_head(128);
  };
  {
    INFO("no window offered");
    inbox box;
    pair_link l(true);
    box.start(*l.rx);
    forge_reference(l, 0);
    CHECK_THAT(box.wait_error(), Catch::Contains("a reference to memory it did not lend"));
    CHECK(box.got.empty());
  }
  // 64 bytes from 4064 end past the window; 2 is not a float's place; 2^63 is far out (no wrap-around).
  for (const uint64_t at : {uint64_t(4096 - 32), uint64_t(2), uint64_t(1) << 63}) {
    INFO("a reference at " << at);
    inbox box;
    pair_link l(true);
    box.start(*l.rx);
    std::string error;
    auto w = net::shm_window::create(4096, &error);
    REQUIRE(w);
    l.tx->lend(w);
    REQUIRE(eventually([&] { return l.tx->lending() == net::shm_sender::window_state::taken; }));
    forge_reference(l, at);
    CHECK_THAT(box.wait_error(), Catch::Contains("a reference to 64 bytes at " + std::to_string(at) + " of a window of 4096"));
    CHECK(box.got.empty());
  }
}

TEST_CASE("shm link: a window that is not the one described, or not sealed, is declined, and the sender copies", "[shm]") {
  std::string error;
  auto w = net::shm_window::create(8192, &error);
  REQUIRE(w);
  net::shm_window_id id = w->id();
  int unsealed = -1;
  SECTION("another inode") { id.ino += 1; }
  SECTION("another size") { id.bytes = 4096; }
  SECTION("another process's fd number") { id.pid = int32_t(getppid()); }
  SECTION("a file that could be cut short under the mapping") {
    unsealed = memfd_create("unsealed", MFD_CLOEXEC);
    REQUIRE(unsealed >= 0);
    REQUIRE(posix_fallocate(unsealed, 0, 8192) == 0);
    struct stat st {};
    REQUIRE(fstat(unsealed, &st) == 0);
    id = {int32_t(getpid()), unsealed, uint64_t(st.st_dev), uint64_t(st.st_ino), 8192};
  }
  SECTION("sealed, but without its pages (mapping it could make us allocate them)") {
    unsealed = memfd_create("sparse", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    REQUIRE(unsealed >= 0);
    REQUIRE(ftruncate(unsealed, 8192) == 0);
    REQUIRE(fcntl(unsealed, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) == 0);
    struct stat st {};
    REQUIRE(fstat(unsealed, &st) == 0);
    id = {int32_t(getpid()), unsealed, uint64_t(st.st_dev), uint64_t(st.st_ino), 8192};
  }
  inbox box;
  pair_link l(true);
  raw_segment& raw = *l.raw;
  box.start(*l.rx);
  // The offer as a sender writes it (control block: offer at 256, then pid, fd, dev, inode, size).
  std::memcpy(raw.at(260), &id.pid, 4);
  std::memcpy(raw.at(264), &id.fd, 4);
  std::memcpy(raw.at(272), &id.dev, 8);
  std::memcpy(raw.at(280), &id.ino, 8);
  std::memcpy(raw.at(288), &id.bytes, 8);
  reinterpret_cast<std::atomic<uint32_t>*>(raw.at(256))->store(1);
  reinterpret_cast<std::atomic<uint32_t>*>(raw.at(72))->fetch_add(1);
  REQUIRE(eventually([&] { return l.tx->lending() == net::shm_sender::window_state::declined; }));
  // Our sender has offered nothing of its own (the one offer went), so it copies, in place or not.
  l.tx->lend(w);
  CHECK(l.tx->lending() == net::shm_sender::window_state::declined);
  w->floats()[0] = 7.0f;
  REQUIRE(l.tx->send(chunk_header(l.stamp, 0, 4), net::payload{w->floats(), 4 * sizeof(float), nullptr}, &error, true));
  REQUIRE(box.wait_messages(1));
  w->floats()[0] = 8.0f;
  CHECK(box.got[0].second[0] == 7.0f);
  CHECK(l.tx->held() == 0);
  CHECK(box.errors.empty());
  if (unsealed >= 0) close(unsealed);
}

namespace {

// A window lent on a pair, taken by its receiver, whose payloads `k` keeps.
struct lent_pair {
  keeper k;  // before the link: its thread hands payloads to it
  pair_link l;
  std::shared_ptr<net::shm_window> w;
  std::shared_ptr<std::atomic<int>> released = std::make_shared<std::atomic<int>>(0);
  lent_pair() {
    std::string error;
    w = net::shm_window::create(1 << 20, &error);
    REQUIRE(w);
    k.start(*l.rx);
    l.tx->lend(w);
    REQUIRE(eventually([&] { return l.tx->lending() == net::shm_sender::window_state::taken; }));
  }
  // An owner that counts its release, as the ring driver's does.
  std::shared_ptr<const void> owner() {
    return std::shared_ptr<const void>(w->floats(), [r = released](const void*) { ++*r; });
  }
  // An owner whose release sends on the link again (sent_again), as the ring driver's may: its last
  // release runs the reducer's next work, which sends here. `keep` keeps `at` alive.
  std::shared_ptr<std::atomic<bool>> sent_again = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<const void> resending_owner(const void* at, std::shared_ptr<const void> keep = {}) {
    return std::shared_ptr<const void>(at, [tx = l.tx.get(), s = l.stamp, flag = sent_again, keep](const void*) {
      std::string e;
      tx->send(chunk_header(s, 5, 4), floats_of(4, 0), &e, false);
      *flag = true;
    });
  }
  // Four copies of 2 MiB: the fourth does not fit beside the other three and waits in the sender's queue.
  void fill_segment() {
    std::string error;
    const size_t big = net::kShmMaxPayload / sizeof(float);
    for (int i = 0; i < 4; ++i) REQUIRE(l.tx->send(chunk_header(l.stamp, i, big), floats_of(big, 0), &error, false));
  }
};

}  // namespace

TEST_CASE("shm link: a reference still queued when the release is asked for is let go once read, whoever polled meanwhile", "[shm]") {
  lent_pair p;
  std::string error;
  p.fill_segment();
  REQUIRE(p.l.tx->send(chunk_header(p.l.stamp, 4, 1000), net::payload{p.w->floats(), 4000, p.owner()}, &error, true));
  REQUIRE(eventually([&] { return p.k.count() == 3; }));
  // The rounds are over while the reference waits behind the copies: the ask must not be lost.
  p.l.tx->await_release();
  {
    net::shm_sender::reaper r(*p.l.tx);  // a replica polls for a while, and stops while the neighbour still reads
    for (size_t i = 0; i < 3; ++i) p.k.let_go(i);
    REQUIRE(eventually([&] { return p.k.count() == 5; }));
    CHECK(p.l.tx->held() == 1);
  }
  p.k.let_go(3);
  p.k.let_go(4);
  CHECK(eventually([&] { return *p.released == 1; }, 2s));
  CHECK(p.l.tx->held() == 0);
  CHECK(p.l.tx->references() == 1);
}

TEST_CASE("shm link: owners let go when the receiver is gone may send on the link again without a deadlock", "[shm]") {
  lent_pair p;
  std::string error;
  p.fill_segment();
  net::shm_sender* tx = p.l.tx.get();
  std::shared_ptr<const void> owner = p.resending_owner(p.w->floats());
  REQUIRE(tx->send(chunk_header(p.l.stamp, 4, 1000), net::payload{p.w->floats(), 4000, std::move(owner)}, &error, true));
  REQUIRE(eventually([&] { return p.k.count() == 3; }));
  p.l.rx.reset();  // gone: the sender's thread drops its queue, the queued reference's owner with it
  if (!eventually([&] { return p.sent_again->load(); }, 3s)) {
    (void)p.l.tx.release();  // its thread is stuck on its own lock: joining it would hang the run
    FAIL("the sender's thread deadlocked letting go of an owner");
  }
}

TEST_CASE("shm link: a copied message's owner, let go as the message queues, may send on the link again", "[shm]") {
  lent_pair p;
  std::string error;
  p.fill_segment();
  net::shm_sender* tx = p.l.tx.get();
  auto keep = floats_of(1000, 0);
  std::shared_ptr<const void> owner = p.resending_owner(keep.data, keep.owner);
  // The segment is full: the message is copied into the queue and its owner let go at once.
  std::thread sender([&] { tx->send(chunk_header(p.l.stamp, 4, 1000), net::payload{keep.data, 4000, std::move(owner)}, &error, false); });
  if (!eventually([&] { return p.sent_again->load(); }, 3s)) {
    sender.detach();
    (void)p.l.tx.release();
    FAIL("send() let go of an owner under its own lock");
  }
  sender.join();
  // The first three copies must be in before they are let go (under load the receiver's thread may not
  // have taken them yet: let_go wrote past the end of the keeper's list, and the heap broke).
  REQUIRE(eventually([&] { return p.k.count() >= 3; }));
  for (size_t i = 0; i < 3; ++i) p.k.let_go(i);
  CHECK(eventually([&] { return p.k.count() == 6; }));  // the last copy, this message and the owner's
}
