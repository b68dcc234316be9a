// The replica: one copy of the model on one device. Per step: forward/backward on its batch shard, hand
// the flat gradient buffer to its reducer, and when the ring has summed it apply the optimizer, so every
// replica applies the same update to the same weights.
#pragma once
#include <caf/all.hpp>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.hpp"
#include "kernels/dataset.hpp"
#include "actors/reducer.hpp"
#include "kernels/model.hpp"

namespace ringmaster {

struct replica_config {
  int rank = 0, replicas = 1;
  std::string device = "cpu";
  std::shared_ptr<const model> def;  // built once per process, shared by its replicas
  optimizer_config opt;
  uint64_t seed = 0;                  // dropout masks: (seed, epoch, sample index in the epoch)
  int global_batch = 0;
  int64_t steps_per_epoch = 0, epochs = 1;
  std::shared_ptr<const std::vector<float>> init_params;  // identical on every replica
  std::shared_ptr<const dataset> test;                    // may be null: no evaluation
  size_t test_begin = 0, test_end = 0;                     // this replica's shard of the test set
  backend_factory make_backend;                            // null: ringmaster::make_backend
  // Gradients are all-reduced in buckets of at least this many floats (whole layers, last layer first),
  // each as soon as backward has produced it. 0: one all-reduce after backward. Every rank of a job
  // must use the same value; results are bit-identical whatever it is. A bucket's update is applied as
  // soon as its sum is in, while the ring still sums the rest; not when elastic, where a step given up on
  // mid-ring must leave the weights and optimizer state as they were.
  size_t bucket_floats = 0;
  std::shared_ptr<reducer_port> port;  // its reducer's (actors/reducer.hpp): gradients are all-reduced there
  // Host memory for the gradients (def->param_count() floats), kept for the replica's life: a window its
  // right neighbour's process reads in place (net/shm_window.hpp). Null: the backend's own.
  std::shared_ptr<float> grad_memory;
  // A resumed job: the steps already done, and the state to go on from (its steps must equal first_step).
  // With first_step > 0 and no state here, a {restore_atom, state} must come before run.
  int64_t first_step = 0;
  std::shared_ptr<const network_state> resume;
  // Checkpoints: after every step checkpoint_due() names (every checkpoint_every steps, 0: at each
  // epoch's end) the replica sends its coordinator {checkpt_atom, state_ptr}. Rank 0 only.
  bool checkpoints = false;
  // Report state checksums (at checkpoints and pauses): ranks on more than one node, whose states a
  // faulty or lying node could send for another's.
  bool state_sums = false;
  int64_t checkpoint_every = 0;
  int shard_begin = 0;  // where its shard starts in every global batch (dropout masks: the samples' places)
  int gen = 0;  // the ring generation it starts in (a node that joins a re-formed ring: that one's)
  // Elastic: an all-reduce that stalls (its reducer's watchdog gave up) is reported with a stall_report,
  // and the replica waits to be paused, rather than failing the job.
  bool elastic = false;
  int64_t stall_after_steps = -1;  // testing (train_config::stall_after_steps)
  bool stall_at_join_pause = false;  // testing (train_config::stall_at_join_pause)
};

// A rank's part in a re-formed ring (actors/reform.hpp), from its node: the replica goes on from
// start_step (one step behind, it took the others' state before) and passes the shard on to its loader.
struct rank_reform {
  int gen = 0, rank = 0, replicas = 1;
  int64_t start_step = 0;               // the global step every rank continues from
  int batch_begin = 0, batch_end = 0;   // its shard of every global batch
  size_t test_begin = 0, test_end = 0;  // its shard of the test set
  std::shared_ptr<reducer_port> port;   // its new reducer's
  // An epoch that ended at start_step is evaluated again (a lost rank's share of it may be missing);
  // not when the ring only grew (every rank evaluated it before the pause).
  bool evaluate_again = true;
};

// The buckets' first offsets, from the last bucket (the last layers') to the first (ending at 0).
std::vector<size_t> gradient_buckets(const model& m, size_t bucket_floats);

// Spawn detached (it computes on its own thread). Receives {run_atom, loader, reducer, coordinator}; sends
// the coordinator step_report after every step, eval_report after every epoch, {done_atom, rank} at the
// end. Answers {weights_atom} with its parameters (chunk_ptr), {sum_atom} with their checksum (fnv1a) and
// whether all are finite. {restore_atom, state_ptr} before run sets its parameters and optimizer state
// (a resumed job). Elastic: {pause_atom, gen} stops it (it answers the
// coordinator with a pause_report) until {reform_atom, rank_reform} lets it go on; {pause_atom, gen, at}
// stops it so once it has applied `at` steps (at once if it has already). Paused, it answers
// {checkpt_atom} with its state (for a node that joins the ring, or survivors a step behind), and takes
// {restore_atom, state_ptr} of the step after its own (the others finished a step it did not).
// {hold_atom} (a job stopping at a signal) keeps it from starting another step and answers how many it
// has started; a planned pause then lets it run up to the step it names.
caf::behavior replica(caf::event_based_actor* self, replica_config cfg);

}  // namespace ringmaster

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ringmaster::rank_reform)
