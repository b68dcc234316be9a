#include "net/ring_driver.hpp"

#include <algorithm>
#include <cstring>

namespace ringmaster::ring {

// Compiled with the project's -O3 -march=native: the add is vectorised, memcpy is libc's.
void host_loop_ops::add(float* __restrict d, const float* __restrict s, size_t n, int) {
  for (size_t i = 0; i < n; ++i) d[i] += s[i];
}
void host_loop_ops::copy(float* d, const float* s, size_t n, int) {
  if (n) std::memcpy(d, s, n * sizeof(float));
}

// Shared with the tokens of sends in flight, which may be let go on other threads.
struct driver::shared {
  std::atomic<int64_t> outstanding{0};
  std::atomic<bool> rounds_done{true};
  std::function<void()> on_released;
};

driver::driver(int rank, int size, link* right, std::unique_ptr<ops> o, driver_options opt,
               std::function<void()> on_released)
    : rank_(rank), size_(size), right_(right), ops_(std::move(o)), opt_(opt), state_(std::make_shared<shared>()) {
  state_->on_released = std::move(on_released);
  opt_.segment_elems = std::max<size_t>(1, opt_.segment_elems);
  last_progress_ = std::chrono::steady_clock::now();
}

driver::~driver() = default;

bool driver::rounds_done() const { return !active_ || state_->rounds_done.load(); }
bool driver::finished() const { return !active_ || (state_->rounds_done.load() && state_->outstanding.load() == 0); }

// Copies sent instead of the buffer come from a few reused vectors: a neighbour (or ZeroMQ) holds one
// while it reads it, and it is free again once only this list holds it. No allocation per step.
std::shared_ptr<std::vector<float>> driver::copy_of(const float* p, size_t n) {
  std::shared_ptr<std::vector<float>> v;
  for (auto& c : copies_)
    if (c.use_count() == 1) {
      std::atomic_thread_fence(std::memory_order_acquire);  // after the last reader let go
      v = c;
      break;
    }
  if (!v) {
    v = std::make_shared<std::vector<float>>();
    if (copies_.size() < 64) copies_.push_back(v);  // more in flight at once: plain allocations
  }
  v->assign(p, p + n);
  return v;
}

bool driver::small() const {
  const size_t limit = size_ == 2 ? std::max(opt_.small_bytes, opt_.pair_small_bytes) : opt_.small_bytes;
  return ops_->device() < 0 && (hi_ - lo_) * sizeof(float) <= limit;
}

// Ring chunk c of the whole layout, cut to this all-reduce's window (offsets into the layout).
chunk_range driver::window_chunk(int c) const {
  const chunk_range g = chunk(total_, size_, c);
  const size_t b = std::max(g.offset, lo_), e = std::min(g.offset + g.count, hi_);
  return e > b ? chunk_range{b, e - b} : chunk_range{b, 0};
}

chunk_range driver::segment_of(const chunk_range& c, int segment) const {
  const size_t off = size_t(segment) * opt_.segment_elems;
  if (off >= c.count) return {c.offset, 0};
  return {c.offset + off, std::min(opt_.segment_elems, c.count - off)};
}

std::string driver::start(int64_t seq, float* buf, size_t total, size_t lo, size_t hi, std::shared_ptr<const void> keep) {
  if (active_) return "all-reduce " + std::to_string(seq) + " started while " + std::to_string(seq_) + " runs";
  if (seq <= seq_) return "all-reduce " + std::to_string(seq) + " started after " + std::to_string(seq_);
  if (lo > hi || hi > total) return "window [" + std::to_string(lo) + ", " + std::to_string(hi) + ") of " + std::to_string(total) + " floats";
  active_ = true;
  seq_ = seq;
  buf_ = buf;
  keep_ = std::move(keep);
  total_ = total;
  lo_ = lo;
  hi_ = hi;
  last_progress_ = std::chrono::steady_clock::now();
  if (size_ == 1) return "";
  state_->rounds_done = false;
  std::string err;
  if (small()) {
    whole_.assign(size_t(size_), message{});
    got_.assign(size_t(size_), false);
    arrived_ = 0;
    if (right_->copies_at_send()) {  // done with our window when send returns: no copy of it first
      err = right_->send(message{opt_.job, seq, rank_, 0, rank_, true, buf + lo, hi - lo, nullptr, -1});
    } else {
      // A copy: this rank's window receives the sum while the others may still read what we sent.
      auto mine = copy_of(buf + lo, hi - lo);
      err = right_->send(message{opt_.job, seq, rank_, 0, rank_, true, mine->data(), mine->size(), mine, -1});
    }
  } else {
    size_t longest = 0;
    for (int c = 0; c < size_; ++c) longest = std::max(longest, window_chunk(c).count);
    const size_t segments = std::max<size_t>(1, (longest + opt_.segment_elems - 1) / opt_.segment_elems);
    if (segments > size_t(INT32_MAX)) return "window too long for segments of " + std::to_string(opt_.segment_elems);
    segs_.assign(segments, segment_state{});
    segs_left_ = int(segments);
    const chunk_range first = window_chunk(send_chunk(rank_, size_, 0));
    for (int s = 0; s < int(segments) && err.empty(); ++s) {
      err = send_range(0, s, segment_of(first, s));
      if (err.empty()) err = advance(s);
    }
  }
  // Messages our left neighbour sent before this rank got here.
  while (err.empty() && !early_.empty() && early_.front().seq <= seq) {
    message m = std::move(early_.front());
    early_.pop_front();
    early_bytes_ -= m.count * sizeof(float);
    if (m.seq == seq) err = apply(m);
  }
  if (err.empty() && !small() && segs_left_ == 0) rounds_over();
  return err;
}

void driver::rounds_over() {
  state_->rounds_done = true;
  // Only the right neighbour's reading of our sends is left: a link that learns of that late (shared
  // memory's references) watches for it now.
  if (state_->outstanding.load() > 0) right_->await_release();
}

// Skips the rounds whose incoming range is empty for this segment (nothing is sent for an empty range,
// by every rank alike), so the segment waits only for messages that will come.
std::string driver::advance(int s) {
  segment_state& g = segs_[size_t(s)];
  const int last = rounds(size_);
  while (g.round < last && segment_of(window_chunk(recv_chunk(rank_, size_, g.round)), s).count == 0) ++g.round;
  if (g.round >= last && g.round != last + 1) {
    g.round = last + 1;  // counted once
    --segs_left_;
  }
  return "";
}

std::string driver::send_range(int round, int segment, const chunk_range& r) {
  if (r.count == 0) return "";
  message m{opt_.job, seq_, rank_, round, segment, false, buf_ + r.offset, r.count, nullptr, ops_->device()};
  m.in_place = true;
  if (ops_->device() < 0 && r.count * sizeof(float) < opt_.copy_below) {
    m.in_place = false;
    auto copy = copy_of(m.data, r.count);
    m.data = copy->data();
    m.owner = std::move(copy);
  } else {
    // The receiver reads our buffer in place (or a link copies it out): count it until it lets go.
    state_->outstanding.fetch_add(1);
    auto st = state_;
    m.owner = std::shared_ptr<const void>(static_cast<const void*>(st.get()), [st, keep = keep_](const void*) {
      // Both sides seq_cst: either this sees rounds_done, or the driver sees outstanding == 0.
      if (st->outstanding.fetch_sub(1) == 1 && st->rounds_done.load() && st->on_released) st->on_released();
    });
  }
  return right_->send(std::move(m));
}

std::string driver::receive(message m) {
  if (m.job != opt_.job)
    return "message of job " + std::to_string(m.job) + " in the ring of job " + std::to_string(opt_.job);
  if (m.sender != left())
    return "message from rank " + std::to_string(m.sender) + ", which is not the left neighbour (rank " +
           std::to_string(left()) + ")";
  if (m.seq < seq_ || (m.seq == seq_ && !active_))
    return "message for all-reduce " + std::to_string(m.seq) + ", which has ended (now at " + std::to_string(seq_) + ")";
  if (m.seq > seq_ || !active_) {
    // The left neighbour cannot finish an all-reduce without us: it is at most one ahead.
    if (m.seq > seq_ + 1)
      return "message for all-reduce " + std::to_string(m.seq) + ", more than one ahead of this rank's " + std::to_string(seq_);
    early_bytes_ += m.count * sizeof(float);
    if (early_.size() >= opt_.max_early || early_bytes_ > opt_.max_early_bytes)
      return "more than " + std::to_string(opt_.max_early) + " messages or " + std::to_string(opt_.max_early_bytes) +
             " bytes ahead of this rank's all-reduce " + std::to_string(seq_);
    // Kept as it came, lent or not: the left neighbour sent all it had for our all-reduce before this,
    // so nothing we wait for is behind it on the link.
    early_.push_back(std::move(m));
    return "";
  }
  std::string err = apply(m);
  if (err.empty() && !small() && segs_left_ == 0) rounds_over();
  return err;
}

std::string driver::apply(const message& m) {
  const auto what = [&] {
    return "all-reduce " + std::to_string(m.seq) + (m.whole ? " (small-buffer path)" : "") + ": segment " +
           std::to_string(m.segment) + " round " + std::to_string(m.round) + " with " + std::to_string(m.count) + " floats";
  };
  if (m.whole != small()) return what() + " is of the wrong kind for a window of " + std::to_string(hi_ - lo_) + " floats (do the ranks' lengths differ?)";
  if (m.whole) return apply_whole(m);
  if (m.segment < 0 || size_t(m.segment) >= segs_.size())
    return what() + ": there are " + std::to_string(segs_.size()) + " segments";
  segment_state& g = segs_[size_t(m.segment)];
  const int round = g.round;
  const chunk_range r = round < rounds(size_) ? segment_of(window_chunk(recv_chunk(rank_, size_, round)), m.segment) : chunk_range{};
  if (m.round != round || m.count != r.count || r.count == 0)
    return what() + " does not fit: expected round " + std::to_string(round) + " with " + std::to_string(r.count) +
           " floats (do the ranks' lengths differ?)";
  if (is_reduce_round(size_, round)) ops_->add(buf_ + r.offset, m.data, r.count, m.device);
  else ops_->copy(buf_ + r.offset, m.data, r.count, m.device);
  ops_->settle();
  last_progress_ = std::chrono::steady_clock::now();
  ++g.round;
  // What arrives in round t is what goes right in round t+1.
  if (g.round < rounds(size_))
    if (std::string err = send_range(g.round, m.segment, r); !err.empty()) return err;
  return advance(m.segment);
}

std::string driver::apply_whole(const message& m) {
  const int hop = m.round, origin = m.segment;
  if (hop < 0 || hop > size_ - 2 || origin != mod(rank_ - 1 - hop, size_) || m.count != hi_ - lo_ || got_[size_t(origin)])
    return "all-reduce " + std::to_string(m.seq) + ": unexpected window of rank " + std::to_string(origin) + " after " +
           std::to_string(hop) + " hops with " + std::to_string(m.count) + " floats (expected " + std::to_string(hi_ - lo_) + ")";
  last_progress_ = std::chrono::steady_clock::now();
  message& w = whole_[size_t(origin)];
  w = m;
  if (w.lent && arrived_ + 1 < size_ - 1) {  // kept until windows behind it on the link come: copied
    auto copy = copy_of(w.data, w.count);
    w.data = copy->data();
    w.owner = std::move(copy);
    w.lent = false;
  }
  got_[size_t(origin)] = true;
  if (hop < size_ - 2) {  // pass it on unless the next rank is its origin
    message f = w;
    f.sender = rank_;
    f.round = hop + 1;
    if (std::string err = right_->send(std::move(f)); !err.empty()) return err;
  }
  if (++arrived_ == size_ - 1) finish_whole();
  return "";
}

// Every window is here: sum each ring chunk in the ring's order, starting at the chunk's own rank.
void driver::finish_whole() {
  if (size_ == 2) {
    // Each chunk is the sum of the two windows, and a + b == b + a exactly (only which NaN's payload a sum
    // of two NaNs keeps may differ, and training has failed by then): ours takes the other's in place.
    ops_->add(buf_ + lo_, whole_[size_t(1 - rank_)].data, hi_ - lo_, -1);
    whole_.assign(whole_.size(), message{});
    state_->rounds_done = true;
    return;
  }
  std::vector<float>& acc = acc_;
  const auto src = [&](int r, size_t at) { return r == rank_ ? buf_ + at : whole_[size_t(r)].data + (at - lo_); };
  for (int c = 0; c < size_; ++c) {
    const chunk_range w = window_chunk(c);
    if (w.count == 0) continue;
    acc.assign(src(c, w.offset), src(c, w.offset) + w.count);
    for (int k = 1; k < size_; ++k) ops_->add(acc.data(), src(mod(c + k, size_), w.offset), w.count, -1);
    std::memcpy(buf_ + w.offset, acc.data(), w.count * sizeof(float));
  }
  whole_.assign(whole_.size(), message{});  // let the others' windows go
  state_->rounds_done = true;
}

int64_t driver::finish() {
  active_ = false;
  keep_.reset();
  segs_.clear();
  segs_left_ = 0;
  whole_.clear();
  state_->rounds_done = true;
  return seq_;
}

int driver::waiting_rank() const {  // as waiting_for() says
  if (!active_) return -1;
  if (small()) return left();
  for (const segment_state& s : segs_)
    if (s.round < rounds(size_)) return left();
  return state_->outstanding.load() > 0 ? mod(rank_ + 1, size_) : left();
}

std::string driver::waiting_for() const {
  if (!active_) return "no all-reduce running";
  std::string s = "all-reduce " + std::to_string(seq_) + " waits for rank " + std::to_string(left()) + " (the left neighbour)";
  if (small()) return s + ": " + std::to_string(arrived_) + " of " + std::to_string(size_ - 1) + " windows came";
  for (size_t k = 0; k < segs_.size(); ++k)
    if (segs_[k].round < rounds(size_))
      return s + ": segment " + std::to_string(k) + " is at round " + std::to_string(segs_[k].round) + " of " + std::to_string(rounds(size_));
  if (state_->outstanding.load() > 0)
    return "all-reduce " + std::to_string(seq_) + " waits for rank " + std::to_string(mod(rank_ + 1, size_)) +
           " (the right neighbour) to let go of " + std::to_string(state_->outstanding.load()) + " pieces of our buffer";
  return s;
}

}  // namespace ringmaster::ring
