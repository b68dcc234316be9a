#include "actors/reducer.hpp"

#include <algorithm>
#include <atomic>
#include <deque>
#include <future>

#include "actors/chunk_pool.hpp"
#include "actors/messages.hpp"
#include "actors/ring_links.hpp"
#include "kernels/cpu_kernels.hpp"
#include "net/bridge.hpp"
#include "net/spin.hpp"
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
  bool copies_at_send() const override { return inner && inner->copies_at_send(); }
  void await_release() override {
    if (inner) inner->await_release();
  }
};

struct job {
  int64_t seq;
  tensor_view buf;
  size_t lo, hi;
  reduce_done done;
};

}  // namespace

// Set while this thread runs a task of some port's strand: news that comes then (a neighbour letting go
// of our buffer) may be acted on at once, as on any thread but a bridge's, which may be tidying its own
// queues when it lets go (there it is queued, and the reducer actor runs it).
thread_local int strand_depth = 0;
// The port this thread polls in poll_briefly, if any.
thread_local const reducer_port* polling_port = nullptr;

// A rank's ring state. Touched only inside its strand's tasks, whichever thread runs them.
class reducer_port {
 public:
  net::strand strand;
  reducer_config cfg;
  staging_link out;
  std::unique_ptr<ring::driver> drv;
  device_ops* ops = nullptr;  // owned by drv
  std::deque<job> jobs;       // the front one runs while drv->active()
  std::deque<ring::message> before;  // messages that came before our first all-reduce
  size_t held_bytes = 0;             // in `before`
  chunk_pool pool;
  int64_t next_seq = 0;
  std::string broken;  // why the ring failed; empty while it works
  std::weak_ptr<reducer_port> me;
  // Shared with other threads.
  std::atomic<bool> closed{false};     // the reducer has ended: nobody will run queued work
  std::atomic<bool> ticking{false};    // the reducer's watchdog ticks
  std::atomic<size_t> queued{0};       // jobs.size(), for the watchdog
  std::atomic<int> stalled_on{-1};     // the rank the watchdog gave up waiting for (-1: it did not)
  std::atomic<bool> link_broke{false}; // or whose link closed (fail_link)
  std::atomic<bool> polled{false};     // its replica's thread waits in poll_briefly: submit() leaves work to it
  caf::weak_actor_ptr owner;           // the reducer actor
  struct polling {
    ring_poller poll;
    std::chrono::microseconds budget;
  };
  std::shared_ptr<const polling> poller;  // set_poller; read and written with atomic_load/atomic_store

  // Runs f in the strand; an exception fails the ring instead of vanishing (a CUDA error, no memory).
  template <class F>
  void run(F f) {
    strand.run([this, f = std::move(f)]() mutable { guarded(f); });
  }
  template <class F>
  void guarded(F& f) {
    ++strand_depth;
    try {
      f();
    } catch (const std::exception& e) {
      fail(std::string("exception: ") + e.what());
    } catch (...) {
      fail("unknown exception");
    }
    --strand_depth;
  }
  // Runs f in the strand: at once on this thread, or, while the port's replica polls for the ring's end
  // (poll_briefly), left to the replica's thread, which has nothing else to do. Else, in one process, the
  // rank that finished backward last would do the ring's adds and copies for every rank (in a 2-replica
  // ring, ~10% of its step), which kept it last step after step.
  template <class F>
  void submit(F f) {
    if (!polled.load() || polling_port == this) return run(std::move(f));
    strand.post([this, f = std::move(f)]() mutable { guarded(f); });
    if (!polled.load()) strand.drain();  // the poll ended meanwhile: its last look may have missed f
  }
  // Has the reducer actor run the strand's queued work (when this thread must not).
  void hand_over() {
    if (auto a = owner.lock()) caf::anon_send(caf::actor_cast<caf::actor>(a), release_atom::value, int64_t(0));
  }

  void fail(const std::string& why) {
    if (!broken.empty()) return;
    broken = "reducer " + std::to_string(cfg.rank) + ": " + why;
    if (drv && drv->active()) drv->finish();  // lets go of the buffer (sends in flight still hold it)
    if (ops) ops->keep = nullptr;
    before.clear();
    std::deque<job> failed;
    failed.swap(jobs);
    queued = 0;
    for (job& j : failed) j.done(broken);
  }

  // Ends finished all-reduces and starts the next; "" or why it failed.
  std::string pump() {
    while (!jobs.empty() && broken.empty()) {
      if (drv && drv->active()) {
        if (!drv->finished()) return "";
        drv->finish();
        ops->keep = nullptr;
        job j = std::move(jobs.front());
        jobs.pop_front();
        queued = jobs.size();
        j.done("");
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
          auto p = me.lock();
          if (!p) return;
          auto task = [p] { p->check(); };
          // Inside ring work (a neighbour's thread), or on ZeroMQ's thread: at once, or left to a polling
          // replica. On a bridge thread the bridge may be tidying its own queues: queue it for the reducer
          // (or the polling replica, whichever looks first).
          if (strand_depth > 0 || !net::bridge::on_any_bridge_thread()) return p->submit(task);
          if (p->strand.post([p, task]() mutable { p->guarded(task); })) p->hand_over();
        });
        for (ring::message& m : before)
          if (std::string e = drv->receive(std::move(m)); !e.empty()) return e;
        before.clear();
        held_bytes = 0;
      }
      if ((be ? be->device() : -1) != ops->where)
        return "a buffer on device " + std::to_string(be ? be->device() : -1) + " after buffers on device " +
               std::to_string(ops->where) + ": a reducer sums in one place";
      if (cfg.size > 1 && !out.inner) return "all-reduce before the ring was joined";
      ops->be = be;
      ops->keep = j.buf.owner;
      out.be = be;
      if (be) be->synchronize();  // the gradients' kernels are done before other streams read them
      if (std::string e = drv->start(j.seq, j.buf.data, j.buf.len, j.lo, j.hi, j.buf.owner); !e.empty()) return e;
    }
    return "";
  }
  void check() {
    if (!broken.empty()) return;
    if (std::string e = pump(); !e.empty()) fail(e);
  }
  void receive(ring::message m) {
    if (!broken.empty()) return;
    if (!drv) {
      // Before our first all-reduce only the left neighbour's first one can be under way.
      held_bytes += m.count * sizeof(float);
      if (m.seq != 0 || before.size() >= cfg.ring.max_early || held_bytes > cfg.ring.max_early_bytes)
        return fail("rank " + std::to_string(m.sender) + " sent all-reduce " + std::to_string(m.seq) +
                    " before this rank's first, or more than it can hold");
      before.push_back(std::move(m));
      return;
    }
    if (std::string e = drv->receive(std::move(m)); !e.empty()) return fail(e);
    check();
  }
  void watchdog() {
    if (!broken.empty() || jobs.empty() || !drv || !drv->active()) return;
    // Only the right neighbour's reading of our sends is left: ask the link again, so that a link that
    // holds their owners (shared memory's references) never keeps them past a tick, whatever it missed.
    if (drv->rounds_done() && !drv->finished()) out.await_release();
    const auto quiet = clock_type::now() - drv->last_progress();
    if (quiet <= cfg.timeout) return;
    stalled_on = drv->waiting_rank();  // before fail(): whoever hears of the failure may ask
    fail("no progress for " + std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(quiet).count()) +
         " ms: " + drv->waiting_for());
  }
  // Gives everything back: the ring's buffers, the staging buffers to their backends, the links (which
  // hold the neighbours' ports: an in-process ring is a cycle until its reducers end).
  void leave(const std::string& why) {
    fail(why);
    drv.reset();
    ops = nullptr;
    pool = chunk_pool{};
    out.inner = nullptr;
    std::atomic_store(&poller, std::shared_ptr<const polling>{});
  }
};

std::shared_ptr<reducer_port> make_reducer_port(const reducer_config& cfg) {
  auto p = std::make_shared<reducer_port>();
  p->cfg = cfg;
  p->cfg.port = nullptr;
  p->me = p;
  p->out.pool = &p->pool;
  return p;
}

void deliver(reducer_port& port, ring::message m) {
  if (port.closed.load()) return;  // its reducer has ended: the chunk (and the sender's buffer) goes
  // In one process a chunk is applied by the thread that brings it, which may pass the next one on to
  // the next rank, and so on round the ring: past a few ranks, queue it (in order) for another thread.
  thread_local int depth = 0;
  auto task = [&port, mm = std::move(m)]() mutable { port.receive(std::move(mm)); };
  if (depth >= 8) {
    if (port.strand.post([&port, task = std::move(task)]() mutable { port.guarded(task); })) port.hand_over();
    return;
  }
  ++depth;
  port.submit(std::move(task));
  --depth;
}

void reduce(reducer_port& port, tensor_view buf, size_t lo, size_t hi, reduce_done done) {
  if (lo > hi || hi > buf.len) return done("reducer: window [" + std::to_string(lo) + ", " + std::to_string(hi) + ") of " + std::to_string(buf.len) + " floats");
  port.run([&port, buf = std::move(buf), lo, hi, done = std::move(done)]() mutable {
    if (!port.broken.empty()) return done(port.broken);
    port.jobs.push_back({port.next_seq++, std::move(buf), lo, hi, std::move(done)});
    port.queued = port.jobs.size();
    port.check();
  });
  if (!port.ticking.exchange(true)) {  // the watchdog sleeps while no all-reduce is asked for
    if (auto a = port.owner.lock()) caf::anon_send(caf::actor_cast<caf::actor>(a), tick_atom::value);
  }
}

void join(reducer_port& port, std::shared_ptr<ring::link> right) {
  port.run([&port, right = std::move(right)] {
    port.out.host = right && host_only(*right);
    port.out.inner = right;
  });
}

int stalled_on(const reducer_port& port) { return port.stalled_on.load(); }
bool link_broke(const reducer_port& port) { return port.link_broke.load(); }

void set_poller(reducer_port& port, ring_poller p, std::chrono::microseconds budget) {
  std::shared_ptr<const reducer_port::polling> set;
  if (p && budget.count() > 0) set = std::make_shared<const reducer_port::polling>(reducer_port::polling{std::move(p), budget});
  std::atomic_store(&port.poller, std::move(set));
}

void poll_briefly(reducer_port& port, const std::function<bool()>& done) {
  const auto p = std::atomic_load(&port.poller);
  if (!p) return;
  const std::function<bool()> ended = done ? done : [&port] { return port.queued.load() == 0; };
  if (ended()) return;
  // While this thread polls, chunks that other threads bring for the port are left to it (deliver); it
  // runs them between its looks, and once more after the poll (even one that throws), for any that came
  // as it ended. It looks at the count first: taking the strand's lock on every pass would make the
  // threads that post sleep on it.
  struct polling {
    reducer_port& port;
    explicit polling(reducer_port& p) : port(p) {
      polling_port = &p;
      p.polled = true;
    }
    ~polling() {
      port.polled = false;
      polling_port = nullptr;
      port.strand.drain();
    }
  } scope(port);
  p->poll(clock_type::now() + p->budget, [&port, &ended] {
    if (port.strand.waiting()) port.strand.drain();
    return ended();
  });
}

ring_poller spin_until_done() {
  return [](clock_type::time_point until, const std::function<bool()>& done) {
    for (uint32_t i = 1; !done(); ++i) {
      if ((i & 63) == 0 && clock_type::now() >= until) return false;
      net::cpu_relax();
    }
    return true;
  };
}

void fail(reducer_port& port, const std::string& why) {
  port.submit([&port, why] { port.fail(why); });
}

void fail_link(reducer_port& port, int rank, const std::string& why) {
  port.submit([&port, rank, why] {
    if (port.broken.empty()) port.stalled_on = rank, port.link_broke = true;  // before fail(), as the watchdog's
    port.fail(why);
  });
}

void leave(reducer_port& port) {
  auto done = std::make_shared<std::promise<void>>();
  auto left = done->get_future();
  port.run([&port, done] {
    port.leave("the reducer left the ring");
    done->set_value();
  });
  left.wait();  // on another thread if one ran the strand: it has finished by now
}

std::shared_ptr<reducer_port> spawn_reducer(caf::actor_system& sys, reducer_config cfg, caf::actor* out) {
  auto port = make_reducer_port(cfg);
  cfg.port = port;
  *out = sys.spawn(reducer, cfg);
  port->owner = caf::actor_cast<caf::weak_actor_ptr>(*out);  // before anyone else can reach the port
  return port;
}

caf::behavior reducer(caf::event_based_actor* self, reducer_config cfg) {
  std::shared_ptr<reducer_port> port = cfg.port;
  if (!port) {  // a port of its own, which nobody else knows yet
    port = make_reducer_port(cfg);
    port->owner = self->ctrl();
  }
  cfg.port = nullptr;
  self->set_exception_handler(error_from_exception("reducer " + std::to_string(cfg.rank)));
  // When the reducer ends, the port lets go of everything; chunks that come later are dropped.
  self->attach_functor([port] {
    port->closed = true;
    port->run([port] { port->leave("the reducer stopped"); });
  });
  // At least once a second: the ranks of a stalled ring then give up within a second of each other, and
  // a launcher that hears them (actors/launcher.hpp) can tell which rank they all waited for.
  const auto period = std::clamp<std::chrono::milliseconds>(cfg.timeout / 4, std::chrono::milliseconds(10), std::chrono::seconds(1));

  return {
      [port](ring_atom, link_ptr right) { join(*port, std::move(right)); },
      [port](release_atom, int64_t) { port->submit([] {}); },  // runs what other threads queued
      [self, port, period](tick_atom) {
        port->submit([port] { port->watchdog(); });
        if (port->queued.load() == 0) {  // idle: the next reduce() wakes the watchdog
          port->ticking = false;
          if (port->queued.load() == 0 || port->ticking.exchange(true)) return;
        }
        self->delayed_send(self, period, tick_atom::value);
      },
  };
}

}  // namespace ringmaster
