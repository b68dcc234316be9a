// Ring all-reduce as a pure algorithm, separate from any transport (as gloo does).
//
// The buffer of `len` floats is split into `size` chunks (some may be empty). With 2(size-1) rounds:
//   reduce-scatter, round t in [0, size-1):  send chunk (rank - t), receive chunk (rank - t - 1) and ADD it;
//   all-gather,    round t = size-1+k:       send chunk (rank + 1 - k), receive chunk (rank - k) and COPY it.
// After reduce-scatter rank r holds the full sum of chunk (r + 1); all-gather passes the sums around.
// What a rank sends in round t+1 is exactly what it received in round t, so the state machine below only
// needs "what to send first" and "apply what came in, then what to send next". Every rank ends with the
// same bits: each chunk is summed at one rank and copied to the others.
#pragma once
#include <cstddef>
#include <cstdint>

namespace ringmaster::ring {

struct chunk_range {
  size_t offset = 0, count = 0;
};

// Chunk c of `size` chunks over len elements: the first len % size chunks have one extra element.
inline chunk_range chunk(size_t len, int size, int c) {
  const size_t base = len / size, extra = len % size;
  const size_t cu = size_t(c);
  return {cu * base + (cu < extra ? cu : extra), base + (cu < extra ? 1 : 0)};
}

inline int mod(int a, int n) { return ((a % n) + n) % n; }
inline int rounds(int size) { return 2 * (size - 1); }
inline bool is_reduce_round(int size, int t) { return t < size - 1; }
inline int send_chunk(int rank, int size, int t) {
  return is_reduce_round(size, t) ? mod(rank - t, size) : mod(rank + 1 - (t - (size - 1)), size);
}
inline int recv_chunk(int rank, int size, int t) {
  return is_reduce_round(size, t) ? mod(rank - t - 1, size) : mod(rank - (t - (size - 1)), size);
}
inline int left(int rank, int size) { return mod(rank - 1, size); }
inline int right(int rank, int size) { return mod(rank + 1, size); }

// One rank's progress through one all-reduce. The transport calls start(), sends what it returns, and
// for every chunk that arrives from the left calls receive(); each returned outgoing chunk goes right.
struct outgoing {
  bool send = false;  // false: nothing to send
  int round = 0;
  chunk_range range;  // the elements of the local buffer to send
};

// Ops provides add(dst, src, n): dst += src, and copy(dst, src, n): for the CPU, host_ops below.
struct host_ops {
  void add(float* d, const float* s, size_t n) const {
    for (size_t i = 0; i < n; ++i) d[i] += s[i];
  }
  void copy(float* d, const float* s, size_t n) const {
    for (size_t i = 0; i < n; ++i) d[i] = s[i];
  }
};

template <class Ops = host_ops>
class allreduce_state {
 public:
  allreduce_state(int rank, int size, float* buf, size_t len, Ops ops = Ops())
      : rank_(rank), size_(size), buf_(buf), len_(len), ops_(ops) {}

  outgoing start() {
    round_ = 0;
    if (size_ == 1) return {};
    return {true, 0, chunk(len_, size_, send_chunk(rank_, size_, 0))};
  }
  // Applies round `round`'s chunk from the left neighbour. Returns false (and changes nothing) if the
  // round or element count is not the one expected: the caller reports a protocol error.
  bool receive(int round, const float* data, size_t count, outgoing* next) {
    if (done() || round != round_) return false;
    const chunk_range r = chunk(len_, size_, recv_chunk(rank_, size_, round));
    if (count != r.count) return false;
    if (is_reduce_round(size_, round)) ops_.add(buf_ + r.offset, data, r.count);
    else ops_.copy(buf_ + r.offset, data, r.count);
    ++round_;
    *next = done() ? outgoing{} : outgoing{true, round_, r};
    return true;
  }
  bool done() const { return round_ >= rounds(size_); }
  int round() const { return round_; }

 private:
  int rank_, size_;
  float* buf_;
  size_t len_;
  Ops ops_;
  int round_ = 0;
};

}  // namespace ringmaster::ring
