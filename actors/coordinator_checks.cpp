// The coordinator's checks on what ranks report, and its words for ranks that are late or silent.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <set>

#include "actors/coordinator_state.hpp"
#include "actors/messages.hpp"

namespace ringmaster::coordinator_detail {

// How far ahead of the steps complete a report may be: honest ranks are at most a batch of reports
// (actors/node_links.cpp) apart; this only bounds what a lying node can make us hold.
constexpr int64_t kMaxReportLead = 100000;

namespace {

// A node's double in our words: at most 13 characters, whatever it sent (to_string writes 1e308 in
// 310 digits).
std::string number(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.6g", v);
  return b;
}

// Index i counted from 1, as our messages count steps and epochs; a node's i may be anything (INT64_MAX + 1
// would overflow).
std::string nth(int64_t i) { return i >= 0 ? std::to_string(uint64_t(i) + 1) : "index " + std::to_string(i); }

}  // namespace

// Steps complete so far in the whole job: those of the closed epochs and the first open one's (a later
// epoch may be open already: a fast rank's reports of it come before a slow one's of this one).
int64_t steps_complete(const coordinator_state& st) {
  const int64_t spe = st.cfg.steps_per_epoch;
  int64_t n = st.first_open * spe;
  for (auto it = st.epochs.lower_bound(st.first_open); it != st.epochs.end(); ++it) {
    const auto& [e, a] = *it;
    if (!a.closed) return std::max(n, e * spe + a.steps_done);  // steps_done counts a resumed epoch's first steps
    n = (e + 1) * spe;
  }
  return n;
}

// "" if a rank's report fits the job and what came before; else what is wrong with it. Reports come from
// other processes (actors/launcher.cpp): a node may lie, and its lies must neither crash, hang nor fool us.
std::string check_report(const coordinator_state& st, const step_report& r) {
  const int64_t spe = st.cfg.steps_per_epoch;
  const std::string what = "step " + nth(r.step) + " of epoch " + nth(r.epoch);
  if (r.epoch < 0 || r.epoch >= st.cfg.epochs || r.step < 0 || r.step >= spe)
    return what + ", which the job (" + std::to_string(st.cfg.epochs) + " epochs of " + std::to_string(spe) + " steps) does not have";
  const int64_t at = r.epoch * spe + r.step, complete = steps_complete(st);
  if (at < complete) return what + " again: it is complete";
  if (at - complete > kMaxReportLead) return what + ", far ahead of the steps complete (" + std::to_string(complete) + ")";
  if (const size_t i = size_t(r.rank); i < st.next_report.size() && at > st.next_report[i]) {
    const std::string from = std::to_string(st.next_report[i] + 1), to = std::to_string(at);
    return what + " without its report" + (from == to ? " of step " + from : "s of steps " + from + "-" + to) +
           " of the job before it: lost on the way (did its node's connection to us break?)";
  }
  if (r.count < 0 || r.count > st.cfg.global_batch || r.correct < 0 || r.correct > r.count || r.loss_sum < 0)
    return what + " with " + std::to_string(r.correct) + " of " + std::to_string(r.count) + " samples right, loss sum " +
           number(r.loss_sum) + ": not a batch of at most " + std::to_string(st.cfg.global_batch);
  for (double t : {r.wait_batch, r.compute, r.wait_ring, r.update})  // summed into train_result: no NaN, no lies below 0
    if (!(t >= 0 && t < 1e9)) return what + " with a time of " + number(t) + " s";
  auto e = st.epochs.find(r.epoch);
  if (e != st.epochs.end()) {
    auto s = e->second.pending.find(r.step);
    if (s != e->second.pending.end() && size_t(r.rank) < s->second.seen.size() && s->second.seen[size_t(r.rank)])
      return what + " twice";
  }
  return "";
}

std::string check_report(const coordinator_state& st, const eval_report& r) {
  const std::string what = "an evaluation of epoch " + nth(r.epoch);
  if (!st.cfg.evaluate || r.epoch < 0 || r.epoch >= st.cfg.epochs) return what + ", which the job does not have";
  auto e = st.epochs.find(r.epoch);
  if (e != st.epochs.end() && size_t(r.rank) < e->second.evaluated.size() && e->second.evaluated[size_t(r.rank)])
    return what + " twice";
  if (r.epoch * st.cfg.steps_per_epoch > steps_complete(st) + kMaxReportLead) return what + " before its steps";
  // No more samples than the test set has (its batches, when known), so sums cannot overflow. (A loss that
  // is NaN or infinite ends the job too, as the model's, not as a lie: the caller says so.)
  const int64_t most = st.cfg.eval_batches > 0 ? st.cfg.eval_batches * int64_t(st.cfg.global_batch) : int64_t(1) << 40;
  if (r.count < 0 || r.count > most || r.correct < 0 || r.correct > r.count || r.loss_sum < 0)
    return what + " with " + std::to_string(r.correct) + " of " + std::to_string(r.count) + " samples right, loss sum " +
           number(r.loss_sum);
  if (!(r.seconds >= 0 && r.seconds < 1e9)) return what + " that took " + number(r.seconds) + " s";  // printed
  return "";
}

// "3", or "3 (node tcp://10.0.0.2:5601)" when the launcher said where rank 3 runs.
std::string rank_where(const coordinator_state& st, int r) {
  const bool known = r >= 0 && size_t(r) < st.cfg.where.size() && !st.cfg.where[size_t(r)].empty();
  return std::to_string(r) + (known ? " (" + st.cfg.where[size_t(r)] + ")" : "");
}

// Ranks that have not reported what the others have, for report_timeout; "" if none is late. Honest
// ranks report each step within a flush of each other (the ring runs them in step), so a rank is late
// when it has said nothing for as long, or when half the ranks or more reported a step that long ago and
// it still has not, though it goes on reporting earlier ones (a lying node's held back its reports, one
// every 29 s, and held the job for hours). A rank is not late for what a minority reported (a lying
// node's ran far ahead, and the honest ranks were blamed); half and half, both halves are named.
std::string late_ranks(const coordinator_state& st, clock_type::time_point now) {
  const auto limit = st.cfg.report_timeout;
  const int n = st.cfg.replicas;
  // The ranks that `pick`, as messages name them.
  auto ranks = [&](auto pick) {
    std::string s;
    for (int r = 0; r < n; ++r)
      if (pick(size_t(r))) s += (s.empty() ? "" : ", ") + rank_where(st, r);
    return s;
  };
  auto silent = [&](size_t i) { return i >= st.heard_from.size() || now - st.heard_from[i] > limit; };
  auto said = [](const std::vector<char>& seen, size_t i) { return i < seen.size() && seen[i]; };
  const std::string secs_text = std::to_string(limit.count() / 1000) + " s";
  for (auto it = st.epochs.lower_bound(st.first_open); it != st.epochs.end(); ++it) {  // a closed epoch waits for nothing
    const auto& [e, a] = *it;
    for (const auto& [k, s] : a.pending) {
      if (s.reports == 0 || now - s.first <= limit) continue;
      const std::string what = "step " + std::to_string(k + 1) + " of epoch " + std::to_string(e + 1);
      const bool half = 2 * s.reports >= n && now - s.half > limit;
      if (const std::string late = ranks([&](size_t i) { return !said(s.seen, i) && (silent(i) || (half && 2 * s.reports > n)); }); !late.empty())
        return "rank(s) " + late + " sent no report of " + what + " in " + secs_text + " after the others did";
      if (half && 2 * s.reports == n)
        return "rank(s) " + ranks([&](size_t i) { return !said(s.seen, i); }) + " sent no report of " + what + " in " + secs_text +
               " after rank(s) " + ranks([&](size_t i) { return said(s.seen, i); }) +
               " did, though they go on reporting: one half holds its reports back, or the other makes them up";
    }
    // An evaluation comes before its rank's reports of the next epoch's steps: one past them owes it.
    const int64_t after = (e + 1) * st.cfg.steps_per_epoch;
    auto owes = [&](size_t i) { return !said(a.evaluated, i) && (silent(i) || (i < st.next_report.size() && st.next_report[i] > after)); };
    if (const std::string late = ranks(owes); a.evals > 0 && !a.closed && now - a.first_eval > limit && !late.empty())
      return "rank(s) " + late + " sent no evaluation of epoch " + std::to_string(e + 1) + " in " + secs_text + " after the others did";
  }
  if (const std::string late = ranks([&](size_t i) { return !said(st.done_ranks, i) && silent(i); });
      st.done > 0 && st.done < n && now - st.first_done > limit && !late.empty())
    return "rank(s) " + late + " did not say they were done in " + secs_text + " after the others did";
  return "";
}

// Whether every rank has been silent too long (coordinator_config::eval_batches); "" if not.
std::string silent_ranks(const coordinator_state& st, clock_type::time_point now) {
  const auto limit = st.cfg.report_timeout;
  // Before a first step: 10 report timeouts when a resumed job's state may be on its way to every node,
  // else 2 (the first step may compile or warm up a device).
  clock_type::duration allowed = (st.cfg.start.step > 0 ? 10 : 2) * limit;
  if (st.slowest_step.count() > 0) {
    const bool evaluating = st.cfg.evaluate && std::any_of(st.epochs.lower_bound(st.first_open), st.epochs.end(), [&](const auto& e) {
      return !e.second.closed && e.second.steps_done == st.cfg.steps_per_epoch;
    });
    // In seconds, capped at a day: slowest_step (ns) times a test set a node said is 10^12 samples overflowed.
    const double batches = 50.0 + (evaluating ? double(st.cfg.eval_batches) : 0.0);
    const double wait = std::min(86400.0, std::chrono::duration<double>(st.slowest_step).count() * batches);
    allowed = std::max<clock_type::duration>(2 * limit, limit + std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(wait)));
  }
  if (st.done == st.cfg.replicas || now - st.last_news <= allowed) return "";  // all done: the weights come
  std::string ranks;
  for (int r = 0; r < st.cfg.replicas; ++r) ranks += (ranks.empty() ? "" : ", ") + rank_where(st, r);
  char slowest[32];
  std::snprintf(slowest, sizeof slowest, "%.3f", std::chrono::duration<double>(st.slowest_step).count());
  // Not one step done: a model whose first step takes minutes (a huge one on CPUs) looks the same.
  return "no rank has reported anything for " + std::to_string(int64_t(secs(st.last_news, now))) +
         (st.slowest_step.count() > 0 ? " s (the slowest step so far took " + std::string(slowest) + " s): ranks " + ranks + " are stuck"
                                      : " s, and no step is done: ranks " + ranks +
                                            " are stuck, or one step of this model takes longer than that (then raise the ring "
                                            "timeout, --ring-timeout: this wait is twice it plus 20 s, at least 60 s)");
}

}  // namespace ringmaster::coordinator_detail
