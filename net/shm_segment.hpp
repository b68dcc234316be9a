// Internal to net/shm_receiver.cpp, net/shm_sender.cpp and net/shm_link.cpp: the segment's layout (its
// control page and records, as net/shm_link.hpp describes them) and what both sides do with it.
#pragma once
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <string>
#include <thread>

#include "net/ring_driver.hpp"
#include "net/shm_link.hpp"

namespace ringmaster::net::shm_segment {

constexpr uint64_t kShmMagic = 0x4d48535f474e4952ull;  // "RING_SHM"
constexpr uint32_t kShmVersion = 2;
constexpr size_t kControlBytes = 4096;
constexpr size_t kRecordAlign = 64;
constexpr size_t kRecordHead = 8 + wire::kHeaderSize;  // length and header: payloads start 64-aligned
constexpr uint64_t kPadRecord = ~uint64_t(0);
// Set in a record's length: its payload is the offset of the bytes in the sender's lent window.
constexpr uint64_t kRefRecord = uint64_t(1) << 62;
constexpr size_t kRefPayload = sizeof(uint64_t);
// control::offer: the sender's window (shm_sender::lend), and what the receiver made of it.
enum : uint32_t { kNoOffer = 0, kOffered = 1, kTaken = 2, kDeclined = 3 };
constexpr int kWaitMs = 100;  // futex waits wake this often to see a stop
static_assert(kRecordHead == kRecordAlign);
static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free);

// The segment's first page. The receiver writes the stamp, then publishes it with magic (release); a
// sender that sees no magic yet (acquire) found a segment still being made.
struct control {
  std::atomic<uint64_t> magic;
  uint32_t version;
  uint32_t uid;
  uint64_t job;
  int32_t sender_rank;
  int32_t receiver_rank;
  uint64_t capacity;
  int32_t pid;  // the receiver's process, for whoever looks
  alignas(64) std::atomic<uint64_t> head;   // bytes written: the sender's
  std::atomic<uint32_t> head_seq;           // one more per record: the receiver's futex
  std::atomic<uint32_t> rx_waiting;         // the receiver sleeps (or is about to) on head_seq
  alignas(64) std::atomic<uint64_t> tail;   // bytes consumed: the receiver's
  std::atomic<uint32_t> tail_seq;           // one more per record consumed: the sender's futex
  std::atomic<uint32_t> tx_waiting;
  alignas(64) std::atomic<uint32_t> closed;  // the receiver is gone or gave up: senders drop messages
  // The sender writes the window's id, then offer = kOffered (release); the receiver answers kTaken or
  // kDeclined.
  alignas(64) std::atomic<uint32_t> offer;
  int32_t offer_pid, offer_fd;
  uint64_t offer_dev, offer_ino, offer_bytes;
};
static_assert(sizeof(control) <= kControlBytes);
// tests/test_shm_link.cpp writes a broken sender's records at these offsets.
static_assert(offsetof(control, head) == 64 && offsetof(control, head_seq) == 72 && offsetof(control, pid) == 40);
static_assert(offsetof(control, offer) == 256 && offsetof(control, offer_pid) == 260 && offsetof(control, offer_fd) == 264 &&
              offsetof(control, offer_dev) == 272 && offsetof(control, offer_ino) == 280 && offsetof(control, offer_bytes) == 288);

constexpr size_t kSegmentBytes = kControlBytes + kShmCapacity;
// The ring's messages must fit, or a job would fail where the network would carry it.
static_assert(ring::driver_options{}.segment_elems * sizeof(float) <= kShmMaxPayload &&
              ring::driver_options{}.pair_small_bytes <= kShmMaxPayload);

// Shared (not FUTEX_PRIVATE): the word lives in memory two processes map. True when it waited the whole
// kWaitMs (nobody woke it).
inline bool futex_wait(std::atomic<uint32_t>* word, uint32_t seen) {
  timespec ts{kWaitMs / 1000, (kWaitMs % 1000) * 1000000L};
  const long r = syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
  return r != 0 && errno == ETIMEDOUT;
}
inline void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

inline std::string sys_error(const std::string& what) { return what + ": " + std::strerror(errno); }

// For a link end's destructor: true when it runs on the end's own thread `t` (the last owner of what it
// holds, let go there, took the end with it), which cannot join itself. `t` is then detached and
// *self_owned set: the caller releases its state, and the thread frees it once its loop returns.
inline bool detached_from_own_thread(std::thread& t, bool* self_owned) {
  if (!t.joinable() || t.get_id() != std::this_thread::get_id()) return false;
  t.detach();
  *self_owned = true;
  return true;
}

inline size_t record_bytes(size_t payload) { return (kRecordHead + payload + kRecordAlign - 1) / kRecordAlign * kRecordAlign; }

// A mapping of a whole segment.
struct mapping {
  void* base = MAP_FAILED;
  control* ctl = nullptr;
  unsigned char* data = nullptr;

  bool map(int fd, std::string* error) {
    // Populated at once: otherwise every page faults the first time each side touches it, and until
    // the buffer has wrapped once, a 200 KB message cost ~100 faults and took 0.2 ms instead of 0.05.
    base = mmap(nullptr, kSegmentBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (base == MAP_FAILED) return *error = sys_error("mmap"), false;
    ctl = static_cast<control*>(base);
    data = static_cast<unsigned char*>(base) + kControlBytes;
    return true;
  }
  ~mapping() {
    if (base != MAP_FAILED) munmap(base, kSegmentBytes);
  }
};

struct fd_guard {
  int fd = -1;
  ~fd_guard() {
    if (fd >= 0) close(fd);
  }
};

}  // namespace ringmaster::net::shm_segment
