// A model is data: an MLP spec such as "784-512-512-10" (Dense layers, ReLU between them, softmax +
// sparse categorical cross-entropy at the end). All parameters live in one flat buffer, all gradients
// in another, laid out layer by layer as W (IN, OUT) row-major then b (OUT).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/backend.hpp"

namespace ringmaster {

struct model_spec {
  std::vector<int> dims;  // input, hidden..., classes
  size_t layers() const { return dims.size() - 1; }
  size_t param_count() const;
  size_t weight_offset(size_t layer) const;  // offset of W of this layer in the flat buffer
  size_t bias_offset(size_t layer) const { return weight_offset(layer) + size_t(dims[layer]) * dims[layer + 1]; }
  std::string str() const;
};

// Parses "784-512-512-10". On failure returns false and says why in *error.
bool parse_model_spec(const std::string& text, model_spec* out, std::string* error);

// Glorot-uniform weights (as Keras), zero biases, from a seed; identical on every machine.
std::vector<float> init_params(const model_spec& spec, uint64_t seed);

struct optimizer_config {
  enum kind_t { adam, sgd } kind = adam;
  float lr = 1e-3f;
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-7f;  // Keras defaults
  float momentum = 0.9f;                             // for sgd
};

struct batch_metrics {
  double loss_sum = 0;  // summed per-sample loss
  int64_t correct = 0;
  int64_t count = 0;
};

// One replica's model on one backend: parameters, gradients, optimizer state and activations,
// allocated once for a maximum batch size so the training step allocates nothing.
class mlp {
 public:
  mlp(backend& be, model_spec spec, int max_batch, optimizer_config opt);
  const model_spec& spec() const { return spec_; }
  size_t size() const { return spec_.param_count(); }
  float* params() { return params_.data(); }
  float* grads() { return grads_.data(); }
  void set_params(const float* host);
  void get_params(float* host) const;
  // Forward and backward on x (B, in), labels (B) in device memory. Gradients (overwritten) are those
  // of loss_sum * grad_scale; grad_scale = 1 / global batch makes a ring sum the global mean gradient.
  batch_metrics forward_backward(const float* x, const int32_t* y, int B, float grad_scale);
  batch_metrics evaluate(const float* x, const int32_t* y, int B);
  // Applies the optimizer with gradient g (device memory, size()) and advances the step count.
  void apply(const float* g);
  int64_t steps() const { return step_; }

 private:
  void forward(const float* x, int B);
  backend& be_;
  model_spec spec_;
  int max_batch_;
  optimizer_config opt_;
  int64_t step_ = 0;
  device_buffer<float> params_, grads_, m_, v_;
  std::vector<device_buffer<float>> acts_;  // output of each layer (B, OUT)
  device_buffer<float> dbuf_a_, dbuf_b_;   // activation gradients, ping-pong
};

}  // namespace ringmaster
