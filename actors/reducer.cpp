#include "actors/reducer.hpp"

#include <deque>

#include "actors/chunk_pool.hpp"
#include "actors/messages.hpp"
#include "actors/ring_links.hpp"
#include "kernels/cpu_kernels.hpp"
#include "net/strand.hpp"

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
    if (!inner) return "no ring yet";
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

struct job {
  int64_t seq;
  tensor_view buf;
  size_t lo, hi;
};

}  // namespace

// A rank's ring state. Touched only inside its strand's tasks, whichever thread runs them.
class reducer_port {
 public:
  net::strand strand;
  reducer_config cfg;
  staging_link out;
  std::unique_ptr<ring::driver> drv;
  device_ops* ops = nullptr;  // owned by drv
  std::deque<job> jobs;       // the front one runs while drv->active()
  std::deque<ring::message> before;  // messages that came before our first request
  chunk_pool pool;
  bool broken = false;
  caf::weak_actor_ptr owner;  // the reducer actor, told of results
  std::weak_ptr<reducer_port> me;

  void tell(caf::message m) {
    if (auto a = owner.lock()) caf::anon_send(caf::actor_cast<caf::actor>(a), std::move(m));
  }
  void fail(const std::string& why) {
    if (broken) return;
    broken = true;
    jobs.clear();
    if (drv && drv->active()) drv->finish();  // lets go of the buffer (sends in flight still hold it)
    if (ops) ops->keep = nullptr;
    tell(caf::make_message(fail_atom::value, why));
  }

  // Answers finished all-reduces and starts the next; "" or why it failed.
  std::string pump() {
    while (!jobs.empty() && !broken) {
      if (drv && drv->active()) {
        if (!drv->finished()) return "";
        const int64_t seq = drv->finish();
        ops->keep = nullptr;
        jobs.pop_front();
        tell(caf::make_message(release_atom::value, seq));
        continue;
      }
      job& j = jobs.front();
      backend* be = j.buf.be && j.buf.be->device() >= 0 ? j.buf.be : nullptr;
      if (!drv) {
        auto o = std::make_unique<device_ops>();
        o->pool = &pool;
        o->where = be ? be->device() : -1;
        ops = o.get();
        drv = std::make_unique<ring::driver>(cfg.rank, cfg.size, &out, std::move(o), cfg.ring, [me = me] {
          if (auto p = me.lock()) p->strand.run([p] { p->check(); });
        });
        for (ring::message& m : before)
          if (std::string e = drv->receive(std::move(m)); !e.empty()) return e;
        before.clear();
      }
      if ((be ? be->device() : -1) != ops->where)
        return "a buffer on device " + std::to_string(be ? be->device() : -1) + " after buffers on device " +
               std::to_string(ops->where) + ": a reducer sums in one place";
      ops->be = be;
      ops->keep = j.buf.owner;
      out.be = be;
      if (be) be->synchronize();  // the gradients' kernels are done before other streams read them
      if (std::string e = drv->start(j.seq, j.buf.data, j.buf.len, j.lo, j.hi, j.buf.owner); !e.empty()) return e;
    }
    return "";
  }
  void check() {
    if (broken) return;
    if (std::string e = pump(); !e.empty()) fail(e);
  }
  void receive(ring::message m) {
    if (broken) return;
    if (!drv) {
      if (before.size() >= cfg.ring.max_early) return fail("too many messages before the first all-reduce");
      before.push_back(std::move(m));
      return;
    }
    if (std::string e = drv->receive(std::move(m)); !e.empty()) return fail(e);
    check();
  }
};

std::shared_ptr<reducer_port> make_reducer_port() { return std::make_shared<reducer_port>(); }

bool deliver(reducer_port& port, ring::message& m) {
  // In one process a chunk is applied by the thread that brings it, which may pass the next one on to
  // the next rank, and so on round the ring: past a few ranks, hand over instead of going deeper.
  thread_local int depth = 0;
  if (depth >= 8) return false;
  ++depth;
  port.strand.run([&port, mm = std::move(m)]() mutable { port.receive(std::move(mm)); });
  --depth;
  return true;
}

caf::behavior reducer(caf::event_based_actor* self, reducer_config cfg) {
  std::shared_ptr<reducer_port> port = cfg.port ? cfg.port : make_reducer_port();
  cfg.port = nullptr;  // no cycle: the port holds its config
  port->cfg = cfg;
  port->out.pool = &port->pool;
  port->owner = self->ctrl();
  port->me = port;
  // Ports of one ring hold each other through their links: the ring is let go when the reducer ends.
  self->attach_functor([port] {
    port->strand.run([port] {
      port->out.inner = nullptr;
      port->jobs.clear();
      port->before.clear();
      port->broken = true;
    });
  });
  const std::string who = "reducer " + std::to_string(cfg.rank);
  self->set_exception_handler(error_from_exception(who));

  struct waiting {
    int64_t seq;
    caf::response_promise reply;
    int64_t step;
  };
  auto replies = std::make_shared<std::deque<waiting>>();
  auto next_seq = std::make_shared<int64_t>(0);
  auto ticking = std::make_shared<bool>(false);
  auto fail = [self, replies, who](const std::string& why) {
    auto err = caf::make_error(caf::sec::runtime_error, who + ": " + why);
    for (waiting& w : *replies) w.reply.deliver(err);
    replies->clear();
    self->quit(err);
  };
  auto tick_later = [self, ticking, cfg] {
    if (*ticking) return;
    *ticking = true;
    self->delayed_send(self, std::max(std::chrono::milliseconds(10), cfg.timeout / 4), tick_atom::value);
  };
  auto enqueue = [self, port, replies, next_seq, tick_later](int64_t step, tensor_view buf, uint64_t lo, uint64_t hi) {
    auto reply = self->make_response_promise();
    if (lo > hi || hi > buf.len) {
      reply.deliver(caf::make_error(caf::sec::invalid_argument, "reducer: bad window"));
      return reply;
    }
    const int64_t seq = (*next_seq)++;
    replies->push_back({seq, reply, step});
    port->strand.run([port, j = job{seq, std::move(buf), size_t(lo), size_t(hi)}]() mutable {
      if (port->broken) return port->tell(caf::make_message(fail_atom::value, std::string("the ring failed earlier")));
      port->jobs.push_back(std::move(j));
      port->check();
    });
    tick_later();
    return reply;
  };

  return {
      [port](ring_atom, link_ptr right) {
        port->strand.run([port, right] {
          port->out.host = right && host_only(*right);
          port->out.inner = right;
        });
      },
      [port](ring_atom) {  // leave the ring: staging buffers go back to their backends now
        port->strand.run([port] {
          port->drv.reset();
          port->ops = nullptr;
          port->pool = chunk_pool{};
        });
        return true;
      },
      [enqueue](reduce_atom, int64_t step, tensor_view buf) {
        const uint64_t len = buf.len;
        return enqueue(step, std::move(buf), 0, len);
      },
      [enqueue](reduce_atom, int64_t step, tensor_view buf, uint64_t lo, uint64_t hi) {
        return enqueue(step, std::move(buf), lo, hi);
      },
      [port](chunk_atom, ring::message m) {
        port->strand.run([port, mm = std::move(m)]() mutable { port->receive(std::move(mm)); });
      },
      [replies](release_atom, int64_t seq) {  // all-reduce `seq` is done on every rank
        if (replies->empty() || replies->front().seq != seq) return;
        replies->front().reply.deliver(replies->front().step);
        replies->pop_front();
      },
      [fail](fail_atom, const std::string& why) { fail(why); },
      [port, ticking, replies, tick_later, cfg](tick_atom) {
        *ticking = false;
        if (replies->empty()) return;
        port->strand.run([port, timeout = cfg.timeout] {
          if (port->broken || !port->drv || !port->drv->active()) return;
          const auto quiet = clock_type::now() - port->drv->last_progress();
          if (quiet > timeout)
            port->fail("no progress for " + std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(quiet).count()) +
                       " ms: " + port->drv->waiting_for());
        });
        tick_later();
      },
  };
}

}  // namespace ringmaster
