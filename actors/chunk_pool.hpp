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

  // A buffer of at least n floats. For pinned and device buffers, `keep` must keep `be` alive: buffers
  // can outlive the pool (a ZeroMQ message still sending one), and their release needs the backend.
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
    } else if (k == kind::pinned) {
      p = std::shared_ptr<float>(static_cast<float*>(be->alloc_host(bytes)),
                                 [be, keep](float* q) { be->release_host(q); });
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
