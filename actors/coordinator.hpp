// The coordinator: steps and epochs, exact metrics, end of job and failure handling. It talks to ranks
// only: whoever spawned the reducers wired them into the ring the job plan orders (actors/job_plan.hpp).
#pragma once
#include <caf/all.hpp>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "actors/messages.hpp"
#include "kernels/model.hpp"

namespace ringmaster {

struct progress {
  int64_t epoch = 0, epochs = 0;  // 0-based epoch
  int64_t step = 0, steps = 0;    // steps done in this epoch
  int64_t first_step = 0;         // of them, done before this run (a resumed epoch): seconds and rates start there
  double seconds = 0;             // since the epoch began
  double loss = 0, accuracy = 0;  // exact running means over the samples seen this epoch
  double samples_per_sec = 0;
  bool epoch_end = false;         // final line of the epoch: val_* are set
  double val_loss = 0, val_accuracy = 0;
};

// Keras-like: " 120/468 [=======>......] - ETA: 2s - loss: 0.70 - accuracy: 0.75 - 20000 samples/s".
std::string format_progress(const progress& p);

struct epoch_stats {
  int64_t epoch = 0;
  double loss = 0, accuracy = 0, val_loss = 0, val_accuracy = 0;  // val_*: NaN without a test set (evaluate off)
  int64_t samples = 0;
  double seconds = 0, eval_seconds = 0;
};

// "rank 1" or "ranks 2-3" for a list of ranks as node_loss holds it, for messages.
inline std::string ranks_named(const std::string& list) {
  return (list.find_first_of("-,") == std::string::npos ? "rank " : "ranks ") + list;
}

// A node lost during an elastic job and how the job went on (actors/reform.hpp), for the summary.
struct node_loss {
  std::string node;             // its endpoint
  std::string ranks;            // the ranks it ran ("2-3")
  std::string why;              // "no heartbeat for 1.6 s"
  // A rank of it hung while the node still answered: the times below count from the ring's last step
  // before the stall, not from the node's last message.
  bool hung = false;
  double detected = 0;          // seconds from its last message (hung: the last step) to its loss being declared
  int generation = 0;           // of the ring re-formed without it (0: none was)
  int survivors = 0;            // ranks in that ring (none re-formed: ranks left as it was lost)
  int64_t epoch = 0, step = 0;  // where the survivors went on from (none re-formed: where it was lost; after the
                                //  last step: that step; 0-based)
  double recovered = NAN;       // seconds from its last message (hung: the last step) to the next completed step
  std::chrono::steady_clock::time_point since;      // its last message (hung: the last step)
  std::chrono::steady_clock::time_point next_step;  // when that step was complete
  std::chrono::steady_clock::time_point when;       // when it was named lost (a summary lists events in order)
};

// A lost node that came back and joined the ring again at an epoch's end (actors/reform.hpp).
struct node_join {
  std::string node;   // its endpoint
  std::string ranks;  // the ranks it runs in the grown ring ("4-5")
  int generation = 0; // of that ring
  int replicas = 0;   // ranks in it
  int64_t epoch = 0;  // the first epoch it trains in (0-based)
  double paused = 0;  // seconds the others stood still for it: from the last one's stop to the new ring's start
  std::chrono::steady_clock::time_point when;  // when the new ring started
};

// A try to take a lost node that came back into the ring that failed (launcher_rejoin.cpp): why, and
// whether it was to be asked again (a later try may have taken it in) or stays out for the rest of the job.
struct failed_join {
  std::string node;  // its endpoint
  std::string why;   // "it refused: ..."
  bool asked_again = false;
  std::chrono::steady_clock::time_point when;  // when the try was given up
};

// A node found faulty (coordinator_config::on_faulty_node) too close to the job's end to re-form the ring
// without it: it finished with the others. Rank 0's state after the last step was written only as the
// majority's, and the final weights were compared (train_result::identical) all the same.
struct node_fault {
  std::string node;  // its endpoint
  std::string ranks; // the ranks it ran ("2-3")
  std::string why;   // "its ranks hold another state after step 50 than node ... hold (a faulty or lying node)"
};

// A ring link between two nodes that broke while both still answered (a reset, a firewall), or (from and
// to empty) a ring whose ranks all waited for another while every node answered: what was on its way was
// lost, so the ring was re-formed with the same nodes from the last step all ranks completed. The same
// ranks sum in the same order: the job goes on as if nothing happened (launcher::reform_same_nodes).
struct ring_relink {
  std::string from, to, why;    // the sending node's endpoint, the receiving one's, what the receiver saw (a rank said)
  int64_t epoch = 0, step = 0;  // the step in flight (0-based)
  std::chrono::steady_clock::time_point when;  // when it was judged
  int64_t at = 0;               // steps done then
};

struct train_result {
  bool ok = false;
  std::string error;                   // set when !ok: which actor failed and why
  bool invalid = false;                // !ok because the job was refused as invalid (bad model or settings)
  std::vector<epoch_stats> history;
  std::vector<float> weights;          // rank 0's final parameters (see on_faulty_node for another's)
  std::string model;                   // the model's canonical description (model::description())
  std::vector<uint64_t> checksums;     // every replica's final parameters, FNV-1a over the bytes
  int result_rank = 0;                 // the rank whose final parameters are `weights`
  // The checkpoint after the last step was not written: rank 0's state was not the majority's, and the
  // result is the final weights of a rank that holds it (result_rank). `checkpoint` is an earlier one.
  bool last_checkpoint_refused = false;
  bool identical = false;              // all replicas ended with bit-identical weights
  double wall_seconds = 0;             // from the call to train() to its return: setup included
  double train_seconds = 0;
  int64_t train_samples = 0;           // trained by this run (a resumed one: since it resumed)
  std::string checkpoint;              // the last checkpoint written ("" none)
  int64_t checkpoints_skipped = 0;     // due but not written (rank 0's states ran ahead of the reports, went with its node, or its
                                       // node sent none or one not the majority's)
  // Replica time summed over all replicas and steps (seconds): where the time went.
  double wait_batch = 0, compute = 0, wait_ring = 0, update = 0;
  // What the ranks' forward/backward took less than the slowest rank's, step by step: synchronized
  // updates wait for the slowest replica, so most of this is waited for in wait_ring (an estimate of
  // that share: a rank's time for its batch or update shifts its wait too, and the rest is the ring).
  double wait_slower = 0;
  std::vector<node_loss> losses;  // nodes lost on the way (elastic jobs went on without them)
  std::vector<node_join> joins;   // lost nodes that came back and joined again
  std::vector<failed_join> failed_joins;  // and tries to take one back that failed
  std::vector<node_fault> faults;         // nodes found faulty as the job ended, kept to its end
  std::vector<ring_relink> relinks;       // ring links broken, or rings stalled, between live nodes (re-formed as they were)
  // Samples trained whose loss and accuracy were lost with their node (a report in flight when it
  // died), or whose ranks took the state after a step they had not finished as a ring was re-formed:
  // counted in the history's samples, not in its means (a resumed epoch's include the run before's).
  int64_t unmeasured = 0;
  // Epochs of this run whose test metrics cover fewer test samples than another's: a lost node's share of
  // their evaluation went with it (val_* are the survivors' shares').
  int64_t partial_evals = 0;
  int interrupted = 0;  // !ok because train_config::interrupt stopped the job: the signal's number
  // Interrupted, the ranks stopped after this step of the job and its checkpoint was written (`checkpoint`);
  // -1: the job stopped where it was, and the last checkpoint is from before.
  int64_t stopped_after = -1;
  bool sent = false;    // train_remote: the job went to the nodes (stopped: they were told to drop it)
};

uint64_t fnv1a(const float* p, size_t n);
// A checksum as 16 lowercase hex digits ("%016llx"): how reports, checkpoints and the examples write them.
// Inline: the fuzz harnesses (tools/fuzz.sh) build the readers that use it without this file's source.
inline std::string hex64(uint64_t v) {
  char b[20];
  std::snprintf(b, sizeof b, "%016llx", (unsigned long long)v);
  return b;
}

// Why a job that signal `sig` interrupted (train_config::interrupt) stopped: "interrupted (SIGINT)".
std::string interrupted_by(int sig);

// Where a job stands after `step` steps, for checkpoints: the epochs closed so far and the open epoch's
// exact sums over its first step % steps_per_epoch steps. A resumed job starts from it, so its epochs
// print and report what the uninterrupted job's would (but for the time).
struct job_progress {
  int64_t step = 0;
  int replicas = 0;  // the ring's ranks that made it (fewer once a node is lost); 0: the job's
  // Times the ring's ranks changed before it (a node lost and the ring re-formed without it, a node taken
  // back), a resumed job's before it too: with any, the weights are an uninterrupted run's only up to rounding.
  int ranks_changed = 0;
  std::vector<epoch_stats> history;
  double loss = 0;
  int64_t correct = 0, count = 0;
  int64_t unmeasured = 0;  // of count: samples whose loss and accuracy went with a lost node
};

struct coordinator_config {
  int replicas = 1;
  int global_batch = 0;
  int64_t steps_per_epoch = 0, epochs = 1;
  bool evaluate = true;
  std::function<void(const progress&)> on_progress;  // runs on the coordinator's thread
  job_progress start;  // a resumed job: where it starts (start.step steps done)
  // Checkpoints: rank 0 sends its state after every step checkpoint_due() names (messages.hpp). Once the
  // coordinator also has that step's metrics (at an epoch's end: its evaluation too) it calls
  // on_checkpoint on its own thread; an error it returns ends the job. Null: no checkpoints.
  int64_t checkpoint_every = 0;  // 0: at the end of every epoch
  std::function<std::string(const job_progress&, const network_state&)> on_checkpoint;
  std::function<void(const std::string&)> on_event;  // a line about the job (a lost node), same thread
  // Ranks on more than one node report their states' checksums at checkpoints (judge_states in
  // state_verdict.hpp). A node they show faulty (a state sent that its own ranks do not hold, or
  // one a majority of nodes do not) goes here by where it runs, to be dropped like a lost node (it may
  // be named again at a later checkpoint before the ring is re-formed); the job goes on, and a
  // checkpoint is written only from the majority's state. After the last step too, the launcher then
  // keeping the node to the end (train_result::faults); where rank 0's state is not the majority's, that
  // checkpoint is not written, and the result is the final weights of the lowest rank that holds the
  // majority's. With this null (no elastic continuation) a state not the majority's fails the job.
  std::function<void(const std::string& where, const std::string& why)> on_faulty_node;
  // Ranks in other processes (nodes): once half the ranks or more have reported a step, or one an
  // evaluation or its end, the others must too within this long, or the job fails naming them (a node
  // that still answers but holds back its reports would hold the job forever); see late_ranks for those
  // still reporting. 0: no limit (ranks in this process). While the launcher forms a new ring
  // ({pause_atom, gen} until {reform_atom, note} of that gen) the clock stands still.
  std::chrono::milliseconds report_timeout{0};
  // With report_timeout: batches of the test set each rank evaluates at an epoch's end (0: unknown). No
  // report of any kind from any rank for report_timeout plus 50 of the slowest step so far (plus one
  // step a test batch while they evaluate; at least twice report_timeout, and ten times before the first
  // step, when a resumed job's state may still travel) fails the job too: every rank stuck at once has
  // no neighbour left to name it (a one-node job, say).
  int64_t eval_batches = 0;
  // With report_timeout: how long a checkpoint whose metrics are in may wait for rank 0's state while no
  // state of rank 0 comes at all. A node that withholds them would have the job go on with no checkpoint
  // written, and fail only at its end. Past it, rank 0's node is faulty (on_faulty_node, before the last
  // step), or the job fails. 0: no limit.
  std::chrono::milliseconds state_timeout{0};
  // Where each rank runs, for errors that name a rank ("node tcp://10.0.0.2:5601"); empty: this process.
  std::vector<std::string> where;
  // Ranks in this process: once this holds a signal's number (train_config::interrupt), looked at every
  // 50 ms, the job ends with train_result::interrupted; with on_checkpoint, after the ranks have stopped
  // at a common step and its checkpoint is written (coordinator_stop.cpp). Null: never (a launcher's
  // own watchdog looks).
  const std::atomic<int>* interrupt = nullptr;
};

// {reform_atom, reform_note}: the ring was re-formed without lost nodes' ranks, or with a node that
// came back (elastic jobs, actors/reform.hpp). Reports of earlier generations are dropped from then on; the steps before
// start_step are complete, those from it on are done again by the new ranks.
struct reform_note {
  int gen = 0;
  int64_t start_step = 0;          // the global step (epoch * steps per epoch + step) they continue from
  std::vector<caf::actor> ranks;   // the new ranks' actors (replica, loader and reducer alike), index = rank
  std::vector<node_loss> losses;   // the nodes lost since the last re-forming
  std::vector<node_join> joins;    // the nodes that join with this ring
  std::vector<std::string> where;  // coordinator_config::where for the new ranks
};

// {checkpt_atom, stop_note}: a launcher stopped its ranks on nodes at signal `sig`; `state` is one rank's,
// after the fewest steps any surviving rank applied (each reported those): it is written as a checkpoint
// and the job ends interrupted. Nodes lost since the last re-forming are in `losses` (their ranks' last
// reports may have gone with them).
// A stop's first round (actors/coordinator_stop.cpp), on nodes as in one process: the ranks said they
// started lo to hi steps of a job that starts after `first` and ends after `total`. "" if honest ranks
// can answer so, else what is wrong.
std::string held_fault(int64_t lo, int64_t hi, int64_t first, int64_t total);

struct stop_note {
  state_ptr state;
  int sig = 0;
  std::vector<node_loss> losses;
};

// Request {run_atom, replicas, loaders, reducers} (vector<actor> each, index = rank), the reducers already
// in their ring; the reply is a std::shared_ptr<train_result> when the job ends, successfully or not.
caf::behavior coordinator(caf::event_based_actor* self, coordinator_config cfg);

}  // namespace ringmaster

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::shared_ptr<ringmaster::train_result>)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ringmaster::reform_note)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ringmaster::stop_note)
