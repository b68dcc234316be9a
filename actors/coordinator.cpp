#include "actors/coordinator.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <map>

#include "actors/coordinator_state.hpp"
#include "actors/messages.hpp"

namespace ringmaster {

// How long a replica (a proxy for a node's, which asks the node) may take to hand over its final weights.
constexpr std::chrono::seconds kWeightsTimeout{60};

using namespace coordinator_detail;

std::string format_progress(const progress& p) {
  const int width = 30;
  const int filled = p.steps ? int(width * p.step / p.steps) : width;
  std::string bar(size_t(filled), '=');
  if (filled < width) bar += '>' + std::string(size_t(width - filled - 1), '.');
  char head[64], tail[256];
  const int digits = int(std::to_string(p.steps).size());
  std::snprintf(head, sizeof head, "%*lld/%lld ", digits, (long long)p.step, (long long)p.steps);
  // A resumed epoch's first steps ran before this run: its time and rates count from where it resumed.
  const int64_t here = p.step - p.first_step;
  if (p.epoch_end) {
    const double per_step = here > 0 ? p.seconds / double(here) : 0;
    char resumed[48] = "";
    if (p.first_step > 0) std::snprintf(resumed, sizeof resumed, " (resumed at step %lld)", (long long)p.first_step);
    std::snprintf(tail, sizeof tail, " - %.1fs %.1fms/step%s - loss: %.4f - accuracy: %.4f - %.0f samples/s",
                  p.seconds, per_step * 1e3, resumed, p.loss, p.accuracy, p.samples_per_sec);
  } else {
    const double eta = here > 0 ? p.seconds / double(here) * double(p.steps - p.step) : 0;
    std::snprintf(tail, sizeof tail, " - ETA: %.0fs - loss: %.4f - accuracy: %.4f - %.0f samples/s", eta,
                  p.loss, p.accuracy, p.samples_per_sec);
  }
  std::string line = std::string(head) + "[" + bar + "]" + tail;
  if (p.epoch_end && !std::isnan(p.val_loss)) {
    char val[96];
    std::snprintf(val, sizeof val, " - val_loss: %.4f - val_accuracy: %.4f", p.val_loss, p.val_accuracy);
    line += val;
  }
  return line;
}

std::string interrupted_by(int sig) {
  const char* name = sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : sig == SIGHUP ? "SIGHUP" : nullptr;
  return std::string("interrupted (") + (name ? name : "signal " + std::to_string(sig)) + ")";
}

namespace {

void stop_all(caf::event_based_actor* self, coordinator_state& st) {
  for (auto* group : {&st.replicas, &st.loaders, &st.reducers})
    for (auto& a : *group) self->send_exit(a, caf::exit_reason::user_shutdown);
}

}  // namespace

void coordinator_detail::finish(caf::event_based_actor* self, coordinator_state& st, std::string error) {
  if (st.finished) return;
  st.finished = true;
  st.result->ok = error.empty();
  st.result->error = std::move(error);
  const auto most = std::max_element(st.val_counts.begin(), st.val_counts.end());
  for (int64_t c : st.val_counts) st.result->partial_evals += c < *most;
  stop_all(self, st);
  st.reply.deliver(st.result);
  self->quit();
}

job_progress coordinator_detail::progress_after(const coordinator_state& st, int64_t done, const epoch_acc* open) {
  job_progress p;
  p.step = done;
  // The ring that ran step `done` (a checkpoint of a step the old ring completed is written as the new one
  // forms; a node lost after the last step changed no ring that ran one).
  const auto ring = st.ring_replicas.lower_bound(done);
  p.replicas = ring == st.ring_replicas.begin() ? st.cfg.replicas : std::prev(ring)->second;
  // Those before `done` (a checkpoint of a step the old ring completed is written as the new one forms).
  const int64_t spe = st.cfg.steps_per_epoch;
  const auto& joins = st.result->joins;
  p.ranks_changed = st.cfg.start.ranks_changed +
                    int(std::count_if(joins.begin(), joins.end(), [&](const node_join& j) { return j.epoch * spe < done; })) +
                    int(std::count_if(st.loss_starts.begin(), st.loss_starts.end(), [&](int64_t start) { return start < done; }));
  p.history = st.result->history;
  if (open) {
    p.loss = open->loss;
    p.correct = open->correct;
    p.count = open->count;
    p.unmeasured = open->unmeasured;
  }
  return p;
}

namespace {

// How long epoch `a`'s steps took, to its last one (`end`) or to now; the ranks' word for their forward
// and backward no more than this run has lasted (a lying node's 10^9 s).
double epoch_seconds(const coordinator_state& st, const epoch_acc& a, bool end) {
  const auto to = end ? a.last_step : clock_type::now();
  return std::max(secs(a.start, to), std::min(a.compute_floor, secs(st.start, to)));
}

void report_progress(coordinator_state& st, int64_t e, bool end) {
  // A later epoch's steps shown before this one's end line would print its header first, then this
  // one's end, then its header again (a backlog of reports after a re-forming).
  if (!st.cfg.on_progress || (!end && e != st.first_open)) return;
  epoch_acc& a = st.epochs[e];
  const auto now = clock_type::now();
  if (!end && secs(st.last_print, now) < 0.1) return;  // at most 10 updates a second
  st.last_print = now;
  progress p;
  p.epoch = e;
  p.epochs = st.cfg.epochs;
  p.step = a.steps_done;
  p.steps = st.cfg.steps_per_epoch;
  p.first_step = a.first_step;
  p.seconds = epoch_seconds(st, a, end);
  p.loss = a.measured() ? a.loss / double(a.measured()) : 0;
  p.accuracy = a.measured() ? double(a.correct) / double(a.measured()) : 0;
  p.samples_per_sec = p.seconds > 0 ? double(a.count - a.first_count) / p.seconds : 0;
  p.epoch_end = end;
  p.val_loss = a.val_count ? a.val_loss / double(a.val_count) : NAN;
  p.val_accuracy = a.val_count ? double(a.val_correct) / double(a.val_count) : NAN;
  st.cfg.on_progress(p);
}

// An epoch is complete when every step has N reports and (if evaluating) N evaluations arrived. `force`:
// also with fewer evaluations (a lost node's went with it, and the weights have moved on since). Epochs
// close in order: a later one waits for this one (after a re-forming, one with the survivors'
// evaluations closed before an earlier one still short of a lost rank's, and went unclocked).
void maybe_close_epoch(caf::event_based_actor* self, coordinator_state& st, int64_t e, bool force = false) {
  epoch_acc& a = st.epochs[e];
  const int n = st.cfg.replicas;
  if (a.closed || e != st.first_open || a.steps_done < st.cfg.steps_per_epoch || (st.cfg.evaluate && a.evals < n && !force)) return;
  a.closed = true;
  for (auto it = st.epochs.lower_bound(st.first_open); it != st.epochs.end() && it->second.closed; ++it) st.first_open = it->first + 1;
  a.val_loss = 0;
  for (double l : a.val_losses) a.val_loss += l;  // rank order, whatever the arrival order
  epoch_stats s;
  s.epoch = e;
  s.loss = a.measured() ? a.loss / double(a.measured()) : 0;
  s.accuracy = a.measured() ? double(a.correct) / double(a.measured()) : 0;
  s.val_loss = a.val_count ? a.val_loss / double(a.val_count) : NAN;
  s.val_accuracy = a.val_count ? double(a.val_correct) / double(a.val_count) : NAN;
  s.samples = a.count;
  s.seconds = epoch_seconds(st, a, true);
  s.eval_seconds = a.eval_seconds;
  st.result->history.push_back(s);
  st.result->train_seconds += s.seconds;
  st.result->train_samples += a.count - a.first_count;
  st.result->unmeasured += a.unmeasured;
  if (st.cfg.evaluate) st.val_counts.push_back(a.val_count);
  report_progress(st, e, true);
  epoch_acc& next = st.epochs[e + 1];
  next.start = next.steps_done > 0 ? a.last_step : clock_type::now();  // one that ran meanwhile: from this one's end
  // At an epoch's end a checkpoint waits for the evaluation, so that the epoch is whole in its history.
  checkpoint_progress(self, st, (e + 1) * st.cfg.steps_per_epoch, nullptr);
  if (!st.finished) maybe_close_epoch(self, st, e + 1);  // one that waited for this one
}

// Why the job stops for a training loss that is not finite.
std::string loss_gone(double loss, int64_t e, int64_t step) {
  return "the loss became " + std::string(std::isnan(loss) ? "NaN" : "infinite") + " at epoch " + std::to_string(e + 1) + ", step " +
         std::to_string(step + 1) + " (too high a learning rate?); the job was stopped";
}

// Adds step `step` of epoch e, all of whose reports are in, to its epoch. A step `settled` at a
// re-forming (a lost rank's report went with it) ran before the ring stalled: it is timed by its last
// report, and it is not the step that ends the recovery.
void complete_step(caf::event_based_actor* self, coordinator_state& st, int64_t e, int64_t step, bool settled = false) {
  const auto now = clock_type::now();
  if (st.last_complete != clock_type::time_point{}) st.slowest_step = std::max(st.slowest_step, now - st.last_complete);
  st.last_complete = now;
  epoch_acc& a = st.epochs[e];
  const step_acc s = std::move(a.pending[step]);
  a.pending.erase(step);
  for (double l : s.losses) a.loss += l;
  a.compute_floor += s.compute_max;
  a.correct += s.correct;
  a.count += s.count;
  // A NaN or infinite loss never comes back: stop rather than train on garbage to the end. (Finite
  // losses may add up to an infinite one; a rank's own NaN is caught as it comes, step_report.)
  if (!std::isfinite(a.loss)) return finish(self, st, loss_gone(a.loss, e, step));
  ++a.steps_done;
  a.last_step = settled ? std::max(a.last_step, s.last) : now;
  if (!settled && st.recovering < st.result->losses.size()) {  // the first step since the ring was re-formed
    char line[160];
    for (size_t i = st.recovering; i < st.result->losses.size(); ++i) {
      node_loss& l = st.result->losses[i];
      l.next_step = a.last_step;
      l.recovered = secs(l.since, a.last_step);
      std::snprintf(line, sizeof line, "the next step was complete %.2f s after %s node %s", l.recovered,
                    l.hung ? "the last step before the ring stalled on" : "the last message of", l.node.c_str());
      if (st.cfg.on_event) st.cfg.on_event(line);
    }
    st.recovering = SIZE_MAX;
  }
  report_progress(st, e, false);
  if (a.steps_done < st.cfg.steps_per_epoch)  // mid-epoch; an epoch's end waits for its evaluation
    checkpoint_progress(self, st, e * st.cfg.steps_per_epoch + a.steps_done, &a);
  if (st.finished) return;
  maybe_close_epoch(self, st, e);
}

// The steps before `start` still open: lost ranks' reports of them went with their nodes. Each counts
// whole, their samples unmeasured (the sum every survivor applied had their gradients).
void count_lost_reports(caf::event_based_actor* self, coordinator_state& st, int64_t start) {
  std::vector<std::pair<int64_t, int64_t>> open;  // (epoch, step)
  for (auto& [e, a] : st.epochs)
    for (auto& [k, s] : a.pending)
      if (e * st.cfg.steps_per_epoch + k < start) open.emplace_back(e, k);
  for (auto [e, step] : open) {
    step_acc& s = st.epochs[e].pending[step];
    const int64_t missing = std::max<int64_t>(0, int64_t(st.cfg.global_batch) - s.count);
    s.count += missing;
    st.epochs[e].unmeasured += missing;
    complete_step(self, st, e, step, true);
    if (st.finished) return;
  }
}

// The ring was re-formed: the steps before note.start_step are complete (every survivor applied them or
// took the state of one that did, and the lost ranks' gradients were in them: their samples count even
// if their reports went with them, unmeasured), the reports of the steps from it on are dropped (those
// steps run again), and so are the evaluations of epochs that end from it on (the survivors evaluate
// them again).
void reform(caf::event_based_actor* self, coordinator_state& st, const reform_note& note) {
  const int64_t spe = st.cfg.steps_per_epoch, start = note.start_step;
  st.last_news = st.last_complete = st.last_state = clock_type::now();  // the pause is no step's time
  for (auto& [e, a] : st.epochs) {
    for (auto it = a.pending.begin(); it != a.pending.end();) it = e * spe + it->first >= start ? a.pending.erase(it) : std::next(it);
    if (!a.closed && (e + 1) * spe >= start) {
      a.val_losses.clear();
      a.val_loss = 0;
      a.val_correct = a.val_count = 0;
      a.evals = 0;
      a.eval_seconds = 0;
    }
  }
  // Rank 0's states for steps that run again are of no use; the new rank 0 sends its own.
  for (auto it = st.checkpoints.begin(); it != st.checkpoints.end();)
    it = it->first > start ? st.checkpoints.erase(it) : std::next(it);
  st.votes.erase(st.votes.upper_bound(start), st.votes.end());  // the new ranks report those steps again
  st.evicted.erase(st.evicted.upper_bound(start), st.evicted.end());  // and the new rank 0 sends their states
  for (auto* group : {&st.replicas, &st.loaders, &st.reducers})
    for (auto& a : *group) self->demonitor(a);
  st.replicas = st.loaders = st.reducers = note.ranks;
  for (auto& a : note.ranks) self->monitor(a);
  st.cfg.replicas = int(note.ranks.size());
  st.ring_replicas[start] = st.cfg.replicas;
  st.cfg.where = note.where;
  st.gen = note.gen;
  st.next_report.assign(note.ranks.size(), start);  // every rank of the new ring goes on from there
  st.heard_from.assign(note.ranks.size(), st.last_news);
  st.done = st.weights_in = 0;
  st.done_ranks.clear();
  st.result->checksums.clear();
  for (auto& [e, a] : st.epochs) {  // what the new ranks owe is counted from now
    a.evaluated.clear();
    a.first_eval = clock_type::now();
    for (auto& [k, s] : a.pending) s.first = clock_type::now();
  }
  // Losses not yet recovered from (one re-forming after another, no step between) wait too.
  st.recovering = std::min(st.recovering, st.result->losses.size());
  st.result->joins.insert(st.result->joins.end(), note.joins.begin(), note.joins.end());
  for (node_loss l : note.losses) {
    st.loss_starts.push_back(start);
    l.generation = note.gen;
    l.survivors = int(note.ranks.size());
    const int64_t at = std::min(start, spe * st.cfg.epochs - 1);  // after the last step: that one
    l.epoch = at / spe;
    l.step = at % spe;
    st.result->losses.push_back(std::move(l));
  }
  count_lost_reports(self, st, start);
  if (st.finished) return;
  // An epoch that ended before `start` and still lacks a lost rank's evaluation will not get it.
  for (auto& [e, a] : st.epochs)
    if ((e + 1) * spe < start) maybe_close_epoch(self, st, e, true);
  // Last, once the steps and epochs above have added their halves: a state the old rank 0 owed for an
  // earlier step went with it (a surviving one sent its states before it paused), so that checkpoint is
  // given up. One due at `start` comes from the new rank 0 as it goes on.
  for (auto it = st.checkpoints.begin(); it != st.checkpoints.end();) {
    if (it->first >= start || it->second.state) {
      ++it;
      continue;
    }
    ++st.result->checkpoints_skipped;
    if (st.cfg.on_event)
      st.cfg.on_event("the checkpoint after step " + std::to_string(it->first) + " is skipped: its state went with rank 0's node");
    st.votes.erase(it->first);
    it = st.checkpoints.erase(it);
  }
}

// Rank r's final weights are in (as their checksum): once every rank's are, the job ends.
void final_weights_in(caf::event_based_actor* self, coordinator_state& st, int r, uint64_t sum, bool finite) {
  // From a node these are its word: weights no training makes are not saved as a result.
  if (!finite) return finish(self, st, "rank " + rank_where(st, r) + " sent final weights that hold NaN or infinite values");
  st.result->checksums[size_t(r)] = sum;
  if (++st.weights_in < int(st.replicas.size())) return;
  bool same = true;
  for (uint64_t c : st.result->checksums) same = same && c == st.result->checksums[0];
  st.result->identical = same;
  st.result->result_rank = st.result_rank;
  st.result->last_checkpoint_refused = st.last_given_up;
  // The checkpoint after the last step is the result too (a resume of the finished run gives it): rank
  // 0's node sent its state, and must not have sent another. Rank 0's final weights are what is saved:
  // checked even where replicas differ (a node found faulty as the job ended finishes with the others).
  // Where that checkpoint was given up, the result is another rank's (result_from): every rank of the
  // nodes that held the majority's state must have ended with the same weights.
  const uint64_t result = st.result->checksums[size_t(st.result_rank)];
  for (size_t i = 0; i < st.result->checksums.size() && !st.result_from.empty(); ++i)
    if (i < st.cfg.where.size() && st.result_from.count(st.cfg.where[i]) && st.result->checksums[i] != result)
      return finish(self, st, "ranks " + rank_where(st, st.result_rank) + " and " + rank_where(st, int(i)) +
                                  ", of nodes that held the majority's state after the last step, ended with different weights: no result can be trusted");
  if (st.written == st.cfg.steps_per_epoch * st.cfg.epochs && st.written_params != result)
    return finish(self, st, same ? "the checkpoint after the last step (" + std::to_string(st.written) +
                                       ") holds other weights than every rank's final ones: rank " + st.written_by +
                                       " sent a state that was not its own; do not resume from it"
                                 : "the checkpoint after the last step (" + std::to_string(st.written) +
                                       ") holds other weights than rank 0's final ones, and the replicas differ: the node of rank " +
                                       st.written_by + " sent a state or final weights not its own; use neither");
  // Every state and report came before its rank's done: a checkpoint still waiting is a bug.
  if (!st.checkpoints.empty())
    return finish(self, st, "the checkpoint after step " + std::to_string(st.checkpoints.begin()->first) + " was never complete");
  finish(self, st, "");
}

}  // namespace

void coordinator_detail::settle_lost_reports(caf::event_based_actor* self, coordinator_state& st, int64_t at) {
  count_lost_reports(self, st, at);
  if (st.finished) return;
  for (auto& [e, a] : st.epochs)
    if ((e + 1) * st.cfg.steps_per_epoch <= at) maybe_close_epoch(self, st, e, true);
}

caf::behavior coordinator(caf::event_based_actor* self, coordinator_config cfg) {
  auto st = std::make_shared<coordinator_state>();
  st->cfg = std::move(cfg);
  st->next_report.assign(size_t(std::max(0, st->cfg.replicas)), st->cfg.start.step);

  self->set_down_handler([self, st](caf::down_msg& dm) {
    if (st->finished) return;
    std::string who = "an actor";
    for (size_t r = 0; r < st->replicas.size() && who == "an actor"; ++r) {
      if (dm.source == st->replicas[r].address()) who = "replica " + std::to_string(r);
      else if (dm.source == st->reducers[r].address()) who = "reducer " + std::to_string(r);
      else if (dm.source == st->loaders[r].address()) who = "data loader " + std::to_string(r);
    }
    // A rank's own error names it ("replica 1 on cuda:0: ..."), and a node's rank (a proxy here) ends with
    // the launcher's verdict on its node or on the job: either is said as it is, not as "replica 0 stopped".
    std::string why = error_text(self->system(), dm.reason);
    if (why.empty()) why = "no reason given";  // an empty error would read as success
    const bool named = why.rfind(who + " ", 0) == 0 || why.rfind(who + ":", 0) == 0 ||
                       (!st->cfg.where.empty() && who.rfind("replica ", 0) == 0);
    finish(self, *st, named ? why : who + " stopped: " + why);
  });

  // An exception in a handler (out of memory, a throwing on_progress) ends the job with its message:
  // without an answer, whoever waits for the job's result would wait forever.
  self->set_exception_handler([self, st](caf::scheduled_actor*, std::exception_ptr& e) -> caf::error {
    std::string what = "coordinator: " + exception_text(e);
    finish(self, *st, what);
    if (st->reply.pending()) st->reply.deliver(st->result);  // finish() itself may have thrown on the way
    return caf::make_error(caf::sec::runtime_error, std::move(what));
  });

  return {
      [self, st](run_atom, std::vector<caf::actor> replicas, std::vector<caf::actor> loaders,
                 std::vector<caf::actor> reducers) {
        st->reply = self->make_response_promise();
        st->replicas = std::move(replicas);
        st->loaders = std::move(loaders);
        st->reducers = std::move(reducers);
        const int n = int(st->replicas.size());
        for (auto* group : {&st->replicas, &st->loaders, &st->reducers})
          for (auto& a : *group) self->monitor(a);
        st->start = st->last_print = st->last_news = st->last_complete = st->last_state = clock_type::now();  // the first step counts
        st->ring_replicas[st->cfg.start.step] = st->cfg.replicas;
        st->heard_from.assign(size_t(std::max(0, st->cfg.replicas)), st->start);
        // A resumed job starts with its history and the open epoch's sums so far.
        const job_progress& from = st->cfg.start;
        const int64_t spe = std::max<int64_t>(1, st->cfg.steps_per_epoch);
        st->result->history = from.history;
        st->first_open = from.step / spe;  // the epochs before closed in the run it resumes
        epoch_acc& a = st->epochs[from.step / spe];
        a.start = st->start;
        a.steps_done = a.first_step = from.step % spe;
        a.loss = from.loss;
        a.correct = from.correct;
        a.count = a.first_count = from.count;
        a.unmeasured = from.unmeasured;
        for (int r = 0; r < n; ++r)
          self->send(st->replicas[r], run_atom::value, st->loaders[r], st->reducers[r],
                     caf::actor_cast<caf::actor>(self));
        if (st->cfg.report_timeout.count() > 0) self->delayed_send(self, std::chrono::seconds(1), tick_atom::value);
        // Urgent: a coordinator behind on its mailbox (writing a checkpoint every step, say) must not see a
        // signal only after the reports of every step to the job's end.
        if (st->cfg.interrupt) self->send<caf::message_priority::high>(self, signal_atom::value);
        return st->reply;
      },
      [self, st](const step_report& r) {
        // Of a ring given up on, or from before the run (its ranks start with it: a lying node's).
        if (st->finished || st->replicas.empty() || r.gen != st->gen || r.rank < 0 || r.rank >= st->cfg.replicas) return;
        if (std::string bad = check_report(*st, r); !bad.empty())
          return finish(self, *st, "rank " + rank_where(*st, r.rank) + " reported " + bad);
        // At once: the other ranks' reports of this step may come after this rank's evaluation, which
        // would be blamed instead (a NaN test loss after a whole epoch trained on NaN).
        if (!std::isfinite(r.loss_sum)) return finish(self, *st, loss_gone(r.loss_sum, r.epoch, r.step));
        st->last_news = st->heard_from[size_t(r.rank)] = clock_type::now();
        st->next_report[size_t(r.rank)] = r.epoch * st->cfg.steps_per_epoch + r.step + 1;
        if (r.state_sum) note_state_sum(*st, r);
        st->result->wait_batch += r.wait_batch;
        st->result->compute += r.compute;
        st->result->wait_ring += r.wait_ring;
        st->result->update += r.update;
        step_acc& s = st->epochs[r.epoch].pending[r.step];
        if (s.reports == 0) s.first = clock_type::now();
        s.last = clock_type::now();
        s.losses.resize(size_t(st->cfg.replicas), 0.0);
        s.seen.resize(size_t(st->cfg.replicas), 0);
        s.losses[size_t(r.rank)] = r.loss_sum;
        s.seen[size_t(r.rank)] = 1;
        s.correct += r.correct;
        s.count += r.count;
        s.compute_sum += r.compute;
        s.compute_max = std::max(s.compute_max, r.compute);
        if (2 * ++s.reports >= st->cfg.replicas && s.half == clock_type::time_point{}) s.half = clock_type::now();
        if (s.reports < st->cfg.replicas) return;
        st->result->wait_slower += s.compute_max * st->cfg.replicas - s.compute_sum;
        if (s.count != st->cfg.global_batch)
          return finish(self, *st, "the ranks reported " + std::to_string(s.count) + " samples for step " + std::to_string(r.step + 1) +
                                       " of epoch " + std::to_string(r.epoch + 1) + ", not the global batch of " +
                                       std::to_string(st->cfg.global_batch));
        complete_step(self, *st, r.epoch, r.step);
      },
      [self, st](const eval_report& r) {
        if (st->finished || st->replicas.empty() || r.gen != st->gen || r.rank < 0 || r.rank >= st->cfg.replicas) return;
        if (auto e = st->epochs.find(r.epoch); e != st->epochs.end() && e->second.closed) return;  // a lost rank's share
        if (std::string bad = check_report(*st, r); !bad.empty())
          return finish(self, *st, "rank " + rank_where(*st, r.rank) + " reported " + bad);
        // Trained weights whose test loss is not a number: the model's fault (an overflow), not the rank's.
        if (!std::isfinite(r.loss_sum))
          return finish(self, *st, "the test loss became " + std::string(std::isnan(r.loss_sum) ? "NaN" : "infinite") +
                                       " in the evaluation after epoch " + std::to_string(r.epoch + 1) + " (rank " +
                                       rank_where(*st, r.rank) + "); the job was stopped");
        st->last_news = st->heard_from[size_t(r.rank)] = clock_type::now();
        epoch_acc& a = st->epochs[r.epoch];
        if (a.evals == 0) a.first_eval = clock_type::now();
        a.val_losses.resize(size_t(st->cfg.replicas), 0.0);
        a.evaluated.resize(size_t(st->cfg.replicas), 0);
        a.evaluated[size_t(r.rank)] = 1;
        a.val_losses[size_t(r.rank)] = r.loss_sum;
        a.val_correct += r.correct;
        a.val_count += r.count;
        a.eval_seconds = std::max(a.eval_seconds, r.seconds);
        ++a.evals;
        maybe_close_epoch(self, *st, r.epoch);
      },
      [self, st](checkpt_atom, state_ptr s) -> bool {  // true: taken (rank 0 goes on)
        take_state(self, *st, std::move(s));
        return true;
      },
      [self, st](reform_atom, const reform_note& note) {
        if (!st->finished) reform(self, *st, note);
      },
      [st](pause_atom, int gen) { st->holding = std::max(st->holding, gen); },  // the launcher forms ring `gen`
      [self, st](tick_atom) {
        if (st->finished) return;
        const auto now = clock_type::now();
        if (st->holding > st->gen) {  // a ring being formed: the clocks stand still
          st->last_news = st->last_state = now;
          std::fill(st->heard_from.begin(), st->heard_from.end(), now);
        }
        if (st->holding <= st->gen) {
          if (std::string late = late_ranks(*st, now); !late.empty())
            return finish(self, *st, late + " (their nodes still answer)");
          if (std::string silent = silent_ranks(*st, now); !silent.empty())
            return finish(self, *st, silent + " (their nodes still answer)");
          check_withheld(self, *st, now);
          if (st->finished) return;
        }
        self->delayed_send(self, std::chrono::seconds(1), tick_atom::value);
      },
      [self, st](signal_atom) {  // Ctrl-C, say: the replicas stop after the step they are in
        if (st->finished) return;
        const int sig = st->cfg.interrupt->load();
        // (Not once the stop fell on the job's last step: it finishes with its results.)
        const bool at_end = st->stop_at == st->cfg.steps_per_epoch * st->cfg.epochs;
        if (st->stopping && !at_end && clock_type::now() >= st->stop_deadline) {
          st->result->interrupted = st->stopping;
          return finish(self, *st, interrupted_by(st->stopping) + "; no checkpoint was written at the stop: it took too long");
        }
        if (sig && !st->stopping && st->cfg.on_checkpoint) begin_stop(self, st, sig);
        else if (sig && !st->stopping) {
          st->result->interrupted = sig;
          return finish(self, *st, interrupted_by(sig));
        }
        self->delayed_send<caf::message_priority::high>(self, std::chrono::milliseconds(50), signal_atom::value);
      },
      [self, st](const pause_report& r) { stop_paused(self, st, r); },
      [self, st](checkpt_atom, stop_note& n) { stop_with_state(self, st, std::move(n)); },
      [self, st](done_atom, int rank) {
        if (st->finished || st->replicas.empty() || rank < 0 || rank >= st->cfg.replicas) return;
        st->done_ranks.resize(size_t(st->cfg.replicas), 0);
        if (st->done_ranks[size_t(rank)]) return;  // said twice
        st->done_ranks[size_t(rank)] = 1;
        st->last_news = st->heard_from[size_t(rank)] = clock_type::now();
        if (st->done++ == 0) st->first_done = clock_type::now();
        if (st->done < st->cfg.replicas) return;
        // Every rank sends its reports before it says it is done: all of them are in, so every epoch is
        // closed, unless a rank said so before its last step.
        if (int64_t(st->result->history.size()) < st->cfg.epochs)
          return finish(self, *st, "every rank said it was done, but the job's " + std::to_string(steps_complete(*st)) +
                                       " steps complete and " + std::to_string(st->result->history.size()) + " epochs closed are short of its " +
                                       std::to_string(st->cfg.epochs) + " epochs of " + std::to_string(st->cfg.steps_per_epoch) + " steps");
        const size_t n = st->replicas.size();
        st->result->checksums.assign(n, 0);
        if ((st->result_rank = pick_result_rank(*st)) < 0)
          return finish(self, *st, "no rank is left on a node that held the majority's state after the last step, whose final weights would be the result");
        // Rank 0's weights are the result (or result_rank's); of the others a checksum is enough to tell
        // they are the same (from nodes each would cross the network, and the launcher held them all at once).
        for (size_t r = 0; r < n; ++r) {
          // An answer for a generation given up on (a node lost meanwhile) is ignored.
          auto failed = [self, st, r, gen = st->gen](caf::error& e) {
            if (gen == st->gen)
              finish(self, *st, "replica " + std::to_string(r) + " did not send its weights" +
                                  (e == caf::sec::request_timeout ? " within " + std::to_string(kWeightsTimeout.count()) + " s"
                                                                  : ": " + error_text(self->system(), e)));
          };
          if (int(r) == st->result_rank) {
            self->request(st->replicas[r], kWeightsTimeout, weights_atom::value)
                .then(
                    [self, st, r, gen = st->gen](chunk_ptr w) {
                      if (gen != st->gen) return;
                      const bool finite = std::all_of(w->begin(), w->end(), [](float x) { return std::isfinite(x); });
                      if (finite) st->result->weights = *w;
                      final_weights_in(self, *st, int(r), fnv1a(w->data(), w->size()), finite);
                    },
                    failed);
          } else {
            self->request(st->replicas[r], kWeightsTimeout, sum_atom::value)
                .then(
                    [self, st, r, gen = st->gen](uint64_t sum, bool finite) {
                      if (gen == st->gen) final_weights_in(self, *st, int(r), sum, finite);
                    },
                    failed);
          }
        }
      },
  };
}

}  // namespace ringmaster
