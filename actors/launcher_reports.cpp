// The launcher reading its nodes' reports (actors/launcher.hpp, actors/report_kv.hpp): each goes to the
// coordinator, step reports also tell how far the ring has got. Bridge thread.
#include <algorithm>

#include "actors/launcher.hpp"
#include "actors/report_kv.hpp"

namespace ringmaster {

void launcher::on_report(int node, const wire::header& h, const net::payload& p) {
  wire::kv_map kv;
  std::string error;
  if (!wire::decode_kv(p.text(), &kv, &error)) return;
  const std::string kind = report_kind(kv);
  if (kind == "paused") {  // numbered as the replica knew itself: counted per node
    pause_report r;
    if (from_kv(kv, &r, &error)) on_paused(node, h.sender_rank, r);
    return;
  }
  if (kind == "held") {  // numbered as on_paused's
    held_report r;
    if (from_kv(kv, &r, &error)) on_held(node, h.sender_rank, r);
    return;
  }
  if (!reports_to_us(node, h.sender_rank)) return;
  if (kind == "stall") {
    stall_report r;
    if (from_kv(kv, &r, int(proxies.size()), &error)) on_stall(node, h.sender_rank, r);
  } else if (kind == "eval") {
    eval_report r;
    r.rank = h.sender_rank;
    if (!from_kv(kv, &r, &error)) return kill_node(node, "node " + ro.nodes[size_t(node)] + " sent a bad evaluation report: " + error);
    caf::anon_send(coordinator, r);
  }
}

void launcher::on_steps(int node, const net::payload& p) {
  std::vector<step_report> reports;
  std::string error;
  // A report we cannot read would leave its step open for ever: the node is faulty, say so.
  if (!decode_steps(p.data, p.size, &reports, &error))
    return kill_node(node, "node " + ro.nodes[size_t(node)] + " sent a bad step report: " + error);
  for (const step_report& r : reports) {
    if (!reports_to_us(node, r.rank)) continue;  // a rank of another node, or of none
    // Of the generation the ranks run (the coordinator drops the others): a record of one to come, at
    // the job's last step, made a lying node look as if the job were at its end (never dropped, no rejoins).
    if (r.gen != plan.generation) continue;
    if (node == fresh) fresh = -1, join_failures[size_t(node)] = join_late[size_t(node)] = 0;  // it runs
    // Within the job (the coordinator refuses the rest): then the product cannot overflow.
    if (r.step < steps_per_epoch && r.epoch < total_steps / std::max<int64_t>(1, steps_per_epoch) &&
        r.epoch * steps_per_epoch + r.step + 1 > seen_step) {
      seen_step = r.epoch * steps_per_epoch + r.step + 1;
      seen_step_at = clock_type::now();
      if (joins == join_step::pausing) forming_since = clock_type::now();  // on the way to the pause
    }
    caf::anon_send(coordinator, r);
  }
}

}  // namespace ringmaster
