// The built-in layers. Each is a small class: build() checks shapes and declares parameters; forward()
// and backward() call backend primitives (kernels/backend.hpp), never a device directly.
#include "kernels/layers.hpp"

#include "kernels/counter_rng.hpp"
#include "kernels/registry.hpp"

namespace ringmaster {
namespace {

// Sizes beyond these are refused as absurd: a description comes from the network.
constexpr int max_width = 1 << 24;
constexpr int max_window = 64;
constexpr size_t max_sample_floats = size_t(1) << 26;

std::string fail(std::string* error, const std::string& why) {
  *error = why;
  return why;
}

// ---- dense ----------------------------------------------------------------------------------------

// A fused ReLU (Keras's activation="relu") saves the activation's own pass and buffer: forward adds the
// bias and clamps in one pass; backward masks dy into the workspace first.
const char* activation_name(bool relu) { return relu ? "relu" : "linear"; }

class dense_layer final : public layer {
 public:
  dense_layer(int units, bool relu) : units_(units), relu_(relu) {}
  std::string type() const override { return "dense"; }
  json config() const override { return {{"units", units_}, {"activation", activation_name(relu_)}}; }
  bool build(const shape& in, shape* out, std::vector<param_info>* params, std::string* error) override {
    if (in.size() > size_t(max_width)) return fail(error, "input of " + std::to_string(in.size()) + " values is too wide"), false;
    *out = shape{units_, 1, 1};
    params->push_back({"kernel", {in.size(), size_t(units_)}, param_init::glorot_uniform, in.size(), size_t(units_)});
    params->push_back({"bias", {size_t(units_)}, param_init::zeros, 0, 0});
    return true;
  }
  size_t workspace(const shape&, const shape& out, int batch) const override { return relu_ ? size_t(batch) * out.size() : 0; }
  void forward(const layer_io& io) const override {
    io.be.dense_forward(io.y, io.x, io.params[0], io.params[1], io.batch, int(io.in.size()), units_, relu_);
  }
  void backward(const layer_io& io, const float* dy, float* dx) const override {
    if (relu_) {
      io.be.relu_backward(io.work, dy, io.y, size_t(io.batch) * units_);
      dy = io.work;
    }
    io.be.dense_backward(dx, io.grads[0], io.grads[1], dy, io.x, io.params[0], io.batch, int(io.in.size()), units_);
  }

 private:
  int units_;
  bool relu_;
};

// ---- conv2d: im2col, then the dense kernels over (B*OH*OW) patch rows --------------------------------

// Output size and leading padding of one axis, as TensorFlow computes them.
bool axis(int in, int k, int s, bool same, int* out, int* pad) {
  if (same) {
    *out = (in + s - 1) / s;
    const int total = std::max((*out - 1) * s + k - in, 0);
    *pad = total / 2;
    return true;
  }
  if (in < k) return false;
  *out = (in - k) / s + 1;
  *pad = 0;
  return true;
}

class conv2d_layer final : public layer {
 public:
  conv2d_layer(int filters, int kh, int kw, int sh, int sw, bool same, bool relu)
      : filters_(filters), kh_(kh), kw_(kw), sh_(sh), sw_(sw), same_(same), relu_(relu) {}
  std::string type() const override { return "conv2d"; }
  json config() const override {
    return {{"filters", filters_}, {"kernel", {kh_, kw_}}, {"stride", {sh_, sw_}}, {"padding", same_ ? "same" : "valid"},
            {"activation", activation_name(relu_)}};
  }
  bool build(const shape& in, shape* out, std::vector<param_info>* params, std::string* error) override {
    conv_geometry g = geometry(in);
    if (!axis(in.h, kh_, sh_, same_, &g.OH, &g.PH) || !axis(in.w, kw_, sw_, same_, &g.OW, &g.PW))
      return fail(error, "a " + std::to_string(kh_) + "x" + std::to_string(kw_) + " kernel does not fit input " +
                             in.str(true) + " with 'valid' padding"), false;
    *out = shape{filters_, g.OH, g.OW};
    if (g.patch() * size_t(g.OH) * g.OW > max_sample_floats || out->size() > max_sample_floats)
      return fail(error, "input " + in.str() + " unfolds into too many patches"), false;
    const size_t k = g.patch();
    params->push_back({"kernel", {size_t(kh_), size_t(kw_), size_t(in.c), size_t(filters_)}, param_init::glorot_uniform,
                       k, size_t(kh_) * kw_ * filters_});
    params->push_back({"bias", {size_t(filters_)}, param_init::zeros, 0, 0});
    return true;
  }
  // Patches and their gradient (none for a 1x1 kernel), then the masked dy of a fused ReLU.
  size_t workspace(const shape& in, const shape& out, int batch) const override {
    const size_t cols = pointwise(in, out) ? 0 : 2 * size_t(batch) * out.h * out.w * geometry(in).patch();
    return cols + (relu_ ? size_t(batch) * out.size() : 0);
  }
  void forward(const layer_io& io) const override {
    const conv_geometry g = full(io);
    const float* col = io.x;
    if (!pointwise(io.in, io.out)) {
      io.be.im2col(io.work, io.x, g, io.batch);
      col = io.work;
    }
    io.be.dense_forward(io.y, col, io.params[0], io.params[1], rows(io), int(g.patch()), filters_, relu_);
  }
  void backward(const layer_io& io, const float* dy, float* dx) const override {
    const conv_geometry g = full(io);
    if (relu_) {
      float* masked = io.work + (pointwise(io.in, io.out) ? 0 : 2 * size_t(rows(io)) * g.patch());
      io.be.relu_backward(masked, dy, io.y, size_t(io.batch) * io.out.size());
      dy = masked;
    }
    if (pointwise(io.in, io.out)) {
      io.be.dense_backward(dx, io.grads[0], io.grads[1], dy, io.x, io.params[0], rows(io), int(g.patch()), filters_);
      return;
    }
    float* dcol = dx ? io.work + size_t(rows(io)) * g.patch() : nullptr;
    io.be.dense_backward(dcol, io.grads[0], io.grads[1], dy, io.work, io.params[0], rows(io), int(g.patch()), filters_);
    if (dx) io.be.col2im(dx, dcol, g, io.batch);
  }

 private:
  conv_geometry geometry(const shape& in) const {
    conv_geometry g;
    g.H = in.h, g.W = in.w, g.C = in.c, g.KH = kh_, g.KW = kw_, g.SH = sh_, g.SW = sw_;
    return g;
  }
  conv_geometry full(const layer_io& io) const {
    conv_geometry g = geometry(io.in);
    axis(io.in.h, kh_, sh_, same_, &g.OH, &g.PH);
    axis(io.in.w, kw_, sw_, same_, &g.OW, &g.PW);
    return g;
  }
  // A 1x1 kernel with stride 1 needs no unfolding: the input is its own patch matrix.
  bool pointwise(const shape& in, const shape& out) const { return kh_ == 1 && kw_ == 1 && in.h == out.h && in.w == out.w; }
  int rows(const layer_io& io) const { return io.batch * io.out.h * io.out.w; }
  int filters_, kh_, kw_, sh_, sw_;
  bool same_, relu_;
};

// ---- max_pool2d ------------------------------------------------------------------------------------

class max_pool2d_layer final : public layer {
 public:
  max_pool2d_layer(int kh, int kw, int sh, int sw) : kh_(kh), kw_(kw), sh_(sh), sw_(sw) {}
  std::string type() const override { return "max_pool2d"; }
  json config() const override { return {{"size", {kh_, kw_}}, {"stride", {sh_, sw_}}}; }
  bool build(const shape& in, shape* out, std::vector<param_info>*, std::string* error) override {
    int oh = 0, ow = 0, pad = 0;
    if (!axis(in.h, kh_, sh_, false, &oh, &pad) || !axis(in.w, kw_, sw_, false, &ow, &pad))
      return fail(error, "a " + std::to_string(kh_) + "x" + std::to_string(kw_) + " window does not fit input " + in.str(true)), false;
    *out = shape{in.c, oh, ow};
    return true;
  }
  size_t workspace(const shape&, const shape& out, int batch) const override { return size_t(batch) * out.size(); }
  void forward(const layer_io& io) const override {
    io.be.maxpool_forward(io.y, reinterpret_cast<int32_t*>(io.work), io.x, geometry(io), io.batch);
  }
  void backward(const layer_io& io, const float* dy, float* dx) const override {
    if (dx) io.be.maxpool_backward(dx, dy, reinterpret_cast<const int32_t*>(io.work), geometry(io), io.batch);
  }

 private:
  conv_geometry geometry(const layer_io& io) const {
    conv_geometry g;
    g.H = io.in.h, g.W = io.in.w, g.C = io.in.c, g.KH = kh_, g.KW = kw_, g.SH = sh_, g.SW = sw_;
    g.OH = io.out.h, g.OW = io.out.w;
    return g;
  }
  int kh_, kw_, sh_, sw_;
};
static_assert(sizeof(int32_t) == sizeof(float), "max_pool2d keeps its argmax indices in float workspace");

// ---- flatten, relu, dropout -------------------------------------------------------------------------

class flatten_layer final : public layer {
 public:
  std::string type() const override { return "flatten"; }
  bool build(const shape& in, shape* out, std::vector<param_info>*, std::string*) override {
    *out = shape{int(in.size()), 1, 1};  // channels-last memory is already (h, w, c) in order
    return true;
  }
  void forward(const layer_io& io) const override { io.be.copy(io.y, io.x, size_t(io.batch) * io.in.size() * sizeof(float)); }
  void backward(const layer_io& io, const float* dy, float* dx) const override {
    if (dx) io.be.copy(dx, dy, size_t(io.batch) * io.in.size() * sizeof(float));
  }
};

class relu_layer final : public layer {
 public:
  std::string type() const override { return "relu"; }
  bool build(const shape& in, shape* out, std::vector<param_info>*, std::string*) override {
    *out = in;
    return true;
  }
  void forward(const layer_io& io) const override { io.be.relu_forward(io.y, io.x, size_t(io.batch) * io.in.size()); }
  void backward(const layer_io& io, const float* dy, float* dx) const override {
    if (dx) io.be.relu_backward(dx, dy, io.y, size_t(io.batch) * io.in.size());
  }
};

class dropout_layer final : public layer {
 public:
  explicit dropout_layer(float rate) : rate_(rate) {}
  std::string type() const override { return "dropout"; }
  json config() const override { return {{"rate", rate_}}; }
  bool build(const shape& in, shape* out, std::vector<param_info>*, std::string*) override {
    *out = in;
    return true;
  }
  void forward(const layer_io& io) const override {
    const size_t n = io.in.size();
    if (!io.training || rate_ == 0.0f) return io.be.copy(io.y, io.x, size_t(io.batch) * n * sizeof(float));
    io.be.dropout(io.y, io.x, io.batch, n, rate_, stream(io), io.key.first_sample);
  }
  // The mask is a function of its key: the same call on dy keeps and scales exactly what forward kept.
  void backward(const layer_io& io, const float* dy, float* dx) const override {
    if (!dx) return;
    const size_t n = io.in.size();
    if (rate_ == 0.0f) return io.be.copy(dx, dy, size_t(io.batch) * n * sizeof(float));
    io.be.dropout(dx, dy, io.batch, n, rate_, stream(io), io.key.first_sample);
  }

 private:
  static uint64_t stream(const layer_io& io) { return dropout_stream(io.key.seed, io.layer_index, io.key.epoch); }
  float rate_;
};

// ---- factories ----------------------------------------------------------------------------------------

template <class L>
layer_factory no_settings() {
  return [](const json& s, std::string* error) -> std::unique_ptr<layer> {
    settings_reader r(s);
    if (!r.only({}).ok()) return *error = r.error(), nullptr;
    return std::make_unique<L>();
  };
}

}  // namespace

layer_registry layer_registry::with_builtins() {
  layer_registry reg;
  std::string error;
  reg.add("dense", [](const json& s, std::string* error) -> std::unique_ptr<layer> {
    int units = 0;
    std::string activation = "linear";
    settings_reader r(s);
    r.only({"units", "activation"}).integer("units", &units, 1, max_width, true).word("activation", &activation, {"linear", "relu"});
    if (!r.ok()) return *error = r.error(), nullptr;
    return std::make_unique<dense_layer>(units, activation == "relu");
  }, &error);
  reg.add("conv2d", [](const json& s, std::string* error) -> std::unique_ptr<layer> {
    int filters = 0, kh = 0, kw = 0, sh = 1, sw = 1;
    std::string padding = "valid", activation = "linear";
    settings_reader r(s);
    r.only({"filters", "kernel", "stride", "padding", "activation"})
        .word("activation", &activation, {"linear", "relu"})
        .integer("filters", &filters, 1, 65536, true)
        .pair("kernel", &kh, &kw, 1, max_window, true)
        .pair("stride", &sh, &sw, 1, max_window)
        .word("padding", &padding, {"valid", "same"});
    if (!r.ok()) return *error = r.error(), nullptr;
    return std::make_unique<conv2d_layer>(filters, kh, kw, sh, sw, padding == "same", activation == "relu");
  }, &error);
  reg.add("max_pool2d", [](const json& s, std::string* error) -> std::unique_ptr<layer> {
    int kh = 0, kw = 0, sh = 0, sw = 0;
    settings_reader r(s);
    r.only({"size", "stride"}).pair("size", &kh, &kw, 1, max_window, true).pair("stride", &sh, &sw, 1, max_window);
    if (!r.ok()) return *error = r.error(), nullptr;
    return std::make_unique<max_pool2d_layer>(kh, kw, sh ? sh : kh, sw ? sw : kw);
  }, &error);
  reg.add("flatten", no_settings<flatten_layer>(), &error);
  reg.add("relu", no_settings<relu_layer>(), &error);
  reg.add("dropout", [](const json& s, std::string* error) -> std::unique_ptr<layer> {
    float rate = -1;
    settings_reader r(s);
    r.only({"rate"}).number("rate", &rate, 0.0, 0.999, true);
    if (!r.ok()) return *error = r.error(), nullptr;
    return std::make_unique<dropout_layer>(rate);
  }, &error);
  return reg;
}

namespace layers {

json dense(int units, const std::string& activation) {
  return {{"type", "dense"}, {"units", units}, {"activation", activation}};
}
json conv2d(int filters, int kernel, int stride, const std::string& padding, const std::string& activation) {
  return {{"type", "conv2d"}, {"filters", filters}, {"kernel", kernel}, {"stride", stride}, {"padding", padding},
          {"activation", activation}};
}
json max_pool2d(int size, int stride) {
  return {{"type", "max_pool2d"}, {"size", size}, {"stride", stride ? stride : size}};
}
json flatten() { return {{"type", "flatten"}}; }
json relu() { return {{"type", "relu"}}; }
json dropout(double rate) { return {{"type", "dropout"}, {"rate", rate}}; }
json custom(const std::string& type, json settings) {
  if (settings.is_null()) settings = json::object();  // custom("t", {})
  // Settings that are no object are not dropped: the layer is them, which the model refuses.
  if (!settings.is_object()) return settings;
  settings["type"] = type;
  return settings;
}

}  // namespace layers
}  // namespace ringmaster
