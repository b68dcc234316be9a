// A local job stopped by a signal (Ctrl-C, a batch system's SIGTERM) writes a checkpoint where it stops,
// so a resume loses no step, not those since the last periodic checkpoint (an epoch's, by default).
//
// The ranks cannot simply stop where each is: a rank between steps that stops at s leaves the others
// waiting for its gradients of step s+1, and a replica that updates bucket by bucket (replica.hpp) holds
// half an update if stopped mid step. So, in two rounds:
//   1. hold: every replica starts no further step and answers how many it has started (applied, plus one
//      in flight). The answers differ by at most one: a rank starts step s+1 only once step s's sum is
//      in, which needs every rank's gradients of step s.
//   2. a planned pause after the highest count H: the ranks behind run up to H (the others' step in
//      flight needs theirs), all apply step H and pause. Each sent its reports (and at an epoch's end its
//      evaluation) before its pause report, so the metrics up to H are whole once every rank has paused.
// Rank 0's state after H is then fetched and written as the checkpoint after H. A rank that does not
// answer in time, or a write that fails, ends the job as before: the last checkpoint is where to go on.
#include <algorithm>

#include "actors/checkpoint.hpp"  // state_fault
#include "actors/coordinator_state.hpp"
#include "actors/messages.hpp"

namespace ringmaster::coordinator_detail {

void stop_without_checkpoint(caf::event_based_actor* self, coordinator_state& st, const std::string& why) {
  st.result->interrupted = st.stopping;
  finish(self, st, interrupted_by(st.stopping) + (why.empty() ? "" : "; no checkpoint was written at the stop: " + why));
}

namespace {

// For the whole stop: the steps in flight, the one up to the stop and the state's writing (a batch
// system's grace is often 30 s before its SIGKILL).
constexpr std::chrono::seconds kStopLimit{25};

// Whether a checkpoint after step `at` or later is written already (one was due then): it is the stop's,
// and the job ends with it.
bool written_already(caf::event_based_actor* self, coordinator_state& st, int64_t at) {
  if (st.written < at) return false;
  st.result->stopped_after = st.written;
  stop_without_checkpoint(self, st, "");
  return true;
}

// Writes the state after st.stop_at as the stop's checkpoint, and ends the job as interrupted.
void write_state(caf::event_based_actor* self, coordinator_state& st, const job_progress& p, const state_ptr& s) {
  if (st.finished) return;
  if (!s || s->steps != st.stop_at) return stop_without_checkpoint(self, st, "the state came from after another step");
  if (written_already(self, st, st.stop_at)) return;
  if (std::string bad = state_fault(*s); !bad.empty())  // as offer_checkpoint: never written over a good one
    return stop_without_checkpoint(self, st, diverged(st.stop_at, bad));
  if (std::string error = st.cfg.on_checkpoint(p, *s); !error.empty()) return stop_without_checkpoint(self, st, error);
  st.written = st.stop_at;
  st.result->stopped_after = st.stop_at;
  stop_without_checkpoint(self, st, "");
}

// The checkpoint after st.stop_at, where every rank has stopped: of `given`, or of rank 0's state.
void write_at_stop(caf::event_based_actor* self, const std::shared_ptr<coordinator_state>& st, state_ptr given = nullptr) {
  const int64_t at = st->stop_at, spe = std::max<int64_t>(1, st->cfg.steps_per_epoch);
  // The metrics after `at`: closed epochs, and the open one's sums (a fast rank's reports of later steps
  // cannot be here: no rank went past `at`).
  const epoch_acc* open = nullptr;
  if (at % spe == 0) {
    if (int64_t(st->result->history.size()) != at / spe)
      return stop_without_checkpoint(self, *st, "the evaluation after epoch " + std::to_string(at / spe) + " is not complete");
  } else {
    auto it = st->epochs.find(at / spe);
    if (it == st->epochs.end() || it->second.steps_done != at % spe)
      return stop_without_checkpoint(self, *st, "the reports of step " + std::to_string(at) + " are not complete");
    open = &it->second;
  }
  // Due at `at` anyway (an epoch's end, say): rank 0 sent its state before it paused, and it is written.
  if (written_already(self, *st, at)) return;
  job_progress p = progress_after(*st, at, open);
  if (given) return write_state(self, *st, p, given);
  self->request(st->replicas[0], kStopLimit, checkpt_atom::value)
      .then([self, st, p = std::move(p)](state_ptr s) { write_state(self, *st, p, s); },
          [self, st](caf::error& e) {
            if (!st->finished) stop_without_checkpoint(self, *st, "rank 0 did not send its state: " + error_text(self->system(), e));
          });
}

// Rank r has started `started` steps and starts no more: once every rank has said, they stop after the
// last step any of them started.
void held(caf::event_based_actor* self, const std::shared_ptr<coordinator_state>& st, size_t r, int64_t started) {
  if (st->finished || st->stop_at >= 0) return;
  st->stop_started[r] = started;
  if (std::count(st->stop_started.begin(), st->stop_started.end(), -1) > 0) return;
  const auto [lo, hi] = std::minmax_element(st->stop_started.begin(), st->stop_started.end());
  const int64_t total = st->cfg.steps_per_epoch * st->cfg.epochs;
  if (std::string bad = held_fault(*lo, *hi, st->cfg.start.step, total); !bad.empty()) return stop_without_checkpoint(self, *st, bad);
  st->stop_at = *hi;
  // At the job's end the ranks finish as they would have: the job ends with its results (the pause
  // after its last step holds them after they said they were done; their weights are still asked).
  if (*hi < total) {
    // Nothing trained since the one resumed from: it is where to go on from. The last one written is
    // after this very step: it is the stop's.
    if (*hi <= st->cfg.start.step) return stop_without_checkpoint(self, *st, "");
    if (written_already(self, *st, *hi)) return;
  }
  for (auto& replica : st->replicas) self->send(replica, pause_atom::value, st->gen + 1, *hi);
}

}  // namespace

}  // namespace ringmaster::coordinator_detail

namespace ringmaster {

std::string held_fault(int64_t lo, int64_t hi, int64_t first, int64_t total) {
  // A rank starts step s+1 only once step s's sum is in: honest answers differ by at most one.
  if (hi - lo <= 1 && lo >= first && hi <= total) return "";
  return "the ranks had started " + std::to_string(lo) + " to " + std::to_string(hi) + " steps";
}

}  // namespace ringmaster

namespace ringmaster::coordinator_detail {

void begin_stop(caf::event_based_actor* self, const std::shared_ptr<coordinator_state>& st, int sig) {
  st->stopping = sig;
  st->stop_started.assign(st->replicas.size(), -1);
  st->stop_paused.assign(st->replicas.size(), 0);
  // The steps in flight and the one up to the stop, and the state's writing: past this, the job ends as
  // before (the signal poll looks).
  st->stop_deadline = clock_type::now() + kStopLimit;
  for (size_t r = 0; r < st->replicas.size(); ++r)
    self->request(st->replicas[r], kStopLimit, hold_atom::value)
        .then([self, st, r](int64_t started) { held(self, st, r, started); },
              [self, st, r](caf::error& e) {
                if (!st->finished)
                  stop_without_checkpoint(self, *st, "rank " + std::to_string(r) + " did not answer" +
                                                         (e == caf::sec::request_timeout ? " within " + std::to_string(kStopLimit.count()) + " s"
                                                                                         : ": " + error_text(self->system(), e)));
              });
}

void stop_with_state(caf::event_based_actor* self, const std::shared_ptr<coordinator_state>& st, stop_note n) {
  if (st->finished) return;
  const bool lost = !n.losses.empty();
  for (node_loss& l : n.losses) st->result->losses.push_back(std::move(l));  // whether or not a checkpoint follows
  if (st->stopping) return;
  st->stopping = n.sig;
  state_ptr s = std::move(n.state);
  if (!s) return stop_without_checkpoint(self, *st, "no state came");
  st->stop_at = s->steps;
  if (s->steps <= st->cfg.start.step) return stop_without_checkpoint(self, *st, "");
  if (written_already(self, *st, s->steps)) return;
  if (s->steps > st->cfg.steps_per_epoch * st->cfg.epochs)
    return stop_without_checkpoint(self, *st, "the state came from after step " + std::to_string(s->steps) + ", past the job's end");
  if (lost) settle_lost_reports(self, *st, s->steps);
  if (st->finished) return;
  write_at_stop(self, st, std::move(s));
}

void stop_paused(caf::event_based_actor* self, const std::shared_ptr<coordinator_state>& st, const pause_report& r) {
  if (st->finished || !st->stopping || st->stop_at < 0 || r.gen != st->gen + 1 || r.rank < 0 || r.rank >= int(st->replicas.size()))
    return;
  if (st->stop_at == st->cfg.steps_per_epoch * st->cfg.epochs) return;  // the job's end: it finishes with its results
  if (r.applied != st->stop_at)
    return stop_without_checkpoint(self, *st, "rank " + std::to_string(r.rank) + " stopped after step " + std::to_string(r.applied) +
                                                  ", not " + std::to_string(st->stop_at));
  st->stop_paused[size_t(r.rank)] = 1;
  if (std::count(st->stop_paused.begin(), st->stop_paused.end(), 0) == 0) write_at_stop(self, st);
}

}  // namespace ringmaster::coordinator_detail
