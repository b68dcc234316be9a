// One interface over the CPU and CUDA kernels, so model code is written once.
// Pointers passed to kernels are device pointers of this backend (host pointers for the CPU).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>

namespace ringmaster {

// A 2-D window over channels-last images (B, H, W, C) -> (B, OH, OW, OC): convolution patches
// (KH, KW, C) or pooling windows. Padding (top/left; bottom/right is whatever makes OH, OW) reads zeros.
struct conv_geometry {
  int H = 0, W = 0, C = 0;  // input
  int KH = 1, KW = 1;       // window
  int SH = 1, SW = 1;       // stride
  int PH = 0, PW = 0;       // padding before the first row / column
  int OH = 0, OW = 0;       // output
  size_t patch() const { return size_t(KH) * KW * C; }
};

class backend {
 public:
  backend() = default;
  // A copy is another backend: it gets a lifetime of its own.
  backend(const backend&) : alive_(std::make_shared<int>(0)) {}
  backend& operator=(const backend&) { return *this; }
  virtual ~backend() = default;
  // Expires when this backend is destroyed, so that memory it handed out (device_buffer) can tell a
  // live backend from a dead one instead of calling into freed memory.
  std::weak_ptr<const void> lifetime() const { return alive_; }
  virtual std::string name() const = 0;
  // True when device memory is ordinary host memory (no copies needed).
  virtual bool is_host() const = 0;
  // Where this backend's memory lives, so a reducer can tell whether a chunk is on its own device:
  // -1 for host memory, else the device's ordinal (CUDA: the device number; unique within a process).
  virtual int device() const = 0;
  virtual void* alloc(size_t bytes) = 0;  // zero-filled
  virtual void release(void* p) = 0;
  virtual void copy_in(void* dst_dev, const void* src_host, size_t bytes) = 0;
  virtual void copy_out(void* dst_host, const void* src_dev, size_t bytes) = 0;
  // dst on this device; src on this device, on another device of this process, or in host memory
  // (CUDA: unified addressing finds out which). Only enqueues, like the kernels.
  virtual void copy(void* dst_dev, const void* src_any, size_t bytes) = 0;
  virtual void synchronize() = 0;
  // Host memory the device copies to and from at full speed (CUDA: pinned), for chunks that leave the
  // process; the CPU backend gives plain memory. It may outlive the backend (a ZeroMQ message still
  // holding it): the last owner frees it.
  virtual std::shared_ptr<void> alloc_host(size_t bytes) = 0;

  // Kernels: semantics as in kernels/cpu_kernels.hpp.
  virtual void dense_forward(float* out, const float* in, const float* w, const float* b, int B, int IN,
                             int OUT, bool relu) = 0;
  virtual void dense_backward(float* din, float* dw, float* db, const float* dout, const float* in,
                              const float* w, int B, int IN, int OUT) = 0;
  virtual void relu_forward(float* out, const float* in, size_t n) = 0;
  virtual void relu_backward(float* din, const float* dout, const float* out, size_t n) = 0;
  // Convolution and pooling over channels-last images x (B, H, W, C); see kernels/cpu_kernels.hpp.
  virtual void im2col(float* col, const float* x, const conv_geometry& g, int B) = 0;
  virtual void col2im(float* dx, const float* col, const conv_geometry& g, int B) = 0;
  virtual void maxpool_forward(float* out, int32_t* arg, const float* in, const conv_geometry& g, int B) = 0;
  virtual void maxpool_backward(float* din, const float* dout, const int32_t* arg, const conv_geometry& g,
                                int B) = 0;
  virtual void dropout(float* out, const float* in, int B, size_t per_sample, float rate, uint64_t stream,
                       int64_t first_sample) = 0;
  // (B, C, H, W) -> (B, H, W, C): data sets hand over NCHW, layers compute channels-last.
  virtual void nchw_to_nhwc(float* out, const float* in, int B, int C, int H, int W) = 0;
  // Adds the batch's loss sum and hits to this backend's metric accumulators (on a GPU they stay there:
  // no wait in the middle of a step); take_metrics() reads them out.
  virtual void softmax_xent(float* dlogits, const float* logits, const int32_t* labels, int B, int C,
                            float grad_scale) = 0;
  // Adds the accumulated loss sum and hits to *loss_sum and *correct (host memory) and zeroes the
  // accumulators. Waits for the work queued so far.
  virtual void take_metrics(double* loss_sum, int64_t* correct) = 0;
  virtual void adam_update(float* w, float* m, float* v, const float* g, size_t n, float lr, float b1,
                           float b2, float eps, int64_t t) = 0;
  virtual void sgd_update(float* w, float* vel, const float* g, size_t n, float lr, float momentum) = 0;
  virtual void add_inplace(float* dst, const float* src, size_t n) = 0;
  // The queue kernels go on, for user layers with kernels of their own (CUDA: the cudaStream_t); null
  // for host backends, whose kernels run at once on the calling thread.
  virtual void* native_stream() { return nullptr; }

 private:
  std::shared_ptr<const int> alive_ = std::make_shared<int>(0);
};

std::unique_ptr<backend> make_cpu_backend();
// A CUDA backend on GPU `device`, or null with *error saying why (no GPU, built without CUDA, ...).
// Defined in kernels/cuda_backend.cpp, or kernels/cuda_stub.cpp when built without CUDA.
std::unique_ptr<backend> make_cuda_backend(int device, std::string* error);
// Number of usable CUDA devices; 0 without a GPU or driver, or when built without CUDA.
int cuda_device_count();
// The kind of a device name: "cuda" for "cuda:1", "cpu" for "cpu". A job's replicas share one kind.
inline std::string device_kind(const std::string& device) { return device.substr(0, device.find(':')); }
// "cpu" or "cuda:N". Null with *error naming the problem.
std::unique_ptr<backend> make_backend(const std::string& device, std::string* error);

// Makes the backend for a device name; a train_config may bring its own (a device ringmaster does not
// know, or a test's simulated device). Null with *error naming the problem.
using backend_factory = std::function<std::unique_ptr<backend>(const std::string& device, std::string* error)>;
// `make` (null: make_backend) for `device`, a program's own factory guarded: one that throws, or gives none
// without a word, is named as such in *error; nothing escapes.
std::unique_ptr<backend> make_backend_with(const backend_factory& make, const std::string& device, std::string* error);

// Device memory owned by a backend, released on destruction. Destroy it before its backend: one that
// outlives its backend leaks its memory, with one line on stderr saying so, rather than calling into the
// dead backend.
template <class T>
class device_buffer {
 public:
  device_buffer() = default;
  device_buffer(backend& be, size_t n)
      : be_(&be), life_(be.lifetime()), owner_(be.name()), n_(n), p_(static_cast<T*>(be.alloc(n * sizeof(T)))) {}
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  device_buffer(device_buffer&& o) noexcept { swap(o); }
  device_buffer& operator=(device_buffer&& o) noexcept { swap(o); return *this; }
  ~device_buffer() {
    if (!p_) return;
    if (!life_.expired()) {
      be_->release(p_);
      return;
    }
    // The backend is gone: nothing of it may be called, release() included.
    std::fprintf(stderr, "ringmaster: a device_buffer of %zu bytes outlived its backend %s; its memory is leaked\n",
                 n_ * sizeof(T), owner_.c_str());
  }
  T* data() const { return p_; }
  size_t size() const { return n_; }

 private:
  void swap(device_buffer& o) noexcept {
    std::swap(be_, o.be_), std::swap(life_, o.life_), owner_.swap(o.owner_), std::swap(n_, o.n_), std::swap(p_, o.p_);
  }
  backend* be_ = nullptr;
  std::weak_ptr<const void> life_;
  std::string owner_;  // the backend's name(), for the message above
  size_t n_ = 0;
  T* p_ = nullptr;
};

}  // namespace ringmaster
