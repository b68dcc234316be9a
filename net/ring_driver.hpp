// The one ring all-reduce driver: net/ring.hpp's schedule run over a link to the right neighbour.
// Training (reducer actors), the topology API's rings and allreduce_bench all run this code; only the
// link differs (a CAF message to a reducer in this process, or a ZeroMQ frame to another process).
//
// What lives here, and nowhere else:
//  - The summation order. Element i of a `total`-float layout is summed along the ring starting at the
//    rank whose ring chunk holds i: ((x_c + x_c+1) + x_c+2) + ... for chunk c of chunk(total, size, c).
//    An all-reduce may cover only a window [lo, hi) of the layout (a gradient bucket), may be cut into
//    segments, or may take the small-buffer path: the order of every element stays the same, so the
//    result is bit-identical whatever the buckets, segments or path.
//  - Segmenting: every chunk is cut into segments of at most `segment_elems` floats, and each segment
//    index runs its own round machine, so the neighbour can add segment k while segment k+1 travels.
//  - The small-buffer path: windows up to `small_bytes` skip the ring; every rank's window goes round
//    (size-1 hops, not 2(size-1)) and each rank sums them in the ring's order.
//  - The checks on every message: job, sender (the left neighbour), all-reduce number, round, segment
//    and size. A message that fails them fails the all-reduce with a message saying what came.
//  - Progress for a watchdog: the time of the last message, and who was expected to send it.
//
// Threads: a driver is used by one thread at a time (its reducer actor). Sends go out from the caller's
// buffer without a copy; the link (or whoever it hands the message to) holds `owner` while it reads the
// floats, and the all-reduce is finished only once every owner has been let go. `on_released` is called,
// possibly on another thread, when the last one goes after the rounds are done: wake the owner up then.
#pragma once
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "net/ring.hpp"

namespace ringmaster::ring {

// One message between neighbours.
struct message {
  uint64_t job = 0;
  int64_t seq = 0;      // which all-reduce of this ring (0, 1, 2, ...)
  int sender = 0;       // the sending rank
  int round = 0;        // ring round; whole buffers: hops from the origin
  int segment = 0;      // segment index; whole buffers: the origin rank
  bool whole = false;   // a rank's whole window (the small-buffer path)
  const float* data = nullptr;
  size_t count = 0;
  std::shared_ptr<const void> owner;  // keeps data alive (and, for the sender, counts the reader)
  int device = -1;      // where data lives: -1 host memory, else a device of this process
  // data is lent by the link (a shared-memory segment's space, net/shm_link.hpp): the driver copies it
  // before it keeps it waiting for later messages from the left, which may need that space.
  bool lent = false;
  // data is the sender's buffer, left unchanged until owner is let go: a link may pass a reference to it
  // instead of the floats (shared memory's lent window).
  bool in_place = false;
};

// How a rank's buffer is summed: the host's loops, or a device's kernels. src_device is where the
// incoming floats live (message::device); an implementation stages them if it cannot read them there.
class ops {
 public:
  virtual ~ops() = default;
  virtual void add(float* dst, const float* src, size_t n, int src_device) = 0;
  virtual void copy(float* dst, const float* src, size_t n, int src_device) = 0;
  // Called after a received message is applied and before anything is sent from the buffer: a device
  // finishes its writes here, so the neighbour (another stream) reads the result.
  virtual void settle() {}
  // -1 for host memory. The small-buffer path is taken only for host memory.
  virtual int device() const { return -1; }
};

class host_loop_ops : public ops {
 public:
  void add(float* __restrict d, const float* __restrict s, size_t n, int) override;
  void copy(float* d, const float* s, size_t n, int) override;
};

class link {
 public:
  virtual ~link() = default;
  // Carries m to the right neighbour. Returns "" or what failed (the all-reduce then fails).
  virtual std::string send(message m) = 0;
  // Whether send() is done with m.data when it returns, for a message not in_place (a link that copies,
  // as shared memory does): the driver then sends its own buffer where it would otherwise send a copy.
  virtual bool copies_at_send() const { return false; }
  // The rounds are done and only owners of sent messages are still held: a link that holds them until
  // the far side says it has read them (shared memory's references) makes sure it hears of it.
  virtual void await_release() {}
};

struct driver_options {
  uint64_t job = 0;
  size_t segment_elems = size_t(1) << 18;  // 1 MiB of floats per message at most
  size_t small_bytes = 64 * 1024;          // windows up to this size take the small-buffer path
  // With two ranks the small-buffer path moves the same bytes as the ring in one hop instead of two, so
  // it wins until a buffer is large enough for the ring's segments to overlap the adds with the wire.
  size_t pair_small_bytes = size_t(1) << 20;
  size_t copy_below = 16 * 1024;           // host sends smaller than this go as copies (no reader to wait for)
  size_t max_early = 1 << 16;              // messages held for all-reduces not yet started
  size_t max_early_bytes = size_t(2) << 30;  // and their floats (a lying neighbour cannot pin more)
};

class driver {
 public:
  // on_released: see the header comment. The link must outlive the driver.
  driver(int rank, int size, link* right, std::unique_ptr<ops> ops, driver_options o,
         std::function<void()> on_released = {});
  ~driver();
  driver(const driver&) = delete;
  driver& operator=(const driver&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int left() const { return ring::left(rank_, size_); }
  const driver_options& options() const { return opt_; }

  // Starts all-reduce number `seq` (one more than the last) over buf[lo, hi), whose element order is
  // that of a `total`-float layout. `keep` keeps buf alive while a neighbour still reads it in place.
  // Returns "" or what failed.
  std::string start(int64_t seq, float* buf, size_t total, size_t lo, size_t hi, std::shared_ptr<const void> keep = {});
  // A message from the left neighbour (any all-reduce: early ones wait). Returns "" or what failed.
  std::string receive(message m);
  // Every round applied; the window holds the sum.
  bool rounds_done() const;
  // Rounds done and no reader holds a piece of the buffer any more: the caller may touch it.
  bool finished() const;
  // Ends the current all-reduce (after finished(), or to give up after a failure). Returns its seq.
  int64_t finish();
  bool active() const { return active_; }
  int64_t seq() const { return seq_; }
  // For a watchdog: the last time a message of the current all-reduce came in (or it started).
  std::chrono::steady_clock::time_point last_progress() const { return last_progress_; }
  // What the current all-reduce waits for, for an error message.
  std::string waiting_for() const;
  // The rank it waits for (the left neighbour's message, or the right one letting go of our buffer); -1
  // when no all-reduce runs.
  int waiting_rank() const;

 private:
  struct segment_state {
    int round = 0;
  };
  struct shared;
  std::string apply(const message& m);
  std::string apply_whole(const message& m);
  std::string send_range(int round, int segment, const chunk_range& r);
  std::string advance(int segment);
  void rounds_over();
  void finish_whole();
  chunk_range window_chunk(int c) const;
  chunk_range segment_of(const chunk_range& c, int segment) const;
  bool small() const;
  std::shared_ptr<std::vector<float>> copy_of(const float* p, size_t n);

  int rank_, size_;
  link* right_;
  std::unique_ptr<ops> ops_;
  driver_options opt_;
  std::shared_ptr<shared> state_;
  bool active_ = false;
  int64_t seq_ = -1;  // the current or last all-reduce
  float* buf_ = nullptr;
  std::shared_ptr<const void> keep_;
  size_t total_ = 0, lo_ = 0, hi_ = 0;
  std::vector<segment_state> segs_;
  int segs_left_ = 0;
  std::vector<message> whole_;  // small path: the windows of the others, by origin
  std::vector<bool> got_;
  int arrived_ = 0;
  std::vector<std::shared_ptr<std::vector<float>>> copies_;
  std::vector<float> acc_;  // the small path's sums
  std::deque<message> early_;
  size_t early_bytes_ = 0;
  std::chrono::steady_clock::time_point last_progress_;
};

}  // namespace ringmaster::ring
