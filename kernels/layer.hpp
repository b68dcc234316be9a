// What a layer is: told its input shape, it declares its parameters and its output shape; then it runs
// forward and backward on a backend over memory the model hands it. Layers own no memory: every
// parameter is a view into the model's one flat parameter buffer, every gradient a view into the flat
// gradient buffer at the same offset, so the ring and the optimizers see two flat buffers, as before.
//
// Layout: a sample of shape (c, h, w) is stored channels-last, (h, w, c) row-major, as Keras does; a
// flat feature vector is (n, 1, 1). Batches are (B, sample). Data sets hand the model (N, C, H, W); the
// model turns an input with several channels into channels-last once, before the first layer.
//
// A user layer derives from `layer`, and a layer_registry (kernels/registry.hpp) creates it by name from
// its JSON settings, in local jobs and on node daemons alike.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kernels/backend.hpp"
#include "kernels/shape.hpp"

namespace ringmaster {

using json = nlohmann::json;

// How a parameter starts: Glorot-uniform over fan_in + fan_out (Keras's default for kernels), zeros
// (biases) or ones (scales).
enum class param_init { glorot_uniform, zeros, ones };

// A parameter a layer declares when it is built. `dims` is the shape others see in saved files (Keras
// layout: dense kernel (in, out), conv2d kernel (kh, kw, in_channels, filters)).
struct param_info {
  std::string name;  // "kernel", "bias", ...: saved as "<layer name>/<name>"
  std::vector<size_t> dims;
  param_init init = param_init::zeros;
  size_t fan_in = 0, fan_out = 0;  // for glorot_uniform
  size_t count() const;
};

// Dropout and anything else random draws from (seed, epoch, global sample index) through this key, so a
// sample gets the same mask whichever replica runs it and however many replicas there are.
struct sample_key {
  uint64_t seed = 0;
  int64_t epoch = 0;
  int64_t first_sample = 0;  // index within the epoch of the batch's first sample
};

// What forward and backward see. Pointers are device memory of `be`.
struct layer_io {
  explicit layer_io(backend& b) : be(b) {}
  backend& be;
  int batch = 0;
  shape in, out;
  const float* x = nullptr;            // (batch, in)
  float* y = nullptr;                  // (batch, out)
  // One per declared parameter, in declaration order. Valid for this call only: keep no pointer.
  const float* const* params = nullptr;
  float* const* grads = nullptr;       // same offsets in the gradient buffer; backward overwrites them
  float* work = nullptr;               // workspace(batch) floats, kept from forward to backward
  bool training = false;               // false: evaluation (dropout passes everything through)
  sample_key key;
  uint64_t layer_index = 0;            // position in the model, so two dropout layers draw differently
};

class layer {
 public:
  virtual ~layer() = default;
  // The registry name ("conv2d") and the settings that recreate this layer (e.g. {"filters": 32, ...}).
  virtual std::string type() const = 0;
  virtual json config() const { return json::object(); }
  // Checks the input shape, sets *out and declares the parameters. False with *error saying what is
  // wrong (the model adds the layer's name).
  virtual bool build(const shape& in, shape* out, std::vector<param_info>* params, std::string* error) = 0;
  // Floats of scratch memory for a batch of `batch` samples (e.g. conv2d's unfolded patches).
  virtual size_t workspace(const shape& /*in*/, const shape& /*out*/, int /*batch*/) const { return 0; }
  // y = f(x). Must be batch-invariant: a sample's output bits do not depend on the other samples.
  virtual void forward(const layer_io& io) const = 0;
  // Given dy = dL/dy (batch, out), overwrites the parameter gradients with dL/dparams and, unless dx is
  // null (the first layer), writes dx = dL/dx (batch, in). io.x and io.y hold what forward saw and made.
  virtual void backward(const layer_io& io, const float* dy, float* dx) const = 0;
};

}  // namespace ringmaster
