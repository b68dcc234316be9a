// The CUDA backend: device memory from cudaMalloc, one stream and one cuBLAS handle per backend, and the
// kernels of kernels/cuda_kernels.cu. Compiled by the host compiler; only the .cu file needs nvcc.
//
// Threads: the current CUDA device is per host thread, and a replica may run on any thread, so every
// entry point first makes this backend's device current (cheap when it already is).
// Ordering: all work goes on this backend's stream. copy_in and copy_out return when the copy is done,
// so host buffers may be reused at once; kernels and copy() only enqueue.
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>

#include "kernels/backend.hpp"
#include "kernels/cuda_kernels.hpp"

namespace ringmaster {
namespace {

class cuda_backend final : public backend {
 public:
  explicit cuda_backend(int device) : device_(device), name_("cuda:" + std::to_string(device)) {
    try {
      init();
    } catch (...) {
      destroy();  // the destructor does not run when a constructor throws
      throw;
    }
  }
  ~cuda_backend() override { destroy(); }

  cuda_backend(const cuda_backend&) = delete;
  cuda_backend& operator=(const cuda_backend&) = delete;

  std::string name() const override { return name_; }
  bool is_host() const override { return false; }
  int device() const override { return device_; }

  void* alloc(size_t bytes) override {
    use_device();
    void* p = nullptr;
    const size_t n = bytes ? bytes : 1;  // a valid, distinct pointer even for an empty buffer
    RM_CUDA_CHECK(cudaMalloc(&p, n));
    // Zero on our stream and wait: cudaMemset would go on the legacy stream, which a non-blocking stream
    // does not wait for.
    try {
      RM_CUDA_CHECK(cudaMemsetAsync(p, 0, n, ctx_.stream));
      RM_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
    } catch (...) {
      cudaFree(p);
      throw;
    }
    return p;
  }

  // Called from destructors (device_buffer): never throws. Waits for queued work that may still use p.
  void release(void* p) override {
    if (!p) return;
    cudaSetDevice(device_);
    cudaStreamSynchronize(ctx_.stream);
    const cudaError_t err = cudaFree(p);
    if (err != cudaSuccess)
      std::fprintf(stderr, "ringmaster: %s: cudaFree failed: %s\n", name_.c_str(), cudaGetErrorString(err));
  }

  void copy_in(void* dst, const void* src, size_t bytes) override {
    use_device();
    if (!bytes) return;
    RM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, ctx_.stream));
    RM_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
  }
  void copy_out(void* dst, const void* src, size_t bytes) override {
    use_device();
    if (!bytes) return;
    RM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, ctx_.stream));
    RM_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    use_device();
    if (!bytes) return;
    // Default: unified addressing tells a peer GPU's or the host's memory from ours.
    RM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, ctx_.stream));
  }
  void synchronize() override {
    use_device();
    RM_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
  }
  // Pinned memory belongs to the process, not to a device or stream: freeing it needs no backend.
  std::shared_ptr<void> alloc_host(size_t bytes) override {
    use_device();
    void* p = nullptr;
    RM_CUDA_CHECK(cudaMallocHost(&p, bytes ? bytes : 1));
    return std::shared_ptr<void>(p, [](void* q) {  // never throws: it runs in destructors
      const cudaError_t err = cudaFreeHost(q);
      if (err != cudaSuccess) std::fprintf(stderr, "ringmaster: cudaFreeHost failed: %s\n", cudaGetErrorString(err));
    });
  }

  void dense_forward(float* out, const float* in, const float* w, const float* b, int B, int IN, int OUT,
                     bool relu) override {
    use_device();
    if (relu) cuda::dense_relu_forward(ctx_, out, in, w, b, B, IN, OUT);
    else cuda::dense_forward(ctx_, out, in, w, b, B, IN, OUT);
  }
  void dense_backward(float* din, float* dw, float* db, const float* dout, const float* in, const float* w,
                      int B, int IN, int OUT) override {
    use_device();
    cuda::dense_backward(ctx_, din, dw, db, dout, in, w, B, IN, OUT);
  }
  void relu_forward(float* out, const float* in, size_t n) override {
    use_device();
    cuda::relu_forward(ctx_, out, in, n);
  }
  void relu_backward(float* din, const float* dout, const float* out, size_t n) override {
    use_device();
    cuda::relu_backward(ctx_, din, dout, out, n);
  }
  void im2col(float* col, const float* x, const conv_geometry& g, int B) override {
    use_device();
    cuda::im2col(ctx_, col, x, g, B);
  }
  void col2im(float* dx, const float* col, const conv_geometry& g, int B) override {
    use_device();
    cuda::col2im(ctx_, dx, col, g, B);
  }
  void maxpool_forward(float* out, int32_t* arg, const float* in, const conv_geometry& g, int B) override {
    use_device();
    cuda::maxpool_forward(ctx_, out, arg, in, g, B);
  }
  void maxpool_backward(float* din, const float* dout, const int32_t* arg, const conv_geometry& g, int B) override {
    use_device();
    cuda::maxpool_backward(ctx_, din, dout, arg, g, B);
  }
  void dropout(float* out, const float* in, int B, size_t per_sample, float rate, uint64_t stream,
               int64_t first_sample) override {
    use_device();
    cuda::dropout(ctx_, out, in, B, per_sample, rate, stream, first_sample);
  }
  void nchw_to_nhwc(float* out, const float* in, int B, int C, int H, int W) override {
    use_device();
    cuda::nchw_to_nhwc(ctx_, out, in, B, C, H, W);
  }
  // The kernel adds into the device scalars metrics_ (zeroed at creation and by take_metrics), so the
  // step's backward pass is queued behind it without waiting.
  void softmax_xent(float* dl, const float* logits, const int32_t* labels, int B, int C, float scale) override {
    use_device();
    double* dev_loss = static_cast<double*>(metrics_);
    cuda::softmax_xent(ctx_, dl, dev_loss, reinterpret_cast<int64_t*>(dev_loss + 1), logits, labels, B, C, scale);
  }
  // The one host round trip of a training step: two scalars, once the step's kernels have run.
  void take_metrics(double* loss_sum, int64_t* correct) override {
    use_device();
    struct {
      double loss;
      int64_t correct;
    } host{};  // the same 16-byte layout as metrics_: one copy brings both back
    static_assert(sizeof host == 2 * sizeof(double));
    RM_CUDA_CHECK(cudaMemcpyAsync(&host, metrics_, sizeof host, cudaMemcpyDeviceToHost, ctx_.stream));
    RM_CUDA_CHECK(cudaMemsetAsync(metrics_, 0, sizeof host, ctx_.stream));
    RM_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
    *loss_sum += host.loss;
    *correct += host.correct;
  }
  void adam_update(float* w, float* m, float* v, const float* g, size_t n, float lr, float b1, float b2,
                   float eps, int64_t t) override {
    use_device();
    cuda::adam_update(ctx_, w, m, v, g, n, lr, b1, b2, eps, t);
  }
  void sgd_update(float* w, float* vel, const float* g, size_t n, float lr, float mom) override {
    use_device();
    cuda::sgd_update(ctx_, w, vel, g, n, lr, mom);
  }
  void add_inplace(float* dst, const float* src, size_t n) override {
    use_device();
    cuda::add_inplace(ctx_, dst, src, n);
  }
  // The cudaStream_t everything above is queued on. A user layer's own kernels go on it too, so they are
  // ordered with ours; the backend's device must be current (cudaSetDevice(device())) when it launches.
  void* native_stream() override { return ctx_.stream; }

 private:
  void init() {
    RM_CUDA_CHECK(cudaSetDevice(device_));
    // Non-blocking: the legacy default stream (used by other libraries) never serializes with ours.
    RM_CUDA_CHECK(cudaStreamCreateWithFlags(&ctx_.stream, cudaStreamNonBlocking));
    RM_CUBLAS_CHECK(cublasCreate(&ctx_.blas));
    RM_CUBLAS_CHECK(cublasSetStream(ctx_.blas, ctx_.stream));
    RM_CUBLAS_CHECK(cublasSetPointerMode(ctx_.blas, CUBLAS_POINTER_MODE_HOST));  // alpha/beta on the host
    // Plain FP32 GEMMs (no TF32 tensor cores): the CPU and CUDA backends must agree within 1e-4.
    RM_CUBLAS_CHECK(cublasSetMathMode(ctx_.blas, CUBLAS_DEFAULT_MATH));
    RM_CUDA_CHECK(cudaDeviceGetAttribute(&ctx_.sm_count, cudaDevAttrMultiProcessorCount, device_));
    // The device scalars softmax_xent adds into: loss (double) then correct (int64).
    RM_CUDA_CHECK(cudaMalloc(&metrics_, 2 * sizeof(double)));
    RM_CUDA_CHECK(cudaMemsetAsync(metrics_, 0, 2 * sizeof(double), ctx_.stream));
    // Scratch for kernels' partial results (column sums of tall matrices), used in stream order only.
    RM_CUDA_CHECK(cudaMalloc(&ctx_.scratch, cuda::default_scratch_floats * sizeof(float)));
    ctx_.scratch_floats = cuda::default_scratch_floats;
    // Reducers of one process copy chunks straight between GPUs where the hardware allows (NVLink or
    // PCIe peer to peer). Best effort: without it cudaMemcpy goes through the host by itself, so any
    // error here (already enabled, too many peers, refused) is read and forgotten, never left pending
    // for a later check to report.
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    for (int peer = 0; peer < n; ++peer) {
      int can = 0;
      if (peer != device_ && cudaDeviceCanAccessPeer(&can, device_, peer) == cudaSuccess && can)
        cudaDeviceEnablePeerAccess(peer, 0);
      cudaGetLastError();
    }
  }

  // Never throws: releases what exists and ignores errors (the device may be gone).
  void destroy() noexcept {
    cudaSetDevice(device_);
    if (ctx_.stream) cudaStreamSynchronize(ctx_.stream);
    if (metrics_) cudaFree(metrics_);
    if (ctx_.scratch) cudaFree(ctx_.scratch);
    if (ctx_.blas) cublasDestroy(ctx_.blas);
    if (ctx_.stream) cudaStreamDestroy(ctx_.stream);
    metrics_ = nullptr, ctx_.blas = nullptr, ctx_.stream = nullptr, ctx_.scratch = nullptr, ctx_.scratch_floats = 0;
  }

  void use_device() { RM_CUDA_CHECK(cudaSetDevice(device_)); }

  int device_;
  std::string name_;
  cuda::cuda_context ctx_;
  void* metrics_ = nullptr;
};

// cudaGetDeviceCount, with any error (no driver: 35, no device: 100, ...) turned into a message.
// Without a GPU it may leave the count unset, so it starts at 0.
int device_count(std::string* why) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear it, so it does not surface in a later, unrelated check
    // 35 on a machine with no NVIDIA driver at all reads as if an upgrade would do: say both.
    if (why && err == cudaErrorInsufficientDriver)
      *why = std::string("no NVIDIA driver is loaded, or it is older than this CUDA runtime needs; cudaGetDeviceCount: ") + cudaGetErrorString(err);
    else if (why)
      *why = std::string("cudaGetDeviceCount failed: ") + cudaGetErrorString(err);
    return 0;
  }
  if (n <= 0 && why) *why = "cudaGetDeviceCount found 0 devices";
  return n > 0 ? n : 0;
}

}  // namespace

int cuda_device_count() { return device_count(nullptr); }

std::unique_ptr<backend> make_cuda_backend(int device, std::string* error) {
  std::string why;
  const int n = device_count(&why);
  if (n == 0) {
    *error = "no CUDA device: " + why;
    return nullptr;
  }
  if (device < 0 || device >= n) {
    *error = "cuda:" + std::to_string(device) + " requested but only " + std::to_string(n) + " CUDA device(s)";
    return nullptr;
  }
  try {
    return std::make_unique<cuda_backend>(device);
  } catch (const std::exception& e) {
    *error = "cuda:" + std::to_string(device) + ": " + e.what();
    return nullptr;
  }
}

}  // namespace ringmaster
