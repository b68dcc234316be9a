#include "actors/node_links.hpp"

#include <algorithm>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include "actors/checkpoint.hpp"
#include "actors/messages.hpp"
#include "actors/report_kv.hpp"

namespace ringmaster {

namespace {

void send_kv(net::bridge* br, const net::peer_info& to, wire::header h, const wire::kv_map& kv) {
  std::string text, err;
  if (!wire::encode_kv(kv, &text, &err)) return;
  br->reply(to, h, net::payload::copy_of(text));
}

// One report of rank `rank` (kind=... in kv: actors/report_kv.hpp).
void send_report(net::bridge* br, const net::peer_info& to, uint64_t job, int rank, const wire::kv_map& kv) {
  wire::header h;
  h.type = wire::msg_type::report;
  h.job_id = job;
  h.sender_rank = rank;
  send_kv(br, to, h, kv);
}

// A rank's training state, its buffers in pieces (net/wire.hpp). `sent` runs (on whichever thread lets the last
// buffer go: ZeroMQ's, say) once none of them is held for sending any more.
void send_state(net::bridge* br, const net::peer_info& to, uint64_t job, int rank, const state_ptr& state,
                std::function<void()> sent) {
  state_ptr s(state.get(), [state, sent = std::move(sent)](const network_state*) noexcept {
    try {
      sent();
    } catch (...) {  // from a deleter nothing may escape; the next state then waits for nothing
    }
  });
  const std::vector<float>* buffers[] = {&s->params, &s->m1, &s->m2};
  for (int32_t b = 0; b < wire::kStateBuffers && !buffers[b]->empty(); ++b) {
    wire::header h;
    h.type = wire::msg_type::checkpoint;
    h.job_id = job;
    h.step = s->steps;
    h.sender_rank = rank;
    h.segment = b;
    send_pieces(h, chunk_ptr(s, buffers[b]), [&](const wire::header& piece, net::payload p) { br->reply(to, piece, std::move(p)); });
  }
}

// Testing (node_options::lie_in_states): `s`, or a copy whose first parameter is changed.
state_ptr as_sent(const state_ptr& s, bool lie) {
  if (!lie || !s || s->params.empty()) return s;
  auto out = std::make_shared<network_state>(*s);
  out->params[0] += 1.0f;
  return out;
}

// Testing (node_options::lie_in_sums): `sum`, or one not the rank's own (nor 0, "none").
uint64_t as_reported(uint64_t sum, bool lie) { return !lie || !sum ? sum : (sum ^ 1) ? sum ^ 1 : 2; }

// Ranks whose weights (or, asked for, states) are on their way to the launcher: until ZeroMQ lets go of
// a copy, more requests for it are dropped, so a launcher that asks again and again without reading holds
// one copy a rank, not one per request. Set on the link's thread, cleared on whichever thread lets the
// copy go.
struct copies_out {
  std::mutex mu;
  std::set<int> ranks;
  bool take(int rank) {
    std::lock_guard<std::mutex> lock(mu);
    return ranks.insert(rank).second;
  }
  void release(int rank) {
    std::lock_guard<std::mutex> lock(mu);
    ranks.erase(rank);
  }
};

// Rank 0's states for checkpoints: up to kStatesOut on their way at once (ZeroMQ lets one go once the
// kernel has it, so a launcher that reads never waits on this). One made while that many are still
// held waits, and a newer one replaces it (the launcher writes the newest and forgets those before): a
// launcher that does not read makes us hold kStatesOut + 1 states, not one a step.
constexpr int kStatesOut = 4;
struct checkpoint_out {
  int sending = 0;
  state_ptr waiting;
  // Ranks' done, held while a state waits: the launcher must have the last state before the end (it
  // then asks for the weights, which would overtake a state not yet on the connection).
  std::vector<int> dones;
};

void send_done(net::bridge* br, const net::peer_info& to, uint64_t job, int rank) {
  wire::header h;
  h.type = wire::msg_type::done;
  h.job_id = job;
  h.sender_rank = rank;
  br->reply(to, h);
}

static_assert(kReportBatch <= wire::kMaxStepRecords, "a batch of step reports goes in one steps message");

// Step reports not sent yet, and whether a flush is on its way.
struct report_queue {
  std::vector<step_report> reports;
  bool flush_due = false;

  // In one steps message (each rank's reports in their order), or more when there are that many.
  void flush(net::bridge* br, const net::peer_info& launcher, uint64_t job) {
    for (size_t at = 0; at < reports.size(); at += wire::kMaxStepRecords) {
      const size_t n = std::min<size_t>(reports.size() - at, wire::kMaxStepRecords);
      wire::header h;
      h.type = wire::msg_type::steps;
      h.job_id = job;
      h.step = reports[at + n - 1].step;
      h.elements = n;
      auto bytes = std::make_shared<const std::string>(encode_steps(&reports[at], n));  // moved in, not copied again
      br->reply(launcher, h, net::payload{bytes->data(), bytes->size(), bytes});
    }
    reports.clear();
  }
};

}  // namespace

caf::behavior launcher_link(caf::event_based_actor* self, net::bridge* br, net::peer_info launcher,
                            uint64_t job, std::map<int, caf::actor> replicas, std::vector<caf::actor> watched,
                            std::string node_name, link_faults faults) {
  const bool lie_in_states = faults.lie_in_states, lie_in_sums = faults.lie_in_sums;
  for (auto& a : watched) self->monitor(a);
  auto ranks = std::make_shared<std::map<int, caf::actor>>(std::move(replicas));  // rank -> replica, now
  auto queue = std::make_shared<report_queue>();
  auto out = std::make_shared<copies_out>();
  // States asked for, per ring generation: a re-formed ring numbers its ranks anew, so a copy still on
  // its way for the old rank r must not hold back a request for the new one.
  auto states_out = std::make_shared<std::shared_ptr<copies_out>>(std::make_shared<copies_out>());
  auto checkpoints = std::make_shared<checkpoint_out>();
  // Sends rank 0's state; the link hears {release_atom, checkpt_atom} once ZeroMQ has let it go.
  auto send_checkpoint = [br, launcher, job, checkpoints, lie_in_states, me = caf::weak_actor_ptr{self->ctrl()}](state_ptr s) {
    ++checkpoints->sending;
    send_state(br, launcher, job, 0, as_sent(s, lie_in_states), [me] {
      if (auto link = me.lock()) caf::anon_send(caf::actor_cast<caf::actor>(link), release_atom::value, checkpt_atom::value);
    });
  };
  // Before anything else goes to the launcher: the step reports before it.
  auto flush = [queue, br, launcher, job] { queue->flush(br, launcher, job); };
  // A paused rank's state, for the launcher: one copy on its way per rank.
  auto fetch_state = [self, br, launcher, job, flush, lie_in_states, all_states = states_out](int rank, caf::actor replica) {
    auto states_out = *all_states;  // this generation's
    if (!states_out->take(rank)) return;  // one on its way already: the launcher gets that one
    self->request(replica, std::chrono::seconds(60), checkpt_atom::value)
        .then(
            [br, launcher, job, rank, flush, lie_in_states, states_out](state_ptr s) {
              flush();
              send_state(br, launcher, job, rank, as_sent(s, lie_in_states), [states_out, rank] { states_out->release(rank); });
            },
            [states_out, rank](caf::error&) { states_out->release(rank); });  // not paused: the launcher's time limits act
  };
  self->set_down_handler([self, br, launcher, job, node_name, ranks, flush](caf::down_msg& dm) {
    if (dm.reason == caf::exit_reason::user_shutdown || !dm.reason) return;  // torn down on purpose
    std::string who = "an actor";
    for (auto& [rank, a] : *ranks)
      if (a.address() == dm.source) who = "replica " + std::to_string(rank);
    wire::header h;
    h.type = wire::msg_type::abort;
    h.job_id = job;
    flush();
    send_kv(br, launcher, h, {{"reason", who + " on node " + node_name + " failed: " + error_text(self->system(), dm.reason)}});
  });
  return {
      [self, queue, flush, lie_in_sums, forge = faults.lie_in_steps, faults](step_report r) mutable {
        r.state_sum = as_reported(r.state_sum, lie_in_sums);
        queue->reports.push_back(r);
        if (std::exchange(forge, false)) {
          step_report lie = r;
          ++lie.gen;
          lie.epoch = faults.last_epoch;
          lie.step = faults.last_step;
          queue->reports.push_back(lie);
        }
        if (queue->reports.size() >= kReportBatch) return flush();
        if (!queue->flush_due) {
          queue->flush_due = true;
          self->delayed_send(self, kReportFlush, flush_atom::value);
        }
      },
      [queue, flush](flush_atom) {  // the timer's
        queue->flush_due = false;
        flush();
      },
      [flush](flush_atom, bool) {  // the node's as it stops: it waits for the answer
        flush();
        return true;
      },
      [br, launcher, job, flush](const eval_report& r) {
        flush();
        send_report(br, launcher, job, r.rank, to_kv(r));  // kind=eval
      },
      // After the replica's last report of the ring being given up on: the launcher counts on that.
      [br, launcher, job, flush, lie_in_sums](pause_report r) {
        flush();
        r.state_sum = as_reported(r.state_sum, lie_in_sums);
        send_report(br, launcher, job, r.rank, to_kv(r));  // kind=paused
      },
      [br, launcher, job, flush](const stall_report& r) {  // elastic: the launcher decides who is to blame
        flush();
        send_report(br, launcher, job, r.rank, to_kv(r));  // kind=stall
      },
      [self, ranks, states_out](reform_atom, std::map<int, caf::actor> replicas, std::vector<caf::actor> watch) {
        *ranks = std::move(replicas);
        *states_out = std::make_shared<copies_out>();
        for (auto& a : watch) self->monitor(a);
      },
      [br, launcher, job, flush, checkpoints](done_atom, int rank) {
        flush();
        if (checkpoints->waiting) return checkpoints->dones.push_back(rank);  // after the state
        send_done(br, launcher, job, rank);
      },
      // Rank 0's state for a checkpoint: taken at once (true), a few on their way, a newer one waiting.
      [flush, checkpoints, send_checkpoint](checkpt_atom, state_ptr s) {
        flush();
        if (checkpoints->sending >= kStatesOut) checkpoints->waiting = std::move(s);
        else send_checkpoint(std::move(s));
        return true;
      },
      [br, launcher, job, checkpoints, send_checkpoint](release_atom, checkpt_atom) {  // one has gone out
        --checkpoints->sending;
        if (checkpoints->waiting) send_checkpoint(std::move(checkpoints->waiting));  // on the connection now
        for (int rank : checkpoints->dones) send_done(br, launcher, job, rank);
        checkpoints->dones.clear();
      },
      // The launcher asks a paused rank for its state: for a node that joins the ring, or for survivors a
      // step behind it. (Testing, link_faults::slow_states: late.)
      [self, fetch_state, slow = faults.slow_states](checkpt_atom, int rank, caf::actor replica) {
        if (slow.count() > 0) return self->delayed_send(self, slow, checkpt_atom::value, rank, replica, true);
        fetch_state(rank, replica);
      },
      [fetch_state](checkpt_atom, int rank, caf::actor replica, bool) { fetch_state(rank, replica); },
      // A job stopped by a signal: the replica starts no further step and says how many it started.
      [self, br, launcher, job, flush](hold_atom, int gen, int rank, caf::actor replica) {
        self->request(replica, std::chrono::seconds(60), hold_atom::value).then([br, launcher, job, gen, rank, flush](int64_t started) {
          flush();
          send_report(br, launcher, job, rank, to_kv(held_report{gen, started}));
        }, [](caf::error&) {});  // no answer: the launcher's time limit acts
      },
      [self, br, launcher, job, ranks, flush, out](weights_atom, int rank) {
        auto it = ranks->find(rank);
        if (it == ranks->end() || !out->take(rank)) return;
        self->request(it->second, std::chrono::seconds(60), weights_atom::value).then(
            [br, launcher, job, rank, flush, out](chunk_ptr w) {
              flush();
              wire::header h;
              h.type = wire::msg_type::weights;
              h.job_id = job;
              h.sender_rank = rank;
              // The same floats, owned so that the rank is free to be asked again once they are sent.
              chunk_ptr sent(w.get(), [w, out, rank](const std::vector<float>*) { out->release(rank); });
              send_pieces(h, sent, [&](const wire::header& piece, net::payload p) { br->reply(launcher, piece, std::move(p)); });
            },
            [out, rank](caf::error&) { out->release(rank); });
      },
      [self, br, launcher, job, ranks, flush](sum_atom, int rank) {
        auto it = ranks->find(rank);
        if (it == ranks->end()) return;
        self->request(it->second, std::chrono::seconds(60), sum_atom::value).then([br, launcher, job, rank, flush](uint64_t sum, bool finite) {
          flush();
          wire::header h;
          h.type = wire::msg_type::weights_sum;
          h.job_id = job;
          h.sender_rank = rank;
          send_kv(br, launcher, h, {{"fnv1a64", std::to_string(sum)}, {"finite", finite ? "1" : "0"}});
        });  // no answer: the launcher's time limit acts
      },
  };
}

}  // namespace ringmaster
