#include "actors/local_ring.hpp"

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <mutex>

#include "actors/messages.hpp"
#include "actors/reducer.hpp"
#include "actors/ring_links.hpp"

namespace ringmaster {

local_ring::local_ring(caf::actor_system& sys, int ranks, std::shared_ptr<const void> owner) : owner_(std::move(owner)), sys_(sys) {
  if (ranks < 1 || ranks > kMaxRanks) {
    broken_ = "a ring of " + std::to_string(ranks) + " ranks: expected 1.." + std::to_string(kMaxRanks);
    return;
  }
  std::vector<std::shared_ptr<reducer_port>>& ports = ports_;
  for (int r = 0; r < ranks; ++r) {
    reducer_config rc;
    rc.rank = r;
    rc.size = ranks;
    rc.ring.pair_small_bytes = rc.ring.small_bytes;  // in one process the ring reads neighbours in place
    caf::actor a;
    ports.push_back(spawn_reducer(sys, rc, &a));
    reducers_.push_back(a);
  }
  starts_.reserve(size_t(ranks));
  for (int r = 0; r < ranks; ++r)
    join(*ports[size_t(r)], make_port_link(ports[size_t((r + 1) % ranks)]));
}

// Waits for the reducers to end: they release staging buffers on the callers' backends as they go.
local_ring::~local_ring() {
  caf::scoped_actor self{sys_};
  // The callers' buffers come without owners: their backends may go right after us, so the reducers'
  // staging buffers on them go back first (a reducer's state may be freed later than it ends).
  for (auto& p : ports_) leave(*p);
  for (auto& a : reducers_) self->send_exit(a, caf::exit_reason::user_shutdown);
  for (auto& a : reducers_) self->wait_for(a);
}

std::string local_ring::allreduce(const std::vector<float*>& buffers, size_t len,
                                  std::chrono::milliseconds timeout) {
  return allreduce(buffers, len, std::vector<backend*>(buffers.size(), nullptr), timeout);
}

std::string local_ring::allreduce(const std::vector<float*>& buffers, size_t len,
                                  const std::vector<backend*>& devices, std::chrono::milliseconds timeout) {
  if (reducers_.empty()) return broken_;
  if (timeout.count() <= 0) return "timeout must be positive, not " + std::to_string(timeout.count()) + " ms";
  if (buffers.size() != reducers_.size() || devices.size() != reducers_.size())  // (the host overload gives devices to match)
    return (buffers.size() != reducers_.size() ? std::to_string(buffers.size()) + " buffer(s)" : std::to_string(devices.size()) + " device(s)") +
           " for a ring of " + std::to_string(reducers_.size());
  if (!broken_.empty()) return "ring unusable after an earlier failure: " + broken_;
  // Each rank reads its neighbour's buffer and writes its own: one buffer twice would be summed into itself.
  std::vector<std::pair<uintptr_t, size_t>>& at = starts_;  // reserved once: no allocation a call
  at.clear();
  for (size_t r = 0; r < buffers.size() && len > 0; ++r) {
    if (!buffers[r]) return "buffer " + std::to_string(r) + " is null";
    at.push_back({reinterpret_cast<uintptr_t>(buffers[r]), r});
  }
  std::sort(at.begin(), at.end());
  for (size_t i = 1; i < at.size(); ++i)
    if (at[i].first - at[i - 1].first < len * sizeof(float))
      return "buffers " + std::to_string(std::min(at[i - 1].second, at[i].second)) + " and " +
             std::to_string(std::max(at[i - 1].second, at[i].second)) + " overlap: each rank needs a buffer of its own";
  // Each rank's all-reduce runs on the threads that bring its chunks; this thread only waits for the ends.
  struct waiter {
    std::mutex mu;
    std::condition_variable cv;
    size_t done = 0;
    std::string error;
  };
  auto w = std::make_shared<waiter>();  // shared: a late end after a timeout finds it alive
  for (size_t r = 0; r < ports_.size(); ++r)
    reduce(*ports_[r], tensor_view{buffers[r], len, nullptr, devices[r]}, 0, len, [w](const std::string& e) {
      {
        std::lock_guard<std::mutex> lock(w->mu);
        ++w->done;
        if (!e.empty() && w->error.empty()) w->error = e;
      }
      w->cv.notify_all();
    });
  std::unique_lock<std::mutex> lock(w->mu);
  if (!w->cv.wait_for(lock, timeout, [&] { return w->done == ports_.size() || !w->error.empty(); }))
    w->error = "all-reduce timed out";
  std::string error = w->error;
  lock.unlock();
  if (!error.empty())
    for (auto& p : ports_) fail(*p, error);  // the others stop too
  broken_ = error;
  return error;
}

}  // namespace ringmaster
