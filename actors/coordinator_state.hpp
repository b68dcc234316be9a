// Internal to actors/coordinator.cpp and its parts (coordinator_checks.cpp, coordinator_checkpoints.cpp,
// coordinator_stop.cpp): what the coordinator keeps of a job, and the checks on what ranks report
// (reports come from other processes: a node may lie).
#pragma once
#include <chrono>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "actors/coordinator.hpp"
#include "actors/messages.hpp"
#include "actors/state_verdict.hpp"

namespace ringmaster::coordinator_detail {

using clock_type = std::chrono::steady_clock;

// One step's reports so far; added to its epoch once all ranks have reported.
struct step_acc {
  std::vector<double> losses;  // per rank: added in rank order, so the epoch's loss has the same bits
                               // whatever order the reports arrived in
  std::vector<char> seen;      // per rank: its report is in
  int64_t correct = 0, count = 0;
  int reports = 0;
  double compute_sum = 0, compute_max = 0;  // the ranks' forward/backward times (train_result::wait_slower)
  clock_type::time_point first;  // when the first report came
  clock_type::time_point half;   // when half the ranks or more had reported it (late_ranks)
  clock_type::time_point last;   // when the latest report came: the step's time, if it is settled later
};

struct epoch_acc {
  double loss = 0;
  int64_t correct = 0, count = 0;
  int64_t unmeasured = 0;  // of count: samples whose loss and accuracy were never reported (a lost node's,
                           // or a survivor's that took the others' state for that step)
  int64_t steps_done = 0;
  int64_t first_step = 0, first_count = 0;  // a resumed epoch's steps and samples from before this run
  std::map<int64_t, step_acc> pending;  // step -> reports so far
  std::vector<double> val_losses;       // per rank, added in rank order when the epoch closes
  double val_loss = 0;
  int64_t val_correct = 0, val_count = 0;
  int evals = 0;
  std::vector<char> evaluated;  // per rank
  clock_type::time_point first_eval;
  double eval_seconds = 0;
  clock_type::time_point start, last_step;
  // Each step's slowest forward/backward, summed: the epoch took at least this, though its reports may
  // come in a burst (after a stopped launcher wakes), which the span of their arrival alone says is 0 s.
  double compute_floor = 0;
  bool closed = false;
  int64_t measured() const { return count - unmeasured; }
};

// A checkpoint waits for both halves: rank 0's state after the step, and the job's metrics up to it.
struct pending_checkpoint {
  state_ptr state;
  std::string sender;  // where rank 0 ran when its state came
  bool have_progress = false;
  job_progress progress;
  clock_type::time_point complete;  // when the metrics half came
};

struct coordinator_state {
  coordinator_config cfg;
  std::vector<caf::actor> replicas, loaders, reducers;
  caf::response_promise reply;
  std::shared_ptr<train_result> result = std::make_shared<train_result>();
  std::map<int64_t, epoch_acc> epochs;
  // The closed epochs at the front of `epochs` (a closed epoch never opens again), walked past once, not
  // for every report: a job of 40,000 short epochs spent most of its time there. The first epoch after
  // them (they end at its first step).
  int64_t first_open = 0;
  std::map<int64_t, pending_checkpoint> checkpoints;  // by steps done
  // The ranks' checksums of their states after a checkpoint's step, from their reports, by steps done;
  // apart from `checkpoints`, whose bound they must not eat into: a lying rank may report far ahead.
  std::map<int64_t, std::vector<state_vote>> votes;
  clock_type::time_point last_state;  // when rank 0's last state that was due came (or the start, or a pause's end)
  int64_t written = -1;  // the last checkpoint written (they come in step order): states up to it are late
  uint64_t written_params = 0;  // after the last step: fnv1a of its parameters (the final weights')
  std::string written_by;       // and rank 0 where it was then (rank_where)
  // Whose final weights are the result: rank 0's, unless its state after the last step was not the
  // majority's (offer_checkpoint): then that checkpoint is given up (a later state for it is not taken),
  // and the result is the final weights of the lowest rank on a node that reported the majority's state
  // (result_from; a ring re-formed since may number them anew), picked as the ranks say they are done.
  std::set<std::string> result_from;
  bool last_given_up = false;
  int result_rank = 0;
  // Per rank: the step (counted from the job's start) its next report is of. A rank reports its steps
  // in order, over one connection from a node: a report past it means those between were lost.
  std::vector<int64_t> next_report;
  // Per rank: when it last reported anything (late_ranks).
  std::vector<clock_type::time_point> heard_from;
  int64_t current_epoch = 0;
  int done = 0, weights_in = 0;
  std::vector<char> done_ranks;  // per rank: said it is done
  std::vector<int64_t> val_counts;  // per epoch closed in this run: the test samples its evaluation covered
  clock_type::time_point first_done;
  bool finished = false;
  int gen = 0;              // the ring generation: reports of others are dropped
  int holding = 0;          // a ring generation being formed (the launcher paused the ranks for it)
  // Per node lost: the step the ring without it went on from (node_loss's is the last step when none was left).
  std::vector<int64_t> loss_starts;
  std::map<int64_t, int> ring_replicas;  // the step each ring went on from (the job's start too) -> its ranks
  size_t recovering = SIZE_MAX;  // result->losses from here on wait for the next completed step
  clock_type::time_point start, last_print;
  // For the silence watchdog: the last report of any kind (or the start, or the end of a pause), the last
  // step complete, and the longest time between two.
  clock_type::time_point last_news, last_complete;
  clock_type::duration slowest_step{0};
  int64_t skipped_checkpoints = 0;
  // Steps whose state was let go before their metrics came (take_state), at most kMaxHeldProgress, the
  // lowest: states far ahead that a liar sends do not push out those honest ones.
  std::set<int64_t> evicted;
  // A local job stopped by a signal with checkpoints on (coordinator_stop.cpp): the signal, the ranks'
  // answers to the hold (steps started, -1 none yet) and pauses, the step they stop after, and by when.
  int stopping = 0;
  std::vector<int64_t> stop_started;
  std::vector<char> stop_paused;
  int64_t stop_at = -1;
  clock_type::time_point stop_deadline;
};

inline double secs(clock_type::time_point a, clock_type::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Ends the job: its result goes to whoever asked for it ("" error: it succeeded), every rank is stopped.
void finish(caf::event_based_actor* self, coordinator_state& st, std::string error);
// Ends a stop (st.stopping) without a checkpoint of its own, saying why ("": none due; the last one
// written is where to go on from).
void stop_without_checkpoint(caf::event_based_actor* self, coordinator_state& st, const std::string& why);
// Why the state after step `at` is not written: state_fault's `bad`.
inline std::string diverged(int64_t at, const std::string& bad) {
  return "the state after step " + std::to_string(at) + ": " + bad + " (training diverged: too high a learning rate? or a layer's gradient)";
}

// A signal stopped a local job whose checkpoints are on (coordinator_config::interrupt and
// on_checkpoint): the ranks finish the steps they are in, all stop after the same one, and its
// checkpoint is written before the job ends as interrupted, so a resume loses no step. Without an
// answer from every rank in time it ends as before, with the last checkpoint written.
void begin_stop(caf::event_based_actor* self, const std::shared_ptr<coordinator_state>& st, int sig);
// The same for ranks on nodes, which the launcher stopped (coordinator.hpp's stop_note).
void stop_with_state(caf::event_based_actor* self, const std::shared_ptr<coordinator_state>& st, stop_note n);
// The stop of a job on nodes: steps up to `at`, where the ranks stopped, still lacking reports (a node
// lost on the way took its ranks' with it) count, their samples unmeasured, as a re-formed ring counts
// them; an epoch that ended by then closes without the lost ranks' evaluations.
void settle_lost_reports(caf::event_based_actor* self, coordinator_state& st, int64_t at);
// A rank paused on the way (replica's pause_report).
void stop_paused(caf::event_based_actor* self, const std::shared_ptr<coordinator_state>& st, const pause_report& r);
// Where a job stands after `done` steps, all of whose reports are in (and at an epoch's end, its
// evaluations): the checkpoint's metrics half (checkpoint_progress for steps due).
job_progress progress_after(const coordinator_state& st, int64_t done, const epoch_acc* open);

// Checkpoints (coordinator_checkpoints.cpp). A rank's checksum of its state after a checkpoint's step,
// kept until rank 0's state is written; the metrics half of the checkpoint after `done` steps, if one is
// due then; rank 0's state after a step. Each writes the checkpoint once both halves are in.
void note_state_sum(coordinator_state& st, const step_report& r);
void checkpoint_progress(caf::event_based_actor* self, coordinator_state& st, int64_t done, const epoch_acc* open);
void take_state(caf::event_based_actor* self, coordinator_state& st, state_ptr s);
// Each second (coordinator_config::state_timeout): a checkpoint whose metrics waited too long for rank 0's
// state, none having come meanwhile, makes rank 0's node faulty, or ends the job.
void check_withheld(caf::event_based_actor* self, coordinator_state& st, clock_type::time_point now);

// Steps complete so far in the whole job: those of the closed epochs and the first open one's (a later
// epoch may be open already: a fast rank's reports of it come before a slow one's of this one).
int64_t steps_complete(const coordinator_state& st);
// "" if a rank's report fits the job and what came before; else what is wrong with it.
std::string check_report(const coordinator_state& st, const step_report& r);
std::string check_report(const coordinator_state& st, const eval_report& r);
// "3", or "3 (node tcp://10.0.0.2:5601)" when the launcher said where rank 3 runs.
std::string rank_where(const coordinator_state& st, int r);
int pick_result_rank(const coordinator_state& st);
// Ranks that have not reported what the others have, for report_timeout (see its comment in
// coordinator_checks.cpp); "" if none is late.
std::string late_ranks(const coordinator_state& st, clock_type::time_point now);
// Whether every rank has been silent too long (coordinator_config::eval_batches); "" if not.
std::string silent_ranks(const coordinator_state& st, clock_type::time_point now);

}  // namespace ringmaster::coordinator_detail
