// The launcher stopping a job by a signal with a checkpoint where its ranks stop (actors/launcher.hpp:
// stop_with_checkpoint), and nodes stopped by a signal that serve their job a while longer (draining).
// Bridge thread.
#include "actors/launcher.hpp"

namespace ringmaster {

using clock_type = launcher::clock_type;

void launcher::stop_with_checkpoint(int sig) {
  if (stopping) return;
  // While the ring is re-formed for a lost node the job ends at once, as before: the lost node's
  // reports of the steps the survivors stopped after may be missing, and a ring that never re-forms
  // cannot give its final weights.
  if (now != phase::running || joining >= 0 || !plan.elastic) return kill_node(-1, interrupted_by(sig));
  stopping = sig;
  draining.clear();  // their ranks pause with the others: the nodes wait for us to drop the job
  event(interrupted_by(sig) + ": the ranks pause, and a checkpoint is written where they stopped");
  pause_survivors({{"for", "stop"}});
}

void launcher::node_stopping(int node, const std::string& sig) {
  if (stopping || gone[node] || draining.count(node)) return;
  draining[node] = {clock_type::now() + kDrainWait, sig};
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
