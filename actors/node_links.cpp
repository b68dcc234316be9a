#include "actors/node_links.hpp"

#include "actors/messages.hpp"
#include "actors/report_kv.hpp"

namespace ringmaster {

namespace {

void send_kv(net::bridge* br, const net::peer_info& to, wire::header h, const wire::kv_map& kv) {
  std::string text, err;
  if (!wire::encode_kv(kv, &text, &err)) return;
  br->reply(to, h, net::payload::copy_of(text));
}

}  // namespace

caf::behavior launcher_link(caf::event_based_actor* self, net::bridge* br, net::peer_info launcher,
                            uint64_t job, std::map<int, caf::actor> replicas, std::vector<caf::actor> watched,
                            std::string node_name) {
  for (auto& a : watched) self->monitor(a);
  auto ranks = std::make_shared<std::map<int, caf::actor>>(std::move(replicas));  // rank -> replica, now
  self->set_down_handler([self, br, launcher, job, node_name, ranks](caf::down_msg& dm) {
    if (dm.reason == caf::exit_reason::user_shutdown || !dm.reason) return;  // torn down on purpose
    std::string who = "an actor";
    for (auto& [rank, a] : *ranks)
      if (a.address() == dm.source) who = "replica " + std::to_string(rank);
    wire::header h;
    h.type = wire::msg_type::abort;
    h.job_id = job;
    send_kv(br, launcher, h, {{"reason", who + " on node " + node_name + " failed: " + self->system().render(dm.reason)}});
  });
  return {
      [br, launcher, job](const step_report& r) {
        wire::header h;
        h.type = wire::msg_type::report;
        h.job_id = job;
        h.step = r.step;
        h.sender_rank = r.rank;
        send_kv(br, launcher, h, to_kv(r));  // kind=step
      },
      [br, launcher, job](const eval_report& r) {
        wire::header h;
        h.type = wire::msg_type::report;
        h.job_id = job;
        h.sender_rank = r.rank;
        send_kv(br, launcher, h, to_kv(r));  // kind=eval
      },
      // After the replica's last report of the ring being given up on: the launcher counts on that.
      [br, launcher, job](const pause_report& r) {
        wire::header h;
        h.type = wire::msg_type::report;
        h.job_id = job;
        h.sender_rank = r.rank;
        send_kv(br, launcher, h, to_kv(r));  // kind=paused
      },
      [self, ranks](reform_atom, std::map<int, caf::actor> replicas, std::vector<caf::actor> watch) {
        *ranks = std::move(replicas);
        for (auto& a : watch) self->monitor(a);
      },
      [br, launcher, job](done_atom, int rank) {
        wire::header h;
        h.type = wire::msg_type::done;
        h.job_id = job;
        h.sender_rank = rank;
        br->reply(launcher, h);
      },
      [br, launcher, job](checkpt_atom, state_ptr s) {  // rank 0's state for a checkpoint: one message a buffer
        const std::vector<float>* buffers[] = {&s->params, &s->m1, &s->m2};
        for (int32_t b = 0; b < wire::kStateBuffers && !buffers[b]->empty(); ++b) {
          wire::header h;
          h.type = wire::msg_type::checkpoint;
          h.job_id = job;
          h.step = s->steps;
          h.sender_rank = 0;
          h.segment = b;
          h.elements = buffers[b]->size();
          br->reply(launcher, h, net::payload::of(chunk_ptr(s, buffers[b])));
        }
      },
      [self, br, launcher, job, ranks](weights_atom, int rank) {
        auto it = ranks->find(rank);
        if (it == ranks->end()) return;
        self->request(it->second, std::chrono::seconds(60), weights_atom::value).then([br, launcher, job, rank](chunk_ptr w) {
          wire::header h;
          h.type = wire::msg_type::weights;
          h.job_id = job;
          h.sender_rank = rank;
          h.elements = w->size();
          br->reply(launcher, h, net::payload::of(w));
        });
      },
  };
}

}  // namespace ringmaster
