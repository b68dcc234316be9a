#include "actors/replica.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>

#include "actors/coordinator.hpp"  // fnv1a
#include "actors/messages.hpp"

namespace ringmaster {
namespace {

struct replica_state {
  replica_config cfg;
  std::unique_ptr<backend> be;
  std::unique_ptr<network> model;
  device_buffer<float> x;      // staging for non-host devices
  device_buffer<int32_t> y;
  caf::actor loader, reducer, coordinator;
  std::deque<batch_ptr> ready;
  std::vector<size_t> buckets;  // gradient_buckets(): first offsets, last bucket first
  size_t buckets_left = 0;      // of this step's all-reduces
  bool update_by_bucket = false;  // each bucket's update applied as its sum comes in (replica.hpp)
  double update_time = 0;       // this step's, so far
  step_report rep;              // this step's, sent once its update is applied
  std::chrono::steady_clock::time_point reduce_start;
  bool busy = false;
  bool restored = false;   // a resumed job's state is in
  int64_t done_steps = 0;  // of the whole job, a resumed one's earlier steps included
  // Elastic jobs: the ring generation it works in, and whether it is paused (for generation pause_gen).
  int gen = 0, pause_gen = 0;
  bool paused = false;
  bool stalled = false;  // this generation's ring stalled (reported once; a pause comes next)
  // A pause planned for once `pause_at` steps are applied (-1: none), for generation planned_gen.
  int64_t pause_at = -1;
  int planned_gen = 0;
  bool hung = false;  // testing (replica_config::stall_at_join_pause)
  bool held = false;  // told to start no further step ({hold_atom}) until a planned pause names one
  // Rank 0's state for a checkpoint is not yet taken: the next step waits, so that a coordinator writing
  // slower than the ranks train holds them back instead of queueing states (and a stop behind them all).
  bool state_out = false;
  std::chrono::steady_clock::time_point idle_since = std::chrono::steady_clock::now();
};

double since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Copies a batch to the device when it is not host memory; returns device pointers.
std::pair<const float*, const int32_t*> stage(replica_state& st, const float* x, const int32_t* y, int n) {
  if (st.be->is_host()) return {x, y};
  const size_t f = st.cfg.def->input().size();
  st.be->copy_in(st.x.data(), x, size_t(n) * f * sizeof(float));
  st.be->copy_in(st.y.data(), y, size_t(n) * sizeof(int32_t));
  return {st.x.data(), st.y.data()};
}

eval_report evaluate(replica_state& st, int64_t epoch) {
  auto t0 = std::chrono::steady_clock::now();
  eval_report r;
  r.rank = st.cfg.rank;
  r.gen = st.gen;
  r.epoch = epoch;
  const dataset& d = *st.cfg.test;
  const int chunk = st.model->max_batch();
  for (size_t i = st.cfg.test_begin; i < st.cfg.test_end; i += chunk) {
    const int n = int(std::min<size_t>(chunk, st.cfg.test_end - i));
    auto [x, y] = stage(st, d.pixels.data() + i * d.features(), d.labels.data() + i, n);
    batch_metrics m = st.model->evaluate(x, y, n);
    r.loss_sum += m.loss_sum;
    r.correct += m.correct;
    r.count += m.count;
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

// A resumed job's state: it must be the one after the steps this replica starts from.
bool restore(replica_state& st, const network_state& s, std::string* error) {
  if (s.steps != st.cfg.first_step) {
    *error = "the state to resume from is after step " + std::to_string(s.steps) + ", the job starts after step " +
             std::to_string(st.cfg.first_step);
    return false;
  }
  return st.restored = st.model->load_state(s, error);
}

// Stops for ring generation `gen`: nothing more is applied; the launcher hears how far it got.
void pause_now(caf::event_based_actor* self, replica_state& st, int gen) {
  st.paused = true;
  st.pause_gen = gen;
  st.pause_at = -1;
  self->send(st.coordinator, pause_report{st.cfg.rank, gen, st.done_steps, st.cfg.state_sums ? state_checksum(*st.model) : 0});
}

// Continues in a re-formed ring (actors/reform.hpp) from global step rf.start_step (one step behind, it
// was sent the state after it first), the new shard goes to the loader, and a finished epoch the lost
// ranks may not have evaluated is evaluated again.
void continue_in(caf::event_based_actor* self, replica_state& st, const rank_reform& rf) {
  auto fail = [&](const std::string& why) {
    self->quit(caf::make_error(caf::sec::runtime_error, "replica " + std::to_string(st.cfg.rank) + ": " + why));
  };
  if (!st.paused || rf.gen != st.pause_gen)
    return fail("re-formed ring " + std::to_string(rf.gen) + " without a pause for it");
  if (st.done_steps != rf.start_step)
    return fail("cannot continue from step " + std::to_string(rf.start_step) + ": it applied " + std::to_string(st.done_steps));
  const int b = rf.batch_end - rf.batch_begin;
  if (b > st.model->max_batch()) {  // a larger shard: room for it (parameters and gradients stay put)
    st.model->reserve(b);
    if (!st.be->is_host()) {
      st.x = device_buffer<float>(*st.be, size_t(b) * st.cfg.def->input().size());
      st.y = device_buffer<int32_t>(*st.be, size_t(b));
    }
  }
  st.gen = rf.gen;
  st.cfg.rank = rf.rank;
  st.cfg.replicas = rf.replicas;
  st.cfg.port = rf.port;
  st.cfg.shard_begin = rf.batch_begin;
  st.cfg.test_begin = rf.test_begin;
  st.cfg.test_end = rf.test_end;
  st.ready.clear();
  st.busy = st.paused = st.stalled = false;
  st.buckets_left = 0;
  self->send(st.loader, reform_atom::value, rf.gen, rf.start_step, rf.batch_begin, rf.batch_end);
  const int64_t steps = st.cfg.steps_per_epoch;
  // The new rank 0 has the state after start_step: a checkpoint due then whose state went with a lost
  // rank 0 gets it from here (the coordinator ignores it if it has one already).
  if (rf.rank == 0 && st.cfg.checkpoints && rf.start_step > 0 &&
      checkpoint_due(rf.start_step, st.cfg.checkpoint_every, steps, steps * st.cfg.epochs)) {
    auto state = std::make_shared<network_state>();
    st.model->save_state(state.get());
    self->request(st.coordinator, caf::infinite, checkpt_atom::value, state_ptr(std::move(state))).then([](bool) {});
  }
  if (rf.evaluate_again && rf.start_step > 0 && rf.start_step % steps == 0 && st.cfg.test)
    self->send(st.coordinator, evaluate(st, rf.start_step / steps - 1));
  if (st.done_steps == steps * st.cfg.epochs) self->send(st.coordinator, done_atom::value, st.cfg.rank);
  st.idle_since = std::chrono::steady_clock::now();
}

}  // namespace

std::vector<size_t> gradient_buckets(const model& m, size_t bucket_floats) {
  std::vector<size_t> firsts;
  size_t acc = 0;
  for (size_t l = m.layers().size(); l-- > 0;) {
    const auto& e = m.layers()[l];  // its parameters are params()[first_param, first_param + param_count)
    if (!e.param_count) continue;
    const size_t first = m.params()[e.first_param].offset;
    for (size_t p = 0; p < e.param_count; ++p) acc += m.params()[e.first_param + p].count;
    if (bucket_floats > 0 && acc >= bucket_floats && first > 0) {
      firsts.push_back(first);
      acc = 0;
    }
  }
  firsts.push_back(0);
  return firsts;
}

caf::behavior replica(caf::event_based_actor* self, replica_config cfg) {
  auto st = std::make_shared<replica_state>();
  std::string error;
  st->be = make_backend_with(cfg.make_backend, cfg.device, &error);
  if (!st->be) {
    self->quit(caf::make_error(caf::sec::runtime_error, "replica " + std::to_string(cfg.rank) + " on " + cfg.device + ": " + error));
    return {};
  }
  const int b = cfg.global_batch / cfg.replicas;
  try {  // out of device memory, say: the job fails with the reason, the process lives on
    st->model = std::make_unique<network>(*st->be, cfg.def, b, cfg.opt, cfg.grad_memory.get());
    st->model->set_params(cfg.init_params->data());
    if (!st->be->is_host()) {
      st->x = device_buffer<float>(*st->be, size_t(b) * cfg.def->input().size());
      st->y = device_buffer<int32_t>(*st->be, size_t(b));
    }
  } catch (const std::exception& e) {
    self->quit(caf::make_error(caf::sec::runtime_error, "replica " + std::to_string(cfg.rank) + " on " + cfg.device + ": " + e.what()));
    return {};
  }
  st->cfg = std::move(cfg);
  st->gen = st->cfg.gen;
  st->done_steps = st->cfg.first_step;
  if (st->cfg.resume && !restore(*st, *st->cfg.resume, &error)) {
    self->quit(caf::make_error(caf::sec::runtime_error, "replica " + std::to_string(st->cfg.rank) + ": " + error));
    return {};
  }
  // A GPU's kernels are only queued when backward returns a layer: its buffer goes as one bucket.
  st->buckets = gradient_buckets(*st->cfg.def, st->be->is_host() ? st->cfg.bucket_floats : 0);
  st->update_by_bucket = st->buckets.size() > 1 && !st->cfg.elastic;

  // Runs the next step if a batch is here and the previous update has been applied.
  auto try_step = std::make_shared<std::function<void()>>();
  *try_step = [self, st, try_step] {
    if (st->busy || st->paused || st->held || st->state_out || st->ready.empty()) return;
    if (st->hung || (st->cfg.stall_after_steps >= 0 && st->done_steps >= st->cfg.stall_after_steps)) return;  // testing: hung
    batch_ptr bt = std::move(st->ready.front());
    st->ready.pop_front();
    st->busy = true;
    self->send(st->loader, credit_atom::value);
    const auto t0 = std::chrono::steady_clock::now();
    auto [x, y] = stage(*st, bt->x.data(), bt->y.data(), bt->size);
    // The batch's first sample is number step * B + shard_begin of its epoch, whatever the replica count.
    const sample_key key{st->cfg.seed, bt->epoch, bt->step * st->cfg.global_batch + int64_t(st->cfg.shard_begin)};
    // Buckets (last layers first) go to the reducer as backward produces them, so the ring runs while
    // earlier layers still compute. The reducer sums where the gradients are (a GPU's stay on it) with
    // this replica's backend; it and its neighbours hold the replica's state (and so the backend) alive
    // while they use the buffer, even if the replica is stopped mid all-reduce.
    float* g = st->model->grads();
    tensor_view grads{g, st->model->size(), std::shared_ptr<const void>(st, g), st->be.get()};
    st->buckets_left = st->buckets.size();
    st->update_time = 0;
    // The port runs the all-reduce on this thread or its neighbours'; only its end comes back here.
    // The end comes back with the generation it was asked in: one of a ring given up on is ignored.
    caf::weak_actor_ptr me{self->ctrl()};
    size_t next = 0, hi = st->model->size();
    auto issue = [&](size_t upto) {  // every bucket whose gradients are final from `upto` on
      for (; next < st->buckets.size() && st->buckets[next] >= upto; ++next) {
        reduce(*st->cfg.port, grads, st->buckets[next], hi, [me, gen = st->gen, lo = st->buckets[next], hi](const std::string& error) {
          if (auto a = me.lock())
            caf::anon_send(caf::actor_cast<caf::actor>(a), reduce_atom::value, error, gen, uint64_t(lo), uint64_t(hi));
        });
        hi = st->buckets[next];
      }
    };
    batch_metrics m = st->model->forward_backward(x, y, bt->size, 1.0f / float(st->cfg.global_batch), key,
                                                  st->buckets.size() > 1 ? std::function<void(size_t)>(issue) : nullptr);
    st->rep = step_report{st->cfg.rank, st->gen, bt->epoch, bt->step, m.loss_sum, m.correct, m.count};
    st->rep.wait_batch = std::chrono::duration<double>(t0 - st->idle_since).count();
    st->rep.compute = since(t0);
    st->reduce_start = std::chrono::steady_clock::now();
    issue(0);
  };

  // A bucket's all-reduce ended; once all have, the update and the next step. Paused, it applies nothing:
  // the steps it said it applied are all it applies.
  auto reduced = [self, st, try_step](const std::string& error, int gen, size_t lo, size_t hi) {
    if (gen != st->gen || st->paused) return;
    if (!error.empty()) {
      // Elastic: a ring that waited too long for one rank goes on without that rank's node. The launcher
      // works out which rank that is from every rank's report, and pauses the others (this one among them).
      // A link between nodes that closed is the launcher's to judge in any job: a node gone, a pause
      // that reached the other end first, or a connection broken between live nodes (re-formed as it was).
      const bool link = link_broke(*st->cfg.port);
      if (const int waited = stalled_on(*st->cfg.port); (st->cfg.elastic || link) && waited >= 0) {
        if (!st->stalled) self->send(st->coordinator, stall_report{st->cfg.rank, st->gen, waited, error, link});
        st->stalled = true;
        return;
      }
      return self->quit(caf::make_error(caf::sec::runtime_error, error));
    }
    if (st->buckets_left == 0) return;
    const auto t2 = std::chrono::steady_clock::now();
    const double before = st->update_time;  // the updates applied before this sum came in
    if (st->update_by_bucket) {
      st->model->apply_part(st->model->grads(), lo, hi);
      st->update_time += since(t2);
    }
    if (--st->buckets_left > 0) return;
    step_report& rep = st->rep;
    // The ring's wait: from backward's end to the last sum, less the updates applied meanwhile.
    rep.wait_ring = std::chrono::duration<double>(t2 - st->reduce_start).count() - before;
    if (st->update_by_bucket) {
      st->model->end_step();
    } else {
      st->model->apply(st->model->grads());
      st->update_time = since(t2);
    }
    rep.update = st->update_time;
    ++st->done_steps;
    const int64_t total = st->cfg.steps_per_epoch * st->cfg.epochs;
    // At a checkpoint's step rank 0 sends its state, and every rank reports its state's checksum.
    std::shared_ptr<network_state> state;
    rep.state_sum = 0;
    if (st->cfg.checkpoints && checkpoint_due(st->done_steps, st->cfg.checkpoint_every, st->cfg.steps_per_epoch, total)) {
      if (st->cfg.rank == 0) {
        state = std::make_shared<network_state>();
        st->model->save_state(state.get());
      }
      if (st->cfg.state_sums) rep.state_sum = state ? state_checksum(*state) : state_checksum(*st->model);
    }
    self->send(st->coordinator, rep);
    if (state) {
      st->state_out = true;
      self->request(st->coordinator, caf::infinite, checkpt_atom::value, state_ptr(std::move(state))).then([st, try_step](bool) {
        st->state_out = false;
        (*try_step)();
      });
    }
    if (rep.step + 1 == st->cfg.steps_per_epoch && st->cfg.test) self->send(st->coordinator, evaluate(*st, rep.epoch));
    // The evaluation and saving the state were no wait for a batch (rank 0's wait for the coordinator to
    // take its state, a checkpoint written, still counts as one).
    st->idle_since = std::chrono::steady_clock::now();
    st->busy = false;
    if (st->done_steps == total) self->send(st->coordinator, done_atom::value, st->cfg.rank);
    if (st->pause_at >= 0 && st->done_steps >= st->pause_at) return pause_now(self, *st, st->planned_gen);
    (*try_step)();
  };

  // try_step holds itself; break that cycle when the actor ends so its state (and device memory) is freed.
  self->attach_functor([try_step] { *try_step = nullptr; });
  // A layer or backend that throws (a user layer, a CUDA error) ends this replica, and so the job, with
  // its message rather than a bare error code.
  self->set_exception_handler(error_from_exception("replica " + std::to_string(st->cfg.rank) + " on " + st->cfg.device));

  return {
      [self, st](run_atom, caf::actor loader, caf::actor reducer, caf::actor coordinator) {
        if (st->cfg.first_step > 0 && !st->restored)
          return self->quit(caf::make_error(caf::sec::runtime_error, "replica " + std::to_string(st->cfg.rank) +
                                                                          ": started without the state to resume from"));
        st->loader = std::move(loader);
        st->reducer = std::move(reducer);
        st->coordinator = std::move(coordinator);
        self->send(st->loader, run_atom::value, caf::actor_cast<caf::actor>(self));
      },
      [reduced](reduce_atom, const std::string& error, int gen, uint64_t lo, uint64_t hi) { reduced(error, gen, lo, hi); },
      [self, st](restore_atom, state_ptr s) {
        std::string error;
        // Paused one step behind the others (elastic, actors/reform.hpp): it goes forward to their state.
        if (st->paused && s) {
          if (s->steps == st->done_steps) return;  // there already
          if (s->steps != st->done_steps + 1)
            error = "paused after " + std::to_string(st->done_steps) + " steps, it was sent the state after " + std::to_string(s->steps);
          else if (st->model->load_state(*s, &error))
            return void(st->done_steps = s->steps);
          return self->quit(caf::make_error(caf::sec::runtime_error, "replica " + std::to_string(st->cfg.rank) + ": " + error));
        }
        if (st->loader || !s || !restore(*st, *s, &error))  // a resumed job's: never once it runs
          self->quit(caf::make_error(caf::sec::runtime_error, "replica " + std::to_string(st->cfg.rank) + ": cannot resume: " +
                                                                  (error.empty() ? "it is running already" : error)));
      },
      [st, try_step](batch_atom, batch_ptr b) {
        if (b->gen != st->gen) return;  // cut for a ring given up on: no credit, the loader starts afresh
        const bool stepping = st->busy;
        st->ready.push_back(std::move(b));
        (*try_step)();
        // The next batch came while the ring still runs: nothing else to do here, so take the ring's
        // chunks on this thread (where the link allows) rather than sleep until a thread hands them on.
        // Not before the batch is in: on a node with one worker, the loader that sends it would wait.
        if (stepping) poll_briefly(*st->cfg.port);
      },
      [self, st](pause_atom, int gen) {
        if (gen > st->pause_gen && gen >= st->planned_gen) pause_now(self, *st, gen);
      },
      // Planned: a node joins the ring after step `at`, or the job stops there (after a hold). The
      // steps up to it run as before; a held replica goes on to it.
      [self, st, try_step](pause_atom, int gen, int64_t at) {
        if (gen <= st->pause_gen || gen <= st->planned_gen) return;
        st->planned_gen = gen;
        st->pause_at = at;
        st->hung = st->cfg.stall_at_join_pause;
        st->held = false;
        if (st->done_steps >= at) return pause_now(self, *st, gen);
        (*try_step)();
      },
      // Every rank has started its last step by the time all answer, and none goes past the highest
      // count they answer (the others run up to it: a step in flight needs every rank's gradients).
      [st](hold_atom) -> int64_t {
        st->held = true;
        return st->done_steps + (st->busy ? 1 : 0);
      },
      [st](checkpt_atom) -> caf::result<state_ptr> {
        if (!st->paused) return caf::make_error(caf::sec::runtime_error, "replica " + std::to_string(st->cfg.rank) + " is not paused");
        auto state = std::make_shared<network_state>();
        st->model->save_state(state.get());
        return state_ptr(std::move(state));
      },
      [self, st](reform_atom, const rank_reform& rf) { continue_in(self, *st, rf); },
      [st](weights_atom) {
        auto w = std::make_shared<std::vector<float>>(st->model->size());
        st->model->get_params(w->data());
        return chunk_ptr(std::move(w));
      },
      [st](sum_atom) -> caf::result<uint64_t, bool> {
        std::vector<float> w(st->model->size());
        st->model->get_params(w.data());
        return {fnv1a(w.data(), w.size()), std::all_of(w.begin(), w.end(), [](float x) { return std::isfinite(x); })};
      },
  };
}

}  // namespace ringmaster
