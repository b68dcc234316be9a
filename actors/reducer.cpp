#include "actors/reducer.hpp"

#include <atomic>
#include <deque>
#include <optional>

#include "actors/messages.hpp"
#include "kernels/cpu_kernels.hpp"
#include "net/ring.hpp"

namespace ringmaster {
namespace {

struct cpu_ring_ops {
  void add(float* d, const float* s, size_t n) const { cpu::add_inplace(d, s, n); }
  void copy(float* d, const float* s, size_t n) const { std::copy(s, s + n, d); }
};

constexpr size_t kZeroCopyBytes = 64 * 1024;

struct pending_chunk {
  int64_t step;
  int round;
  chunk_data data;
};

struct reducer_state {
  int rank = 0, size = 1;
  caf::actor right, left;  // left: only when it runs in this process
  bool right_local = false;
  bool released = false;   // the right neighbour has finished reading our buffer this step
  bool zero_copy = false;  // this all-reduce's all-gather chunks are read in place (see send_out)
  int64_t step = -1;  // step being reduced, -1 when idle
  tensor_view buf;
  std::optional<ring::allreduce_state<cpu_ring_ops>> ring;
  caf::response_promise reply;
  std::deque<pending_chunk> early;  // chunks for a step this rank has not started yet
  // Send buffers, reused once nobody else holds them (the receiver or ZeroMQ let go): no allocation
  // per chunk in the steady state.
  std::vector<std::shared_ptr<std::vector<float>>> pool;

  std::shared_ptr<std::vector<float>> buffer(size_t n) {
    for (auto& b : pool)
      if (b.use_count() == 1) {
        std::atomic_thread_fence(std::memory_order_acquire);  // after the last reader let go
        b->resize(n);
        return b;
      }
    pool.push_back(std::make_shared<std::vector<float>>(n));
    return pool.back();
  }
};

}  // namespace

caf::behavior reducer(caf::event_based_actor* self, int rank, int size) {
  auto st = std::make_shared<reducer_state>();
  st->rank = rank;
  st->size = size;

  // Reduce-scatter chunks change after they are sent, so they go as copies. All-gather chunks hold final
  // sums that stay put until the all-reduce ends, so a neighbour in this process reads them straight
  // from our buffer (no copy), and tells us with a release when it has read the last one.
  auto send_out = [self, st](const ring::outgoing& out) {
    if (!out.send) return;
    const float* p = st->buf.data + out.range.offset;
    if (st->zero_copy && st->right_local && !ring::is_reduce_round(st->size, out.round)) {
      self->send(st->right, chunk_atom::value, st->step, out.round, chunk_data{p, out.range.count, st->buf.owner});
      return;
    }
    auto copy = st->buffer(out.range.count);
    std::copy(p, p + out.range.count, copy->data());
    chunk_data c{copy->data(), copy->size(), std::move(copy)};
    self->send(st->right, chunk_atom::value, st->step, out.round, std::move(c));
  };
  auto finish_if_done = [st] {
    const bool zero_copy_sent = st->zero_copy && st->right_local && st->size > 1;
    if (st->ring && st->ring->done() && (st->released || !zero_copy_sent)) {
      const int64_t step = st->step;
      st->ring.reset();
      st->step = -1;
      st->released = false;
      st->buf = tensor_view{};
      st->reply.deliver(step);
    }
  };
  auto apply = [self, st, send_out](int64_t step, int round, const chunk_data& data) {
    ring::outgoing next;
    if (!st->ring->receive(round, data.data, data.count, &next)) {
      auto err = caf::make_error(caf::sec::unexpected_message,
                                 "reducer " + std::to_string(st->rank) + ": chunk of " +
                                     std::to_string(data.count) + " floats for round " + std::to_string(round) +
                                     " of step " + std::to_string(step) + " does not fit the ring");
      st->reply.deliver(err);
      self->quit(err);
      return;
    }
    // Our last read from the left neighbour's buffer: it may reuse it now.
    if (st->zero_copy && st->left && round == ring::rounds(st->size) - 1)
      self->send(st->left, release_atom::value, step);
    send_out(next);
  };

  return {
      [st](ring_atom, caf::actor right) {  // a right neighbour that copies are sent to
        st->right = std::move(right);
        st->right_local = false;
      },
      [st](ring_atom, caf::actor right, bool right_local, caf::actor left) {
        st->right = std::move(right);
        st->right_local = right_local;
        st->left = std::move(left);
      },
      [st, finish_if_done](release_atom, int64_t step) {
        if (step == st->step) st->released = true;
        finish_if_done();
      },
      [self, st, send_out, apply, finish_if_done](reduce_atom, int64_t step, tensor_view buf) {
        if (st->step >= 0 || (st->size > 1 && !st->right)) {
          auto refused = self->make_response_promise();  // the request in flight keeps its promise
          refused.deliver(caf::make_error(caf::sec::invalid_argument,
                                          st->step >= 0 ? "reducer busy with another all-reduce" : "no ring yet"));
          return refused;
        }
        st->reply = self->make_response_promise();
        while (!st->early.empty() && st->early.front().step < step) st->early.pop_front();  // stale
        st->step = step;
        st->buf = buf;
        // Small chunks are cheaper to copy than to pay for the release message's extra hop. Every rank
        // decides the same way, from the same length.
        st->zero_copy = buf.len / size_t(st->size) * sizeof(float) >= kZeroCopyBytes;
        st->ring.emplace(st->rank, st->size, buf.data, buf.len);
        send_out(st->ring->start());
        // Chunks that arrived before our replica was ready (the left neighbour may run ahead).
        while (st->ring && !st->early.empty() && st->early.front().step == step) {
          pending_chunk c = std::move(st->early.front());
          st->early.pop_front();
          apply(c.step, c.round, c.data);
          if (!st->ring) break;
          finish_if_done();
        }
        finish_if_done();
        return st->reply;
      },
      [st, apply, finish_if_done](chunk_atom, int64_t step, int round, chunk_data data) {
        if (!st->ring || step != st->step) {
          st->early.push_back({step, round, std::move(data)});
          return;
        }
        apply(step, round, data);
        finish_if_done();
      },
  };
}

}  // namespace ringmaster
