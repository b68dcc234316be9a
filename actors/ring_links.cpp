#include "actors/ring_links.hpp"

#include "actors/messages.hpp"
#include "actors/reducer.hpp"

#include <type_traits>

namespace ringmaster {
namespace {

struct port_link : ring::link {
  std::shared_ptr<reducer_port> port;
  explicit port_link(std::shared_ptr<reducer_port> p) : port(std::move(p)) {}
  std::string send(ring::message m) override {
    deliver(*port, std::move(m));
    return "";
  }
};

wire::header to_wire(const ring::message& m) {
  wire::header h;
  h.type = wire::msg_type::chunk;
  h.job_id = m.job;
  h.step = m.seq;
  h.sender_rank = m.sender;
  h.round = m.round;
  h.segment = m.segment;
  h.flags = m.whole ? wire::kFlagWhole : 0;
  h.elements = m.count;
  return h;
}

// Both links to another process: host memory only.
struct process_link : ring::link {};

struct bridge_link : process_link {
  net::bridge* br;
  int peer;
  bridge_link(net::bridge* b, int p) : br(b), peer(p) {}
  std::string send(ring::message m) override {
    if (m.device >= 0) return "a chunk in device memory reached the link to another process";
    std::string err;
    if (!br->send(peer, to_wire(m), net::payload{m.data, m.count * sizeof(float), std::move(m.owner)}, &err))
      return "send to the next node: " + err;
    return "";
  }
};

// Through a sender of net/: net::shm_sender copies the floats into the segment (or, for a message in
// place in the window it lends, writes where they are and holds the owner until the receiver has read
// them), net::tcp_sender seals them into a buffer of its own, or, plain, writes them from where they
// are, holding the message's owner.
template <class Sender>
struct sender_link : process_link {
  std::shared_ptr<Sender> out;
  const char* via;  // for errors: " through shared memory", ""
  bool copies;      // done with the floats when send() returns
  sender_link(std::shared_ptr<Sender> o, const char* v, bool c) : out(std::move(o)), via(v), copies(c) {}
  std::string send(ring::message m) override {
    if (m.device >= 0) return "a chunk in device memory reached the link to another process";
    std::string err;
    net::payload p{m.data, m.count * sizeof(float), std::move(m.owner)};
    bool sent = false;
    if constexpr (std::is_same_v<Sender, net::shm_sender>) sent = out->send(to_wire(m), std::move(p), &err, m.in_place);
    else sent = out->send(to_wire(m), std::move(p), &err);
    if (!sent) return std::string("send to the next node") + via + ": " + err;
    return "";
  }
  bool copies_at_send() const override { return copies; }
  void await_release() override {
    if constexpr (std::is_same_v<Sender, net::shm_sender>) out->await_release();
  }
};

}  // namespace

link_ptr make_port_link(std::shared_ptr<reducer_port> port) {
  return std::make_shared<port_link>(std::move(port));
}
link_ptr make_bridge_link(net::bridge* br, int peer) { return std::make_shared<bridge_link>(br, peer); }
link_ptr make_shm_link(std::shared_ptr<net::shm_sender> out) {
  return std::make_shared<sender_link<net::shm_sender>>(std::move(out), " through shared memory", true);
}
link_ptr make_tcp_link(std::shared_ptr<net::tcp_sender> out) {
  const bool copies = out->sealed();
  return std::make_shared<sender_link<net::tcp_sender>>(std::move(out), "", copies);
}
bool host_only(const ring::link& l) { return dynamic_cast<const process_link*>(&l) != nullptr; }

ring::message from_wire(const wire::header& h, net::payload p) {
  return {h.job_id, h.step, h.sender_rank, h.round, h.segment, (h.flags & wire::kFlagWhole) != 0,
          p.floats(), size_t(h.elements), std::move(p.owner), -1, p.lent};
}

}  // namespace ringmaster
