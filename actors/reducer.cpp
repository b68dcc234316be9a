#include "actors/reducer.hpp"

#include <deque>
#include <optional>

#include "actors/chunk_pool.hpp"
#include "actors/messages.hpp"
#include "kernels/cpu_kernels.hpp"
#include "net/ring.hpp"

namespace ringmaster {
namespace {

// The ring's add and copy on the buffer's device: its backend's kernels, or the CPU's for host buffers.
struct device_ring_ops {
  backend* be = nullptr;
  void add(float* d, const float* s, size_t n) const {
    if (be) be->add_inplace(d, s, n);
    else cpu::add_inplace(d, s, n);
  }
  void copy(float* d, const float* s, size_t n) const {
    if (be) be->copy(d, s, n * sizeof(float));
    else std::copy(s, s + n, d);
  }
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
  int where = -1;     // buf's device (backend::device()), -1: host memory
  std::optional<ring::allreduce_state<device_ring_ops>> ring;
  caf::response_promise reply;
  std::deque<pending_chunk> early;  // chunks for a step this rank has not started yet
  chunk_pool pool;
};

}  // namespace

caf::behavior reducer(caf::event_based_actor* self, int rank, int size) {
  auto st = std::make_shared<reducer_state>();
  st->rank = rank;
  st->size = size;
  self->set_exception_handler(error_from_exception("reducer " + std::to_string(rank)));

  // Reduce-scatter chunks change after they are sent, so they go as copies. All-gather chunks hold final
  // sums that stay put until the all-reduce ends, so a neighbour in this process reads them straight
  // from our buffer (no copy), and tells us with a release when it has read the last one.
  // A GPU's copies stay on its device for a neighbour in this process (which reads them device to
  // device), and go to pinned host memory for a link to another process.
  auto send_out = [self, st](const ring::outgoing& out) {
    if (!out.send) return;
    const float* p = st->buf.data + out.range.offset;
    const size_t n = out.range.count;
    if (st->zero_copy && st->right_local && !ring::is_reduce_round(st->size, out.round)) {
      self->send(st->right, chunk_atom::value, st->step, out.round, chunk_data{p, n, st->buf.owner, st->where});
      return;
    }
    using kind = chunk_pool::kind;
    backend* be = st->buf.be;
    chunk_data c{nullptr, n, nullptr, -1};
    if (st->where < 0) {
      auto copy = st->pool.get(kind::host, n);
      std::copy(p, p + n, copy.get());
      c.data = copy.get(), c.owner = std::move(copy);
    } else if (st->right_local) {
      auto copy = st->pool.get(kind::device, n, be, st->buf.owner);
      be->copy(copy.get(), p, n * sizeof(float));
      be->synchronize();  // the copy is complete before the neighbour's stream reads it
      c.data = copy.get(), c.owner = std::move(copy), c.device = st->where;
    } else {
      auto copy = st->pool.get(kind::pinned, n, be);
      be->copy_out(copy.get(), p, n * sizeof(float));  // returns when the copy is done
      c.data = copy.get(), c.owner = std::move(copy);
    }
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
    auto fail = [&](const std::string& why) {
      auto err = caf::make_error(caf::sec::unexpected_message, "reducer " + std::to_string(st->rank) + ": " + why);
      st->ring.reset();  // nothing more is applied (the early-chunk loop checks it)
      st->reply.deliver(err);
      self->quit(err);
    };
    if (st->where < 0 && data.device >= 0)
      return fail("chunk in the memory of device " + std::to_string(data.device) +
                  " but this reducer sums on the host (rings mixing CPU and GPU replicas are not supported)");
    // Our kernels add only our own device's memory: a chunk from the host (another process) or from
    // another GPU is first copied over. A copy (all-gather) reads it where it is.
    const float* src = data.data;
    const size_t expected = ring::chunk(st->buf.len, st->size, ring::recv_chunk(st->rank, st->size, round)).count;
    if (st->where >= 0 && data.device != st->where && ring::is_reduce_round(st->size, round) &&
        data.count == expected && round == st->ring->round()) {
      auto staged = st->pool.get(chunk_pool::kind::device, data.count, st->buf.be, st->buf.owner);
      st->buf.be->copy(staged.get(), src, data.count * sizeof(float));
      src = staged.get();  // the pool keeps it; we synchronize below before it can be handed out again
    }
    ring::outgoing next;
    if (!st->ring->receive(round, src, data.count, &next))
      return fail("chunk of " + std::to_string(data.count) + " floats for round " + std::to_string(round) +
                  " of step " + std::to_string(step) + " does not fit the ring");
    // The sum or copy is in place before we send from it or release the left neighbour's buffer, and
    // before `data` (the sender's buffer) is let go.
    if (st->buf.be) st->buf.be->synchronize();
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
        st->where = buf.be ? buf.be->device() : -1;
        if (st->where < 0) st->buf.be = nullptr;  // host memory: the CPU kernels, no backend needed
        // The gradients' kernels (on the replica's stream) are done before other streams read them.
        if (st->buf.be) st->buf.be->synchronize();
        // Small chunks are cheaper to copy than to pay for the release message's extra hop. Every rank
        // decides the same way, from the same length.
        st->zero_copy = buf.len / size_t(st->size) * sizeof(float) >= kZeroCopyBytes;
        st->ring.emplace(st->rank, st->size, buf.data, buf.len, device_ring_ops{st->buf.be});
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
