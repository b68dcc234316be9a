// Ring all-reduce on its own: N reducer actors in one process, usable without replicas (the benchmark
// and the topology API use it).
//
//   caf::actor_system sys{cfg};
//   local_ring ring(sys, 4);
//   std::string err = ring.allreduce({a, b, c, d}, len);  // every buffer ends with the elementwise sum
#pragma once
#include <caf/all.hpp>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "actors/reducer.hpp"
#include "kernels/backend.hpp"

namespace ringmaster {

class local_ring {
 public:
  // owner: kept until the reducers have ended (topology::ring() passes its actor system's, so that a ring
  // may outlive the topology that made it). Ranks outside 1..kMaxRanks (as a job's replicas) make a ring
  // of none, whose allreduce says so.
  static constexpr int kMaxRanks = 1024;
  local_ring(caf::actor_system& sys, int ranks, std::shared_ptr<const void> owner = nullptr);
  // Stops the reducers and waits for them (they release staging buffers on the callers' backends).
  // Blocks: do not destroy a ring inside an actor's handler.
  ~local_ring();
  local_ring(const local_ring&) = delete;
  local_ring& operator=(const local_ring&) = delete;
  int size() const { return int(reducers_.size()); }
  // Sums buffers[r][0..len) over r into every buffer (len > 0: none null, no two overlapping). Returns ""
  // or what failed, at once when a reducer
  // dies; `timeout` (> 0) is the longest silence between the reducers' replies. After a failure or a
  // timeout the ring refuses further work (its reducers may still touch the buffers of the failed
  // call, so keep those alive until the ring is destroyed).
  std::string allreduce(const std::vector<float*>& buffers, size_t len,
                        std::chrono::milliseconds timeout = std::chrono::seconds(60));
  // The same for buffers in device memory: buffers[r] lives on devices[r] (a GPU backend, say), whose
  // kernels sum it there. Chunks go device to device; the host never sees the data. The backends must
  // outlive the ring (its reducers keep staging buffers on them).
  std::string allreduce(const std::vector<float*>& buffers, size_t len, const std::vector<backend*>& devices,
                        std::chrono::milliseconds timeout = std::chrono::seconds(60));

 private:
  std::shared_ptr<const void> owner_;  // first: it goes last, once the reducers are gone
  caf::actor_system& sys_;
  std::vector<caf::actor> reducers_;
  std::vector<std::shared_ptr<reducer_port>> ports_;
  std::string broken_;
  std::vector<std::pair<uintptr_t, size_t>> starts_;  // allreduce's: each buffer's address and rank, sorted
};

}  // namespace ringmaster
