// A reducer's send and staging buffers, reused once nobody else holds them (the receiving reducer or
// ZeroMQ let go): no allocation per chunk in the steady state. A buffer lives in plain host memory, in
// pinned host memory of a backend (a GPU's chunks on their way to another process), or on a backend's
// device.
#pragma once
#include <atomic>
#include <memory>
#include <vector>

#include "kernels/backend.hpp"

namespace ringmaster {

class chunk_pool {
 public:
  enum class kind { host, pinned, device };

  // A buffer of at least n floats. For device buffers, `keep` must keep `be` alive: a buffer can outlive
  // the pool (a neighbour still holding a chunk), and its release needs the backend. Device buffers
  // never leave the process; pinned ones (which may sit in ZeroMQ's queues) need no backend to be freed.
  std::shared_ptr<float> get(kind k, size_t n, backend* be = nullptr, std::shared_ptr<const void> keep = {}) {
    for (entry& e : entries_)
      if (e.k == k && e.be == be && e.capacity >= n && e.p.use_count() == 1) {
        std::atomic_thread_fence(std::memory_order_acquire);  // after the last reader let go
        return e.p;
      }
    const size_t bytes = (n ? n : 1) * sizeof(float);
    std::shared_ptr<float> p;
    if (k == kind::host) {
      p = std::shared_ptr<float>(new float[n ? n : 1], std::default_delete<float[]>());
    } else if (k == kind::pinned) {  // frees itself: ZeroMQ may hold it after the job and the backend end
      std::shared_ptr<void> host = be->alloc_host(bytes);
      p = std::shared_ptr<float>(host, static_cast<float*>(host.get()));
    } else {
      p = std::shared_ptr<float>(static_cast<float*>(be->alloc(bytes)), [be, keep](float* q) { be->release(q); });
    }
    entries_.push_back({k, be, n, p});
    return p;
  }

 private:
  struct entry {
    kind k;
    backend* be;
    size_t capacity;
    std::shared_ptr<float> p;
  };
  std::vector<entry> entries_;
};

}  // namespace ringmaster
