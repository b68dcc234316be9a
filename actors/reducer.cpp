#include "actors/reducer.hpp"

#include <deque>

#include "actors/chunk_pool.hpp"
#include "actors/messages.hpp"
#include "actors/ring_links.hpp"
#include "kernels/cpu_kernels.hpp"

namespace ringmaster {
namespace {

using clock_type = std::chrono::steady_clock;

// The ring's add and copy where the buffer lives: the CPU's kernels for host memory, else its backend's.
// Our kernels add only our own device's memory: floats from elsewhere (the host, another GPU) are first
// copied over; a copy reads them where they are.
struct device_ops : ring::ops {
  backend* be = nullptr;  // null: host memory
  int where = -1;
  std::shared_ptr<const void> keep;  // keeps `be` alive for staging buffers that outlive a request
  chunk_pool* pool = nullptr;
  void add(float* d, const float* s, size_t n, int src_device) override {
    if (!be) return cpu::add_inplace(d, s, n);
    if (src_device != where) {
      auto staged = pool->get(chunk_pool::kind::device, n, be, keep);  // reused only after our stream is past it
      be->copy(staged.get(), s, n * sizeof(float));
      s = staged.get();
    }
    be->add_inplace(d, s, n);
  }
  void copy(float* d, const float* s, size_t n, int) override {
    if (be) be->copy(d, s, n * sizeof(float));
    else std::copy(s, s + n, d);
  }
  void settle() override {
    if (be) be->synchronize();  // the sum is in place before a neighbour's stream reads it
  }
  int device() const override { return where; }
};

// In front of the real link: device memory bound for another process goes through pinned host memory.
struct staging_link : ring::link {
  link_ptr inner;
  bool host = false;
  backend* be = nullptr;
  chunk_pool* pool = nullptr;
  std::string send(ring::message m) override {
    if (m.device >= 0 && host) {
      auto copy = pool->get(chunk_pool::kind::pinned, m.count, be);
      be->copy_out(copy.get(), m.data, m.count * sizeof(float));  // returns when the copy is done
      m.data = copy.get();
      m.owner = std::move(copy);  // lets go of our buffer at once
      m.device = -1;
    }
    return inner->send(std::move(m));
  }
};

struct request {
  int64_t step;
  tensor_view buf;
  size_t lo, hi;
  caf::response_promise reply;
};

struct reducer_state {
  reducer_config cfg;
  staging_link out;
  std::unique_ptr<ring::driver> drv;
  device_ops* ops = nullptr;        // owned by drv
  std::deque<request> queue;        // the front one runs while drv->active()
  std::deque<ring::message> before;  // messages that came before our first request
  int64_t next_seq = 0;
  bool ticking = false;
  chunk_pool pool;
};

}  // namespace

caf::behavior reducer(caf::event_based_actor* self, reducer_config cfg) {
  auto st = std::make_shared<reducer_state>();
  st->cfg = cfg;
  st->out.pool = &st->pool;
  const std::string who = "reducer " + std::to_string(cfg.rank);
  self->set_exception_handler(error_from_exception(who));

  auto fail = [self, st, who](const std::string& why) {
    auto err = caf::make_error(caf::sec::runtime_error, who + ": " + why);
    for (request& r : st->queue) r.reply.deliver(err);
    st->queue.clear();
    self->quit(err);
  };
  // Starts the next request when none runs, and answers those that are done.
  auto pump = std::make_shared<std::function<void()>>();
  *pump = [self, st, fail, pump] {
    while (!st->queue.empty()) {
      if (st->drv && st->drv->active()) {
        if (!st->drv->finished()) return;
        st->drv->finish();
        st->queue.front().reply.deliver(st->queue.front().step);
        st->queue.pop_front();
        continue;
      }
      request& r = st->queue.front();
      backend* be = r.buf.be && r.buf.be->device() >= 0 ? r.buf.be : nullptr;
      if (!st->drv) {
        auto ops = std::make_unique<device_ops>();
        ops->pool = &st->pool;
        st->ops = ops.get();
        ops->be = be;
        ops->where = be ? be->device() : -1;
        caf::weak_actor_ptr weak{self->ctrl()};
        st->drv = std::make_unique<ring::driver>(st->cfg.rank, st->cfg.size, &st->out, std::move(ops), st->cfg.ring, [weak] {
          if (auto strong = weak.lock()) caf::anon_send(caf::actor_cast<caf::actor>(strong), release_atom::value, int64_t(0));
        });
        for (ring::message& m : st->before)
          if (std::string e = st->drv->receive(std::move(m)); !e.empty()) return fail(e);
        st->before.clear();
      }
      if ((be ? be->device() : -1) != st->ops->where)
        return fail("a buffer on device " + std::to_string(be ? be->device() : -1) + " after buffers on device " +
                    std::to_string(st->ops->where) + ": a reducer sums in one place");
      st->ops->be = be;
      st->ops->keep = r.buf.owner;
      st->out.be = be;
      if (be) be->synchronize();  // the gradients' kernels are done before other streams read them
      if (std::string e = st->drv->start(st->next_seq++, r.buf.data, r.buf.len, r.lo, r.hi, r.buf.owner); !e.empty())
        return fail(e);
      if (!st->ticking) {
        st->ticking = true;
        self->delayed_send(self, std::max(std::chrono::milliseconds(10), st->cfg.timeout / 4), tick_atom::value);
      }
    }
  };
  auto enqueue = [self, st, pump](int64_t step, tensor_view buf, uint64_t lo, uint64_t hi) {
    auto reply = self->make_response_promise();
    if (lo > hi || hi > buf.len || (st->cfg.size > 1 && !st->out.inner)) {
      reply.deliver(caf::make_error(caf::sec::invalid_argument, !st->out.inner ? "reducer: no ring yet" : "reducer: bad window"));
      return reply;
    }
    st->queue.push_back({step, std::move(buf), size_t(lo), size_t(hi), reply});
    (*pump)();
    return reply;
  };
  self->attach_functor([pump] { *pump = nullptr; });

  return {
      [st](ring_atom, link_ptr right) {
        st->out.host = right && host_only(*right);
        st->out.inner = std::move(right);
      },
      [st](ring_atom) {  // leave the ring: staging buffers go back to their backends now
        st->drv.reset();
        st->ops = nullptr;
        st->pool = chunk_pool{};
        return true;
      },
      [enqueue](reduce_atom, int64_t step, tensor_view buf) {
        const uint64_t len = buf.len;
        return enqueue(step, std::move(buf), 0, len);
      },
      [enqueue](reduce_atom, int64_t step, tensor_view buf, uint64_t lo, uint64_t hi) {
        return enqueue(step, std::move(buf), lo, hi);
      },
      [st, fail, pump](chunk_atom, ring::message m) {
        if (!st->drv) {
          if (st->before.size() >= st->cfg.ring.max_early) return fail("too many messages before the first all-reduce");
          st->before.push_back(std::move(m));
          return;
        }
        if (std::string e = st->drv->receive(std::move(m)); !e.empty()) return fail(e);
        (*pump)();
      },
      [pump](release_atom, int64_t) { (*pump)(); },
      [self, st, fail](tick_atom) {
        st->ticking = false;
        if (!st->drv || !st->drv->active()) return;
        const auto quiet = clock_type::now() - st->drv->last_progress();
        if (quiet > st->cfg.timeout)
          return fail("no progress for " + std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(quiet).count()) +
                      " ms: " + st->drv->waiting_for());
        st->ticking = true;
        self->delayed_send(self, std::max(std::chrono::milliseconds(10), st->cfg.timeout / 4), tick_atom::value);
      },
  };
}

}  // namespace ringmaster
