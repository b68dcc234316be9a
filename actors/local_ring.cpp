#include "actors/local_ring.hpp"

#include "actors/messages.hpp"
#include "actors/reducer.hpp"

namespace ringmaster {

local_ring::local_ring(caf::actor_system& sys, int ranks) : sys_(sys) {
  for (int r = 0; r < ranks; ++r) reducers_.push_back(sys.spawn(reducer, r, ranks));
  for (int r = 0; r < ranks; ++r)
    caf::anon_send(reducers_[r], ring_atom::value, reducers_[(r + 1) % ranks], true,
                   reducers_[(r + ranks - 1) % ranks]);
}

local_ring::~local_ring() {
  for (auto& a : reducers_) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
}

std::string local_ring::allreduce(const std::vector<float*>& buffers, size_t len,
                                  std::chrono::milliseconds timeout) {
  if (buffers.size() != reducers_.size())
    return std::to_string(buffers.size()) + " buffers for a ring of " + std::to_string(reducers_.size());
  if (!broken_.empty()) return "ring unusable after an earlier failure: " + broken_;
  const int64_t step = step_++;
  caf::scoped_actor self{sys_};
  for (size_t r = 0; r < reducers_.size(); ++r)
    self->send(reducers_[r], reduce_atom::value, step, tensor_view{buffers[r], len, nullptr, nullptr});
  std::string error;
  size_t replies = 0;
  self->receive_for(replies, reducers_.size())(
      [&](int64_t) {},
      [&](caf::error& e) { error = "reducer failed: " + sys_.render(e); },
      caf::after(timeout) >> [&] {
        error = "all-reduce timed out";
        replies = reducers_.size();
      });
  broken_ = error;
  return error;
}

}  // namespace ringmaster
