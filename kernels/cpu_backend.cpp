// The CPU backend: host memory and the Eigen kernels.
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <new>

#include "kernels/backend.hpp"
#include "kernels/cpu_kernels.hpp"

namespace ringmaster {
namespace {

class cpu_backend final : public backend {
 public:
  std::string name() const override { return "cpu"; }
  bool is_host() const override { return true; }
  int device() const override { return -1; }
  void* alloc(size_t bytes) override {
    // 64-byte alignment: full AVX-512 lines for Eigen's loads.
    size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded ? rounded : 64);
    if (!p) throw std::bad_alloc();
    std::memset(p, 0, rounded);
    return p;
  }
  void release(void* p) override { std::free(p); }
  // n == 0 may come with null pointers (an empty buffer's data()), which memcpy must not be given.
  void copy_in(void* d, const void* s, size_t n) override { if (n) std::memcpy(d, s, n); }
  void copy_out(void* d, const void* s, size_t n) override { if (n) std::memcpy(d, s, n); }
  void copy(void* d, const void* s, size_t n) override { if (n) std::memmove(d, s, n); }
  void synchronize() override {}
  std::shared_ptr<void> alloc_host(size_t bytes) override { return std::shared_ptr<void>(alloc(bytes), std::free); }

  void dense_forward(float* out, const float* in, const float* w, const float* b, int B, int IN, int OUT,
                     bool relu) override {
    cpu::flush_denormals_on_this_thread();  // every step starts with a forward; MXCSR is per thread
    if (relu) cpu::dense_relu_forward(out, in, w, b, B, IN, OUT);
    else cpu::dense_forward(out, in, w, b, B, IN, OUT);
  }
  void dense_backward(float* din, float* dw, float* db, const float* dout, const float* in, const float* w,
                      int B, int IN, int OUT) override {
    cpu::dense_backward(din, dw, db, dout, in, w, B, IN, OUT);
  }
  void relu_forward(float* out, const float* in, size_t n) override { cpu::relu_forward(out, in, n); }
  void relu_backward(float* din, const float* dout, const float* out, size_t n) override {
    cpu::relu_backward(din, dout, out, n);
  }
  void im2col(float* col, const float* x, const conv_geometry& g, int B) override { cpu::im2col(col, x, g, B); }
  void col2im(float* dx, const float* col, const conv_geometry& g, int B) override { cpu::col2im(dx, col, g, B); }
  void maxpool_forward(float* out, int32_t* arg, const float* in, const conv_geometry& g, int B) override {
    cpu::maxpool_forward(out, arg, in, g, B);
  }
  void maxpool_backward(float* din, const float* dout, const int32_t* arg, const conv_geometry& g, int B) override {
    cpu::maxpool_backward(din, dout, arg, g, B);
  }
  void dropout(float* out, const float* in, int B, size_t per_sample, float rate, uint64_t stream,
               int64_t first_sample) override {
    cpu::dropout(out, in, B, per_sample, rate, stream, first_sample);
  }
  void nchw_to_nhwc(float* out, const float* in, int B, int C, int H, int W) override {
    cpu::nchw_to_nhwc(out, in, B, C, H, W);
  }
  void softmax_xent(float* dl, const float* logits, const int32_t* labels, int B, int C, float scale) override {
    cpu::softmax_xent(dl, &loss_, &correct_, logits, labels, B, C, scale);
  }
  void take_metrics(double* loss, int64_t* correct) override {
    *loss += loss_, *correct += correct_;
    loss_ = 0, correct_ = 0;
  }
  void adam_update(float* w, float* m, float* v, const float* g, size_t n, float lr, float b1, float b2,
                   float eps, int64_t t) override {
    cpu::flush_denormals_on_this_thread();
    cpu::adam_update(w, m, v, g, n, lr, b1, b2, eps, t);
  }
  void sgd_update(float* w, float* vel, const float* g, size_t n, float lr, float mom) override {
    cpu::flush_denormals_on_this_thread();  // as for Adam: whichever thread runs it, the same bits
    cpu::sgd_update(w, vel, g, n, lr, mom);
  }
  void add_inplace(float* dst, const float* src, size_t n) override { cpu::add_inplace(dst, src, n); }

 private:
  double loss_ = 0;  // the metric accumulators (softmax_xent / take_metrics)
  int64_t correct_ = 0;
};

}  // namespace

std::unique_ptr<backend> make_cpu_backend() {
  // Replicas are the parallelism: one BLAS thread each, so BLAS does not fight them for the cores.
  cpu::use_one_blas_thread();
  return std::make_unique<cpu_backend>();
}

std::unique_ptr<backend> make_backend_with(const backend_factory& make, const std::string& device, std::string* error) {
  std::unique_ptr<backend> be;
  try {
    be = make ? make(device, error) : make_backend(device, error);
  } catch (const std::exception& e) {
    *error = std::string("its backend factory threw: ") + e.what();
  } catch (...) {
    *error = "its backend factory threw";
  }
  if (!be && error->empty()) *error = "its backend factory gave none, and said nothing";
  return be;
}

std::unique_ptr<backend> make_backend(const std::string& device, std::string* error) {
  if (device == "cpu") return make_cpu_backend();
  if (device.rfind("cuda:", 0) == 0) {
    const std::string n = device.substr(5);
    if (n.empty() || n.size() > 3 || n.find_first_not_of("0123456789") != std::string::npos) {
      *error = "bad device '" + device + "': expected cuda:N";
      return nullptr;
    }
    return make_cuda_backend(std::stoi(n), error);
  }
  *error = "unknown device '" + device + "': expected cpu or cuda:N";
  return nullptr;
}

}  // namespace ringmaster
