#include "kernels/model.hpp"

#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>

namespace ringmaster {

size_t model_spec::weight_offset(size_t layer) const {
  size_t off = 0;
  for (size_t l = 0; l < layer; ++l) off += size_t(dims[l]) * dims[l + 1] + dims[l + 1];
  return off;
}

size_t model_spec::param_count() const { return weight_offset(layers()); }

std::string model_spec::str() const {
  std::string s;
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += '-';
    s += std::to_string(dims[i]);
  }
  return s;
}

bool parse_model_spec(const std::string& text, model_spec* out, std::string* error) {
  model_spec spec;
  std::stringstream ss(text);
  std::string part;
  while (std::getline(ss, part, '-')) {
    if (part.empty() || part.size() > 7 || !std::all_of(part.begin(), part.end(), ::isdigit) ||
        std::stoi(part) <= 0) {
      *error = "bad model spec '" + text + "': '" + part + "' is not a layer width in 1..9999999";
      return false;
    }
    spec.dims.push_back(std::stoi(part));
  }
  if (spec.dims.size() < 2) {
    *error = "bad model spec '" + text + "': need at least input and output widths, e.g. 784-512-512-10";
    return false;
  }
  if (spec.dims.back() < 2) {
    *error = "bad model spec '" + text + "': the last layer needs at least 2 classes";
    return false;
  }
  *out = spec;
  return true;
}

std::vector<float> init_params(const model_spec& spec, uint64_t seed) {
  std::vector<float> p(spec.param_count(), 0.0f);
  std::mt19937_64 rng(seed);
  for (size_t l = 0; l < spec.layers(); ++l) {
    const int in = spec.dims[l], out = spec.dims[l + 1];
    const double limit = std::sqrt(6.0 / double(in + out));
    float* w = p.data() + spec.weight_offset(l);
    // Our own uniform mapping (24 random bits) so every standard library gives the same weights.
    for (size_t i = 0; i < size_t(in) * out; ++i) {
      const double u = double(rng() >> 40) * (1.0 / 16777216.0);  // [0, 1)
      w[i] = float((2.0 * u - 1.0) * limit);
    }
  }
  return p;
}

mlp::mlp(backend& be, model_spec spec, int max_batch, optimizer_config opt)
    : be_(be), spec_(std::move(spec)), max_batch_(max_batch), opt_(opt) {
  const size_t n = spec_.param_count();
  params_ = device_buffer<float>(be_, n);
  grads_ = device_buffer<float>(be_, n);
  m_ = device_buffer<float>(be_, n);
  if (opt_.kind == optimizer_config::adam) v_ = device_buffer<float>(be_, n);
  int widest = 0;
  for (size_t l = 0; l < spec_.layers(); ++l) {
    acts_.emplace_back(be_, size_t(max_batch) * spec_.dims[l + 1]);
    widest = std::max(widest, spec_.dims[l + 1]);
  }
  dbuf_a_ = device_buffer<float>(be_, size_t(max_batch) * widest);
  dbuf_b_ = device_buffer<float>(be_, size_t(max_batch) * widest);
}

void mlp::set_params(const float* host) { be_.copy_in(params(), host, size() * sizeof(float)); }
void mlp::get_params(float* host) const {
  be_.copy_out(host, params_.data(), size() * sizeof(float));
}

void mlp::forward(const float* x, int B) {
  const float* in = x;
  for (size_t l = 0; l < spec_.layers(); ++l) {
    const int IN = spec_.dims[l], OUT = spec_.dims[l + 1];
    const float* w = params_.data() + spec_.weight_offset(l);
    const float* b = params_.data() + spec_.bias_offset(l);
    const bool relu = l + 1 < spec_.layers();
    be_.dense_forward(acts_[l].data(), in, w, b, B, IN, OUT, relu);  // (B, OUT)
    in = acts_[l].data();
  }
}

batch_metrics mlp::forward_backward(const float* x, const int32_t* y, int B, float grad_scale) {
  batch_metrics m;
  m.count = B;
  forward(x, B);
  const size_t L = spec_.layers();
  float* dout = dbuf_a_.data();  // (B, classes)
  float* dnext = dbuf_b_.data();
  be_.softmax_xent(dout, acts_[L - 1].data(), y, B, spec_.dims[L], grad_scale);
  for (size_t l = L; l-- > 0;) {
    const int IN = spec_.dims[l], OUT = spec_.dims[l + 1];
    const float* in = l ? acts_[l - 1].data() : x;
    const float* w = params_.data() + spec_.weight_offset(l);
    float* dw = grads_.data() + spec_.weight_offset(l);
    float* db = grads_.data() + spec_.bias_offset(l);
    be_.dense_backward(l ? dnext : nullptr, dw, db, dout, in, w, B, IN, OUT);
    if (l) {
      be_.relu_backward(dnext, dnext, acts_[l - 1].data(), size_t(B) * IN);  // (B, IN)
      std::swap(dout, dnext);
    }
  }
  be_.take_metrics(&m.loss_sum, &m.correct);  // on a GPU: the one wait, with the whole step queued
  return m;
}

batch_metrics mlp::evaluate(const float* x, const int32_t* y, int B) {
  batch_metrics m;
  m.count = B;
  forward(x, B);
  const size_t L = spec_.layers();
  be_.softmax_xent(nullptr, acts_[L - 1].data(), y, B, spec_.dims[L], 0.0f);
  be_.take_metrics(&m.loss_sum, &m.correct);
  return m;
}

void mlp::apply(const float* g) {
  ++step_;
  if (opt_.kind == optimizer_config::adam)
    be_.adam_update(params(), m_.data(), v_.data(), g, size(), opt_.lr, opt_.beta1, opt_.beta2, opt_.eps, step_);
  else
    be_.sgd_update(params(), m_.data(), g, size(), opt_.lr, opt_.momentum);
}

}  // namespace ringmaster
