// The launcher stopping a job by a signal with a checkpoint where its ranks stop (actors/launcher.hpp:
// stop_with_checkpoint), and nodes stopped by a signal that serve their job a while longer (draining).
// Bridge thread.
#include <algorithm>
#include <csignal>
#include <utility>

#include "actors/launcher.hpp"
#include "actors/report_kv.hpp"

namespace ringmaster {

using clock_type = launcher::clock_type;

void launcher::stop_with_checkpoint(int sig) {
  if (stopping) return;
  const bool waited = std::exchange(stop_waits, 0) != 0;  // for a re-forming (on_reformed starts it)
  if (!waited) stop_since = clock_type::now();
  // A node about to rejoin (loading its data, or the others on their way to the epoch's end it joins
  // at) is let go: the stop comes first. On their way, the ranks pause where they are instead (elastic
  // ranks apply whole steps: a step in flight is redone).
  const bool on_the_way = joining >= 0 && joins == join_step::pausing;
  if (joining >= 0 && (on_the_way || (joins == join_step::setting_up && now == phase::running))) {
    join_failures[size_t(joining.load())] = kJoinTries;  // the job ends: it is not asked again
    give_up_join("the job is stopped first (" + interrupted_by(sig) + ")");
  }
  if (on_the_way) {
    stopping = sig;
    draining.clear();
    event(interrupted_by(sig) + ": the ranks pause where they are, and a checkpoint is written there");
    forming_since = clock_type::now();
    return pause_survivors({{"for", "stop"}});
  }
  // While the ring is re-formed for a lost node, or a node takes its place in it, the ranks are paused
  // for that already (a stop would have to take over that pause's answers): the stop begins as the ring
  // runs again (on_reformed), unless that takes half the stop's limit (tick). (It used to end the job
  // at once, with no checkpoint of the stop.)
  if (now != phase::running || joining >= 0) {
    if (!waited) event(interrupted_by(sig) + ": the stop begins as soon as the ring re-formed runs");
    stop_waits = sig;
    return;
  }
  stopping = sig;
  draining.clear();  // their ranks stop with the others: the nodes wait for us to drop the job
  event(interrupted_by(sig) + ": the ranks finish the steps they started, and a checkpoint is written where they stop");
  // Round one: every rank starts no further step and says how many it started (on_held).
  holding = true;
  applied.clear();
  forming_since = clock_type::now();
  now = phase::pausing;
  if (coordinator) caf::anon_send(coordinator, pause_atom::value, gen + 1);  // its report clock stands still
  for (int i : survivors()) send_kv(i, wire::msg_type::pause, {{"gen", std::to_string(gen + 1)}, {"for", "hold"}});
}

std::chrono::milliseconds launcher::stop_patience() const {
  // Enough for the step in flight and the one up to the stop, at the fastest pace seen, and a few seconds.
  const auto steps = std::chrono::milliseconds(step_rate > 0 ? int64_t(3000 / step_rate) : 0);
  return std::min<std::chrono::milliseconds>(std::chrono::seconds(5) + steps, kStopLimit / 2);
}

void launcher::on_held(int node, int rank, const held_report& r) {
  if (!holding || now != phase::pausing || r.gen != gen + 1 || gone[node] || !reports_to_us(node, rank)) return;
  applied[{node, rank}] = r.started;
  if (!all_answered()) return;
  int64_t lo = INT64_MAX, hi = 0;
  for (auto& [who, n] : applied) lo = std::min(lo, n), hi = std::max(hi, n);
  if (std::string bad = held_fault(lo, hi, plan.first_step, total_steps); !bad.empty())
    return kill_node(-1, interrupted_by(stopping) + "; no checkpoint was written at the stop: " + bad);
  // Round two: all stop after the last step any of them started (on_paused takes it from there).
  pause_survivors({{"for", "stop"}, {"at", std::to_string(hi)}});
}

void launcher::node_stopping(int node, const std::string& sig) {
  if (stopping || gone[node] || draining.count(node)) return;
  draining[node] = {clock_type::now() + kDrainWait, sig};
  stop_if_every_node_stops();
}

void launcher::stop_if_every_node_stops() {
  // Without checkpoints they are lost in turn, and the job fails with the last of them. While the ring is
  // re-formed or a node rejoins, this waits for the ring to run (the nodes serve a while longer).
  if (stopping || stop_waits || draining.empty() || !plan.checkpoints || now != phase::running || joining >= 0) return;
  for (int i : survivors())
    if (!draining.count(i)) return;
  const std::string sig = draining.begin()->second.second;
  event("every node is being stopped (" + sig + ")");
  stop_with_checkpoint(sig == "SIGINT" ? SIGINT : sig == "SIGHUP" ? SIGHUP : SIGTERM);
}

void launcher::drained(clock_type::time_point t) {
  stop_if_every_node_stops();  // the ring runs again since the last of them said so
  if (stopping || stop_waits) return;  // they take part in our stop
  for (auto it = draining.begin(); it != draining.end();) {
    if (t < it->second.first) {
      ++it;
      continue;
    }
    const auto [node, sig] = std::make_pair(it->first, it->second.second);
    it = draining.erase(it);
    node_lost(node, "was stopped (" + sig + ")");
  }
}

}  // namespace ringmaster
