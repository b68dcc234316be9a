// The message protocol between ringmaster's actors, in one place.
//
//   coordinator ──(run)──▶ every replica and loader
//   data_loader ──batch──▶ replica ──credit──▶ data_loader          (prefetch with back-pressure)
//   replica ──reduce(step, grads)──▶ reducer ──chunk──▶ right reducer (ring), reply: step done
//   (a chunk is a ring::message, net/ring_driver.hpp; to another process it goes through a link)
//   replica ──metrics / eval / done──▶ coordinator
//   replica 0 ──checkpoint(state)──▶ coordinator                  (after the steps checkpoint_due names)
//   whoever starts a resumed rank ──restore(state)──▶ replica      (before run; or paused, a step behind)
//   elastic jobs (actors/reform.hpp): pause ──▶ replica ──pause_report──▶ coordinator's side;
//   replica ──stall_report──▶ coordinator's side (its ring waited past the timeout);
//   a local job stopped by a signal: coordinator ──hold──▶ replica (reply: steps started), then a
//   planned pause after the last of them ──▶ replica ──pause_report──▶ coordinator, which fetches a
//   state (checkpt) and writes the checkpoint there (actors/coordinator_stop.cpp);
//   reform ──▶ replica ──reform──▶ data_loader; reports carry the ring's generation
#pragma once
#include <caf/all.hpp>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.hpp"
#include "kernels/model.hpp"
#include "net/ring_driver.hpp"

namespace ringmaster {

// Atoms (CAF 0.17: at most 10 characters).
using run_atom = caf::atom_constant<caf::atom("run")>;
using batch_atom = caf::atom_constant<caf::atom("batch")>;
using credit_atom = caf::atom_constant<caf::atom("credit")>;
using reduce_atom = caf::atom_constant<caf::atom("reduce")>;
using chunk_atom = caf::atom_constant<caf::atom("chunk")>;
using ring_atom = caf::atom_constant<caf::atom("ring")>;
using metrics_atom = caf::atom_constant<caf::atom("metrics")>;
using eval_atom = caf::atom_constant<caf::atom("eval")>;
using done_atom = caf::atom_constant<caf::atom("done")>;
using weights_atom = caf::atom_constant<caf::atom("weights")>;
using release_atom = caf::atom_constant<caf::atom("release")>;  // "done reading your buffer"
using fail_atom = caf::atom_constant<caf::atom("fail")>;  // {fail_atom, why}: a proxy's peer is gone
using tick_atom = caf::atom_constant<caf::atom("tick")>;  // a watchdog's periodic look
using signal_atom = caf::atom_constant<caf::atom("signal")>;  // a coordinator's look at train_config::interrupt
using checkpt_atom = caf::atom_constant<caf::atom("checkpt")>;  // {checkpt_atom, state_ptr}: rank 0 after a step
using restore_atom = caf::atom_constant<caf::atom("restore")>;  // {restore_atom, state_ptr}: start from here
using pause_atom = caf::atom_constant<caf::atom("pause")>;    // {pause_atom, generation}: stop, say how far
using reform_atom = caf::atom_constant<caf::atom("reform")>;  // continue in a re-formed ring
// {hold_atom}: start no further step (a job stopping at a signal); the reply is the steps the replica
// has started (applied, plus one in flight), so the coordinator can name one step they all stop after.
using hold_atom = caf::atom_constant<caf::atom("hold")>;
// {sum_atom}: a replica's final weights as (fnv1a of their bytes, all finite), what the coordinator asks
// of every rank but one: across nodes the weights themselves would each cross the network.
using sum_atom = caf::atom_constant<caf::atom("sum")>;

// One replica's shard of one global batch. Shared, immutable once sent: no copy on the way.
struct batch {
  int64_t epoch = 0;
  int64_t step = 0;  // step within the epoch
  int size = 0;      // samples in this shard
  int gen = 0;       // the ring generation it was cut for (a re-formed ring cuts new shards)
  std::vector<float> x;     // (size, features)
  std::vector<int32_t> y;   // (size)
};
using batch_ptr = std::shared_ptr<const batch>;

// A buffer a reducer reduces in place. In-process only: the owner does not touch it until the reply.
struct tensor_view {
  float* data = nullptr;
  size_t len = 0;
  std::shared_ptr<const void> owner;  // keeps the buffer (and `be`) alive while reducers and neighbours use it
  backend* be = nullptr;  // the device `data` lives on, whose kernels sum it; null: host memory, CPU kernels
};

// A replica's parameters (weights request/reply).
using chunk_ptr = std::shared_ptr<const std::vector<float>>;

// A replica's whole training state (kernels/model.hpp), for checkpoints and resuming.
using state_ptr = std::shared_ptr<const network_state>;

// Whether rank 0 sends its state after `done` steps of the job (counted from its very start): every
// `every` steps (0: at the end of every epoch), and after the last of `total`. Replica and coordinator
// agree on it, so the coordinator knows which states to wait for.
inline bool checkpoint_due(int64_t done, int64_t every, int64_t steps_per_epoch, int64_t total) {
  const int64_t period = every > 0 ? every : steps_per_epoch;
  return done == total || (period > 0 && done % period == 0);
}

// A whole training state's checksum (steps, parameters, moments; the first 8 bytes of SHA-256,
// actors/state_checksum.cpp): identical on every rank after a step, so a state sent for rank 0 that is
// not the one the ranks hold (a faulty or lying node) is found before it is written or handed on.
// 0 only if OpenSSL failed (no memory): reported as no checksum, and a state is then not checked.
uint64_t state_checksum(const network_state& s);
// The same of a network's own state, read piece by piece (network::read_state), not copied whole.
uint64_t state_checksum(const network& net);

// What a replica reports after each step (sums, so the coordinator aggregates exactly).
struct step_report {
  int rank = 0;
  int gen = 0;  // the ring generation: 0 as the job started, one more each time it is re-formed
  int64_t epoch = 0, step = 0;
  double loss_sum = 0;
  int64_t correct = 0, count = 0;
  // Where the replica's time went since its previous report (seconds): waiting for a batch,
  // forward/backward, waiting for the ring, optimizer update.
  double wait_batch = 0, compute = 0, wait_ring = 0, update = 0;
  // After a step a checkpoint is due (checkpoint_due, checkpoints on): state_checksum of the rank's state
  // then, which the coordinator compares with rank 0's state before it writes it; else 0.
  uint64_t state_sum = 0;
};

// Test-set evaluation of one replica's shard of the test set at the end of an epoch.
struct eval_report {
  int rank = 0;
  int gen = 0;
  int64_t epoch = 0;
  double loss_sum = 0;
  int64_t correct = 0, count = 0;
  double seconds = 0;
};

// A replica's answer to {pause_atom, gen}: it stopped, having applied `applied` steps of the job.
struct pause_report {
  int rank = 0;
  int gen = 0;
  int64_t applied = 0;
  uint64_t state_sum = 0;  // state_checksum of its state as it paused: a state sent on for it is checked against it
};

// Elastic jobs: a replica's all-reduce made no progress for the ring's timeout, waiting for rank
// `waiting_for`. The replica stays, as for a pause; its launcher works out from these which rank stopped
// the ring (actors/launcher.hpp) and drops that rank's node.
// With `link`, no watchdog's: the link from or to rank waiting_for, on another node, closed under the ring
// (reducer.hpp's fail_link); the launcher tells a node gone from a link broken between two live ones.
struct stall_report {
  int rank = 0;
  int gen = 0;
  int waiting_for = 0;
  std::string why;
  bool link = false;
};

// The text an error was made with (make_error(code, "why")), else CAF's rendering of it
// ("system_error(runtime_error, (\"...\"))" is no message for a user).
inline std::string error_text(caf::actor_system& sys, const caf::error& e) {
  const caf::message& ctx = e.context();
  if (ctx.match_elements<std::string>()) return ctx.get_as<std::string>(0);
  return sys.render(e);
}

// What an exception says: its what(), or "unknown exception".
inline std::string exception_text(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}

// For set_exception_handler: an exception thrown in a handler (a user layer, a CUDA error, a simulated
// device's broken rule) ends the actor with its message, prefixed by who it was, instead of a bare code.
inline auto error_from_exception(std::string who) {
  return [who = std::move(who)](caf::scheduled_actor*, std::exception_ptr& e) -> caf::error {
    return caf::make_error(caf::sec::runtime_error, who + ": " + exception_text(e));
  };
}

}  // namespace ringmaster

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ringmaster::batch_ptr)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ringmaster::tensor_view)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ringmaster::chunk_ptr)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ringmaster::state_ptr)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ringmaster::ring::message)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::shared_ptr<ringmaster::ring::link>)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ringmaster::step_report)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ringmaster::eval_report)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ringmaster::pause_report)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ringmaster::stall_report)
