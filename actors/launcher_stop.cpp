// The launcher stopping a job by a signal with a checkpoint where its ranks stop (actors/launcher.hpp:
// stop_with_checkpoint), and nodes stopped by a signal that serve their job a while longer (draining).
// Bridge thread.
#include <algorithm>
#include <csignal>

#include "actors/launcher.hpp"
#include "actors/report_kv.hpp"

namespace ringmaster {

using clock_type = launcher::clock_type;

void launcher::stop_with_checkpoint(int sig) {
  if (stopping) return;
  // While the ring is re-formed for a lost node the job ends at once, as before: the lost node's
  // reports of the steps the survivors stopped after may be missing, and a ring that never re-forms
  // cannot give its final weights.
  if (now != phase::running || joining >= 0) return kill_node(-1, interrupted_by(sig));
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
  if (!holding || r.gen != gen + 1 || gone[node] || !reports_to_us(node, rank)) return;
  applied[{node, rank}] = r.started;
  if (!all_answered()) return;
  int64_t hi = 0;
  for (auto& [who, n] : applied) hi = std::max(hi, n);
  // Round two: all stop after the last step any of them started (on_paused takes it from there).
  pause_survivors({{"for", "stop"}, {"at", std::to_string(hi)}});
}

void launcher::node_stopping(int node, const std::string& sig) {
  if (stopping || gone[node] || draining.count(node)) return;
  draining[node] = {clock_type::now() + kDrainWait, sig};
  // Every node is being stopped (a batch system preempts the nodes' allocation, and not ours, or ours
  // later): the job cannot go on without them, so it stops as at our own signal, while they still serve.
  for (int i : survivors())
    if (!draining.count(i)) return;
  if (!plan.checkpoints) return;  // they are lost in turn, and the job fails with the last of them
  event("every node is being stopped (" + sig + ")");
  stop_with_checkpoint(sig == "SIGINT" ? SIGINT : sig == "SIGHUP" ? SIGHUP : SIGTERM);
}

void launcher::drained(clock_type::time_point t) {
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
