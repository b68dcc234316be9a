// Local data-parallel training (the MirroredStrategy case): N replicas in one process, each with its
// data loader and reducer, and a coordinator. One call runs a whole job.
#pragma once
#include <caf/all.hpp>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "actors/coordinator.hpp"
#include "actors/reducer.hpp"
#include "kernels/dataset.hpp"
#include "kernels/model.hpp"

namespace ringmaster {

struct job_plan;    // actors/job_plan.hpp
struct checkpoint;  // actors/checkpoint.hpp

struct train_config {
  // The model's description: "784-512-512-10", "cnn", or JSON (sequential{...}.text()); see kernels/model.hpp.
  std::string model = "784-512-512-10";
  // The layer types the description may use; null: the built-in layers. Nodes use their own registry.
  std::shared_ptr<const layer_registry> layers;
  optimizer_config opt;
  int replicas = 2;
  std::vector<std::string> devices;  // one per replica ("cpu", "cuda:0"); empty: all "cpu". One kind per job.
  backend_factory make_backend;      // turns a device name into a backend; null: ringmaster::make_backend
  int global_batch = 128;            // split evenly across replicas
  int64_t epochs = 5;
  uint64_t seed = 42;
  int prefetch = 2;
  // Gradients are all-reduced in buckets of whole layers of at least this size, last layers first, each
  // while backward still computes the layers before it (CPU replicas). 0: one all-reduce per step. The
  // result is bit-identical either way. It travels to node daemons in the job plan.
  size_t bucket_bytes = size_t(1) << 20;
  bool evaluate = true;
  // An all-reduce that waits this long for a neighbour without any message fails (naming the neighbour);
  // in an elastic node job the launcher then drops the node of the rank the ring waited for. It travels
  // to node daemons in the job plan.
  std::chrono::milliseconds ring_timeout{60000};
  // Testing only: replicas take no step once this many are done, as a stuck GPU or a deadlock would stop
  // them, while the rest of the process goes on. -1: never. (ringmaster-node --stall-after-steps.)
  int64_t stall_after_steps = -1;
  bool stall_at_join_pause = false;  // testing: likewise once told to pause for a node that rejoins
  std::shared_ptr<const dataset> train, test;  // test may be null
  std::shared_ptr<const std::vector<float>> init_params;  // null: Glorot from seed (local jobs only: nodes refuse)
  std::function<void(const progress&)> on_progress;
  int threads = 0;  // CAF scheduler threads; 0: one per replica, at most one per core
  // When every replica has a thread: how long one whose next batch is in spins for its all-reduces' end
  // (actors/reducer.hpp, poll_briefly) before it sleeps until they wake it; 0: never, the default. In one
  // process the neighbour's thread runs the ring anyway, and a spinning replica only takes that work over:
  // train_bench 784-64-10, 2 replicas on 2 cores, alternating runs gave 0.89-0.95 of the ideal without the
  // spin, 0.55-0.90 with it (README, Benchmarks).
  std::chrono::microseconds ring_poll{0};
  // Checkpoints (actors/checkpoint.hpp): written into checkpoint_dir ("" none) every checkpoint_every steps
  // (0: at the end of every epoch) and after the last step. on_checkpoint hears of each file written.
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  std::function<void(const std::string& path)> on_checkpoint;
  // Continue the job that wrote this checkpoint (latest_checkpoint()), bit for bit: its settings must be
  // this job's (resume_mismatch(); a refusal is result.invalid), but epochs may be more.
  std::shared_ptr<const checkpoint> resume;
  // Set to a signal's number (from a handler of SIGINT, say) to stop the job: replicas stop after the
  // step they are in; on nodes, the nodes are told to drop it at once, not left to notice our silence. The
  // result says so (train_result::interrupted). Looked at every 50 ms (on nodes, while they set up, and
  // every heartbeat after). Null: never.
  const std::atomic<int>* interrupt = nullptr;
  // Called once the job's model is built, before its first step (on nodes: once they have taken the job
  // and said what they built): "" or why the job must not start, which fails it as bad input
  // (train_result::invalid). A launcher checks here that its output files have room for this model's
  // weights, found only after training otherwise. Null: nothing to check.
  std::function<std::string(const ringmaster::model&)> check_model;  // (the type: `model` is the field above)
  int interrupted() const { return interrupt ? interrupt->load() : 0; }  // the signal, or 0
};

// Builds cfg.model for cfg.train's samples with cfg.layers; null with *error.
std::shared_ptr<const model> build_model(const train_config& cfg, std::string* error);
// cfg.check_model's answer for m ("" without one); one that throws answers with its message.
std::string run_check_model(const train_config& cfg, const model& m);
// Checks the configuration against the built model; returns an empty string or what is wrong.
// replicas_here: how many of cfg.replicas this process runs (their memory, and their loaders' prefetched
// batches, must fit in half the memory this process may use: kernels/host_memory.hpp); 0: none (a
// launcher whose ranks run on nodes).
std::string check_config(const train_config& cfg, const model& m, int replicas_here);

// Building blocks shared by local jobs, node daemons and remote jobs.
// Scheduler settings for training processes (threads 0: one per core).
void configure(caf::actor_system_config& c, int threads);
// This machine's cores (at least 1).
int cpu_cores();
// The workers for `replicas` replicas that compute inside their handlers: `threads` if given, else one per
// replica, at most one per core (a spare worker only takes messages from the busy ones, a thread hop each).
int workers_for(int threads, int replicas);

// The actors of some ranks of a job, index i belonging to ranks[i] (the reducers not yet in a ring:
// train() and local_ring link reducers of one process through their ports, a node links its own to
// other nodes).
struct rank_actors {
  std::vector<caf::actor> loaders, reducers, replicas;
  std::vector<std::shared_ptr<reducer_port>> ports;  // each reducer's: chunks go straight into it
};
// Each rank's settings, device and shards come from the plan (its job id: the reducers take only that
// job's chunks); of cfg only the data, init_params, bucket_bytes and make_backend are read.
// grad_memory(rank, floats), if given, may give a rank's gradients host memory of their own
// (replica_config::grad_memory); null: the backend's.
using grad_memory_fn = std::function<std::shared_ptr<float>(int rank, size_t floats)>;
rank_actors spawn_ranks(caf::actor_system& sys, const job_plan& plan, const train_config& cfg,
                        std::shared_ptr<const model> m, const std::vector<int>& ranks,
                        const grad_memory_fn& grad_memory = {});

// Rank `rank`'s reducer settings in `plan`'s ring (its id, size and paths).
reducer_config plan_reducer_config(const job_plan& plan, int rank, size_t params);

// Runs a coordinator (actors/coordinator.hpp) over all ranks' actors (index = rank) until the job ends.
std::shared_ptr<train_result> run_coordinator(caf::actor_system& sys, caf::actor coordinator,
                                              const rank_actors& all);

// Runs the job to completion (or failure: result.ok false, result.error says why). Never throws for
// bad input; never hangs on a failed actor.
train_result train(const train_config& cfg);

}  // namespace ringmaster
