#include "actors/launcher.hpp"

#include <algorithm>
#include <charconv>
#include <random>

#include "actors/messages.hpp"
#include "actors/reform.hpp"
#include "actors/report_kv.hpp"

namespace ringmaster {
namespace {

using clock_type = launcher::clock_type;

struct rank_proxy_state {
  caf::response_promise weights, sum;
};

}  // namespace

uint64_t fresh_ring_id(uint64_t job_id) {
  std::random_device rd;
  uint64_t ring = 0;
  while (ring == 0 || ring == job_id) ring = uint64_t(rd()) | uint64_t(rd()) << 32;
  return ring;
}

bool stopped_by_signal(const std::string& sig) { return sig == "SIGTERM" || sig == "SIGINT" || sig == "SIGHUP"; }

std::string node_text(const std::string& said, size_t max) {
  std::string out = said.substr(0, max);
  for (char& c : out)
    if (static_cast<unsigned char>(c) < ' ' || c == 127) c = '?';
  return out;
}

std::string host_of(const std::string& host) {
  const bool fits = host.size() <= kMaxHostIdBytes && std::all_of(host.begin(), host.end(), [](char c) { return c > ' ' && c < 127; });
  return fits ? host : "";
}

int ring_port_of(const std::string& said) {  // a node's word: checked, never std::stoi
  int v = 0;
  const auto [end, ec] = std::from_chars(said.data(), said.data() + said.size(), v);
  return ec == std::errc() && end == said.data() + said.size() && v > 0 && v <= 65535 ? v : 0;
}

caf::behavior rank_proxy(caf::event_based_actor* self, net::bridge* br, int peer, uint64_t job, int rank) {
  auto st = std::make_shared<rank_proxy_state>();
  // A message without payload to the rank's node, addressed to the rank: a start, or a request.
  auto tell = [br, peer, job, rank](wire::msg_type type) {
    wire::header h;
    h.type = type;
    h.job_id = job;
    h.sender_rank = rank;
    br->send(peer, h);
  };
  return {
      [tell](run_atom, caf::actor, caf::actor, caf::actor) { tell(wire::msg_type::start); },
      [self, st, tell](weights_atom) {
        st->weights = self->make_response_promise();
        tell(wire::msg_type::weights);
        return st->weights;
      },
      [st](weights_atom, chunk_ptr w) { st->weights.deliver(std::move(w)); },
      [self, st, tell](sum_atom) {
        st->sum = self->make_response_promise();
        tell(wire::msg_type::weights_sum);
        return st->sum;
      },
      [st](sum_atom, uint64_t sum, bool finite) { st->sum.deliver(sum, finite); },
      [self](fail_atom, const std::string& why) { self->quit(caf::make_error(caf::sec::runtime_error, why)); },
  };
}

void launcher::event(const std::string& line) {
  if (events) events->write(line);
}

int launcher::node_of(const net::peer_info& from) const {
  for (size_t i = 0; i < peer.size(); ++i)
    if (peer[i] == from.peer) return int(i);
  return -1;
}

void launcher::kill_node(int node, const std::string& why) {
  bool any = false;
  for (size_t r = 0; r < proxies.size(); ++r)
    if (proxy_node[r] == node) any = true, caf::anon_send(proxies[r], fail_atom::value, why);
  for (size_t r = 0; r < proxies.size() && !any; ++r) caf::anon_send(proxies[r], fail_atom::value, why);
}

std::string launcher::ranks_of(int node) const { return rank_list(plan.ranks_on(node)); }

void launcher::send(int node, wire::msg_type type, const std::string& text, int rank) {
  wire::header h;
  h.type = type;
  h.job_id = job_id;
  h.sender_rank = rank;
  br.send(peer[size_t(node)], h, text.empty() ? net::payload{} : net::payload::copy_of(text));
}

void launcher::send_kv(int node, wire::msg_type type, const wire::kv_map& kv) {
  std::string text, err;
  if (wire::encode_kv(kv, &text, &err)) send(node, type, text);
}

void launcher::send_state(int node, const state_ptr& s) {
  const std::vector<float>* buffers[] = {&s->params, &s->m1, &s->m2};
  for (int32_t b = 0; b < state_buffers; ++b) {
    wire::header h;
    h.type = wire::msg_type::checkpoint;
    h.job_id = job_id;
    h.step = s->steps;
    h.segment = b;
    send_pieces(h, chunk_ptr(s, buffers[b]), [&](const wire::header& piece, net::payload p) { br.send(peer[size_t(node)], piece, std::move(p)); });
  }
}

void launcher::broadcast(wire::msg_type type, const wire::kv_map& kv, bool skip_gone) {
  std::string text, err;
  wire::encode_kv(kv, &text, &err);
  for (size_t i = 0; i < peer.size(); ++i) {
    if (skip_gone && gone && gone[i] && int(i) != joining.load()) continue;
    wire::header h;
    h.type = type;
    h.job_id = job_id;
    br.send(peer[i], h, kv.empty() ? net::payload{} : net::payload::copy_of(text));
  }
}

void launcher::abort_all(const std::string& reason) {
  broadcast(wire::msg_type::abort, {{"reason", reason}});
  aborted = true;
}

// A buffer of rank 0's state after a step; once whole it goes to the coordinator. One out of order or of
// the wrong size, or a whole state holding a value no training makes (NaN, infinite, a negative second
// moment), fails the job at once naming the node: a checkpoint must never be written from it.
void launcher::take_checkpoint(int node, const wire::header& h, const net::payload& p) {
  const bool whole = add_state_buffer(incoming, h, p, param_count, state_buffers);
  const std::string from = "node " + ro.nodes[size_t(node)] + " sent rank 0's state after step " + std::to_string(h.step);
  if (!incoming) return kill_node(node, from + " out of order or of the wrong size (buffer " + std::to_string(h.segment) + ", " +
                                            std::to_string(h.elements) + " floats)");
  if (!whole) return;
  if (std::string bad = state_fault(*incoming); !bad.empty())
    return kill_node(node, from + ": " + bad + " (training diverged: too high a learning rate? or a faulty node)");
  caf::anon_send(coordinator, checkpt_atom::value, state_ptr(std::move(incoming)));
}

std::vector<int> launcher::survivors() const {
  std::vector<int> out;
  for (size_t i = 0; i < ro.nodes.size(); ++i)
    if (!gone[i] && !plan.ranks_on(int(i)).empty()) out.push_back(int(i));
  return out;
}

void launcher::tick() {
  const auto t = clock_type::now();
  drained(t);
  if (t - rate_since >= std::chrono::seconds(1)) {
    // The fastest second so far: a second with a pause in it says little about how soon a step comes.
    step_rate = std::max(step_rate, double(seen_step - rate_mark) / std::chrono::duration<double>(t - rate_since).count());
    rate_mark = seen_step;
    rate_since = t;
  }
  // Ranks give up on a stalled ring within a second of each other (their reducers look once a second),
  // give or take a step's work; one that started waiting later (a longer evaluation) says so later still,
  // so a verdict waits for every rank off the blamed node, up to another ring timeout.
  const auto window = std::chrono::seconds(2) + (step_rate > 0 ? std::chrono::duration<double>(2 / step_rate) : std::chrono::duration<double>(0));
  // Re-forming waits for every survivor's answer; a replica busy with a long step answers late, but one
  // that never does must not hold the job forever. (Steps on the way to a planned pause count as news.)
  // On the way to a planned pause a hung rank is named by its ring's stall reports (after the ring
  // timeout, and a verdict's window): the fallback waits for those.
  const auto forming_limit =
      stopping ? std::chrono::milliseconds(kStopLimit)
      : joins == join_step::pausing
          ? std::max<std::chrono::milliseconds>(ro.setup_timeout, std::chrono::milliseconds(plan.ring_timeout_ms) + std::chrono::seconds(10) +
                                                                      std::chrono::duration_cast<std::chrono::milliseconds>(window))
          : ro.setup_timeout;
  if (stop_waits && t - stop_since >= kStopLimit / 2) {  // the ring still re-formed: no time left for the stop
    char took[64];
    std::snprintf(took, sizeof took, "%.1f s after it", std::chrono::duration<double>(t - stop_since).count());
    return kill_node(-1, interrupted_by(std::exchange(stop_waits, 0)) + "; no checkpoint was written at the stop: the ring was still being re-formed " + took);
  }
  if (now != phase::running && !stop_handed && t - (stopping ? stop_since : forming_since) >= forming_limit) {
    now = phase::running;  // once
    const std::string s = std::to_string(forming_limit.count() / 1000) + " s";
    if (stopping)
      return kill_node(-1, interrupted_by(stopping) + "; no checkpoint was written at the stop: the ranks did not all pause within " + s);
    kill_node(-1, joins == join_step::pausing ? "the ranks made no step for " + s + " on their way to step " + std::to_string(join_at) +
                                                    ", where node " + ro.nodes[size_t(joining.load())] + " was to rejoin"
                                              : "the ring could not be re-formed within " + s + " of a node's loss");
    return;
  }
  if (stopping && now == phase::pausing && (holding || stop_planned) && !stop_handed && !forwarding && plan.elastic &&
      t - forming_since >= stop_patience()) {
    // The ranks do not all reach the stop's step (a rank hangs, a ring stalls for a node not yet named
    // lost): elastic ranks apply whole steps only, so they pause where they are (a step in flight is redone).
    event("the ranks did not all reach the stop's step within " + std::to_string(stop_patience().count()) + " ms: they pause where they are");
    pause_survivors({{"for", "stop"}});
  }
  if (broken_link && stalls_count()) judge_link(t);
  if (!stalls.empty() && stalls_count() && t - stall_since >= window)
    judge_stall(t - stall_since >= std::max<std::chrono::duration<double>>(window, std::chrono::milliseconds(plan.ring_timeout_ms)));
  if (joining >= 0) {
    const auto limit = joins == join_step::setting_up ? ro.setup_timeout
                                                       : std::max<std::chrono::milliseconds>(ro.node_timeout * 4, std::chrono::seconds(5));
    if (joins != join_step::pausing && t - join_since > limit)
      give_up_join("it did not get through joining within " + std::to_string(limit.count() / 1000) + " s");
    return;
  }
  if (!plan.elastic || !ro.rejoin || now != phase::running || t - last_hello < kHelloEvery) return;
  last_hello = t;
  for (size_t i = 0; i < ro.nodes.size(); ++i)
    if (gone[i] && original_ranks[i] > 0 && join_failures[i] < kJoinTries) {
      // libzmq does not try a refused handshake again (our key, or keys at all): a new connection, at most
      // every 3 s, lets the node in once it is fixed (its authorized_keys, say). Each one's failure is said
      // once, unless it is news: a hang-up (libzmq's word when the node hung up before it said why) after
      // a reason said is none (a node run --insecure is said so at the first try, hangs up at the next).
      if (!changed[i].empty() && t - reconnected[i] >= std::chrono::seconds(3)) {
        std::string why = std::exchange(changed[i], {});
        const bool vague = why.find("hangs up during the handshake") != std::string::npos;
        if (why != said_changed[i] && (said_changed[i].empty() || !vague)) join_failed(int(i), why, true), said_changed[i] = std::move(why);
        reconnected[i] = t;
        br.reconnect(peer[i]);
      }
      send_kv(int(i), wire::msg_type::hello, {{"role", "launcher"}});
    }
}

void launcher::on_abort(int node, wire::kv_map& kv) {
  if (stopped_by_signal(kv["stopped"]) && kv.count("grace_ms")) return node_stopping(node, kv["stopped"]);
  if (stopped_by_signal(kv["stopped"])) return node_lost(node, "was stopped (" + kv["stopped"] + ")");
  if (node == fresh) return node_lost(node, "failed before its first step after it rejoined: " + node_text(kv["reason"]));
  kill_node(node, kv.count("reason") ? node_text(kv["reason"], kMaxNodeError) : "node " + ro.nodes[node] + " aborted the job");
}

void launcher::take_early_aborts() {
  std::unique_lock<std::mutex> lock(mu);
  std::deque<control_msg> early = std::exchange(inbox, {});
  lock.unlock();
  for (control_msg& m : early)
    if (m.h.type == wire::msg_type::abort) on_abort(m.node, m.kv);
}

void launcher::on_message(const net::peer_info& from, const wire::header& h, net::payload p) {
  const int node = node_of(from);
  if (node < 0 || (h.job_id != job_id && h.type != wire::msg_type::hello_ack)) return;
  using wire::msg_type;
  wire::kv_map kv;
  std::string error;
  const bool running = started.load(std::memory_order_acquire);
  if (gone && gone[node]) {  // lost: whether it is back is all that counts, and what it says as it joins
    if (h.type == msg_type::hello_ack && running && wire::decode_kv(p.text(), &kv, &error)) return on_back(node, kv);
    if (node != joining) return;
    // The newcomer: its answers (data loaded; state taken), a refusal or an abort, heartbeats. Nothing it
    // says touches the ring's ranks before it is in.
    last_heard[node] = clock_type::now().time_since_epoch().count();
    const bool answer = h.type == msg_type::job_ack || h.type == msg_type::error || h.type == msg_type::abort;
    if (!answer || !wire::decode_kv(p.text(), &kv, &error)) return;
    if (h.type == msg_type::job_ack) return joins == join_step::setting_up ? on_join_ack(kv) : on_reformed(node, kv);
    if (h.type == msg_type::error) give_up_join("it refused: " + node_text(kv["error"]));
    if (h.type == msg_type::abort) give_up_join("it gave up: " + node_text(kv["reason"]));
    return;
  }
  last_heard[node] = clock_type::now().time_since_epoch().count();
  changed[size_t(node)].clear();  // it lets us in: a failed handshake of a while ago is past
  // Reports, weights and aborts concern the proxies and the coordinator, which exist once started; before
  // that an abort is an answer to the setup.
  const bool setup_reply = h.type == msg_type::hello_ack || h.type == msg_type::job_ack || h.type == msg_type::error;
  if (!setup_reply && !running) {
    if (h.type == msg_type::abort && wire::decode_kv(p.text(), &kv, &error)) {
      std::lock_guard<std::mutex> lock(mu);
      inbox.push_back({node, h, std::move(kv)});
      cv.notify_all();
    }
    return;
  }
  switch (h.type) {
    case msg_type::hello_ack:
    case msg_type::job_ack:
    case msg_type::error: {
      wire::decode_kv(p.text(), &kv, &error);
      if (h.type == msg_type::job_ack && running) return on_reformed(node, kv);
      if (h.type == msg_type::error && running && node == fresh)
        return node_lost(node, "failed before its first step after it rejoined: " + node_text(kv["error"]));
      const std::string why = kv.count("error") ? node_text(kv["error"], kMaxNodeError) : "node " + ro.nodes[node] + " reported an error";
      if (!running) {  // for await_all, which nobody calls once the job runs: later ones would pile up
        std::lock_guard<std::mutex> lock(mu);
        inbox.push_back({node, h, std::move(kv)});
        cv.notify_all();
      }
      if (h.type == msg_type::error && running) kill_node(node, why);
      return;
    }
    case msg_type::report:
      return on_report(node, h, p);
    case msg_type::steps:
      return on_steps(node, p);
    case msg_type::done:
      if (reports_to_us(node, h.sender_rank)) caf::anon_send(coordinator, done_atom::value, int(h.sender_rank));
      return;
    case msg_type::weights:
      if (reports_to_us(node, h.sender_rank)) {
        std::vector<float>& w = weights_in[h.sender_rank];
        if (!add_piece(&w, h, p, param_count)) {  // as its job_ack said: else the result would be another model's
          const std::string had = std::to_string(w.size());
          weights_in.erase(h.sender_rank);  // its memory back now
          return kill_node(node, "node " + ro.nodes[size_t(node)] + " sent final weights for rank " + std::to_string(h.sender_rank) +
                                     " out of order or of the wrong size (piece " + std::to_string(h.round) + " of " +
                                     std::to_string(h.elements) + " values, after " + had + "; the model has " +
                                     std::to_string(param_count) + ")");
        }
        if (w.size() < param_count) return;
        auto whole = std::make_shared<std::vector<float>>(std::move(w));
        weights_in.erase(h.sender_rank);
        caf::anon_send(proxies[size_t(h.sender_rank)], weights_atom::value, chunk_ptr(std::move(whole)));
      }
      return;
    case msg_type::weights_sum:
      if (reports_to_us(node, h.sender_rank)) {
        wire::kv_map kv;
        std::string error;
        uint64_t sum = 0;
        const bool read = wire::decode_kv(p.text(), &kv, &error) && (kv["finite"] == "1" || kv["finite"] == "0");
        const std::string& said = kv["fnv1a64"];
        const auto [end, ec] = std::from_chars(said.data(), said.data() + said.size(), sum);
        if (!read || said.empty() || ec != std::errc() || end != said.data() + said.size())
          return kill_node(node, "node " + ro.nodes[size_t(node)] + " sent a malformed checksum of rank " + std::to_string(h.sender_rank) +
                                     "'s final weights ('" + node_text(std::string(p.text()), 80) + "')");
        caf::anon_send(proxies[size_t(h.sender_rank)], sum_atom::value, sum, kv["finite"] == "1");
      }
      return;
    case msg_type::checkpoint:
      if (forwarding && node == forward_node && h.sender_rank == forward_rank && reports_to_us(node, forward_rank))
        return take_forward_state(h, p);
      if (joins == join_step::state && h.sender_rank == join_state_rank && reports_to_us(node, join_state_rank))
        return take_join_state(h, p);
      if (h.sender_rank == 0 && reports_to_us(node, 0)) take_checkpoint(node, h, p);
      return;
    case msg_type::abort:
      wire::decode_kv(p.text(), &kv, &error);
      return on_abort(node, kv);
    default:
      return;
  }
}

}  // namespace ringmaster
