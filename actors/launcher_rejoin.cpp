// The launcher taking a lost node back (actors/launcher.hpp, actors/reform.hpp): asked whether it is back
// (tick), it gets the grown ring's plan, loads its data, the others pause after an epoch's last step,
// rank 0's state goes to it, and the grown ring starts (on_reformed). Bridge thread.
#include <algorithm>
#include <cstdio>

#include "actors/launcher.hpp"
#include "actors/node_service.hpp"  // parse_devices
#include "actors/reform.hpp"

namespace ringmaster {

using clock_type = launcher::clock_type;

// A lost node answered a hello: it is back (started again, or awake and idle). It gets the grown ring's
// plan, to join after the first epoch's end that leaves it time to load its data: rejoin_lead's worth of
// steps, or half as long again as its last try took; more after tries that came too late.
void launcher::on_back(int node, wire::kv_map& kv) {
  changed[size_t(node)].clear();  // it let us in: what it said before is past
  said_changed[size_t(node)].clear();
  if (!plan.elastic || !ro.rejoin || now != phase::running || !stalls.empty() || joining >= 0 || original_ranks[size_t(node)] == 0 ||
      join_failures[size_t(node)] >= kJoinTries)
    return;
  const std::string& name = ro.nodes[size_t(node)];
  // Started again with too few devices, or others: no use asking it (it would refuse the plan). Said once
  // for what it offers; it is asked again when that changes. ("cuda", every GPU it has, it alone can count.)
  std::vector<std::string> slots;
  std::string error;
  const std::string& offers = kv["devices"];
  if (offers != "cuda" && (!parse_devices(offers, &slots, &error) || int(slots.size()) < original_ranks[size_t(node)] ||
                           device_kind(slots[0]) != plan.device)) {
    if (unfit[size_t(node)] == offers) return;
    unfit[size_t(node)] = offers;
    const int need = original_ranks[size_t(node)];
    return join_failed(node, "it now offers " + node_text(offers, 80) + ", and its part of the job is " + std::to_string(need) + " " +
                                 plan.device + " replica" + (need == 1 ? "" : "s"), true);
  }
  unfit[size_t(node)].clear();
  const int64_t spe = steps_per_epoch;
  // Steps a second: this ring's own pace once it has run two seconds and 16 steps (the fastest second so
  // far may be from before the loss, when more nodes shared the work, and would put the join past the
  // job's end), else the faster of that and the fastest second; it is asked again meanwhile.
  const double ran = std::chrono::duration<double>(clock_type::now() - ring_since).count();
  if (ran < 0.5) return;
  const double pace = double(seen_step - ring_from) / ran;
  const double rate = ran >= 2 && seen_step - ring_from >= 16 ? pace : std::max(step_rate, pace);
  const double setup = join_setup[size_t(node)];
  const double lead = std::max(std::chrono::duration<double>(ro.rejoin_lead).count(), 1.5 * setup) *
                      double(1 + std::min(join_late[size_t(node)], 4));
  const int64_t at = rejoin_step(seen_step, spe, total_steps, std::max<int64_t>(16, int64_t(rate * lead)),
                                 std::max<int64_t>(16, int64_t(rate * std::max(1.0, setup))));
  if (at < 0) {
    join_failures[size_t(node)] = kJoinTries;
    char ahead[32];
    std::snprintf(ahead, sizeof ahead, "%.3g", lead);
    return join_failed(node, std::string("no epoch's end is left far enough ahead for it to rejoin at: ") + ahead +
                                 " s of steps (--rejoin-lead, or longer for a node slow to set up)", false);
  }
  plan_node entry = plan.nodes[size_t(node)];
  entry.id = kv["id"];
  entry.host = host_of(kv["host"]);
  entry.ring_port = ring_port_of(kv["ring_port"]);  // it seals again, with the keys of a new life:
  entry.life = ++lives;  // one per try, as one given up may have reached it (the daemon refuses a life again)
  job_plan theirs;
  if (!make_grow(plan, node, original_ranks[size_t(node)], entry, gen + 1, fresh_ring_id(job_id), at, &join_plan, &error) ||
      !(theirs = join_plan, theirs.recipient = node, theirs.first_step = at, validate(theirs, &error))) {
    join_failures[size_t(node)] = kJoinTries;
    return join_failed(node, error, false);
  }
  const std::string text = to_json(theirs);
  if (text.size() > wire::kMaxJobBytes) {
    join_failures[size_t(node)] = kJoinTries;
    return join_failed(node, "its plan is over the size limit", false);
  }
  joining = node;
  joins = join_step::setting_up;
  join_at = at;
  join_since = clock_type::now();
  last_heard[size_t(node)] = join_since.time_since_epoch().count();
  send(node, wire::msg_type::job, text);
  event("node " + name + " is back; it rejoins after step " + std::to_string(at) + " (epoch " + std::to_string(at / spe) +
        "'s end) once it has loaded its data");
}

// The newcomer has its data and model: the survivors pause after step join_at, unless they are about to
// pass it already (then it tries again at a later epoch's end).
void launcher::on_join_ack(wire::kv_map& kv) {
  if (joins != join_step::setting_up) return;
  join_setup[size_t(joining.load())] = std::chrono::duration<double>(clock_type::now() - join_since).count();
  if (kv["train"] != train_count || kv["train_data"] != train_data || kv["model"] != model_layout || kv["params"] != std::to_string(param_count)) {
    join_failures[size_t(joining.load())] = kJoinTries;
    return give_up_join("it has " + node_text(kv["train"].substr(0, 12)) + " training samples (data fingerprint " +
                        node_text(kv["train_data"].substr(0, 12)) + ") and model layout " + node_text(kv["model"].substr(0, 24)) + " (" +
                        node_text(kv["params"].substr(0, 12)) + " parameters), the job " + train_count + " (" + train_data + ") and " +
                        model_layout + " (" + std::to_string(param_count) + ")");
  }
  if (kv["test"] != test_count) {  // its share of each evaluation would be of other samples
    join_failures[size_t(joining.load())] = kJoinTries;
    return give_up_join("it has " + node_text(kv["test"].substr(0, 12)) + " test samples, the job " + test_count);
  }
  if (seen_step + std::max<int64_t>(2, int64_t(step_rate * 0.2)) >= join_at)
    return give_up_join("it was ready only as the job reached step " + std::to_string(join_at), true);
  if (gen + 1 != join_plan.generation) return give_up_join("the ring changed meanwhile");
  // A pause would drop the stall reports in (each rank sends one): the stall is judged first.
  if (!stalls.empty() || broken_link) return give_up_join(broken_link ? "a ring link broke meanwhile" : "the ring stalled meanwhile", true);
  joins = join_step::pausing;
  join_since = clock_type::now();
  event("node " + ro.nodes[size_t(joining.load())] + " has loaded its data; the others pause after step " + std::to_string(join_at) +
        " for it");
  pause_survivors({{"at", std::to_string(join_at)}});
}

// Rank 0's state after join_at, for the newcomer. Once whole it goes on to it (before its start: one
// connection keeps the order), and the survivors take the grown plan.
void launcher::take_join_state(const wire::header& h, const net::payload& p) {
  join_since = forming_since = piece_clock();
  if (!add_state_buffer(join_state, h, p, param_count, state_buffers)) {
    if (!join_state) give_up_join("rank 0's state came broken");
    return;
  }
  const state_ptr s = std::move(join_state);
  if (s->steps != join_at) return give_up_join("rank 0's state is after step " + std::to_string(s->steps));
  if (std::string bad = state_fault(*s); !bad.empty()) return give_up_join("rank 0's state: " + bad);
  if (const state_verdict v = judge_paused(state_checksum(*s), s->steps, plan.ranks[0].node, 0); !v.agree) {
    if (drop_shown_faulty(v, false)) return;  // the join plan counts them: it is off (node_lost), and asked again
    return give_up_join("rank 0's state is not the one held by " + v.disagree + " (a faulty or lying node" + faults_named(v) + ")");
  }
  send_state(joining, s);
  job_plan next = join_plan;
  for (int i : survivors()) {
    next.recipient = i;
    send(i, wire::msg_type::reform, to_json(next));
  }
  plan = join_plan;
  brought_forward = 0;
  acked.assign(ro.nodes.size(), false);
  joins = join_step::reforming;
  join_since = clock_type::now();
  now = phase::reforming;
}

// A node that is back did not get in, for the log and the summary.
void launcher::join_failed(int node, const std::string& why, bool again) {
  failed_joins.push_back({ro.nodes[size_t(node)], why, again, clock_type::now()});
  event("node " + ro.nodes[size_t(node)] + " is back, but could not rejoin: " + why + (again ? "; it is asked again" : "; it stays out"));
}

// A lost node started again with another key (or none) fails the handshake: it cannot rejoin until it is
// started with its own. Said once, as a failed try (asked again: it may be), when it is lost.
void launcher::on_changed(int node, const std::string& why) {
  const std::string said = " let us in before, and now ";  // net/bridge.cpp's words after the endpoint
  const size_t at = why.find(said);
  changed[size_t(node)] = at == std::string::npos ? why : "it now " + why.substr(at + said.size());
}

// The join is off: the newcomer drops the job, and the survivors go on among themselves (re-formed once
// more if they are waiting for a plan already, or took the grown one).
void launcher::give_up_join(const std::string& why, bool late, bool others_pause) {
  const int j = joining;
  if (j < 0) return;
  const join_step was = others_pause ? join_step::none : joins;
  send_kv(j, wire::msg_type::abort, {{"reason", "could not rejoin: " + why}});
  join_failed(j, why, late ? ++join_late[size_t(j)] > 0 : ++join_failures[size_t(j)] < kJoinTries);
  joining = -1;
  joins = join_step::none;
  join_state.reset();
  join_state_rank = -1;
  last_hello = clock_type::now();
  if (was == join_step::state) reform_survivors(join_at);    // paused after join_at, waiting
  if (was == join_step::reforming) pause_survivors({});       // they hold a plan with its ranks
}

}  // namespace ringmaster
