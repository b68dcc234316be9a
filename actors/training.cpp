#include "actors/training.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <thread>
#include <tuple>

#include "actors/checkpoint.hpp"
#include "actors/data_loader.hpp"
#include "actors/job_plan.hpp"
#include "actors/local_ring.hpp"
#include "actors/messages.hpp"
#include "actors/reducer.hpp"
#include "actors/replica.hpp"
#include "actors/ring_links.hpp"
#include "kernels/host_memory.hpp"

namespace ringmaster {

std::shared_ptr<const model> build_model(const train_config& cfg, std::string* error) {
  if (!cfg.train) {
    *error = "no training data";
    return nullptr;
  }
  return model::build(cfg.model, cfg.layers ? *cfg.layers : layer_registry::with_builtins(), cfg.train->sample(), error);
}

std::string run_check_model(const train_config& cfg, const model& m) {
  if (!cfg.check_model) return "";
  try {  // the user's: train() never throws
    return cfg.check_model(m);
  } catch (const std::exception& x) {
    return std::string("check_model threw: ") + x.what();
  } catch (...) {
    return "check_model threw";
  }
}

// Whether `bytes` more fit in the tighter of two bounds: half the memory this process may use (the
// machine's, or its control group's limit: kernels/host_memory.hpp), and what the address-space limit
// (ulimit -v) leaves this process once the threads a job starts have their stacks and malloc arenas
// (8 + 64 MiB of address space each); else false with *room naming that bound.
bool enough_memory(double bytes, std::string* room) {
  const memory_bound usable = usable_memory();
  double most = usable.bytes > 0 ? usable.bytes / 2 : HUGE_VAL;
  *room = usable.group.empty() ? "half of this machine's memory" : "half of " + describe(usable);
  rlimit as{};
  if (getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY) {
    long pages = 0;  // the address space in use now: /proc/self/statm's first figure
    if (FILE* f = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
      std::fclose(f);
    }
    const double threads = cpu_cores() + 4;  // the scheduler's workers and CAF's own
    const double left = std::max(0.0, double(as.rlim_cur) - double(pages) * double(sysconf(_SC_PAGE_SIZE)) - threads * (72 << 20));
    if (left < most) {
      most = left;
      const auto mib = [](double b) { return std::to_string(int64_t(b / (1 << 20))); };
      *room = "the " + mib(left) + " MiB its address-space limit (ulimit -v, " + mib(double(as.rlim_cur)) + " MiB) leaves after the " +
              mib(double(pages) * double(sysconf(_SC_PAGE_SIZE))) + " MiB this process has mapped (its libraries, the data) and " +
              mib(threads * (72 << 20)) + " MiB for its threads' stacks and heaps";
    }
  }
  return bytes <= most;
}

std::string check_config(const train_config& cfg, const model& m, int replicas_here) {
  if (cfg.replicas < 1 || cfg.replicas > local_ring::kMaxRanks) return "replicas must be in 1.." + std::to_string(local_ring::kMaxRanks);
  if (cfg.global_batch < 1) return "batch must be positive";
  if (cfg.global_batch % cfg.replicas != 0)
    return "global batch " + std::to_string(cfg.global_batch) + " is not divisible by " +
           std::to_string(cfg.replicas) + " replicas";
  if (cfg.epochs < 1) return "epochs must be at least 1";
  // A thread each: 100,000 made std::thread throw (an abort), INT_MAX a memory blow-up.
  if (cfg.threads < 0 || cfg.threads > 1024) return "threads must be in 0..1024 (0: one per replica, at most one per core)";
  if (!cfg.devices.empty() && int(cfg.devices.size()) != cfg.replicas)
    return std::to_string(cfg.devices.size()) + " devices given for " + std::to_string(cfg.replicas) +
           " replicas";
  // A ring sums in one kind of memory: every replica on CPUs, or every replica on GPUs.
  for (const std::string& d : cfg.devices)
    if (device_kind(d) != device_kind(cfg.devices[0]))
      return "replicas on " + cfg.devices[0] + " and on " + d +
             " in one job: a ring sums in one kind of memory, so put every replica on CPUs or every replica on GPUs";
  // 2^28 floats = 1 GiB: a ring chunk then always fits one wire message (net/wire.hpp's limit).
  if (m.param_count() == 0) return "model " + m.label() + " has no parameters: there is nothing to train";
  if (m.param_count() > (size_t(1) << 28))
    return "model " + m.label() + " has " + std::to_string(m.param_count()) +
           " parameters; the limit is 2^28 (each replica holds 4 such buffers)";
  if (!cfg.train) return "no training data";
  // A dataset filled by hand (its fields are public) whose count is more than its arrays hold would be read
  // past their ends: its labels by the check below, its samples by the loaders (checked last).
  for (const auto& [d, name] : {std::pair{cfg.train.get(), "training"}, std::pair{cfg.test.get(), "test"}})
    if (d && d->labels.size() != d->count)
      return std::to_string(d->count) + " " + name + " samples with " + std::to_string(d->labels.size()) + " labels";
  if (cfg.train->sample() != m.input())
    return "model input " + m.input().str() + " does not match the data's samples " + cfg.train->sample().str();
  if (steps_per_epoch(cfg.train->count, cfg.global_batch) == 0)
    return "global batch " + std::to_string(cfg.global_batch) + " is larger than the " +
           std::to_string(cfg.train->count) + " training samples";
  if (cfg.test && cfg.test->sample() != cfg.train->sample()) return "test and training data differ in shape";
  for (const auto* d : {cfg.train.get(), cfg.test.get()})
    for (size_t i = 0; d && i < d->count; ++i)
      if (d->labels[i] < 0 || d->labels[i] >= m.classes())
        return "label " + std::to_string(d->labels[i]) + " of " + (d == cfg.train.get() ? "training" : "test") + " sample " +
               std::to_string(i) + " is out of range for a model with " + std::to_string(m.classes()) + " outputs";
  const optimizer_config& o = cfg.opt;  // from the network on nodes: a bad value would only make NaNs
  if (!(o.lr > 0) || !std::isfinite(o.lr)) return "learning rate must be a positive number";
  if (!(o.beta1 >= 0 && o.beta1 < 1) || !(o.beta2 >= 0 && o.beta2 < 1) || !(o.eps > 0) || !std::isfinite(o.eps) ||
      !(o.momentum >= 0 && o.momentum <= 1))
    return "optimizer settings out of range (beta1, beta2 in [0, 1), eps > 0, momentum in [0, 1])";
  // What one replica will hold, before any of it is allocated (a description can ask for terabytes).
  const int b = cfg.global_batch / cfg.replicas;
  double largest = 0, floats = 0;
  try {  // a user layer's workspace() may throw: the caller's thread must not end
    largest = m.largest_buffer_floats(b);
    floats = m.memory_floats(b);
  } catch (const std::exception& x) {
    return "model " + m.label() + ": a layer's workspace() threw: " + x.what();
  } catch (...) {
    return "model " + m.label() + ": a layer's workspace() threw";
  }
  if (largest >= double(INT32_MAX))
    return "model " + m.label() + " at " + std::to_string(b) + " samples per replica needs a buffer of over 2^31 floats";
  // Each replica's model and buffers, and its loader's batches (up to prefetch + 1 live at a time); and
  // once per process the initial weights all replicas share and the final ones (a replica's answer and the
  // result's copy).
  const double batches = double(cfg.prefetch + 1) * b * double(m.input().size() + 1);
  const double bytes = 4 * ((floats + batches) * replicas_here + 3 * double(m.param_count()));
  const bool host = cfg.devices.empty() || device_kind(cfg.devices[0]) == "cpu";
  std::string room;
  if (host && !enough_memory(bytes, &room))
    return "model " + m.label() + " at " + std::to_string(b) + " samples per replica, " + std::to_string(replicas_here) +
           " replica" + (replicas_here == 1 ? "" : "s") + " here with " + std::to_string(cfg.prefetch) +
           " batches prefetched each, needs " + std::to_string(int64_t(bytes / (1 << 20))) + " MiB, over " + room;
  for (const auto& [d, name] : {std::pair{cfg.train.get(), "training"}, std::pair{cfg.test.get(), "test"}}) {
    if (!d) continue;
    const std::string n = std::to_string(d->count) + " " + name + " samples";
    if (d->features() == 0 || d->pixels.size() / d->features() != d->count || d->pixels.size() % d->features() != 0)
      return n + " of " + std::to_string(d->features()) + " values each with " + std::to_string(d->pixels.size()) + " pixel values";
    if (!d->bytes.empty() && d->bytes.size() != d->pixels.size())
      return n + " with " + std::to_string(d->pixels.size()) + " pixel values and " + std::to_string(d->bytes.size()) + " bytes";
  }
  return "";
}

int cpu_cores() { return int(std::max(1u, std::thread::hardware_concurrency())); }

int workers_for(int threads, int replicas) { return threads > 0 ? threads : std::max(1, std::min(replicas, cpu_cores())); }

void configure(caf::actor_system_config& c, int threads) {
  // A shared queue wakes idle workers at once; work stealing would let them sleep up to 10 ms.
  // Replicas compute inside their handlers, so one worker per core and no other threads: then the
  // cores are never oversubscribed and a reducer runs as soon as a replica hands over its gradients.
  c.set("scheduler.policy", caf::atom("sharing"));
  c.set("scheduler.max-threads", threads > 0 ? threads : int(std::max(2u, std::thread::hardware_concurrency())));
  c.set("logger.console", caf::atom("none"));
}

reducer_config plan_reducer_config(const job_plan& plan, int rank, size_t params) {
  reducer_config red;
  red.rank = rank;
  red.size = plan.replicas();
  red.ring.job = plan.ring_id();
  red.timeout = std::chrono::milliseconds(plan.ring_timeout_ms);
  // What a left neighbour may have sent before this rank starts the all-reduce it is for: it is at most
  // one all-reduce ahead, and in one it sends us less than the whole gradient twice over. So a lying
  // neighbour (or, without keys, whoever logs in as it) pins at most that, not the driver's 2 GiB.
  red.ring.max_early_bytes = std::max<size_t>(size_t(16) << 20, 2 * params * sizeof(float));
  // The one-hop path pays for its copies only where a hop is expensive: when the ring leaves a process.
  // Every rank of a job decides alike, from the plan.
  if (plan.nodes.size() <= 1) red.ring.pair_small_bytes = red.ring.small_bytes;
  return red;
}

rank_actors spawn_ranks(caf::actor_system& sys, const job_plan& plan, const train_config& cfg,
                        std::shared_ptr<const model> m, const std::vector<int>& ranks,
                        const grad_memory_fn& grad_memory) {
  const int n = plan.replicas();
  const int64_t steps = int64_t(steps_per_epoch(cfg.train->count, size_t(plan.global_batch)));
  // A resumed job's state (on nodes it comes in a restore message instead).
  const state_ptr resume = cfg.resume ? state_ptr(cfg.resume, &cfg.resume->state) : nullptr;
  auto init = resume ? std::shared_ptr<const std::vector<float>>(resume, &resume->params)
              : cfg.init_params ? cfg.init_params
                                : std::make_shared<const std::vector<float>>(init_params(*m, plan.seed));
  // Batches from the images' bytes only if they still hold what pixels hold (a program may have changed
  // pixels after loading them): one pass, a few tens of ms for MNIST.
  const bool from_bytes = bytes_agree(*cfg.train);
  rank_actors out;
  for (int r : ranks) {
    const rank_plan& rp = plan.ranks[size_t(r)];
    loader_config lc{cfg.train, rp.batch_begin, rp.batch_end, plan.global_batch, plan.seed, plan.epochs, plan.prefetch,
                     plan.first_step, plan.generation, from_bytes};
    out.loaders.push_back(sys.spawn(data_loader, lc));
    caf::actor a;
    out.ports.push_back(spawn_reducer(sys, plan_reducer_config(plan, r, m->param_count()), &a));
    out.reducers.push_back(a);
    replica_config rc;
    rc.rank = r;
    rc.replicas = n;
    rc.device = rp.device;
    rc.def = m;
    rc.opt = plan.opt;
    rc.seed = plan.seed;
    rc.global_batch = plan.global_batch;
    rc.steps_per_epoch = steps;
    rc.epochs = plan.epochs;
    rc.init_params = init;
    rc.make_backend = cfg.make_backend;
    rc.bucket_floats = cfg.bucket_bytes / sizeof(float);
    rc.port = out.ports.back();
    rc.first_step = plan.first_step;
    rc.resume = resume;
    rc.checkpoints = plan.checkpoints;  // the coordinator writes rank 0's state (rank 0 may change: elastic)
    rc.state_sums = std::any_of(plan.ranks.begin(), plan.ranks.end(), [&](const rank_plan& o) { return o.node != plan.ranks[0].node; });
    rc.checkpoint_every = plan.checkpoint_every;
    rc.shard_begin = rp.batch_begin;
    rc.gen = plan.generation;
    rc.elastic = plan.elastic;
    rc.stall_after_steps = cfg.stall_after_steps;
    rc.stall_at_join_pause = cfg.stall_at_join_pause;
    if (grad_memory) rc.grad_memory = grad_memory(r, m->param_count());
    if (plan.evaluate && cfg.test) {
      rc.test = cfg.test;
      std::tie(rc.test_begin, rc.test_end) = plan.test_shard(r, cfg.test->count);  // sums are exact
    }
    out.replicas.push_back(sys.spawn(replica, rc));
  }
  return out;
}

std::shared_ptr<train_result> run_coordinator(caf::actor_system& sys, caf::actor coord, const rank_actors& all) {
  std::shared_ptr<train_result> result;
  caf::scoped_actor self{sys};
  self->request(coord, caf::infinite, run_atom::value, all.replicas, all.loaders, all.reducers)
      .receive([&](std::shared_ptr<train_result> r) { result = std::move(r); },
               [&](caf::error& e) {
                 result = std::make_shared<train_result>();
                 result->error = "coordinator failed: " + sys.render(e);
               });
  return result;
}

namespace {

train_result run_local(const train_config& cfg) {
  train_result failed;
  failed.invalid = true;  // until the job starts, a failure is the configuration's
  auto m = build_model(cfg, &failed.error);
  if (!m) return failed;
  if (failed.error = check_config(cfg, *m, cfg.replicas); !failed.error.empty()) return failed;
  if (cfg.init_params && cfg.init_params->size() != m->param_count()) {
    failed.error = "initial parameters have the wrong size for model " + m->label();
    return failed;
  }
  const int64_t steps = int64_t(steps_per_epoch(cfg.train->count, cfg.global_batch));
  // Which samples these are, for checkpoints: a resume must be on the data its checkpoint was made on.
  const uint32_t train_data = cfg.resume || !cfg.checkpoint_dir.empty() ? data_fingerprint(*cfg.train) : 0;
  if (cfg.resume && !(failed.error = resume_mismatch(*cfg.resume, cfg, m.get(), int64_t(cfg.train->count), train_data)).empty())
    return failed;
  if (!(failed.error = run_check_model(cfg, *m)).empty()) return failed;
  if (cfg.resume && trained_to_end(*cfg.resume, cfg)) return finished_run(*cfg.resume);
  std::shared_ptr<const void> dir_lock;  // the checkpoint folder is this job's until it returns
  if (!cfg.checkpoint_dir.empty() && (!(failed.error = check_checkpoint_dir(cfg.checkpoint_dir, cfg.resume != nullptr, &dir_lock)).empty() ||
                                      !(failed.error = check_checkpoint_room(cfg.checkpoint_dir, m->param_count(), cfg.opt.kind, cfg.epochs)).empty())) {
    failed.error = "checkpoints: " + failed.error;
    return failed;
  }
  job_plan plan;
  if (!make_local_plan(cfg, &plan, &failed.error)) return failed;
  caf::actor_system_config sys_cfg;
  // One replica on two workers waited for its reducer 11% of a step, on one 2%.
  const int workers = workers_for(cfg.threads, cfg.replicas);
  configure(sys_cfg, workers);
  caf::actor_system sys{sys_cfg};
  rank_actors all = spawn_ranks(sys, plan, cfg, m, plan.ranks_on(0));
  // The ring as the plan orders it, before any replica runs: rank r sends to its right neighbour.
  for (int r = 0; r < plan.replicas(); ++r)
    join(*all.ports[size_t(r)], make_port_link(all.ports[size_t(plan.right(r))]));
  // With a worker each, a replica whose next batch is in may spin for its ring's end instead of sleeping
  // (784-64-10: 7-12% more samples/s); with fewer, the spin would hold a worker another replica needs.
  if (std::min(workers, cpu_cores()) >= plan.replicas())
    for (auto& p : all.ports) set_poller(*p, spin_until_done(), cfg.ring_poll);
  auto last = std::make_shared<std::string>();
  coordinator_config cc = job_coordinator_config(cfg, m, cfg.replicas, cfg.evaluate && cfg.test != nullptr,
                                                 int64_t(cfg.train->count), train_data, steps, last);
  cc.interrupt = cfg.interrupt;
  train_result r = std::move(*run_coordinator(sys, sys.spawn(coordinator, cc), all));
  r.model = m->description();
  r.checkpoint = *last;
  return r;
}

}  // namespace

train_result train(const train_config& cfg) {
  const auto start = std::chrono::steady_clock::now();
  train_result r = run_local(cfg);
  r.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();  // a failed setup took its time too
  return r;
}

}  // namespace ringmaster
