// A node job's ring links through shared memory (net/shm_link.hpp): to and from neighbours that run in
// another node daemon on this host, as this user. The rest of the job: actors/node_job.cpp.
#include "actors/node_job.hpp"

#include "actors/messages.hpp"
#include "actors/ring_links.hpp"

namespace ringmaster {

// A CPU rank's gradients go into a window its right neighbour may read in place, should that run in
// another process on this host (net/shm_window.hpp): the same memory, which the neighbour then maps.
std::shared_ptr<float> node_job::lend_memory(int rank, size_t floats) {
  if (plan_.ranks[size_t(rank)].device.rfind("cpu", 0) != 0) return nullptr;
  bool neighbours = false;  // another node on this host, or none could ever read it
  for (size_t j = 0; j < plan_.nodes.size(); ++j) neighbours = neighbours || (int(j) != plan_.recipient && same_host(int(j)));
  if (!neighbours) return nullptr;
  std::string error;
  auto w = net::shm_window::create(floats * sizeof(float), &error);
  if (!w) {
    ctx_.log("job " + std::to_string(plan_.job_id) + ": rank " + std::to_string(rank) + "'s gradients stay in its own memory: " + error);
    return nullptr;
  }
  windows_[rank] = w;
  return std::shared_ptr<float>(w, w->floats());
}

// Whether the right neighbours read our ranks' gradients in place, once the ring they did it in is over.
void node_job::say_lending() {
  for (auto& [r, out] : lending_) {
    const auto state = out->lending();
    ctx_.log("job " + std::to_string(plan_.job_id) + ": rank " + std::to_string(r) + "'s gradients " +
             (state == net::shm_sender::window_state::taken
                  ? "were read in place by its right neighbour: " + std::to_string(out->references()) + " chunks by reference"
              : state == net::shm_sender::window_state::declined ? std::string("were copied: its right neighbour could not map them")
                                                                 : std::string("were copied: its right neighbour did not answer the offer")));
  }
  lending_.clear();
}

// Whether node `node` runs on this host as our user, so that a segment between us may work.
bool node_job::same_host(int node) const {
  return plan_.shared_memory && !host_.empty() && plan_.nodes[size_t(node)].host == host_;
}

void node_job::open_shm_receivers() {
  const uint64_t ring_id = plan_.ring_id();
  const std::string job = "job " + std::to_string(plan_.job_id);
  for (int r : mine_) {
    const int left = plan_.left(r);
    if (reducers_.count(left) || shm_in_.count(r)) continue;  // a neighbour in this process
    if (!same_host(plan_.ranks[size_t(left)].node)) continue;  // another host: the network
    std::string error;
    auto in = net::shm_receiver::create({ring_id, left, r}, &error);
    if (!in) {  // the left node sends over the network then, as it would from another host
      ctx_.log(job + ": no shared memory for rank " + std::to_string(r) + "'s chunks: " + error);
      continue;
    }
    // On the segment's thread, which only hands chunks on: log lines go to the bridge thread.
    net::bridge* br = ctx_.br;
    auto log = [br, say = ctx_.log, job](std::string line) { br->post([say, line = job + ": " + line] { say(line); }); };
    std::shared_ptr<reducer_port> port = ports_[r];
    auto strays = std::make_shared<int>(0);
    in->start(
        [port, left, ring_id, log, strays](const wire::header& h, net::payload p) {
          if (h.type == wire::msg_type::chunk && h.job_id == ring_id && h.sender_rank == left)
            return deliver(*port, from_wire(h, std::move(p)));
          if ((*strays)++ == 0)  // the ring's checks catch the rest; one line is enough for a bug this plain
            log(std::string("dropped a ") + wire::type_name(h.type) + " from rank " + std::to_string(h.sender_rank) +
                " on the shared-memory link from rank " + std::to_string(left));
        },
        [port, log](const std::string& why) {
          log(why);
          fail(*port, why);
        });
    std::shared_ptr<net::shm_receiver> shared = std::move(in);
    set_shm_poller(r, shared, nullptr);
    shm_in_[r] = std::move(shared);
  }
}

// The replica, once it has asked for its all-reduces, may take the chunks itself (poll_briefly), if its
// spinning holds no worker another replica here needs. A poll holds the receiver until it ends, and lets
// go of the messages our right neighbour has read in our window (out: the rank's sender, if it lends).
void node_job::set_shm_poller(int rank, const std::shared_ptr<net::shm_receiver>& in, const std::shared_ptr<net::shm_sender>& out) {
  const auto budget = ctx_.workers >= int(mine_.size()) ? ctx_.ring_poll : std::chrono::microseconds(0);
  set_poller(*ports_[rank], [weak_in = std::weak_ptr<net::shm_receiver>(in), weak_out = std::weak_ptr<net::shm_sender>(out)](
                                std::chrono::steady_clock::time_point until, const std::function<bool()>& done) {
    auto in = weak_in.lock();
    auto out = weak_out.lock();
    if (!out) return in ? in->poll(until, done) : done();
    return net::poll_reaping(in.get(), *out, until, done);
  }, budget);
}

std::shared_ptr<net::shm_sender> node_job::open_shm_sender(int rank, int right) {
  const int right_node = plan_.ranks[size_t(right)].node;
  if (!same_host(right_node)) return nullptr;
  const std::string& node = plan_.nodes[size_t(right_node)].endpoint;
  std::string error;
  bool missing = false;  // worth a line too: a node on our host should have made it
  std::shared_ptr<net::shm_sender> out = net::shm_sender::open({plan_.ring_id(), rank, right}, &error, &missing);
  const std::string job = "job " + std::to_string(plan_.job_id);
  if (!out) {  // on this host by its word, but no segment of its own that we could use
    ctx_.log(job + ": no shared memory with node " + node + " (" + error + "); ring chunks go over the network");
    return nullptr;
  }
  ctx_.log(job + ": ring chunks to node " + node + " through shared memory (same host, same user)");
  return out;
}

}  // namespace ringmaster
