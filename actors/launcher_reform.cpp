// Losing a node and re-forming the ring without it: a node named lost (silent, stopped, or blamed for a
// stalled ring) is dropped, the survivors pause and say how far they got, those a step behind take the
// state of one ahead, and the ring is numbered anew from the job plan (actors/reform.hpp).
#include <algorithm>
#include <set>
#include <utility>

#include "actors/launcher.hpp"
#include "actors/messages.hpp"
#include "actors/reform.hpp"
#include "actors/report_kv.hpp"

namespace ringmaster {

using clock_type = launcher::clock_type;

void launcher::node_lost(int node, const std::string& why, std::optional<clock_type::time_point> hung_since, loss_kind kind) {
  draining.erase(node);  // lost another way (a second signal, silence) before its time was up
  const bool faulty = kind != loss_kind::lost;
  if (faulty) join_failures[size_t(node)] = kJoinTries;  // never taken back in this job
  const std::string said = (faulty ? "is faulty: " : why.rfind("no heartbeat", 0) == 0 ? "stopped answering: " : "") + why;
  if (gone[node]) {  // lost already; if it was joining again, that is off
    if (node == joining) give_up_join("it " + node_text(said));
    return;
  }
  node_loss l;
  l.node = ro.nodes[node];
  l.ranks = ranks_of(node);
  l.why = why;
  l.hung = hung_since.has_value();
  const clock_type::time_point since = hung_since.value_or(heard(node));
  l.since = since;
  l.when = clock_type::now();
  l.detected = std::chrono::duration<double>(l.when - since).count();
  // Where it was lost, for a job that ends without a re-formed ring (the coordinator puts where the
  // survivors went on from, and how many, once one is formed).
  l.epoch = seen_step / std::max<int64_t>(1, steps_per_epoch);
  l.step = seen_step % std::max<int64_t>(1, steps_per_epoch);
  // The job ends with it (--on-node-loss abort): named once, though its silence may follow its abort.
  if (!plan.elastic) {
    const bool first = std::none_of(losses.begin(), losses.end(), [&](const node_loss& x) { return x.node == l.node; });
    const std::string line = "node " + ro.nodes[node] + " (" + ranks_named(ranks_of(node)) + ") " + said;
    // Said now: the job's end comes once its ranks have wound down (half a second or so).
    if (first) losses.push_back(l), event(line + "; the job fails (--on-node-loss abort)");
    return kill_node(node, line);
  }
  losses.push_back(l);
  gone[node] = true;
  // Kept to the end as faulty (drop_faulty), and lost after all: a loss, not one that finished.
  faults.erase(std::remove_if(faults.begin(), faults.end(), [&](const node_fault& f) { return f.node == l.node; }), faults.end());
  if (node == fresh) ++join_failures[size_t(node)], fresh = -1;  // it rejoined, and was lost before its first step
  send_kv(node, wire::msg_type::abort, {{"reason", "dropped from the job: " + l.why}});  // if it lives
  const std::vector<int> left = survivors();
  for (int i : left) losses.back().survivors += int(plan.ranks_on(i).size());
  if (left.empty()) return kill_node(node, "node " + l.node + " (" + ranks_named(l.ranks) + ") " + said + ", and no node is left");
  if (stop_handed) return;  // the stop's state is with the coordinator: the job ends without a new ring
  const std::string lost_line = "lost node " + l.node + " (" + ranks_named(l.ranks) + "): " + why;
  if (kind == loss_kind::faulty_in_place)
    return event(lost_line + (stopping ? "; the stop's checkpoint is the state in hand, the majority's" : "; the others go on without it"));
  event(lost_line + (stopping ? "; the others pause again for the stop's state"
                              : "; re-forming the ring from " + std::to_string(left.size()) + " node" + (left.size() > 1 ? "s" : "")));
  // After the loss is said: the join it ends names it.
  if (joining >= 0) give_up_join("node " + l.node + (faulty ? " was found faulty meanwhile" : " was lost meanwhile"), true, true);
  pause_survivors({});
}

void launcher::drop_faulty(const std::string& where, const std::string& why) {
  const int i = node_at(where);
  if (i < 0) return event("a node named faulty is not in this job (" + where + "): " + why);
  const std::string ranks = ranks_of(i);  // none once a ring is re-formed without it
  const std::string named = "node " + ro.nodes[size_t(i)] + (ranks.empty() ? "" : " (" + ranks_named(ranks) + ")") + " is faulty: " + why;
  if (gone[size_t(i)]) {  // lost already; if it is rejoining, that is off
    join_failures[size_t(i)] = kJoinTries;  // never taken back in this job
    if (i == joining) give_up_join("its ranks' checksums showed it faulty: " + why);
    // Said once: its ranks' reports of later steps, in flight as it was dropped, show it again.
    if (!named_faulty.insert(i).second) return;
    return event(named + "; it was lost already");
  }
  // A ring re-formed as the last step ends, or after it, while final weights come in, is not one to
  // risk: it finishes with the others. Its fault cannot pass into the result unseen: rank 0's state
  // after the last step is written only as the majority's, and rank 0's final weights are compared with
  // it; where it was not the majority's, the result is the weights of a rank of the majority's nodes.
  if (seen_step + 1 >= total_steps) {
    if (std::any_of(faults.begin(), faults.end(), [&](const node_fault& f) { return f.node == ro.nodes[size_t(i)]; })) return;
    faults.push_back({ro.nodes[size_t(i)], ranks_of(i), why});
    return event(named + "; too close to the job's end to re-form the ring without it, it finishes with the others");
  }
  named_faulty.insert(i);
  node_lost(i, why, std::nullopt, loss_kind::faulty);
}

int launcher::node_at(const std::string& where) const {
  for (size_t i = 0; i < ro.nodes.size() && !where.empty(); ++i)
    if (plan.node_name(int(i)) == where) return int(i);
  return -1;
}

// A new generation: the survivors stop (at once, or with "at" after that step) and say how far they got.
void launcher::pause_survivors(const wire::kv_map& extra) {
  if (!stopping) weights_in.clear();  // the ranks are numbered anew: weights still coming are asked for again
  ++gen;
  holding = false;
  stop_planned = stopping && extra.count("at");
  stalls.clear();
  broken_link.reset();
  applied.clear();
  paused_sums.clear();
  forwarding = false;
  forward_state.reset();
  if (!stopping) forming_since = clock_type::now();  // a stop's limit counts from the signal
  now = phase::pausing;
  if (coordinator) caf::anon_send(coordinator, pause_atom::value, gen);  // its report clock stands still meanwhile
  wire::kv_map kv = extra;
  kv["gen"] = std::to_string(gen);
  for (int i : survivors()) send_kv(i, wire::msg_type::pause, kv);
}

// Whether a stall now is judged: while the ring runs, and on its way to a planned pause for a node that
// joins (a rank that hangs there stops the ring as anywhere else: the join is given up as it is dropped).
bool launcher::stalls_count() const { return now == phase::running || joins == join_step::pausing; }

void launcher::on_stall(int node, int rank, const stall_report& r) {
  // The ranks work in plan.generation; a planned pause has numbered the ring to come already (gen).
  if (!stalls_count() || r.gen != plan.generation || gone[node]) return;
  if (r.link) {  // the first says which; the rest are of the same ring and go with it
    // A rank's link is from its left neighbour, on another node (one that says otherwise is not believed).
    const int from = proxy_node[size_t(r.waiting_for)];
    if (r.waiting_for != plan.left(rank) || from == node) return;
    if (!broken_link) {
      // What the socket said, at the end of the rank's words ("reducer 1: the ring's link from node X closed: WHY").
      const size_t cut = r.why.rfind(": ");
      broken_link = link_break{from, node, node_text(cut == std::string::npos ? r.why : r.why.substr(cut + 2)), clock_type::now()};
      if (coordinator && stalls.empty()) caf::anon_send(coordinator, pause_atom::value, gen + 1);  // as for a stall
    }
    return;
  }
  if (stalls.empty()) {
    stall_since = clock_type::now();
    // A rank that hung before its report must not be named by the coordinator's report clock first:
    // it stands still until the stall is judged (a node dropped pauses the ranks; a failure ends it all).
    if (coordinator) caf::anon_send(coordinator, pause_atom::value, gen + 1);
  }
  stalls[rank] = {r.waiting_for, node_text(r.why)};
}

// Each rank that waits names the rank it waits for. Followed from any of them, the names end at a rank
// that does not wait: the one that stopped the ring, on a node that still answers (a stuck device, a
// deadlock, a lost process's thread). Its node is dropped as lost, and the others go on. If the names go
// round in a circle, every rank waits for another, every one on a node that still answers (a message
// lost between nodes; a node stopped for longer than the ring timeout, but not the node timeout, whose
// ranks gave up on the others as it woke): nobody can be blamed, and the ring is re-formed with the
// same nodes from the last step all ranks completed (or the job fails with what the ranks said).
void launcher::judge_stall(bool final) {
  std::map<int, stall>& s = stalls;
  int r = s.begin()->first, waiter = -1;
  std::set<int> seen;
  while (s.count(r) && seen.insert(r).second) waiter = r, r = s[r].waiting_for;
  if (s.count(r) || size_t(r) >= proxy_node.size()) {
    const std::string said = "rank " + std::to_string(s.begin()->first) + ": " + s.begin()->second.why;
    stalls.clear();
    const int64_t at = std::min(seen_step, std::max<int64_t>(0, total_steps - 1)), per_epoch = std::max<int64_t>(1, steps_per_epoch);
    const std::string line = "the ring stalled with every rank waiting for another (" + said + ")";
    return reform_same_nodes(line, {"", "", said, at / per_epoch, at % per_epoch, clock_type::now(), seen_step}, "");
  }
  const int culprit = proxy_node[size_t(r)];
  std::string silent;  // ranks off the culprit's node that have not said whom they wait for
  for (size_t k = 0; k < proxy_node.size(); ++k)
    if (proxy_node[k] != culprit && !gone[size_t(proxy_node[k])] && !s.count(int(k))) silent += (silent.empty() ? "" : ", ") + std::to_string(k);
  if (!silent.empty() && !final) return;  // they may yet: a verdict now could blame an honest node
  const std::string why = "rank " + std::to_string(waiter) + ": " + s[waiter].why;
  stalls.clear();
  if (!silent.empty())
    return kill_node(-1, "the ring stalled, but rank(s) " + silent + " never said whom they waited for, so no node can be blamed (" + why + ")");
  node_lost(culprit, "its rank " + std::to_string(r) + " stopped taking part in the ring while its node still answered (" + why + ")", seen_step_at);
}

// A link between nodes closed under the ring. A node gone stops its heartbeats and is named lost within
// node_timeout (which re-forms the ring without it); a node heard from twice since is alive, and so both
// ends of a link that broke between them (a reset, a firewall's idle timeout). What was in flight on it is
// lost, so the ring cannot go on as it is: it is re-formed with the same nodes from the last step all
// ranks completed, as after a loss but with every rank kept, so the job goes on bit for bit as before.
void launcher::judge_link(clock_type::time_point t) {
  const link_break b = *broken_link;
  const auto since = b.at + 2 * ro.heartbeat;
  if (gone[size_t(b.from)] || gone[size_t(b.to)]) return broken_link.reset();  // lost: its re-forming is under way
  if (heard(b.from) < since || heard(b.to) < since || t < since) return;
  broken_link.reset();
  const std::string line = "the ring's link from node " + ro.nodes[size_t(b.from)] + " to node " + ro.nodes[size_t(b.to)] +
                           " broke while both nodes still answer (" + ro.nodes[size_t(b.to)] + " saw: " + b.why + ")";
  const int64_t at = std::min(seen_step, std::max<int64_t>(0, total_steps - 1)), per_epoch = std::max<int64_t>(1, steps_per_epoch);
  reform_same_nodes(line, {ro.nodes[size_t(b.from)], ro.nodes[size_t(b.to)], b.why, at / per_epoch, at % per_epoch, t, seen_step},
                    "; what was on its way is lost (with --on-node-loss continue the ring is re-formed)");
}

// The ring re-formed with the same nodes from the last step all ranks completed (a link broke, or every
// rank waited for another), as after a loss but with every rank kept: they sum as before. Without
// --on-node-loss continue the job fails (line + not_elastic). A ring that stops again before the one
// re-formed for the last such trouble (a break or a stall, whichever it was) completed a step would be
// re-formed for ever (a middlebox that resets every large transfer, say): the job fails.
void launcher::reform_same_nodes(const std::string& line, const ring_relink& what, const std::string& not_elastic) {
  if (!plan.elastic) return kill_node(-1, line + not_elastic);
  if (!relinks.empty() && relinks.back().at == seen_step)
    return kill_node(-1, line + ", again before the ring re-formed for the last " + (relinks.back().from.empty() ? "stall" : "break") +
                             " completed a step" + (what.from.empty() || relinks.back().from.empty() ? "" : ": the link cannot carry the ring"));
  event(line + "; re-forming the ring with the same nodes");
  relinks.push_back(what);
  if (joining >= 0) give_up_join(what.from.empty() ? "the ring stalled meanwhile" : "a ring link broke meanwhile", true, true);
  pause_survivors({});
}

bool launcher::all_answered() const {
  for (int i : survivors()) {
    size_t answers = 0;
    for (auto& [who, n] : applied) answers += who.first == i;
    if (answers < plan.ranks_on(i).size()) return false;
  }
  return true;
}

state_verdict launcher::judge_paused(uint64_t sum, int64_t steps, int sender, int rank) const {
  std::vector<state_vote> votes;  // none if sum is 0: no memory for it (then unchecked, as ranks that sent none)
  for (const auto& [who, n] : applied)  // of nodes still in: one dropped meanwhile has no say
    if (auto it = paused_sums.find(who); sum && n == steps && !gone[size_t(who.first)] && it != paused_sums.end() && it->second)
      votes.push_back({who.second, it->second, plan.node_name(who.first)});
  return judge_states(std::move(votes), plan.node_name(sender), sum, steps, rank);
}

bool launcher::drop_shown_faulty(const state_verdict& v, bool in_place) {
  if (!plan.elastic) return false;
  bool any = false;
  for (const auto& [where, why] : v.faulty)
    if (const int i = node_at(where); i >= 0 && !gone[size_t(i)])
      node_lost(i, why + " (a faulty or lying node)", std::nullopt, in_place ? loss_kind::faulty_in_place : loss_kind::faulty), any = true;
  return any;
}

// A replica stopped for generation `gen` after applying some steps. Once every surviving rank has
// answered, the ring is re-formed from the largest count (reform.hpp says why that is the one: those
// behind get the state of one that has it first); for a node that joins, they all stopped after its
// step, and one rank's state is fetched for it first.
void launcher::on_paused(int node, int rank, const pause_report& r) {
  if (forwarding) return;  // decided already: a second answer must not start it again
  // Replicas number themselves as in the ring last started (a re-formed one renumbers them as it starts),
  // as the proxies do; a lost or joining node has no say.
  if (now != phase::pausing || r.gen != gen || gone[node] || !reports_to_us(node, rank)) return;
  applied[{node, rank}] = r.applied;
  paused_sums[{node, rank}] = r.state_sum;
  if (!all_answered()) return;
  int64_t lo = INT64_MAX, hi = 0;
  for (auto& [who, n] : applied) lo = std::min(lo, n), hi = std::max(hi, n);
  if (stopping) {
    // Every rank reported the steps up to lo before it paused: the state of one that stopped there is
    // the checkpoint's (one a step ahead has no reports of its last step from the others). At the job's
    // end there is none to write: the job finishes as it would have.
    if (lo >= total_steps) return void(stop_handed = true);  // the coordinator asks for the final weights
    if (hi - lo > 1)
      return kill_node(-1, interrupted_by(stopping) + "; no checkpoint was written at the stop: the ranks had applied " + std::to_string(lo) +
                               " to " + std::to_string(hi) + " steps");
    for (auto& [who, n] : applied)
      if (n == lo) {
        forwarding = true;
        forward_node = who.first, forward_rank = who.second, forward_to = lo;
        forward_state.reset();
        state_asked = clock_type::now();
        return send(forward_node, wire::msg_type::checkpoint, "", forward_rank);  // no payload: a request
      }
  }
  if (joins == join_step::pausing) {
    if (lo == join_at && hi == join_at) {
      joins = join_step::state;
      join_since = join_paused = clock_type::now();
      join_state.reset();
      join_state_rank = 0;
      state_asked = clock_type::now();
      send(plan.ranks[0].node, wire::msg_type::checkpoint, "", 0);  // no payload: a request for rank 0's state
      event("node " + ro.nodes[size_t(joining.load())] + " gets rank 0's state after step " + std::to_string(join_at) + ": the others paused there for it");
      return;
    }
    give_up_join("the ranks stopped after steps " + std::to_string(lo) + " to " + std::to_string(hi) + ", not after step " +
                     std::to_string(join_at),
                 true);  // they were past it already; they go on among themselves
  }
  if (hi - lo > 1) return kill_node(-1, "the survivors applied " + std::to_string(lo) + " to " + std::to_string(hi) + " steps: cannot go on together");
  if (hi == lo) {
    // No state moves, but the ranks' sums are judged all the same (the first one's as if it were sent): a
    // node whose state is not the majority's would go on in the new ring. Those shown faulty are dropped
    // where they stand, until the others agree; with no majority left, they cannot go on together.
    for (;;) {
      auto first = std::find_if(applied.begin(), applied.end(), [&](const auto& a) { return !gone[size_t(a.first.first)] && paused_sums[a.first]; });
      if (first == applied.end()) break;  // no sums (no memory for them): unchecked
      const auto [by, its_rank] = first->first;
      const state_verdict v = judge_paused(paused_sums[first->first], lo, by, its_rank);
      if (v.agree) break;
      if (!drop_shown_faulty(v, true))
        return kill_node(-1, "the survivors hold different states after step " + std::to_string(lo) + ": " + v.disagree + " against rank " +
                                 std::to_string(its_rank) + " (a faulty or lying node" + faults_named(v) + (v.decided ? ")" : "; no majority of nodes holds one state)") +
                                 ": they cannot go on together");
      if (survivors().empty()) return;  // the job ended with the last of them
    }
    return reform_survivors(lo);
  }
  // Some finished step hi and the others did not: the sum was whole where it was finished, so all go on
  // from there with the state of one that has it (no undo kept per step).
  for (auto& [who, n] : applied)
    if (n == hi) {
      forwarding = true;
      forward_node = who.first, forward_rank = who.second, forward_to = hi;
      forward_state.reset();
      state_asked = clock_type::now();
      send(forward_node, wire::msg_type::checkpoint, "", forward_rank);  // no payload: a request
      return;
    }
}

launcher::clock_type::time_point launcher::piece_clock() const {
  return ringmaster::piece_clock(state_asked, clock_type::now(), double(param_count) * double(state_buffers) * sizeof(float));
}

// The state after forward_to from a survivor that finished that step: to every node with a rank that did
// not (its replicas take it while paused), then the re-formed plan from that step.
void launcher::take_forward_state(const wire::header& h, const net::payload& p) {
  // A stop's limit is from the signal, which a batch system follows with SIGKILL.
  if (!stopping) forming_since = piece_clock();
  if (!add_state_buffer(forward_state, h, p, param_count, state_buffers)) {
    if (!forward_state) kill_node(-1, "the state after step " + std::to_string(forward_to) + " came broken from node " +
                                          ro.nodes[size_t(forward_node)] + ": the survivors cannot go on together");
    return;
  }
  forwarding = false;
  if (!stopping) forming_since = clock_type::now();  // whole: handing it on and the acks have their own time
  const state_ptr s = std::move(forward_state);
  if (s->steps != forward_to) return kill_node(-1, "node " + ro.nodes[size_t(forward_node)] + " sent the state after step " + std::to_string(s->steps) + ", not " + std::to_string(forward_to));
  if (std::string bad = state_fault(*s); !bad.empty())
    return kill_node(-1, "node " + ro.nodes[size_t(forward_node)] + " sent the state after step " + std::to_string(s->steps) + ": " + bad);
  // Finite, plausible values are not enough: it must be the state the ranks hold, not one made up.
  // Nodes shown faulty are dropped. Where the state in hand is the majority's, the others go on from it;
  // else they pause again without them, and it comes from one of them.
  if (const state_verdict v = judge_paused(state_checksum(*s), s->steps, forward_node, forward_rank); !v.agree) {
    const bool in_place = v.decided && v.sender_ok;
    if (!drop_shown_faulty(v, in_place))
      return kill_node(-1, std::string(stopping ? interrupted_by(stopping) + "; no checkpoint was written at the stop: " : "") + "node " +
                             ro.nodes[size_t(forward_node)] + " sent a state after step " + std::to_string(s->steps) +
                             " that is not the one held by " + v.disagree + " (a faulty or lying node" + faults_named(v) + ")" +
                             (stopping ? "" : ": the survivors cannot go on together"));
    if (!in_place) return;
  }
  if (stopping) {  // the stop's checkpoint: the coordinator writes it and ends the job
    stop_handed = true;
    // Those lost since the last ring all leave the same ranks (two found faulty at once: not the first's count).
    int left = 0;
    for (int i : survivors()) left += int(plan.ranks_on(i).size());
    for (node_loss& l : losses) l.survivors = left;
    return caf::anon_send(coordinator, checkpt_atom::value, stop_note{s, stopping, std::exchange(losses, {})});
  }
  std::vector<bool> behind(ro.nodes.size(), false);
  for (auto& [who, n] : applied) behind[size_t(who.first)] = behind[size_t(who.first)] || n < forward_to;
  for (size_t i = 0; i < behind.size(); ++i)
    if (behind[i] && !gone[i]) send_state(int(i), s);
  reform_survivors(forward_to);
}

// The ring of the survivors (of generation `gen`, which they paused for) from global step `start`.
void launcher::reform_survivors(int64_t start) {
  std::vector<bool> lost(ro.nodes.size());
  for (size_t i = 0; i < lost.size(); ++i) lost[i] = gone[i];
  job_plan next;
  std::string error;
  if (!make_reform(plan, lost, gen, fresh_ring_id(job_id), start, &next, &error)) return kill_node(-1, "cannot re-form the ring: " + error);
  for (int i : survivors()) {
    next.recipient = i;
    send(i, wire::msg_type::reform, to_json(next));
  }
  next.recipient = -1;
  plan = std::move(next);
  brought_forward = 0;
  for (auto& [who, n] : applied) brought_forward += n < start && !gone[size_t(who.first)];
  acked.assign(ro.nodes.size(), false);
  now = phase::reforming;
}

// A node took the re-formed plan. Once all have, its ranks start: every node has its new reducers
// by then, so no chunk of the new ring finds nobody to take it.
void launcher::on_reformed(int node, const wire::kv_map& kv) {
  auto g = kv.find("generation");
  if (now != phase::reforming || g == kv.end() || g->second != std::to_string(gen)) return;
  acked[size_t(node)] = true;
  for (int i : survivors())
    if (!acked[size_t(i)]) return;
  if (joins == join_step::reforming && !acked[size_t(joining.load())]) return;  // it has not taken its state yet
  if (joins == join_step::reforming) {  // the newcomer is in
    const int j = joining;
    fresh = j;  // its tries count as failed until its first step is in
    gone[j] = false;
    last_heard[j] = clock_type::now().time_since_epoch().count();
    const double paused = std::chrono::duration<double>(clock_type::now() - join_paused).count();
    joined.push_back({ro.nodes[size_t(j)], ranks_of(j), gen, plan.replicas(), plan.start_step / steps_per_epoch, paused, clock_type::now()});
    joining = -1;
    joins = join_step::none;
    char took[32];
    std::snprintf(took, sizeof took, "%.2f", paused);
    event("node " + ro.nodes[size_t(j)] + " rejoined the job as " + ranks_named(ranks_of(j)) + "; the others stood still for " + took + " s");
  }
  reform_note note;
  note.gen = gen;
  note.start_step = plan.start_step;
  retired.insert(retired.end(), proxies.begin(), proxies.end());
  proxies.clear();
  proxy_node.clear();
  for (const rank_plan& r : plan.ranks) {
    proxies.push_back(sys->spawn(rank_proxy, &br, peer[size_t(r.node)].load(), job_id, r.rank));
    proxy_node.push_back(r.node);
  }
  note.ranks = proxies;
  note.where = plan.rank_nodes();
  note.losses = std::move(losses);
  note.joins = std::move(joined);
  losses.clear();
  joined.clear();
  const std::string ranks = std::to_string(plan.replicas()) + (plan.replicas() == 1 ? " rank" : " ranks");
  event("ring generation " + std::to_string(gen) + ": " +
        (plan.start_step >= total_steps ? ranks + " with no step left to run (the job's " + std::to_string(total_steps) + " are done) hand on the final weights"
                                        : ranks + (plan.replicas() == 1 ? " goes" : " go") + " on from step " + std::to_string(plan.start_step + 1) + " of the job") +
        (brought_forward ? " (" + std::to_string(brought_forward) + " took the state after a step the others finished)" : ""));
  caf::anon_send(coordinator, reform_atom::value, note);  // before any report of the new ranks
  ring_since = clock_type::now();
  ring_from = plan.start_step;
  for (const rank_plan& r : plan.ranks) send(r.node, wire::msg_type::start, "", r.rank);
  now = phase::running;
  if (stop_waits) stop_with_checkpoint(stop_waits);  // a signal came while it was re-formed
}

}  // namespace ringmaster
