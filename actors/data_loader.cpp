#include "actors/data_loader.hpp"

#include <algorithm>
#include <atomic>

#include "actors/messages.hpp"

namespace ringmaster {
namespace {

struct loader_state {
  loader_config cfg;
  caf::actor sink;
  int credits = 0;
  int64_t epoch = 0, step = 0, steps = 0;
  int gen = 0;  // the ring generation the shard is cut for
  std::vector<uint32_t> order;  // this epoch's permutation
  // Batches handed out before; one is reused once the replica has let go of it (at most prefetch + 1
  // live at a time), so steady-state training allocates no batch memory.
  std::vector<std::shared_ptr<batch>> pool;

  std::shared_ptr<batch> fresh() {
    for (auto& b : pool)
      if (b.use_count() == 1) {
        // The replica's reads happened before its release of the pointer; order our writes after them.
        std::atomic_thread_fence(std::memory_order_acquire);
        return b;
      }
    pool.push_back(std::make_shared<batch>());
    return pool.back();
  }
};

// This replica's shard of global batch `step`: samples order[step*B + shard_begin, step*B + shard_end).
batch_ptr cut(loader_state& st) {
  const dataset& d = *st.cfg.data;
  const int b = st.cfg.shard_end - st.cfg.shard_begin;
  std::shared_ptr<batch> out = st.fresh();
  out->epoch = st.epoch;
  out->step = st.step;
  out->size = b;
  out->gen = st.gen;
  out->x.resize(size_t(b) * d.features());
  out->y.resize(b);
  const size_t first = size_t(st.step) * st.cfg.global_batch + size_t(st.cfg.shard_begin);
  gather_samples(d, st.order.data() + first, size_t(b), out->x.data(), out->y.data(), st.cfg.from_bytes);
  return out;
}

void push(caf::event_based_actor* self, loader_state& st) {
  while (st.credits > 0 && st.epoch < st.cfg.epochs) {
    if (st.order.empty())  // a new epoch, or the first batch of a resumed one
      st.order = epoch_permutation(st.cfg.data->count, st.cfg.seed, st.epoch);
    self->send(st.sink, batch_atom::value, cut(st));
    --st.credits;
    if (++st.step == st.steps) {
      st.step = 0;
      ++st.epoch;
      st.order.clear();
    }
  }
}

}  // namespace

caf::behavior data_loader(caf::event_based_actor* self, loader_config cfg) {
  auto st = std::make_shared<loader_state>();
  st->steps = int64_t(steps_per_epoch(cfg.data->count, size_t(cfg.global_batch)));
  st->credits = std::max(1, cfg.prefetch);
  st->gen = cfg.gen;
  if (st->steps > 0) {
    st->epoch = cfg.first_step / st->steps;
    st->step = cfg.first_step % st->steps;
  }
  st->cfg = std::move(cfg);
  return {
      [self, st](run_atom, caf::actor sink) {
        st->sink = std::move(sink);
        push(self, *st);
      },
      [self, st](credit_atom) {
        ++st->credits;
        push(self, *st);
      },
      [self, st](reform_atom, int gen, int64_t start, int shard_begin, int shard_end) {
        // The replica sends this after its last credit for the old shard, and sends credits only for
        // batches of the new generation: the prefetch window starts afresh.
        st->gen = gen;
        st->cfg.shard_begin = shard_begin;
        st->cfg.shard_end = shard_end;
        st->epoch = st->steps ? start / st->steps : 0;
        st->step = st->steps ? start % st->steps : 0;
        st->order = st->epoch < st->cfg.epochs ? epoch_permutation(st->cfg.data->count, st->cfg.seed, st->epoch)
                                               : std::vector<uint32_t>{};
        st->credits = std::max(1, st->cfg.prefetch);
        push(self, *st);
      },
  };
}

}  // namespace ringmaster
