#include "actors/local_ring.hpp"

#include "actors/messages.hpp"
#include "actors/reducer.hpp"
#include "actors/ring_links.hpp"

namespace ringmaster {

local_ring::local_ring(caf::actor_system& sys, int ranks) : sys_(sys) {
  std::vector<std::shared_ptr<reducer_port>> ports;
  for (int r = 0; r < ranks; ++r) {
    reducer_config rc;
    rc.rank = r;
    rc.size = ranks;
    rc.port = make_reducer_port();
    ports.push_back(rc.port);
    reducers_.push_back(sys.spawn(reducer, rc));
  }
  for (int r = 0; r < ranks; ++r)
    caf::anon_send(reducers_[size_t(r)], ring_atom::value, make_port_link(ports[size_t((r + 1) % ranks)], reducers_[size_t((r + 1) % ranks)]));
}

// Waits for the reducers to end: they release staging buffers on the callers' backends as they go.
local_ring::~local_ring() {
  caf::scoped_actor self{sys_};
  // The callers' buffers come without owners: their backends may go right after us, so the reducers'
  // staging buffers on them go back first (a reducer's state may be freed later than it ends).
  for (auto& a : reducers_)
    self->request(a, std::chrono::seconds(10), ring_atom::value).receive([](bool) {}, [](caf::error&) {});
  for (auto& a : reducers_) self->send_exit(a, caf::exit_reason::user_shutdown);
  for (auto& a : reducers_) self->wait_for(a);
}

std::string local_ring::allreduce(const std::vector<float*>& buffers, size_t len,
                                  std::chrono::milliseconds timeout) {
  return allreduce(buffers, len, std::vector<backend*>(buffers.size(), nullptr), timeout);
}

std::string local_ring::allreduce(const std::vector<float*>& buffers, size_t len,
                                  const std::vector<backend*>& devices, std::chrono::milliseconds timeout) {
  if (buffers.size() != reducers_.size() || devices.size() != reducers_.size())
    return std::to_string(buffers.size()) + " buffers and " + std::to_string(devices.size()) +
           " devices for a ring of " + std::to_string(reducers_.size());
  if (!broken_.empty()) return "ring unusable after an earlier failure: " + broken_;
  const int64_t step = step_++;
  caf::scoped_actor self{sys_};
  for (auto& a : reducers_) self->monitor(a);  // a reducer that dies fails the call at once
  for (size_t r = 0; r < reducers_.size(); ++r)
    self->send(reducers_[r], reduce_atom::value, step, tensor_view{buffers[r], len, nullptr, devices[r]});
  std::string error;
  size_t replies = 0;
  bool stop = false;
  self->receive_while([&] { return !stop && replies < reducers_.size(); })(
      [&](int64_t) { ++replies; },
      [&](caf::error& e) {
        error = "reducer failed: " + sys_.render(e);
        ++replies;
      },
      [&](caf::down_msg& dm) {
        error = "reducer stopped: " + sys_.render(dm.reason);
        stop = true;
      },
      caf::after(timeout) >> [&] {
        error = "all-reduce timed out";
        stop = true;
      });
  for (auto& a : reducers_) self->demonitor(a);  // monitors last as long as the reducer, not the call
  broken_ = error;
  return error;
}

}  // namespace ringmaster
