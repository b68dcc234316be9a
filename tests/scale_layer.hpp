// A user layer for the tests of models users define (test_models.cpp) and of jobs that carry one to
// nodes (test_nodes.cpp): y = x * scale, one learnable scale per value, starting at ones. CPU only.
#pragma once
#include <catch2/catch.hpp>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/layer.hpp"
#include "kernels/registry.hpp"

namespace ringmaster::test {

class scale_layer final : public layer {
 public:
  std::string type() const override { return "scale"; }
  bool build(const shape& in, shape* out, std::vector<param_info>* params, std::string*) override {
    *out = in;
    params->push_back({"scale", {in.size()}, param_init::ones, 0, 0});
    return true;
  }
  void forward(const layer_io& io) const override {
    if (!io.be.is_host()) throw std::runtime_error("scale: this layer runs on the CPU only");
    const size_t n = io.in.size();
    for (int b = 0; b < io.batch; ++b)
      for (size_t i = 0; i < n; ++i) io.y[b * n + i] = io.x[b * n + i] * io.params[0][i];
  }
  void backward(const layer_io& io, const float* dy, float* dx) const override {
    if (!io.be.is_host()) throw std::runtime_error("scale: this layer runs on the CPU only");
    const size_t n = io.in.size();
    for (size_t i = 0; i < n; ++i) {
      float s = 0;
      for (int b = 0; b < io.batch; ++b) s += dy[b * n + i] * io.x[b * n + i];
      io.grads[0][i] = s;
    }
    if (dx)
      for (int b = 0; b < io.batch; ++b)
        for (size_t i = 0; i < n; ++i) dx[b * n + i] = dy[b * n + i] * io.params[0][i];
  }
};

inline layer_registry with_scale() {
  layer_registry reg = layer_registry::with_builtins();
  std::string err;
  const bool added = reg.add("scale", [](const json& s, std::string* error) -> std::unique_ptr<layer> {
    settings_reader r(s);
    if (!r.only({}).ok()) return *error = r.error(), nullptr;
    return std::make_unique<scale_layer>();
  }, &err);
  REQUIRE(added);
  return reg;
}

}  // namespace ringmaster::test
