// The coordinator's checkpoints (actors/coordinator_state.hpp): rank 0's state after a step and the job's
// metrics up to it wait for each other, and the ranks' checksums of their states decide whether the state
// may be written and which nodes are faulty (judge_states).
#include <algorithm>
#include <cstdio>
#include <iterator>

#include "actors/checkpoint.hpp"  // state_fault
#include "actors/coordinator_state.hpp"
#include "actors/messages.hpp"

namespace ringmaster {

using namespace coordinator_detail;

namespace {

// Checkpoints whose halves wait for each other: rank 0's state may come a little ahead of the others'
// reports, or they ahead of it, but a node that sends states for steps far ahead (or never) must not
// make us hold them all. A state that finds this many waiting makes the oldest go (a line says so once).
constexpr size_t kMaxHeldCheckpoints = 8;
// Metrics waiting for their state are small: many may wait (a state of GBs on a slow link), not forever.
constexpr size_t kMaxHeldProgress = 256;
// How far ahead of the steps complete rank 0's state may be and still count as news from it: its node
// sends the state right after the step, the reports of every rank within a batch of 64 (node_links.hpp).
constexpr int64_t kMaxStateLead = 1024;

// Writes the checkpoint after `done` steps once both its halves are here.
void offer_checkpoint(caf::event_based_actor* self, coordinator_state& st, int64_t done) {
  auto it = st.checkpoints.find(done);
  if (it == st.checkpoints.end() || !it->second.state || !it->second.have_progress) return;
  pending_checkpoint c = std::move(it->second);
  // Weights gone NaN or infinite while the loss stays finite (a layer that hides them, a parameter the
  // forward pass does not use): never written, where it would replace a good one.
  if (std::string bad = state_fault(*c.state); !bad.empty()) {
    if (st.stopping) return stop_without_checkpoint(self, st, diverged(done, bad));  // the stop's own
    return finish(self, st, diverged(done, bad) + ": no checkpoint was written from it" +
                                (st.written > st.cfg.start.step ? "; the last one, after step " + std::to_string(st.written) + ", is kept" : ""));
  }
  // Rank 0's state must be the one every rank holds: a node that sent another (finite, plausible values:
  // state_fault passes them) would have it written, and a resume would train on from it.
  std::vector<state_vote> votes;
  if (auto vote = st.votes.find(done); vote != st.votes.end()) votes = std::move(vote->second);
  st.votes.erase(st.votes.begin(), st.votes.upper_bound(done));  // those before it: of checkpoints superseded
  const uint64_t sent = votes.empty() ? 0 : state_checksum(*c.state);  // 0: nothing to compare with, or no memory
  std::string fail_after;  // --on-node-loss abort with a node shown faulty: the job ends once this is written
  if (const state_verdict v = sent ? judge_states(votes, c.sender, sent, done) : state_verdict{}; !v.agree) {
    // The faulty nodes, for the messages, and why rank 0's state is not written.
    std::string not_written = "rank 0's node, " + c.sender + " (lost since), sent a state that the other nodes do not hold";
    bool sender_named = false;
    for (const auto& [where, why] : v.faulty)
      if (where == c.sender) not_written = "rank 0's node, " + where + ", is faulty: " + why, sender_named = true;
    // A sender still in the ring that gave no checksum of its own cannot be judged on another's word.
    const bool sender_here = !st.cfg.where.empty() && st.cfg.where[0] == c.sender;
    const bool last = done >= st.cfg.steps_per_epoch * st.cfg.epochs;
    if (!v.decided || (!v.sender_ok && !sender_named && sender_here) || (!st.cfg.on_faulty_node && !v.sender_ok))
      return finish(self, st, "the state rank 0" + (c.sender.empty() ? "" : " (" + c.sender + ")") + " sent after step " +
                                  std::to_string(done) + " is not the one held by " + v.disagree +
                                  ": no checkpoint was written from it (a faulty or lying node" + faults_named(v) + ")" +
                                  (v.decided ? "" : "; no majority of nodes holds one state") +
                                  (st.written > st.cfg.start.step ? "; the last one, after step " + std::to_string(st.written) + ", is kept" : ""));
    // After the last step the launcher keeps them to the end (it re-forms no ring for them while the final
    // weights come in). With --on-node-loss abort (no on_faulty_node) rank 0's state, the majority's, is
    // written, and then the job ends.
    for (const auto& [where, why] : v.faulty)
      if (st.cfg.on_faulty_node) st.cfg.on_faulty_node(where, why + " (a faulty or lying node)");
      else fail_after += where + " is faulty: " + why + " (a faulty or lying node); ";
    if (!fail_after.empty())
      fail_after += "--on-node-loss abort ends the job (" + v.disagree + ": another state than rank 0's); the checkpoint after step " +
                    std::to_string(done) + ", rank 0's state, which the majority of nodes holds, is written";
    if (!v.sender_ok) {  // not written: the next one comes from the new ring's rank 0
      std::string instead;
      if (last) {  // none comes after it: the result is the final weights of a rank of the majority's
        for (const state_vote& x : votes)  // the nodes whose ranks reported it
          if (x.sum && x.where != c.sender && std::none_of(v.faulty.begin(), v.faulty.end(), [&](const auto& f) { return f.first == x.where; }))
            st.result_from.insert(x.where);
        st.last_given_up = true;
        const int r = pick_result_rank(st);
        if (r < 0) return finish(self, st, "after the last step no rank is left on a node that holds the majority's state: " + not_written);
        instead = "; the result is the final weights of rank " + rank_where(st, r) + ", which holds the majority's state";
        if (st.written > st.cfg.start.step) instead += ", and the last checkpoint, after step " + std::to_string(st.written) + ", is kept";
      }
      if (st.cfg.on_event)
        st.cfg.on_event("the checkpoint after step " + std::to_string(done) + " was not written: " + not_written + instead);
      ++st.result->checkpoints_skipped;
      st.checkpoints.erase(it);
      return;
    }
  }
  // Those before it will never be written now (they come in step order; a skipped one is superseded).
  // One whose metrics are in never got its state (rank 0's node did not send it): say so, once.
  for (auto k = st.checkpoints.begin(); k != it; ++k) {
    if (!k->second.have_progress) continue;
    ++st.result->checkpoints_skipped;
    if (st.cfg.on_event && st.skipped_checkpoints++ == 0)
      st.cfg.on_event("skipped the checkpoint after step " + std::to_string(k->first) +
                      ": rank 0's node sent no state for it, only for a later step");
  }
  st.checkpoints.erase(st.checkpoints.begin(), std::next(it));
  st.written = std::max(st.written, done);
  if (done == st.cfg.steps_per_epoch * st.cfg.epochs) {  // the result's twin: compared with the final weights
    st.written_params = fnv1a(c.state->params.data(), c.state->params.size());
    st.written_by = rank_where(st, 0);  // who sent it (a re-formed ring may number another node's rank 0)
  }
  if (std::string error = st.cfg.on_checkpoint(c.progress, *c.state); !error.empty())
    return finish(self, st, "checkpoint after step " + std::to_string(done) + ": " + error +
                                (fail_after.empty() ? "" : "; and " + fail_after.substr(0, fail_after.find("; the checkpoint after step"))));
  if (!fail_after.empty()) return finish(self, st, fail_after);
  st.last_state = clock_type::now();  // the write took our time, not rank 0's node's (a slow disk)
}

}  // namespace

// A rank's checksum of its state after a checkpoint's step, kept until rank 0's state is written. One
// where none is due, or for a step written already, is not kept (a lying node cannot fill our memory).
void coordinator_detail::note_state_sum(coordinator_state& st, const step_report& r) {
  const int64_t spe = st.cfg.steps_per_epoch, done = r.epoch * spe + r.step + 1;
  if (st.cfg.on_checkpoint && done > st.written && checkpoint_due(done, st.cfg.checkpoint_every, spe, spe * st.cfg.epochs))
    st.votes[done].push_back({r.rank, r.state_sum, size_t(r.rank) < st.cfg.where.size() ? st.cfg.where[size_t(r.rank)] : ""});
}

// The rank whose final weights are the result (coordinator_state::result_from): 0, or the lowest on a
// node that reported the majority's state after the last step; -1 if none is left in the ring.
int coordinator_detail::pick_result_rank(const coordinator_state& st) {
  if (st.result_from.empty()) return 0;
  for (size_t r = 0; r < st.cfg.where.size() && r < st.replicas.size(); ++r)
    if (st.result_from.count(st.cfg.where[r])) return int(r);
  return -1;
}

// The metrics half of a checkpoint after `done` steps, if one is due then.
void coordinator_detail::checkpoint_progress(caf::event_based_actor* self, coordinator_state& st, int64_t done, const epoch_acc* open) {
  const int64_t spe = st.cfg.steps_per_epoch;
  if (!st.cfg.on_checkpoint || !checkpoint_due(done, st.cfg.checkpoint_every, spe, spe * st.cfg.epochs) || st.evicted.erase(done)) return;
  pending_checkpoint& c = st.checkpoints[done];
  // Bounded: metrics whose state has not come within kMaxHeldProgress later ones never get one.
  while (st.checkpoints.size() > kMaxHeldProgress && st.checkpoints.begin()->first < done && !st.checkpoints.begin()->second.state) {
    ++st.result->checkpoints_skipped;
    st.checkpoints.erase(st.checkpoints.begin());
  }
  c.have_progress = true;
  c.complete = clock_type::now();
  c.progress = progress_after(st, done, open);
  offer_checkpoint(self, st, done);
}

// Rank 0's state after a step: held until its metrics are in (and written then), if a checkpoint is due.
void coordinator_detail::take_state(caf::event_based_actor* self, coordinator_state& st, state_ptr s) {
  st.last_news = clock_type::now();  // a large state may have held up the reports behind it
  const int64_t spe = st.cfg.steps_per_epoch, done = s ? s->steps : -1;
  if (!st.cfg.on_checkpoint || done <= st.cfg.start.step || done <= st.written || (st.last_given_up && done >= spe * st.cfg.epochs) ||
      !checkpoint_due(done, st.cfg.checkpoint_every, spe, spe * st.cfg.epochs))
    return;  // none asked for then (or given up: a re-formed ring's rank 0 sends it again)
  // A state far ahead of the steps complete is no honest rank 0's: it must not keep check_withheld quiet
  // while the one due is held back (it is judged once its step's metrics come).
  if (done <= steps_complete(st) + kMaxStateLead) st.last_state = clock_type::now();
  size_t states = 0;
  for (const auto& [k, c] : st.checkpoints) states += c.state != nullptr;
  if (states >= kMaxHeldCheckpoints) {  // the oldest goes: a newer one supersedes it, the last must stay
    auto oldest = std::find_if(st.checkpoints.begin(), st.checkpoints.end(), [](const auto& c) { return c.second.state != nullptr; });
    ++st.result->checkpoints_skipped;
    if (st.cfg.on_event && st.skipped_checkpoints++ == 0)  // once: a lying node could send thousands
      st.cfg.on_event("skipped the checkpoint after step " + std::to_string(oldest->first) + ": " +
                      std::to_string(states) + " states waited for their steps' reports");
    // Its metrics, when they come, have no state to go with (nor a reason to be said again, or to make
    // rank 0's node look as if it withheld the state). Only one within the lead an honest node's could have.
    if (oldest->first <= steps_complete(st) + kMaxStateLead) st.evicted.insert(oldest->first);
    if (st.evicted.size() > kMaxHeldProgress) st.evicted.erase(std::prev(st.evicted.end()));
    if (oldest->second.have_progress) oldest->second.state.reset();
    else st.checkpoints.erase(oldest);
  }
  pending_checkpoint& c = st.checkpoints[done];
  c.state = std::move(s);
  c.sender = st.cfg.where.empty() ? "" : st.cfg.where[0];
  offer_checkpoint(self, st, done);
}

void coordinator_detail::check_withheld(caf::event_based_actor* self, coordinator_state& st, clock_type::time_point now) {
  const auto limit = st.cfg.state_timeout;
  auto it = std::find_if(st.checkpoints.begin(), st.checkpoints.end(), [](const auto& c) { return c.second.have_progress && !c.second.state; });
  if (limit.count() <= 0 || it == st.checkpoints.end() || now - std::max(it->second.complete, st.last_state) < limit) return;
  const int64_t done = it->first;
  const std::string sender = st.cfg.where.empty() ? "" : st.cfg.where[0];
  char waited[48];
  std::snprintf(waited, sizeof waited, "%.3g s", std::chrono::duration<double>(limit).count());
  const std::string none = "no state for the checkpoint after step " + std::to_string(done) + " within " + waited +
                           " of that step's end, nor one for a later step (a faulty or lying node, or a link too slow for its states)";
  if (st.cfg.on_faulty_node && !sender.empty() && done < st.cfg.steps_per_epoch * st.cfg.epochs) {
    st.cfg.on_faulty_node(sender, "it sent " + none);
    if (st.cfg.on_event)
      st.cfg.on_event("the checkpoint after step " + std::to_string(done) + " was not written: rank 0's node, " + sender + ", sent no state for it");
    st.votes.erase(done);
    ++st.result->checkpoints_skipped;
    st.checkpoints.erase(it);  // given up: the next one comes from the new ring's rank 0
    return;
  }
  finish(self, st, "rank 0's node" + (sender.empty() ? "" : " (" + sender + ")") + " sent " + none +
                       (st.written > st.cfg.start.step ? "; the last checkpoint, after step " + std::to_string(st.written) + ", is kept" : ""));
}

}  // namespace ringmaster
