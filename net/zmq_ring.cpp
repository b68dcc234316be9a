#include "net/zmq_ring.hpp"

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>

#include "net/ring.hpp"

namespace ringmaster::net {
namespace {

using clock = std::chrono::steady_clock;
using wire::msg_type;

// Compiled with the project's -O3 -march=native: the add is vectorised, memcpy is libc's.
struct fast_ops {
  void add(float* __restrict d, const float* __restrict s, size_t n) const {
    for (size_t i = 0; i < n; ++i) d[i] += s[i];
  }
  void copy(float* d, const float* s, size_t n) const {
    if (n) std::memcpy(d, s, n * sizeof(float));
  }
};

struct early_chunk {
  wire::header h;
  payload p;
};

// One all-reduce in progress (bridge thread only).
struct step_state {
  int64_t step = 0;
  float* buf = nullptr;
  size_t len = 0, piece_len = 0;
  std::vector<ring::allreduce_state<fast_ops>> pieces;
  size_t done = 0;
  // Small buffers: every rank's whole buffer travels round the ring (size-1 hops instead of the ring's
  // 2(size-1)); whole[r] is rank r's buffer once it has arrived.
  bool small = false;
  std::vector<payload> whole;
  int arrived = 0;
};

}  // namespace

struct zmq_ring::impl {
  int rank, size, left, right;
  zmq_ring_options opt;

  // Shared between the caller and the bridge thread (and ZeroMQ's I/O thread for `outstanding`).
  std::mutex mu;
  std::condition_variable cv;
  bool left_hello = false, right_ack = false, connected = false;
  // Set by the bridge thread when every piece is done; the caller then still waits for `outstanding`.
  std::atomic<bool> step_finished{false};
  std::atomic<bool> failed{false};  // mirrors !failure.empty() for ZeroMQ's thread
  std::string failure;  // non-empty: the ring is broken
  std::atomic<int64_t> outstanding{0};  // sent messages still pointing into the caller's buffer
  std::atomic<int64_t> last_progress{0};
  std::atomic<int> right_peer{-1};

  // Bridge thread only.
  std::optional<step_state> cur;
  int64_t finished_step = -1;
  std::string left_identity;
  std::deque<early_chunk> early;
  int64_t next_step = 0;  // caller thread only

  bridge br;  // last: destroyed (stopped) first, while everything its callbacks touch still exists

  impl(int r, int n, zmq_ring_options o)
      : rank(r), size(n), left(ring::left(r, n)), right(ring::right(r, n)), opt(std::move(o)), br(opt.bridge) {}
  ~impl() { br.stop(); }

  void touch() { last_progress.store(clock::now().time_since_epoch().count(), std::memory_order_relaxed); }

  // Changes shared state and wakes the caller. Notifying after unlocking spares the woken thread
  // from blocking on the mutex at once (an extra context switch on every wake-up).
  template <class F>
  void update(F f) {
    {
      std::lock_guard<std::mutex> lock(mu);
      f();
    }
    cv.notify_all();
  }

  void fail(const std::string& why) {
    cur.reset();  // on the bridge thread: from now on nobody writes into the caller's buffer
    update([&] {
      if (failure.empty()) failure = why;
      failed = true;
    });
  }

  void log(const std::string& why) {
    if (opt.on_error) opt.on_error({fault::malformed, {}, why});
    else std::fprintf(stderr, "ringmaster zmq_ring rank %d: %s\n", rank, why.c_str());
  }

  wire::header make(msg_type t) const {
    wire::header h;
    h.type = t;
    h.job_id = opt.job_id;
    h.sender_rank = rank;
    return h;
  }

  // A payload pointing into the caller's buffer; the count of such messages drops when ZeroMQ frees it.
  payload borrow(const float* p, size_t n) {
    outstanding.fetch_add(1, std::memory_order_relaxed);
    std::shared_ptr<const void> token(static_cast<const void*>(this), [this](const void*) {
      touch();
      // Wake the caller only when it waits for this (step done, or a failure being cleaned up): a
      // wake-up per message would double the context switches of a small all-reduce. Both sides use
      // seq_cst, so either this sees step_finished or the caller sees outstanding == 0.
      if (outstanding.fetch_sub(1) == 1 && (step_finished.load() || failed.load())) update([] {});
    });
    return {p, n * sizeof(float), std::move(token)};
  }

  void send_piece(size_t k, const ring::outgoing& out) {
    if (!out.send) return;
    wire::header h = make(msg_type::chunk);
    h.step = cur->step;
    h.round = out.round;
    h.segment = int32_t(k);
    h.elements = out.range.count;
    const float* p = cur->buf + k * cur->piece_len + out.range.offset;
    std::string err;
    if (!br.send(right_peer.load(), h, borrow(p, out.range.count), &err)) fail("send to right: " + err);
  }

  void finish_if_done() {
    if (!cur || cur->done < cur->pieces.size() || (cur->small && cur->arrived < size - 1)) return;
    finished_step = cur->step;
    cur.reset();
    update([this] { step_finished = true; });
  }

  void apply(const wire::header& h, const payload& p) {
    if (bool(h.flags & wire::kFlagWhole) != cur->small)
      return fail("chunk of the " + std::string(cur->small ? "ring" : "small-buffer") +
                  " kind during a " + std::string(cur->small ? "small-buffer" : "ring") +
                  " all-reduce (the ranks' buffer lengths differ?)");
    if (cur->small) return apply_whole(h, p);
    const size_t k = size_t(h.segment);
    if (k >= cur->pieces.size())
      return fail("chunk for segment " + std::to_string(k) + " of " + std::to_string(cur->pieces.size()));
    ring::outgoing next;
    auto& piece = cur->pieces[k];
    if (!piece.receive(h.round, p.floats(), h.elements, &next))
      return fail("unexpected chunk: step " + std::to_string(h.step) + " segment " + std::to_string(k) +
                  " round " + std::to_string(h.round) + " with " + std::to_string(h.elements) +
                  " floats (the ranks' buffer lengths differ?)");
    touch();
    const bool piece_done = piece.done();
    send_piece(k, next);  // may fail and end the step
    if (cur && piece_done) ++cur->done;
  }

  // Rank `origin`'s buffer, `round` hops from home: keep it, pass it on unless the next rank is its
  // origin, and once all have come, sum them in rank order, so every rank computes the same bits.
  void apply_whole(const wire::header& h, const payload& p) {
    const int hop = h.round, origin = h.segment;
    if (hop > size - 2 || origin != ring::mod(rank - 1 - hop, size) || h.elements != cur->len ||
        cur->whole[origin].owner)
      return fail("unexpected small-buffer chunk: step " + std::to_string(h.step) + " origin " +
                  std::to_string(origin) + " hop " + std::to_string(hop) + " with " + std::to_string(h.elements) +
                  " floats (the ranks' buffer lengths differ?)");
    touch();
    cur->whole[origin] = p;
    if (hop < size - 2) {
      wire::header f = h;
      f.sender_rank = rank;
      f.round = hop + 1;
      std::string err;
      if (!br.send(right_peer.load(), f, p, &err)) return fail("send to right: " + err);
    }
    if (++cur->arrived < size - 1) return;
    std::vector<float> sum(cur->len);
    const auto src = [&](int r) { return r == rank ? cur->buf : cur->whole[r].floats(); };
    fast_ops().copy(sum.data(), src(0), cur->len);
    for (int r = 1; r < size; ++r) fast_ops().add(sum.data(), src(r), cur->len);
    fast_ops().copy(cur->buf, sum.data(), cur->len);
  }

  void start_small(step_state& s) {
    s.small = true;
    s.whole.resize(size);
    cur.emplace(std::move(s));
    touch();
    wire::header h = make(msg_type::chunk);
    h.step = cur->step;
    h.flags = wire::kFlagWhole;
    h.segment = rank;
    h.elements = cur->len;
    // A copy: the caller's buffer receives the sum before ZeroMQ may have sent it.
    auto mine = std::make_shared<const std::vector<float>>(cur->buf, cur->buf + cur->len);
    std::string err;
    if (!br.send(right_peer.load(), h, payload::of(std::move(mine)), &err)) fail("send to right: " + err);
  }

  void start_step(int64_t step, float* buf, size_t len) {
    step_state s;
    s.step = step;
    s.buf = buf;
    s.len = len;
    if (len * sizeof(float) <= opt.small_bytes) {
      start_small(s);
      replay_early(step);
      return finish_if_done();
    }
    const size_t segment = std::min<size_t>(opt.segment_bytes, wire::kMaxPayloadBytes) / sizeof(float);
    s.piece_len = size * std::max<size_t>(1, segment);
    const size_t pieces = len == 0 ? 1 : (len + s.piece_len - 1) / s.piece_len;
    if (pieces > size_t(INT32_MAX)) return fail("buffer too long for this segment size");
    s.pieces.reserve(pieces);
    for (size_t k = 0; k < pieces; ++k) {
      const size_t off = k * s.piece_len, n = std::min(s.piece_len, len - std::min(len, off));
      s.pieces.emplace_back(rank, size, buf + std::min(len, off), n);
    }
    cur.emplace(std::move(s));
    touch();
    for (size_t k = 0; k < pieces && cur; ++k) send_piece(k, cur->pieces[k].start());
    replay_early(step);
    finish_if_done();
  }

  // Chunks our left neighbour sent before this rank got here.
  void replay_early(int64_t step) {
    while (cur && !early.empty() && early.front().h.step <= step) {
      early_chunk c = std::move(early.front());
      early.pop_front();
      if (c.h.step == step) apply(c.h, c.p);
    }
  }

  void on_chunk(const peer_info& from, const wire::header& h, payload p) {
    if (from.peer >= 0 || from.identity != left_identity || h.sender_rank != left) {
      log("chunk from rank " + std::to_string(h.sender_rank) + " which is not our left neighbour: dropped");
      return;
    }
    if (!cur || h.step != cur->step) {
      if (h.step > finished_step) early.push_back({h, std::move(p)});
      else log("stale chunk for finished step " + std::to_string(h.step) + ": dropped");
      return;
    }
    apply(h, p);
    finish_if_done();
  }

  void on_hello(const peer_info& from, const wire::header& h, const payload& p) {
    wire::kv_map kv;
    std::string err, why;
    if (!wire::decode_kv(p.text(), &kv, &err)) why = "bad hello: " + err;
    else if (h.job_id != opt.job_id)
      why = "hello for job " + std::to_string(h.job_id) + ", this ring runs job " + std::to_string(opt.job_id);
    else if (kv["size"] != std::to_string(size))
      why = "hello from a ring of " + kv["size"] + " ranks, this one has " + std::to_string(size);
    else if (h.sender_rank != left)
      why = "hello from rank " + std::to_string(h.sender_rank) + ", expected the left neighbour, rank " +
            std::to_string(left);
    if (!why.empty()) {
      wire::header e = make(msg_type::error);
      br.reply(from, e, payload::copy_of(why));
      // Someone else's job is noise; a wrong rank in our own job is a broken ring layout.
      if (h.job_id == opt.job_id && !connected_now()) fail(why);
      else log(why);
      return;
    }
    left_identity = from.identity;
    br.reply(from, make(msg_type::hello_ack));
    update([this] { left_hello = true; });
  }

  bool connected_now() {
    std::lock_guard<std::mutex> lock(mu);
    return connected;
  }

  void on_abort(const payload& p) {
    wire::kv_map kv;
    std::string err;
    wire::decode_kv(p.text(), &kv, &err);
    const std::string origin = kv.count("origin") ? kv["origin"] : "?";
    fail("rank " + origin + " aborted: " + (kv.count("reason") ? kv["reason"] : "no reason given"));
    // Pass it round so every rank stops waiting, until it reaches the rank that started it.
    if (origin != std::to_string(right) && right_peer.load() >= 0) {
      wire::header h = make(msg_type::abort);
      br.send(right_peer.load(), h, payload::copy_of(p.text()));
    }
  }

  void on_message(const peer_info& from, const wire::header& h, payload p) {
    switch (h.type) {
      case msg_type::chunk: return on_chunk(from, h, std::move(p));
      case msg_type::hello: return on_hello(from, h, p);
      case msg_type::hello_ack:
        if (from.peer == right_peer.load() && h.job_id == opt.job_id) update([this] { right_ack = true; });
        return;
      case msg_type::abort:
        if (h.job_id == opt.job_id) on_abort(p);
        return;
      case msg_type::error:
        if (from.peer >= 0 && from.peer == right_peer.load())
          return fail("rank " + std::to_string(right) + " refused us: " + std::string(p.text()));
        if (!from.identity.empty() && from.identity == left_identity)
          return fail("rank " + std::to_string(left) + " reported: " + std::string(p.text()));
        log("error from a peer outside the ring: " + std::string(p.text()));
        return;
      default:
        if (opt.fallback) opt.fallback(from, h, std::move(p));
    }
  }

  void on_bridge_error(const bridge_error& e) {
    // A neighbour in another protocol version can never join: fail the handshake with its message.
    if (e.kind == fault::version_mismatch && !connected_now()) fail(e.message);
    if (opt.on_error) opt.on_error(e);
    else std::fprintf(stderr, "ringmaster zmq_ring rank %d: %s: %s\n", rank, fault_name(e.kind), e.message.c_str());
  }

  // After a failure: make sure nothing points into the caller's buffer any more before returning.
  std::string clean_up(const std::string& why) {
    const int peer = right_peer.load();
    // The bridge thread must have let go of the step before the caller gets its buffer back.
    auto released = std::make_shared<bool>(false);  // shared: outlives this frame if the wait gives up
    const bool posted = br.post([this, why, released] {
      if (cur) fail(why);
      update([&released] { *released = true; });
    });
    std::unique_lock<std::mutex> lock(mu);
    if (posted) cv.wait_for(lock, std::chrono::seconds(10), [&released] { return *released; });
    // Let what is queued drain for a moment (the abort goes out behind it), then cut the connection,
    // which makes ZeroMQ free every message still queued.
    if (!cv.wait_for(lock, std::chrono::seconds(1), [this] { return outstanding.load() == 0; })) {
      lock.unlock();
      br.disconnect(peer);
      lock.lock();
      if (!cv.wait_for(lock, std::chrono::seconds(5), [this] { return outstanding.load() == 0; }))
        return why + " (and " + std::to_string(outstanding.load()) +
               " sends from the buffer are still in flight: keep it alive)";
    }
    return why;
  }
};

zmq_ring::zmq_ring(int rank, int size, zmq_ring_options options)
    : d_(std::make_unique<impl>(rank, size, std::move(options))) {
  d_->br.set_handler([d = d_.get()](const peer_info& f, const wire::header& h, payload p) {
    d->on_message(f, h, std::move(p));
  });
  d_->br.set_error_handler([d = d_.get()](const bridge_error& e) { d->on_bridge_error(e); });
}

zmq_ring::~zmq_ring() = default;

int zmq_ring::rank() const { return d_->rank; }
int zmq_ring::size() const { return d_->size; }
bridge& zmq_ring::transport() { return d_->br; }
std::string zmq_ring::endpoint() const { return d_->br.endpoint(); }

bool zmq_ring::listen(const std::string& endpoint, std::string* error) {
  if (d_->size < 1 || d_->rank < 0 || d_->rank >= d_->size) {
    if (error) *error = "rank " + std::to_string(d_->rank) + " of " + std::to_string(d_->size);
    return false;
  }
  return d_->br.start(endpoint, error);
}

bool zmq_ring::start(const std::vector<std::string>& endpoints, std::string* error) {
  if (endpoints.size() != size_t(d_->size)) {
    if (error) *error = std::to_string(endpoints.size()) + " endpoints for a ring of " + std::to_string(d_->size);
    return false;
  }
  return listen(endpoints[d_->rank], error) && connect(endpoints, error);
}

bool zmq_ring::connect(const std::vector<std::string>& endpoints, std::string* error) {
  auto failed = [error](std::string why) {
    if (error) *error = std::move(why);
    return false;
  };
  if (endpoints.size() != size_t(d_->size))
    return failed(std::to_string(endpoints.size()) + " endpoints for a ring of " + std::to_string(d_->size));
  if (!d_->br.running()) return failed("connect before listen");
  if (d_->size == 1) {
    std::lock_guard<std::mutex> lock(d_->mu);
    d_->connected = true;
    return true;
  }
  const std::string& right_ep = endpoints[d_->right];
  const int peer = d_->br.connect(right_ep, error);
  if (peer < 0) return false;
  d_->right_peer.store(peer);
  wire::kv_map kv{{"rank", std::to_string(d_->rank)},
                  {"size", std::to_string(d_->size)},
                  {"protocol_version", std::to_string(wire::kProtocolVersion)}};
  std::string text;
  wire::encode_kv(kv, &text, nullptr);
  if (!d_->br.send(peer, d_->make(msg_type::hello), payload::copy_of(text), error)) return false;

  std::unique_lock<std::mutex> lock(d_->mu);
  const bool ok = d_->cv.wait_for(lock, d_->opt.handshake_timeout, [this] {
    return !d_->failure.empty() || (d_->left_hello && d_->right_ack);
  });
  if (!d_->failure.empty()) return failed(d_->failure);
  if (!ok) {
    std::string missing;
    if (!d_->right_ack)
      missing = "no answer from the right neighbour, rank " + std::to_string(d_->right) + " at " + right_ep;
    if (!d_->left_hello)
      missing += std::string(missing.empty() ? "" : "; ") + "no hello from the left neighbour, rank " +
                 std::to_string(d_->left) + " at " + endpoints[d_->left];
    return failed("handshake timed out after " + std::to_string(d_->opt.handshake_timeout.count()) +
                  " ms: " + missing);
  }
  d_->connected = true;
  return true;
}

std::string zmq_ring::allreduce(float* buf, size_t len) {
  if (d_->size == 1) return "";
  {
    std::lock_guard<std::mutex> lock(d_->mu);
    if (!d_->failure.empty()) return "ring failed earlier: " + d_->failure;
    if (!d_->connected) return "allreduce before connect";
    d_->step_finished = false;
  }
  const int64_t step = d_->next_step++;
  d_->touch();
  if (!d_->br.post([d = d_.get(), step, buf, len] { d->start_step(step, buf, len); }))
    return "bridge not running";

  // Small all-reduces finish in tens of microseconds: yielding in a loop for a while costs less than
  // falling asleep and being woken (two context switches), and yields the core to the threads we wait on.
  if (d_->opt.wait_spin.count() > 0) {
    const auto until = clock::now() + d_->opt.wait_spin;
    while (!d_->failed.load() && clock::now() < until) {
      if (d_->step_finished.load() && d_->outstanding.load() == 0) return "";
      std::this_thread::yield();
    }
  }
  std::unique_lock<std::mutex> lock(d_->mu);
  for (;;) {
    if (!d_->failure.empty()) break;
    if (d_->step_finished && d_->outstanding.load() == 0) return "";
    const auto last = clock::time_point(clock::duration(d_->last_progress.load(std::memory_order_relaxed)));
    const auto deadline = last + d_->opt.timeout;
    if (clock::now() >= deadline) {
      d_->failed = true;
      d_->failure = "all-reduce step " + std::to_string(step) + " made no progress for " +
                    std::to_string(d_->opt.timeout.count()) + " ms (a neighbour died or is stuck)";
      // Tell the others so they stop waiting too.
      wire::kv_map kv{{"origin", std::to_string(d_->rank)}, {"reason", d_->failure}};
      std::string text;
      wire::encode_kv(kv, &text, nullptr);
      wire::header h = d_->make(msg_type::abort);
      h.step = step;
      d_->br.send(d_->right_peer.load(), h, payload::copy_of(text));
      break;
    }
    d_->cv.wait_until(lock, deadline);
  }
  const std::string why = d_->failure;
  lock.unlock();
  return d_->clean_up(why);
}

}  // namespace ringmaster::net
