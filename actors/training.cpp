#include "actors/training.hpp"

#include <thread>

#include "actors/data_loader.hpp"
#include "actors/messages.hpp"
#include "actors/reducer.hpp"
#include "actors/replica.hpp"

namespace ringmaster {

std::string check_config(const train_config& cfg, const model_spec& spec) {
  if (cfg.replicas < 1 || cfg.replicas > 1024) return "replicas must be in 1..1024";
  if (cfg.global_batch < 1) return "batch must be positive";
  if (cfg.global_batch % cfg.replicas != 0)
    return "global batch " + std::to_string(cfg.global_batch) + " is not divisible by " +
           std::to_string(cfg.replicas) + " replicas";
  if (cfg.epochs < 1) return "epochs must be at least 1";
  if (!cfg.devices.empty() && int(cfg.devices.size()) != cfg.replicas)
    return std::to_string(cfg.devices.size()) + " devices given for " + std::to_string(cfg.replicas) +
           " replicas";
  if (!cfg.train) return "no training data";
  if (size_t(cfg.train->features()) != size_t(spec.dims[0]))
    return "model input width " + std::to_string(spec.dims[0]) + " does not match the data's " +
           std::to_string(cfg.train->features()) + " features";
  if (steps_per_epoch(cfg.train->count, cfg.global_batch) == 0)
    return "global batch " + std::to_string(cfg.global_batch) + " is larger than the " +
           std::to_string(cfg.train->count) + " training samples";
  if (cfg.test && cfg.test->features() != cfg.train->features()) return "test and training data differ in shape";
  if (!(cfg.opt.lr > 0)) return "learning rate must be positive";
  return "";
}

train_result train(const train_config& cfg) {
  train_result failed;
  model_spec spec;
  if (!parse_model_spec(cfg.model, &spec, &failed.error)) return failed;
  if (failed.error = check_config(cfg, spec); !failed.error.empty()) return failed;
  const int n = cfg.replicas;

  caf::actor_system_config sys_cfg;
  // A shared queue wakes idle workers at once; work stealing would let them sleep up to 10 ms.
  sys_cfg.set("scheduler.policy", caf::atom("sharing"));
  const int threads = cfg.threads > 0 ? cfg.threads : int(std::max(2u, std::thread::hardware_concurrency()));
  sys_cfg.set("scheduler.max-threads", threads);
  sys_cfg.set("logger.console", caf::atom("none"));
  caf::actor_system sys{sys_cfg};

  auto init = cfg.init_params ? cfg.init_params
                              : std::make_shared<const std::vector<float>>(init_params(spec, cfg.seed));
  if (init->size() != spec.param_count()) {
    failed.error = "initial parameters have the wrong size for model " + spec.str();
    return failed;
  }
  const int64_t steps = int64_t(steps_per_epoch(cfg.train->count, cfg.global_batch));
  std::vector<caf::actor> replicas, loaders, reducers;
  for (int r = 0; r < n; ++r) {
    loader_config lc{cfg.train, r, n, cfg.global_batch, cfg.seed, cfg.epochs, cfg.prefetch};
    loaders.push_back(sys.spawn(data_loader, lc));
    reducers.push_back(sys.spawn(reducer, r, n));
    replica_config rc;
    rc.rank = r;
    rc.replicas = n;
    rc.device = cfg.devices.empty() ? "cpu" : cfg.devices[r];
    rc.spec = spec;
    rc.opt = cfg.opt;
    rc.global_batch = cfg.global_batch;
    rc.steps_per_epoch = steps;
    rc.epochs = cfg.epochs;
    rc.init_params = init;
    if (cfg.evaluate && cfg.test) {
      rc.test = cfg.test;
      rc.test_begin = cfg.test->count * r / n;  // contiguous test shards; sums are exact
      rc.test_end = cfg.test->count * (r + 1) / n;
    }
    replicas.push_back(sys.spawn(replica, rc));
  }
  coordinator_config cc{n, cfg.global_batch, steps, cfg.epochs, cfg.evaluate && cfg.test != nullptr,
                        cfg.on_progress};
  auto coord = sys.spawn(coordinator, cc);

  std::shared_ptr<train_result> result;
  {
    caf::scoped_actor self{sys};
    self->request(coord, caf::infinite, run_atom::value, replicas, loaders, reducers)
        .receive([&](std::shared_ptr<train_result> r) { result = std::move(r); },
                 [&](caf::error& e) {
                   result = std::make_shared<train_result>();
                   result->error = "coordinator failed: " + sys.render(e);
                 });
  }
  return std::move(*result);
}

}  // namespace ringmaster
