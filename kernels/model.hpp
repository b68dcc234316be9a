// A model is data: a description that travels as text, built against a layer registry and the data's
// sample shape into a list of layers over one flat parameter buffer and one flat gradient buffer.
//
// Descriptions (parse_model_desc):
//   "784-512-512-10"   an MLP: Dense layers with ReLU between them (input width first)
//   "cnn"              the Keras "simple MNIST convnet": conv 32 3x3 relu, maxpool 2, conv 64 3x3 relu,
//                      maxpool 2, flatten, dropout 0.5, dense 10
//   JSON               {"input": [C, H, W], "layers": [{"type": "conv2d", "filters": 32, "kernel": 3}, ...]}
//                      ("input" optional; a bare array of layers also works), e.g. sequential{...}.text()
// The loss is always softmax + sparse categorical cross-entropy over the last layer's outputs (logits).
#pragma once
#include <cstdint>
#include <initializer_list>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.hpp"
#include "kernels/layer.hpp"
#include "kernels/registry.hpp"

namespace ringmaster {

// A sequential stack of layer descriptions, composed in code:
//   cfg.model = sequential{layers::conv2d(32, 3), layers::relu(), ..., layers::dense(10)}.text();
struct sequential {
  std::vector<json> layers;
  sequential(std::initializer_list<json> l) : layers(l) {}
  sequential& add(json l) {
    layers.push_back(std::move(l));
    return *this;
  }
  std::string text() const;  // the JSON description
};

// A parsed description: layer settings and what it says of the input (nothing, a flat width, or a shape).
struct model_desc {
  std::vector<json> layers;
  int input_width = 0;  // "784-..." form: the data must have this many features
  bool has_input_shape = false;
  shape input;          // "input": [C, H, W]
};

// Parses any of the forms above. Never throws; false with *error naming the problem. Text over 64 KiB
// or nested deeper than 16 levels is refused before parsing.
bool parse_model_desc(const std::string& text, model_desc* out, std::string* error);

// A parameter tensor in the flat buffer: "conv2d_0/kernel" at offset (floats), with its Keras shape.
struct param_entry {
  std::string name;
  std::vector<size_t> dims;
  size_t offset = 0, count = 0;
  param_init init = param_init::zeros;
  size_t fan_in = 0, fan_out = 0;
};

// A built model: layers with their shapes and parameter offsets. Immutable and shared by all replicas
// of a process (layers keep no state between calls).
class model {
 public:
  struct entry {
    std::string name;  // "conv2d_0", "relu_1", ... (type, then its count among layers of that type)
    std::unique_ptr<layer> impl;
    shape in, out;
    size_t first_param = 0, param_count = 0;  // indexes into params() (whose offsets are in floats)
  };
  // Builds a description for samples of shape `input` (the data's). Null with *error naming the layer
  // and the problem: "layer 4 (conv2d_1): a 3x3 kernel does not fit input (32, 2, 2) ...".
  static std::shared_ptr<const model> build(const std::string& text, const layer_registry& reg, const shape& input,
                                            std::string* error);
  // Builds a description that names its input shape (as description() does).
  static std::shared_ptr<const model> build(const std::string& text, const layer_registry& reg, std::string* error);
  const shape& input() const { return input_; }
  const shape& output() const { return output_; }
  int classes() const { return int(output_.size()); }
  const std::vector<entry>& layers() const { return layers_; }
  const std::vector<param_entry>& params() const { return params_; }
  size_t param_count() const { return param_count_; }
  // The canonical description (JSON, with the input shape): what travels to nodes.
  const std::string& description() const { return text_; }
  // A short name for logs: "784-512-512-10" for MLPs given that way, else "cnn" or "JSON, N layers".
  const std::string& label() const { return label_; }
  // Floats a network of this model holds for a batch of `batch` (parameters, gradients, optimizer state,
  // activations, workspaces), as a double so that absurd models cannot wrap it; and the largest single
  // buffer among them, which kernels index with int.
  double memory_floats(int batch) const;
  double largest_buffer_floats(int batch) const;
  // Keras-like table: layer, output shape, parameters.
  std::string summary() const;
  // FNV-1a over names, shapes and offsets: two processes with equal fingerprints lay out parameters alike.
  uint64_t fingerprint() const;

 private:
  shape input_, output_;
  std::vector<entry> layers_;
  std::vector<param_entry> params_;
  size_t param_count_ = 0;
  std::string text_, label_;
};

// Builds with the built-in layers only.
std::shared_ptr<const model> build_model(const std::string& text, const shape& input, std::string* error);

// Glorot-uniform kernels (as Keras), zero biases, ones for scales, from a seed; identical on every
// machine (our own uniform mapping over mt19937_64).
std::vector<float> init_params(const model& m, uint64_t seed);

struct optimizer_config {
  enum kind_t { adam, sgd } kind = adam;
  float lr = 1e-3f;
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-7f;  // Keras defaults
  float momentum = 0.9f;                             // for sgd
};

// A network's whole training state, as a checkpoint holds it: with it a stopped job continues bit for bit.
struct network_state {
  int64_t steps = 0;                  // optimizer steps applied (Adam's t in its bias correction)
  std::vector<float> params, m1, m2;  // m1: Adam's first moment or SGD's velocity; m2: Adam's second (SGD: empty)
};

struct batch_metrics {
  double loss_sum = 0;  // summed per-sample loss
  int64_t correct = 0;
  int64_t count = 0;
};

// One replica's model on one backend: parameters, gradients, optimizer state, activations and layer
// workspaces, allocated once for a maximum batch so the training step allocates nothing.
class network {
 public:
  // host_grads: where the gradients live, size() floats of host memory the caller keeps for the network's
  // life (memory a neighbour process reads, net/shm_window.hpp), for a host backend only; null: the
  // backend's own.
  network(backend& be, std::shared_ptr<const model> m, int max_batch, optimizer_config opt, float* host_grads = nullptr);
  const model& def() const { return *m_; }
  size_t size() const { return m_->param_count(); }
  float* params() { return params_.data(); }
  float* grads() { return grads_at_; }
  void set_params(const float* host);
  void get_params(float* host) const;
  // Forward and backward on x (B, input) in NCHW and labels (B), device memory. Gradients (overwritten)
  // are those of loss_sum * grad_scale; grad_scale = 1 / global batch makes a ring sum the global mean.
  // key: where the batch sits in its epoch (dropout masks).
  // ready(first): called as backward goes, last layer first, once grads()[first, size()) are final, so
  // that their all-reduce can start while earlier layers still compute (on the host: a GPU's kernels are
  // only queued by then).
  batch_metrics forward_backward(const float* x, const int32_t* y, int B, float grad_scale, sample_key key,
                                 const std::function<void(size_t first)>& ready = {});
  batch_metrics evaluate(const float* x, const int32_t* y, int B);
  // Applies the optimizer with gradient g (device memory, size()) and advances the step count.
  void apply(const float* g);
  // The same in pieces, as gradient buckets' sums come in: apply_part updates [lo, hi) as the next step
  // does (g still points at element 0), and end_step() counts the step once every element has been.
  // The optimizers are elementwise, so any pieces give apply()'s bits.
  void apply_part(const float* g, size_t lo, size_t hi);
  void end_step() { ++step_; }
  int64_t steps() const { return step_; }
  // The parameters, the optimizer's state and its step count, read out to host memory; and put back
  // (false with *error when the sizes do not fit this network and optimizer).
  void save_state(network_state* out) const;
  // The same state piece by piece for `take` (part 0: the parameters, 1: the first moment, 2: the second,
  // none for SGD; in order, at most 1M floats a piece), through a small buffer, or as it lies in a host
  // backend's memory: a checksum of a large model's state without a copy of it.
  void read_state(const std::function<void(int part, const float* p, size_t n)>& take) const;
  bool has_second_moment() const { return m2_.data() != nullptr; }
  bool load_state(const network_state& s, std::string* error);
  int max_batch() const { return max_batch_; }
  // Makes room for batches of up to max_batch samples (activations and workspaces only: parameters,
  // gradients and optimizer state stay put: a gradient view remains valid). A smaller
  // max_batch keeps what there is.
  void reserve(int max_batch);
 private:
  void allocate_batch(int max_batch);
  const float* forward(const float* x, int B, bool training, const sample_key& key);
  layer_io io(size_t l, const float* x, int B, bool training, const sample_key& key);
  backend& be_;
  std::shared_ptr<const model> m_;
  int max_batch_;
  optimizer_config opt_;
  int64_t step_ = 0;
  device_buffer<float> params_, grads_, m1_, m2_;  // m1_, m2_: Adam's moments (m1_: SGD's velocity)
  float* grads_at_ = nullptr;                      // grads_, or the caller's host_grads
  device_buffer<float> input_;                     // channels-last copy of a multi-channel input
  std::vector<device_buffer<float>> acts_, work_;  // per layer: output (B, out), workspace
  std::vector<std::vector<const float*>> pviews_;
  std::vector<std::vector<float*>> gviews_;
  device_buffer<float> dbuf_a_, dbuf_b_;  // activation gradients, ping-pong
};

}  // namespace ringmaster
