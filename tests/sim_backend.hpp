// A simulated device for tests on machines without a GPU: "sim:K" behaves like GPU K to the code that
// uses it (is_host() false, device() K, batches staged in, gradients summed where they live), computes
// with the CPU kernels, and checks the rules a real GPU would enforce by crashing or by wrong results:
// kernels and add_inplace touch only this device's memory, copy_in reads and copy_out writes host memory
// only, copy writes this device's memory. A broken rule throws std::logic_error naming it, which ends
// the replica or reducer and so the job (the test sees result.ok false and the reason).
#pragma once
#include <atomic>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "kernels/backend.hpp"

namespace ringmaster::test {

// Which memory belongs to which simulated device; shared by every sim backend of a test.
class sim_devices {
 public:
  void add(int dev, const void* p, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    blocks_[uintptr_t(p)] = {bytes, dev};
  }
  void remove(const void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    blocks_.erase(uintptr_t(p));
  }
  // The device whose allocation holds [p, p + bytes), or -1 for host memory. Straddling a device
  // allocation's end throws.
  int owner(const void* p, size_t bytes) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.upper_bound(uintptr_t(p));
    if (it == blocks_.begin()) return -1;
    --it;
    const uintptr_t b = it->first, e = b + it->second.bytes, q = uintptr_t(p);
    if (q >= e) return -1;
    if (q + bytes > e) throw std::logic_error("sim: access runs past the end of a device allocation");
    return it->second.dev;
  }
  // Copies whose source was another device's memory or host memory (staging), and device-to-host copies.
  std::atomic<long> foreign_copies{0}, copies_out{0};

 private:
  struct block {
    size_t bytes;
    int dev;
  };
  mutable std::mutex mu_;
  std::map<uintptr_t, block> blocks_;
};

class sim_backend final : public backend {
 public:
  sim_backend(int dev, std::shared_ptr<sim_devices> reg) : dev_(dev), reg_(std::move(reg)), cpu_(make_cpu_backend()) {}
  std::string name() const override { return "sim:" + std::to_string(dev_); }
  bool is_host() const override { return false; }
  int device() const override { return dev_; }
  void* alloc(size_t bytes) override {
    void* p = cpu_->alloc(bytes);
    reg_->add(dev_, p, bytes ? bytes : 1);
    return p;
  }
  void release(void* p) override {
    if (!p) return;
    reg_->remove(p);
    cpu_->release(p);
  }
  void copy_in(void* d, const void* s, size_t n) override {
    mine(d, n, "copy_in destination");
    host(s, n, "copy_in source");
    cpu_->copy_in(d, s, n);
  }
  void copy_out(void* d, const void* s, size_t n) override {
    host(d, n, "copy_out destination");
    mine(s, n, "copy_out source");
    ++reg_->copies_out;
    cpu_->copy_out(d, s, n);
  }
  void copy(void* d, const void* s, size_t n) override {
    mine(d, n, "copy destination");
    if (n && reg_->owner(s, n) != dev_) ++reg_->foreign_copies;
    cpu_->copy(d, s, n);
  }
  void synchronize() override {}
  std::shared_ptr<void> alloc_host(size_t bytes) override { return cpu_->alloc_host(bytes); }

  void dense_forward(float* out, const float* in, const float* w, const float* b, int B, int IN, int OUT,
                     bool relu) override {
    mine(out, sizeof(float) * B * OUT, "dense_forward out");
    mine(in, sizeof(float) * B * IN, "dense_forward in");
    mine(w, sizeof(float) * IN * OUT, "dense_forward w");
    cpu_->dense_forward(out, in, w, b, B, IN, OUT, relu);
  }
  void dense_backward(float* din, float* dw, float* db, const float* dout, const float* in, const float* w,
                      int B, int IN, int OUT) override {
    mine(dw, sizeof(float) * IN * OUT, "dense_backward dw");
    mine(dout, sizeof(float) * B * OUT, "dense_backward dout");
    cpu_->dense_backward(din, dw, db, dout, in, w, B, IN, OUT);
  }
  void relu_forward(float* out, const float* in, size_t n) override {
    mine(out, n * sizeof(float), "relu_forward out");
    mine(in, n * sizeof(float), "relu_forward in");
    cpu_->relu_forward(out, in, n);
  }
  void relu_backward(float* din, const float* dout, const float* out, size_t n) override {
    mine(din, n * sizeof(float), "relu_backward din");
    mine(dout, n * sizeof(float), "relu_backward dout");
    mine(out, n * sizeof(float), "relu_backward out");
    cpu_->relu_backward(din, dout, out, n);
  }
  void im2col(float* col, const float* x, const conv_geometry& g, int B) override {
    mine(col, sizeof(float) * B * g.OH * g.OW * g.patch(), "im2col col");
    mine(x, sizeof(float) * B * g.H * g.W * g.C, "im2col x");
    cpu_->im2col(col, x, g, B);
  }
  void col2im(float* dx, const float* col, const conv_geometry& g, int B) override {
    mine(dx, sizeof(float) * B * g.H * g.W * g.C, "col2im dx");
    mine(col, sizeof(float) * B * g.OH * g.OW * g.patch(), "col2im col");
    cpu_->col2im(dx, col, g, B);
  }
  void maxpool_forward(float* out, int32_t* arg, const float* in, const conv_geometry& g, int B) override {
    mine(out, sizeof(float) * B * g.OH * g.OW * g.C, "maxpool_forward out");
    mine(arg, sizeof(int32_t) * B * g.OH * g.OW * g.C, "maxpool_forward arg");
    mine(in, sizeof(float) * B * g.H * g.W * g.C, "maxpool_forward in");
    cpu_->maxpool_forward(out, arg, in, g, B);
  }
  void maxpool_backward(float* din, const float* dout, const int32_t* arg, const conv_geometry& g, int B) override {
    mine(din, sizeof(float) * B * g.H * g.W * g.C, "maxpool_backward din");
    mine(dout, sizeof(float) * B * g.OH * g.OW * g.C, "maxpool_backward dout");
    mine(arg, sizeof(int32_t) * B * g.OH * g.OW * g.C, "maxpool_backward arg");
    cpu_->maxpool_backward(din, dout, arg, g, B);
  }
  void dropout(float* out, const float* in, int B, size_t per_sample, float rate, uint64_t stream,
               int64_t first_sample) override {
    mine(out, sizeof(float) * B * per_sample, "dropout out");
    mine(in, sizeof(float) * B * per_sample, "dropout in");
    cpu_->dropout(out, in, B, per_sample, rate, stream, first_sample);
  }
  void nchw_to_nhwc(float* out, const float* in, int B, int C, int H, int W) override {
    mine(out, sizeof(float) * B * C * H * W, "nchw_to_nhwc out");
    mine(in, sizeof(float) * B * C * H * W, "nchw_to_nhwc in");
    cpu_->nchw_to_nhwc(out, in, B, C, H, W);
  }
  void softmax_xent(float* dl, const float* logits, const int32_t* labels, int B, int C, float scale) override {
    mine(logits, sizeof(float) * B * C, "softmax_xent logits");
    mine(labels, sizeof(int32_t) * B, "softmax_xent labels");
    cpu_->softmax_xent(dl, logits, labels, B, C, scale);
  }
  void take_metrics(double* loss, int64_t* correct) override { cpu_->take_metrics(loss, correct); }
  void adam_update(float* w, float* m, float* v, const float* g, size_t n, float lr, float b1, float b2, float eps,
                   int64_t t) override {
    mine(w, n * sizeof(float), "adam w");
    mine(g, n * sizeof(float), "adam g");
    cpu_->adam_update(w, m, v, g, n, lr, b1, b2, eps, t);
  }
  void sgd_update(float* w, float* vel, const float* g, size_t n, float lr, float mom) override {
    mine(w, n * sizeof(float), "sgd w");
    mine(g, n * sizeof(float), "sgd g");
    cpu_->sgd_update(w, vel, g, n, lr, mom);
  }
  void add_inplace(float* dst, const float* src, size_t n) override {
    mine(dst, n * sizeof(float), "add_inplace dst");
    mine(src, n * sizeof(float), "add_inplace src");
    cpu_->add_inplace(dst, src, n);
  }

 private:
  void mine(const void* p, size_t n, const char* what) const {
    if (n == 0) return;  // an empty range may point one past an allocation's end
    const int o = reg_->owner(p, n);
    if (o != dev_)
      throw std::logic_error(name() + ": " + what + " is " + (o < 0 ? "host memory" : "memory of sim:" + std::to_string(o)) +
                             ", not this device's");
  }
  void host(const void* p, size_t n, const char* what) const {
    if (n == 0) return;
    const int o = reg_->owner(p, n);
    if (o >= 0) throw std::logic_error(name() + ": " + what + " is memory of sim:" + std::to_string(o) + ", not host memory");
  }
  int dev_;
  std::shared_ptr<sim_devices> reg_;
  std::unique_ptr<backend> cpu_;
};

// A backend_factory for train_config / node_options: "sim:K" gives a simulated device, anything else
// what ringmaster::make_backend gives.
inline backend_factory sim_factory(std::shared_ptr<sim_devices> reg) {
  return [reg](const std::string& device, std::string* error) -> std::unique_ptr<backend> {
    if (device.rfind("sim:", 0) == 0) {
      const std::string k = device.substr(4);
      if (!k.empty() && k.size() < 4 && k.find_first_not_of("0123456789") == std::string::npos)
        return std::make_unique<sim_backend>(std::stoi(k), reg);
      *error = "bad simulated device '" + device + "'";
      return nullptr;
    }
    return make_backend(device, error);
  };
}

}  // namespace ringmaster::test
