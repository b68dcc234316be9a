// Local data-parallel training (the MirroredStrategy case): N replicas in one process, each with its
// data loader and reducer, and a coordinator. One call runs a whole job.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "actors/coordinator.hpp"
#include "kernels/dataset.hpp"
#include "kernels/model.hpp"

namespace ringmaster {

struct train_config {
  std::string model = "784-512-512-10";
  optimizer_config opt;
  int replicas = 2;
  std::vector<std::string> devices;  // one per replica ("cpu", "cuda:0"); empty: all "cpu"
  int global_batch = 128;            // split evenly across replicas
  int64_t epochs = 5;
  uint64_t seed = 42;
  int prefetch = 2;
  bool evaluate = true;
  std::shared_ptr<const dataset> train, test;  // test may be null
  std::shared_ptr<const std::vector<float>> init_params;  // null: Glorot from seed
  std::function<void(const progress&)> on_progress;
  int threads = 0;  // CAF scheduler threads; 0: hardware concurrency
};

// Checks the configuration; returns an empty string or what is wrong.
std::string check_config(const train_config& cfg, const model_spec& spec);

// Runs the job to completion (or failure: result.ok false, result.error says why). Never throws for
// bad input; never hangs on a failed actor.
train_result train(const train_config& cfg);

}  // namespace ringmaster
