// Models made of the built-in layers: whole-model gradients against the float64 reference
// (tests/layer_reference.hpp) and against finite differences of the network's own loss, the registry's
// and the description parser's refusals, a user layer through train(), and the Keras parameter layout
// and fingerprints. The layers one at a time: test_layers.cpp.
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "actors/training.hpp"
#include "kernels/host_memory.hpp"
#include "kernels/layers.hpp"
#include "kernels/model.hpp"
#include "kernels/registry.hpp"
#include "kernels/safetensors.hpp"
#include "tests/layer_reference.hpp"
#include "tests/scale_layer.hpp"
#include "tests/sim_backend.hpp"
#include "tests/test_util.hpp"

using namespace ringmaster;
using namespace ringmaster::test;

// ---- a. whole models: double reference and finite differences of the network's own loss ------------------

namespace {

// Checks a network's loss against ref_model_loss and its gradients against (1) central differences of
// the float64 reference and (2) central differences of the network's own loss, on a handful of
// parameters per tensor (the largest gradients, where float noise matters least, and a random one).
void check_model_gradients(const std::string& text, const shape& in, int B, bool dropout_key) {
  INFO("model " << text);
  std::string err;
  auto m = build_model(text, in, &err);
  INFO(err);
  REQUIRE(m);
  auto be = make_cpu_backend();
  network net(*be, m, B, {});
  std::mt19937 rng(21);
  std::vector<float> p = init_params(*m, 5);
  for (float& v : p) v += std::uniform_real_distribution<float>(-0.05f, 0.05f)(rng);  // nonzero biases
  net.set_params(p.data());
  const auto x = randv(size_t(B) * in.size(), rng, 0, 1);
  std::vector<int32_t> y(B);
  for (int i = 0; i < B; ++i) y[i] = int32_t(rng() % m->classes());
  const sample_key key{123, 1, 48};
  // The network's own loss: forward_backward with a fixed dropout key, or evaluate (no dropout).
  auto own_loss = [&] {
    net.set_params(p.data());
    return dropout_key ? net.forward_backward(x.data(), y.data(), B, 1.0f, key).loss_sum
                       : net.evaluate(x.data(), y.data(), B).loss_sum;
  };
  const batch_metrics bm = net.forward_backward(x.data(), y.data(), B, 1.0f, key);
  const std::vector<float> g(net.grads(), net.grads() + net.size());
  dvec pd = to_d(p);
  CHECK(bm.loss_sum == Approx(ref_model_loss(*m, pd, x, y, B, true, key)).epsilon(1e-5));
  if (!dropout_key) CHECK(net.evaluate(x.data(), y.data(), B).loss_sum == Approx(bm.loss_sum).epsilon(1e-6));
  auto ref_loss = [&] { return ref_model_loss(*m, pd, x, y, B, dropout_key, key); };
  double worst_ref = 0, worst_own = 0;
  size_t checked = 0;
  for (const param_entry& e : m->params()) {
    std::vector<size_t> idx(e.count);
    std::iota(idx.begin(), idx.end(), e.offset);
    const size_t top = std::min<size_t>(3, idx.size());
    std::partial_sort(idx.begin(), idx.begin() + ptrdiff_t(top), idx.end(),
                      [&](size_t a, size_t b) { return std::abs(g[a]) > std::abs(g[b]); });
    idx.resize(top);
    idx.push_back(e.offset + rng() % e.count);
    for (size_t i : idx) {
      INFO(e.name << " [" << i - e.offset << "]: gradient " << g[i]);
      const double keep = pd[i];
      const double h = 1e-6;
      pd[i] = keep + h;
      const double up = ref_loss();
      pd[i] = keep - h;
      const double down = ref_loss();
      pd[i] = keep;
      const double fd_ref = (up - down) / (2 * h);
      // The network computes in float: its loss carries rounding noise (~1e-7 relative) that a small
      // step magnifies, while a large step crosses ReLU and max kinks. Measured worst errors: 7e-2 / 2.5e-2
      // / 7e-3 / 2e-2 at steps 3e-3 / 1e-3 / 1e-4 / 3e-5; 1e-4 it is, with a bound of 4x what it gave.
      const float hf = 1e-4f, kf = p[i];
      p[i] = kf + hf;
      const double up_own = own_loss();
      p[i] = kf - hf;
      const double down_own = own_loss();
      p[i] = kf;
      const double fd_own = (up_own - down_own) / (double(kf + hf) - double(kf - hf));
      const double scale = std::max(1e-2, std::abs(double(g[i])));
      worst_ref = std::max(worst_ref, std::abs(g[i] - fd_ref) / scale);
      worst_own = std::max(worst_own, std::abs(g[i] - fd_own) / scale);
      CHECK(std::abs(g[i] - fd_ref) / scale < 1e-5);  // measured: under 1e-6
      CHECK(std::abs(g[i] - fd_own) / scale < 3e-2);
      ++checked;
    }
  }
  net.set_params(p.data());
  WARN(text.substr(0, 40) << ": worst relative gradient error vs float64 differences " << worst_ref
                          << ", vs the network's own float differences " << worst_own << " (" << checked << " parameters)");
}

}  // namespace

TEST_CASE("the cnn's gradient matches finite differences (with a fixed dropout key)", "[layers]") {
  check_model_gradients("cnn", shape{1, 28, 28}, 3, /*dropout_key=*/true);
}

TEST_CASE("a 3-channel conv model with 'same' padding: NCHW data, loss and gradient match", "[layers]") {
  using namespace layers;
  const std::string text = sequential{conv2d(4, 3, 1, "same"), relu(), conv2d(5, 3, 2, "same"), relu(),
                                      max_pool2d(2), flatten(), dense(6), relu(), dense(3)}
                               .text();
  check_model_gradients(text, shape{3, 9, 8}, 4, /*dropout_key=*/false);
}

// ---- b. registry and descriptions -------------------------------------------------------------------------

namespace {

std::string build_error(const std::string& text, const shape& in = shape{1, 28, 28},
                        const layer_registry& reg = builtins()) {
  std::string err;
  auto m = model::build(text, reg, in, &err);
  CHECK_FALSE(m);
  CHECK_FALSE(err.empty());
  return err;
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// n samples of 8 features, two classes: the sign of (features 0..3 summed) - (features 4..7 summed).
std::shared_ptr<const dataset> two_class_set(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> f = randv(n * 8, rng);
  std::vector<int32_t> l(n);
  for (size_t i = 0; i < n; ++i) {
    float s = 0;
    for (int k = 0; k < 8; ++k) s += k < 4 ? f[i * 8 + k] : -f[i * 8 + k];
    l[i] = s > 0;
  }
  auto d = std::make_shared<dataset>();
  std::string err;
  REQUIRE(make_dataset(shape{8, 1, 1}, std::move(f), std::move(l), 2, d.get(), &err));
  return d;
}

}  // namespace

TEST_CASE("the registry refuses unknown types, duplicates and bad names", "[layers]") {
  const std::string e = build_error(R"({"layers": [{"type": "conv3d", "filters": 2}]})");
  CHECK(has(e, "layer 0"));
  CHECK(has(e, "unknown layer type 'conv3d'"));
  CHECK(has(e, "known: conv2d, dense, dropout, flatten, max_pool2d, relu"));
  CHECK(has(build_error(R"({"layers": [{"type": "dense", "units": 2}]})", {8, 1, 1}, layer_registry{}),
            "unknown layer type 'dense' (no layer types are registered)"));  // it said "(known: )"
  CHECK(has(build_error(R"({"layers": [{"type": "dense", "units": 4}, {"units": 2}]})"), "layer 1: a layer has no \"type\""));
  CHECK(has(build_error(R"({"layers": [{"type": 5}]})"), "layer 0: a layer's \"type\" is a name such as \"dense\", not number"));
  CHECK(has(build_error(R"({"layers": [{"type": null}]})"), "layer 0: a layer's \"type\" is a name such as \"dense\", not null"));
  CHECK(has(build_error(R"({"layers": [7]})"), "layer 0: a layer is a JSON object"));
  // A name that reorders the message around it (U+202E, right-to-left override) is shown escaped;
  // other characters beyond ASCII as they are.
  CHECK(has(build_error(R"({"layers": [{"type": "d\u202Eesnéd"}]})"), "unknown layer type 'd\\u202Eesnéd'"));
  CHECK(quoted("a\xEF\xBB\xBF" "b\xE2\x81\xA6" "c\xD8\x9C" "d\xE2\x80\x8B") == "'a\\uFEFFb\\u2066c\\u061Cd\\u200B'");

  layer_registry reg = layer_registry::with_builtins();
  std::string err;
  auto dummy = [](const json&, std::string*) -> std::unique_ptr<layer> { return std::make_unique<scale_layer>(); };
  CHECK_FALSE(reg.add("dense", dummy, &err));
  CHECK(has(err, "'dense' is registered already"));
  for (const char* bad : {"", "Scale", "my-layer", "a b", "0123456789012345678901234567890123"}) {
    INFO(bad);
    CHECK_FALSE(reg.add(bad, dummy, &err));
    CHECK(has(err, "a-z, 0-9 and _"));
  }
  CHECK_FALSE(reg.add("nothing", layer_factory{}, &err));
  CHECK(has(err, "no factory"));
  REQUIRE(reg.add("my_layer_2", dummy, &err));
  CHECK(reg.types().size() == 7);
  // A factory that throws or gives nothing: refused with its reason, nothing escapes.
  REQUIRE(reg.add("thrower", [](const json&, std::string*) -> std::unique_ptr<layer> { throw std::runtime_error("boom"); }, &err));
  REQUIRE(reg.add("silent", [](const json&, std::string*) -> std::unique_ptr<layer> { return nullptr; }, &err));
  CHECK(has(build_error(R"({"layers": [{"type": "thrower"}]})", {8, 1, 1}, reg), "layer 0: thrower: boom"));
  CHECK(has(build_error(R"({"layers": [{"type": "silent"}]})", {8, 1, 1}, reg), "layer 0: silent: could not be created"));
}

namespace {
// A user layer that misbehaves as `how` says: "type" throws from type(), "workspace" from workspace(),
// "twice" declares two parameters of one name, "fanless" a glorot_uniform parameter with no fan, "mute"
// fails its build without a word.
class odd_layer final : public layer {
 public:
  explicit odd_layer(std::string how) : how_(std::move(how)) {}
  std::string type() const override {
    if (how_ == "type") throw std::runtime_error("type() throws");
    return "odd";
  }
  bool build(const shape& in, shape* out, std::vector<param_info>* params, std::string*) override {
    if (how_ == "mute") return false;
    *out = in;
    params->push_back({"w", {in.size()}, how_ == "fanless" ? param_init::glorot_uniform : param_init::ones, 0, 0});
    if (how_ == "twice") params->push_back({"w", {in.size()}, param_init::ones, 0, 0});
    return true;
  }
  size_t workspace(const shape&, const shape&, int) const override {
    if (how_ == "workspace") throw std::runtime_error("workspace() throws");
    return 0;
  }
  void forward(const layer_io& io) const override { std::copy(io.x, io.x + io.batch * io.in.size(), io.y); }
  void backward(const layer_io& io, const float*, float*) const override { std::fill(io.grads[0], io.grads[0] + io.in.size(), 0.f); }

 private:
  std::string how_;
};
}  // namespace

TEST_CASE("a user layer whose type() or workspace() throws, or whose parameters clash or have no fan, is refused by train()", "[layers]") {
  // Before: std::terminate from type() and workspace(); two parameters of one name saved as one tensor
  // (4 of 42 values came back wrong); a glorot_uniform parameter over no fan started at -inf.
  auto reg = std::make_shared<layer_registry>(layer_registry::with_builtins());
  std::string err;
  REQUIRE(reg->add("odd", [](const json& s, std::string*) { return std::make_unique<odd_layer>(s.value("how", "")); }, &err));
  train_config c;
  c.layers = reg;
  c.global_batch = 32;
  c.train = two_class_set(64, 1);
  auto refused = [&](const std::string& how) {
    c.model = R"({"layers": [{"type": "odd", "how": ")" + how + R"("}, {"type": "dense", "units": 2}]})";
    const train_result r = train(c);
    CHECK(!r.ok);
    CHECK(r.invalid);
    return r.error;
  };
  CHECK(refused("type") == "layer 0: its type() threw or is empty");
  CHECK(has(refused("workspace"), ": a layer's workspace() threw: workspace() throws"));
  CHECK(has(refused("twice"), "layer 0 (odd_0): parameter 'w' is named twice"));
  CHECK(has(refused("mute"), "layer 0 (odd_0): its build() failed and said nothing"));
  CHECK(has(refused("fanless"), "layer 0 (odd_0): parameter 'w' is glorot_uniform with fan_in and fan_out 0"));
  c.model = R"({"layers": [{"type": "odd"}, {"type": "dense", "units": 2}]})";
  const train_result fine = train(c);
  INFO(fine.error);
  CHECK(fine.ok);
}

TEST_CASE("bad layer settings are refused naming the layer and the problem", "[layers]") {
  struct bad_case {
    const char* layer;
    std::vector<const char*> parts;
  };
  const std::vector<bad_case> cases = {
      {R"({"type": "conv2d", "filters": 0, "kernel": 3})", {"conv2d", "'filters': expected an integer in 1..65536, got 0"}},
      {R"({"type": "conv2d", "filters": -3, "kernel": 3})", {"'filters'", "got -3"}},
      {R"({"type": "conv2d", "filters": 100000, "kernel": 3})", {"'filters'", "got 100000"}},
      {R"({"type": "conv2d", "filters": 1e30, "kernel": 3})", {"'filters'", "expected an integer"}},
      {R"({"type": "conv2d", "filters": 9223372036854775808, "kernel": 3})", {"'filters'", "got 9223372036854775808"}},
      {R"({"type": "conv2d", "filters": -9223372036854775808, "kernel": 3})", {"'filters'"}},
      {R"({"type": "conv2d", "filters": 18446744073709551615, "kernel": 3})", {"'filters'"}},
      {R"({"type": "conv2d", "filters": 4294967297, "kernel": 3})", {"'filters'"}},  // 2^32 + 1: no wrap to 1
      {R"({"type": "conv2d", "filters": "32", "kernel": 3})", {"'filters'", "got \"32\""}},
      {R"({"type": "conv2d", "filters": 32.5, "kernel": 3})", {"'filters'"}},
      {R"({"type": "conv2d", "filters": true, "kernel": 3})", {"'filters'"}},
      {R"({"type": "conv2d", "filters": 4})", {"'kernel' is required"}},
      {R"({"type": "conv2d", "filters": 4, "kernel": [3]})", {"'kernel'", "or a pair of them"}},
      {R"({"type": "conv2d", "filters": 4, "kernel": [3, 3, 3]})", {"'kernel'"}},
      {R"({"type": "conv2d", "filters": 4, "kernel": [3, "3"]})", {"'kernel'"}},
      {R"({"type": "conv2d", "filters": 4, "kernel": 0})", {"'kernel'"}},
      {R"({"type": "conv2d", "filters": 4, "kernel": 65})", {"'kernel'", "1..64"}},
      {R"({"type": "conv2d", "filters": 4, "kernel": 3, "stride": 0})", {"'stride'"}},
      {R"({"type": "conv2d", "filters": 4, "kernel": 3, "padding": "full"})", {"'padding': expected \"valid\" or \"same\""}},
      {R"({"type": "conv2d", "filters": 4, "kernel": 3, "padding": 1})", {"'padding'"}},
      {R"({"type": "conv2d", "filter": 4, "kernel": 3})", {"unknown setting 'filter'", "known: filters, kernel, stride, padding"}},
      {R"({"type": "conv2d", "filters": 4, "kernel": 3, "activation": "tanh"})", {"'activation': expected \"linear\" or \"relu\""}},
      {R"({"type": "dense"})", {"dense", "'units' is required"}},
      {R"({"type": "dense", "units": 0})", {"'units'"}},
      {R"({"type": "dense", "units": 1e30})", {"'units'"}},
      {R"({"type": "dense", "units": 9223372036854775807})", {"'units'"}},
      {R"({"type": "dense", "units": [10]})", {"'units'"}},
      {R"({"type": "dense", "units": null})", {"'units'"}},
      {R"({"type": "dense", "units": 10, "use_bias": false})", {"unknown setting 'use_bias'"}},
      {R"({"type": "dense", "units": 10, "activation": "softmax"})", {"'activation'"}},
      {R"({"type": "dense", "units": 10, "activation": null})", {"'activation'"}},
      {R"({"type": "max_pool2d"})", {"max_pool2d", "'size' is required"}},
      {R"({"type": "max_pool2d", "size": -2})", {"'size'"}},
      {R"({"type": "max_pool2d", "size": 2, "stride": 1e30})", {"'stride'"}},
      {R"({"type": "dropout", "rate": 1.0})", {"dropout", "'rate': expected a number in [0, 0.999], got 1.0"}},
      {R"({"type": "dropout", "rate": -0.1})", {"'rate'"}},
      {R"({"type": "dropout", "rate": 1e30})", {"'rate'"}},
      {R"({"type": "dropout", "rate": "0.5"})", {"'rate'"}},
      {R"({"type": "dropout"})", {"'rate' is required"}},
      {R"({"type": "relu", "alpha": 0.1})", {"relu", "unknown setting 'alpha' (it takes none)"}},
      {R"({"type": "flatten", "x": 1})", {"flatten", "unknown setting 'x'"}},
  };
  for (const bad_case& c : cases) {
    // The bad layer is the second one: the message names index 1.
    const std::string text = std::string(R"({"layers": [{"type": "relu"}, )") + c.layer + R"(, {"type": "dense", "units": 10}]})";
    INFO(text);
    const std::string e = build_error(text);
    INFO(e);
    CHECK(has(e, "layer 1: "));
    for (const char* part : c.parts) CHECK(has(e, part));
  }
}

TEST_CASE("shapes that do not fit are refused naming the layer", "[layers]") {
  using namespace layers;
  const std::string big_kernel = build_error(sequential{conv2d(4, 5), flatten(), dense(10)}.text(), shape{1, 4, 4});
  CHECK(has(big_kernel, "layer 0 (conv2d_0)"));
  CHECK(has(big_kernel, "a 5x5 kernel does not fit input (1, 4, 4) with 'valid' padding"));
  // 'same' padding fits any input.
  std::string err;
  CHECK(build_model(sequential{conv2d(4, 5, 1, "same"), flatten(), dense(10)}.text(), shape{1, 4, 4}, &err));
  // The cnn on too small an image: its second conv no longer fits (its input named whole: it said "(32)").
  const std::string small = build_error("cnn", shape{1, 5, 5});
  CHECK(has(small, "layer 2 (conv2d_1)"));
  CHECK(has(small, "a 3x3 kernel does not fit input (32, 1, 1)"));
  const std::string pool = build_error(sequential{max_pool2d(4), flatten(), dense(10)}.text(), shape{2, 3, 8});
  CHECK(has(pool, "layer 0 (max_pool2d_0)"));
  CHECK(has(pool, "a 4x4 window does not fit input (2, 3, 8)"));
  // Absurd sizes: refused from the description, nothing allocated.
  CHECK(has(build_error(sequential{dense(1 << 24), dense(1 << 24)}.text(), shape{8, 1, 1}), "over 2^30 values"));
  CHECK(has(build_error(sequential{conv2d(65536, 64, 1, "same"), flatten(), dense(10)}.text(), shape{1, 512, 512}),
            "layer 0 (conv2d_0)"));
  // A model input the data does not have.
  CHECK(has(build_error(R"({"input": [3, 8, 8], "layers": [{"type": "dense", "units": 2}]})", shape{1, 28, 28}),
            "model expects input (3, 8, 8) but the data's samples are (1, 28, 28)"));
  CHECK(has(build_error("100-10", shape{1, 28, 28}), "model input width 100 does not match the data's 784 features"));
}

TEST_CASE("malformed descriptions are refused before any layer is built", "[layers]") {
  CHECK(has(build_error(R"({"layers": [{"type": "relu"})"), "not valid JSON (at byte 29)"));  // where it gave up: the ")"
  CHECK(has(build_error(R"({"layers": [{"type": "relu"},]})"), "not valid JSON (at byte 30)"));
  CHECK(has(build_error(R"({"layers": [{"type": "dense", "units": 1e400}]})"), "not valid JSON (a number out of range)"));
  CHECK(has(build_error("[" + std::string(40, '{')), "nested deeper than 16 levels"));
  CHECK(has(build_error(std::string(17, '[') + std::string(17, ']')), "nested deeper than 16 levels"));
  CHECK(has(build_error(std::string(100000, '[')), "over 64 KiB"));
  CHECK(has(build_error(R"({"layers": []})"), "\"layers\" must be a non-empty array"));
  CHECK(has(build_error("[]"), "non-empty array"));
  CHECK(has(build_error(R"({"layers": {"type": "relu"}})"), "non-empty array"));
  CHECK(has(build_error(R"({"input": [1, 28, 28]})"), "has no \"layers\""));
  CHECK(has(build_error(R"({"layer": [{"type": "relu"}]})"), "unknown key 'layer'"));
  CHECK(has(build_error(R"({"input": [0, 28, 28], "layers": [{"type": "relu"}]})"), "\"input\" must be [C, H, W]"));
  CHECK(has(build_error(R"({"input": "1x28x28", "layers": [{"type": "relu"}]})"), "\"input\" must be"));
  CHECK(has(build_error(R"({"input": [1, 28], "layers": [{"type": "relu"}]})"), "\"input\" must be [C, H, W] (or [C]"));  // was (1, 28, 1)
  // The parser would keep the last of two equal keys, and stop quietly at a NUL byte.
  CHECK(has(build_error(R"({"layers": [{"type": "relu"}], "layers": [{"type": "dense", "units": 10}]})"),
            "key 'layers' appears twice in one object"));
  CHECK(has(build_error(R"([{"type": "dense", "units": 10, "units": 12}])"), "key 'units' appears twice"));
  CHECK(has(build_error(std::string(R"([{"type": "relu"}])") + '\0' + "[1]"), "holds a NUL byte"));
  // Nesting inside strings does not count.
  std::string err;
  CHECK(has(build_error(R"({"layers": [{"type": "dense", "units": 10, "activation": "[[[[[[[[[[[[[[[[[[[[[["}]})"),
            "'activation': expected \"linear\" or \"relu\""));
  // Keys the description does not have are refused, not ignored.
  CHECK(has(build_error(R"({"layers": [{"type": "relu"}], "format": "keras"})"), "unknown key 'format' (known: input, layers)"));
  // The loss needs at least two classes.
  const std::string one = build_error(sequential{layers::flatten(), layers::dense(1)}.text());
  CHECK(has(one, "dense_0), the last, gives 1 output(s)"));
  CHECK(has(one, "at least 2 classes"));
  CHECK(has(build_error("784-16-1"), "at least 2 classes"));
  // A layer count beyond reason.
  json many = {{"layers", json::array()}};
  for (int i = 0; i < 1025; ++i) many["layers"].push_back(layers::relu());
  CHECK(has(build_error(many.dump()), "more than 1024 layers"));
  // A description that names no input cannot be built without data.
  CHECK_FALSE(model::build("cnn", builtins(), &err));
  CHECK(has(err, "does not name its input shape"));
}

TEST_CASE("a user layer from a registry builds and trains through train(), without the registry it is unknown", "[layers]") {
  auto reg = std::make_shared<const layer_registry>(with_scale());
  using namespace layers;
  train_config c;
  c.model = sequential{custom("scale"), dense(16), relu(), dense(2)}.text();
  c.layers = reg;
  c.replicas = 2;
  c.global_batch = 16;
  c.epochs = 3;
  c.threads = 2;
  c.opt.lr = 1e-2f;
  c.train = two_class_set(512, 1);
  c.test = two_class_set(200, 2);
  train_result r = train(c);
  INFO(r.error);
  REQUIRE(r.ok);
  CHECK(r.identical);
  std::string err;
  auto m = model::build(c.model, *reg, shape{8, 1, 1}, &err);
  REQUIRE(m);
  REQUIRE(m->params()[0].name == "scale_0/scale");
  REQUIRE(r.weights.size() == m->param_count());
  CHECK(init_params(*m, 1)[0] == 1.0f);  // param_init::ones
  size_t moved = 0;
  for (size_t i = 0; i < 8; ++i) moved += r.weights[i] != 1.0f;
  CHECK(moved == 8);  // the scales learned
  CHECK(r.history.back().val_accuracy > 0.8);
  CHECK(has(r.model, "\"type\":\"scale\""));

  // The built-in registry does not know it.
  c.layers = nullptr;
  train_result unknown = train(c);
  CHECK_FALSE(unknown.ok);
  CHECK(has(unknown.error, "layer 0: unknown layer type 'scale'"));

  // On a device that is not the host, the layer's own refusal ends the job with its reason.
  c.layers = reg;
  c.make_backend = test::sim_factory(std::make_shared<test::sim_devices>());
  c.devices = {"sim:0", "sim:1"};
  train_result on_sim = train(c);
  INFO(on_sim.error);
  CHECK_FALSE(on_sim.ok);
  CHECK(has(on_sim.error, "CPU only"));
}

// ---- c. summary and layout --------------------------------------------------------------------------------

TEST_CASE("the cnn's parameters, shapes and names are Keras's, fingerprints follow the description", "[layers]") {
  std::string err;
  auto m = build_model("cnn", shape{1, 28, 28}, &err);
  REQUIRE(m);
  CHECK(m->param_count() == 34826);  // Keras: 320 + 18,496 + 16,010
  CHECK(m->classes() == 10);
  CHECK(m->label() == "cnn");
  struct want_param {
    const char* name;
    std::vector<size_t> dims;
  };
  const std::vector<want_param> want = {{"conv2d_0/kernel", {3, 3, 1, 32}}, {"conv2d_0/bias", {32}},
                                        {"conv2d_1/kernel", {3, 3, 32, 64}}, {"conv2d_1/bias", {64}},
                                        {"dense_0/kernel", {1600, 10}},       {"dense_0/bias", {10}}};
  REQUIRE(m->params().size() == want.size());
  size_t offset = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const param_entry& p = m->params()[i];
    CHECK(p.name == want[i].name);
    CHECK(p.dims == want[i].dims);
    CHECK(p.offset == offset);
    offset += p.count;
  }
  CHECK(offset == 34826);
  // As Keras writes it: Conv2D(32, 3, activation="relu"), MaxPooling2D(2), Conv2D(64, 3, activation="relu"),
  // MaxPooling2D(2), Flatten(), Dropout(0.5), Dense(10).
  const std::vector<std::pair<std::string, shape>> layers_want = {
      {"conv2d_0", {32, 26, 26}}, {"max_pool2d_0", {32, 13, 13}}, {"conv2d_1", {64, 11, 11}}, {"max_pool2d_1", {64, 5, 5}},
      {"flatten_0", {1600, 1, 1}}, {"dropout_0", {1600, 1, 1}},    {"dense_0", {10, 1, 1}}};
  REQUIRE(m->layers().size() == layers_want.size());
  for (size_t i = 0; i < layers_want.size(); ++i) {
    CHECK(m->layers()[i].name == layers_want[i].first);
    CHECK(m->layers()[i].out == layers_want[i].second);
  }
  const std::string s = m->summary();
  INFO(s);
  CHECK(has(s, "Total params: 34826"));
  for (const char* line : {"conv2d_0", "(32, 26, 26)", "320", "18496", "16010", "(1600)"}) CHECK(has(s, line));

  // The canonical description rebuilds the same model; equal descriptions, equal fingerprints.
  auto again = build_model("cnn", shape{1, 28, 28}, &err);
  auto canonical = model::build(m->description(), builtins(), &err);
  REQUIRE(canonical);
  CHECK(canonical->input() == shape{1, 28, 28});
  CHECK(m->fingerprint() == again->fingerprint());
  CHECK(m->fingerprint() == canonical->fingerprint());
  CHECK(canonical->description() == m->description());
  using namespace layers;
  auto cnn_with = [](int filters, const std::string& padding, double rate, bool fused) {
    sequential s{conv2d(filters, 3, 1, padding, fused ? "relu" : "linear")};
    if (!fused) s.add(relu());
    s.add(max_pool2d(2)).add(conv2d(64, 3, 1, "valid", fused ? "relu" : "linear"));
    if (!fused) s.add(relu());
    return s.add(max_pool2d(2)).add(flatten()).add(dropout(rate)).add(dense(10)).text();
  };
  CHECK(build_model(cnn_with(32, "valid", 0.5, true), shape{1, 28, 28}, &err)->fingerprint() == m->fingerprint());
  // Any change: a dropout rate (same parameters), a filter count, a padding, separate ReLU layers, the input.
  for (const std::string& other : {cnn_with(32, "valid", 0.4, true), cnn_with(16, "valid", 0.5, true),
                                   cnn_with(32, "same", 0.5, true), cnn_with(32, "valid", 0.5, false)}) {
    auto o = build_model(other, shape{1, 28, 28}, &err);
    REQUIRE(o);
    CHECK(o->fingerprint() != m->fingerprint());
  }
  CHECK(build_model("cnn", shape{1, 30, 30}, &err)->fingerprint() != m->fingerprint());

  // The MLP form keeps its old layout: dense_0/kernel (784, 512), dense_0/bias, ...
  auto mlp = build_model("784-512-512-10", shape{1, 28, 28}, &err);
  REQUIRE(mlp);
  CHECK(mlp->label() == "784-512-512-10");
  REQUIRE(mlp->params().size() == 6);
  CHECK(mlp->params()[0].name == "dense_0/kernel");
  CHECK(mlp->params()[0].dims == std::vector<size_t>{784, 512});
  CHECK(mlp->params()[5].name == "dense_2/bias");
}

// Found by a hostile review: inputs that used to crash, hang or allocate without bound.
TEST_CASE("hostile descriptions and files: wrapped sizes, control characters, huge models, deep JSON", "[layers]") {
  std::string err;
  const layer_registry reg = layer_registry::with_builtins();
  // Three sizes below 2^24 whose product wraps a size_t to 2^24.
  CHECK_FALSE(model::build(R"({"input": [16777216, 419021, 10496005], "layers": [{"type": "dense", "units": 10}]})", reg, &err));
  CHECK(err.find("at most 2^26 values") != std::string::npos);
  // User text in a message is escaped: a newline would break the key=value line a node refuses with.
  CHECK(has(build_error(R"({"layers": [{"type": "dense", "units": 10, "x\ny": 1}]})"), R"(unknown setting 'x\ny')"));
  CHECK(build_error(R"({"layers": [{"type": "a\nb"}]})").find('\n') == std::string::npos);
  // The MLP form has the JSON form's limits.
  std::string mlp = "784";
  for (int i = 0; i < 1100; ++i) mlp += "-2";
  CHECK(has(build_error(mlp + "-10", shape{784, 1, 1}), "more than 1024 layers"));
  // A canonical description too long to travel back from a node is refused, not dropped on the wire.
  std::string many = "[";  // 41 KB as written, 100 KB with every setting spelled out
  for (int i = 0; i < 1000; ++i) many += R"({"type":"conv2d","filters":1,"kernel":1},)";
  CHECK(has(build_error(many + R"({"type":"dense","units":10}])"), "model description too long"));
  // A model far bigger than memory is refused before anything is allocated.
  train_config c;
  c.model = "784-30000-30000-10";  // 9.4e8 parameters would pass 2^30 but not the memory budget
  auto data = std::make_shared<dataset>();
  REQUIRE(make_dataset(shape{784, 1, 1}, std::vector<float>(784 * 64, 0.5f), std::vector<int32_t>(64, 1), 10, data.get(), &err));
  c.train = data;
  c.global_batch = 64;
  c.replicas = 1;
  const train_result r = train(c);
  CHECK_FALSE(r.ok);
  CHECK(r.invalid);
  CHECK((has(r.error, "MiB, over half of ") || has(r.error, "the limit is 2^28")));
  // The memory budget counts every replica of this process and its loader's prefetched batches: a job
  // each replica of which fits may still not fit all of them (a node offering cpu:4), nor a prefetch of 64
  // huge batches. Sized from the memory this process may use (the machine's, or its control group's
  // limit, as check_config weighs it); the data set is only its labels (nothing here reads the pixels).
  const double ram = usable_memory().bytes;
  const int64_t in = 1000, per_replica = int64_t(ram / 120 / in);  // ~20 bytes a sample and feature: a sixth of memory
  auto big = std::make_shared<dataset>();
  big->count = size_t(4 * per_replica);
  big->rows = 1, big->cols = int(in);
  big->labels.assign(big->count, 0);
  train_config crowd;
  crowd.model = std::to_string(in) + "-10";
  crowd.train = big;
  crowd.replicas = 4;
  crowd.global_batch = int(4 * per_replica);
  crowd.prefetch = 1;
  auto wide = build_model(crowd.model, big->sample(), &err);
  REQUIRE(wide);
  // It fits: what is left to say is that its samples hold no pixels (train() would refuse it so).
  const std::string fits = std::to_string(big->count) + " training samples of 1000 values each with 0 pixel values";
  CHECK(check_config(crowd, *wide, 1) == fits);
  CHECK(check_config(crowd, *wide, 2) == fits);
  // A model with no parameters (its checkpoints could not be read back) is refused before it runs.
  auto bare = build_model(R"({"layers": [{"type": "flatten"}]})", big->sample(), &err);
  REQUIRE(bare);
  CHECK(has(check_config(crowd, *bare, 1), "has no parameters: there is nothing to train"));
  CHECK(has(check_config(crowd, *wide, 4), "4 replicas here with 1 batches prefetched each, needs "));
  CHECK(check_config(crowd, *wide, 0) == fits);  // a launcher: its ranks run elsewhere
  crowd.prefetch = 64;  // one replica, but 65 batches of its shard in memory
  CHECK(has(check_config(crowd, *wide, 1), "1 replica here with 64 batches prefetched each, needs "));
  // A safetensors header nested 100,000 deep is refused before it is parsed (copying it overflowed the stack).
  auto m = build_model("4-2", shape{4, 1, 1}, &err);
  REQUIRE(m);
  const std::string header = "{\"dense_0/kernel\":{\"dtype\":\"F32\",\"shape\":" + std::string(100000, '[') +
                             std::string(100000, ']') + ",\"data_offsets\":[0,32]}}";
  const std::string path = "/tmp/ringmaster-deep-header.safetensors";
  {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    REQUIRE(f);
    const uint64_t n = header.size();
    std::fwrite(&n, 8, 1, f);  // little-endian on our hosts, as the format says
    std::fwrite(header.data(), 1, header.size(), f);
    std::fwrite(std::string(40, '\0').data(), 1, 40, f);
    std::fclose(f);
  }
  std::vector<float> params;
  CHECK_FALSE(read_safetensors(path, *m, &params, &err));
  CHECK(has(err, "nests deeper"));
  std::remove(path.c_str());
  // A tensor named twice: the parser would keep the second; which one was meant is not ours to guess.
  auto file = [](const std::string& tensors) {
    const std::string h = "{" + tensors + "}";
    std::string f(8, '\0');
    for (int i = 0; i < 8; ++i) f[size_t(i)] = char(uint64_t(h.size()) >> (8 * i) & 0xff);
    return f + h + std::string(40, '\0');
  };
  const std::string kernel = R"("dense_0/kernel":{"dtype":"F32","shape":[4,2],"data_offsets":[0,32]})";
  const std::string bias = R"("dense_0/bias":{"dtype":"F32","shape":[2],"data_offsets":[32,40]})";
  const std::string good = file(kernel + "," + bias), twice = file(kernel + "," + bias + "," + bias);
  CHECK(read_safetensors_bytes("mem", good.data(), good.size(), *m, &params, &err));
  CHECK_FALSE(read_safetensors_bytes("mem", twice.data(), twice.size(), *m, &params, &err));
  CHECK(err == "mem: the header names 'dense_0/bias' twice");
}
