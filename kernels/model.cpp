#include "kernels/model.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <stdexcept>
#include <map>
#include <set>
#include <random>
#include <sstream>

#include "kernels/fnv1a.hpp"
#include "kernels/layers.hpp"

namespace ringmaster {
namespace {

constexpr size_t max_text = 64 * 1024;
constexpr int max_depth = 16;
constexpr size_t max_layers = 1024;
constexpr size_t max_canonical = 48 * 1024;

// "784-512-512-10": Dense layers with ReLU between them. (Text is quoted in errors only in part: it may
// be 64 KiB from the network.)
bool parse_mlp(const std::string& text, model_desc* out, std::string* error) {
  const std::string shown = quoted(text, 64);
  std::vector<int> dims;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t dash = std::min(text.find('-', at), text.size());
    const std::string part = text.substr(at, dash - at);
    int width = 0;
    const bool digits = !part.empty() && part.size() <= 7 &&
                        std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (digits) std::from_chars(part.data(), part.data() + part.size(), width);
    if (!digits && text.find('-') == std::string::npos) {  // a word: not meant as widths at all ("cnnn")
      *error = "bad model spec " + shown + ": a model is widths (784-512-512-10), cnn, or a JSON list of layers";
      return false;
    }
    if (!digits || width <= 0) {
      *error = "bad model spec " + shown + ": " + quoted(part, 16) + " is not a layer width in 1..9999999";
      return false;
    }
    dims.push_back(width);
    if (dims.size() > max_layers + 1) {
      *error = "bad model spec " + shown + ": more than 1024 layers";
      return false;
    }
    at = dash + 1;
  }
  if (dims.size() < 2) {
    *error = "bad model spec " + shown + ": need at least input and output widths, e.g. 784-512-512-10";
    return false;
  }
  if (dims.back() < 2) {
    *error = "bad model spec " + shown + ": the last layer needs at least 2 classes";
    return false;
  }
  out->input_width = dims[0];
  for (size_t l = 1; l < dims.size(); ++l) {
    // Hidden layers with a fused ReLU: the same arithmetic as the MLP always had.
    out->layers.push_back(layers::dense(dims[l], l + 1 < dims.size() ? "relu" : "linear"));
  }
  return true;
}

bool read_shape(const json& j, shape* s, std::string* error) {
  int v[3] = {1, 1, 1};
  bool ok = j.is_array() && (j.size() == 1 || j.size() == 3);  // [1, 28] read as (1, 28, 1) surprised: H or W?
  for (size_t i = 0; ok && i < j.size(); ++i) {
    ok = j[i].is_number_integer() && j[i].get<long long>() >= 1 && j[i].get<long long>() <= (1 << 24);
    if (ok) v[i] = int(j[i].get<long long>());
  }
  // The product too: three sizes each below 2^24 can still wrap a size_t.
  if (ok && double(v[0]) * v[1] * v[2] > double(size_t(1) << 26)) ok = false;
  if (!ok) {
    *error = "\"input\" must be [C, H, W] (or [C] for flat features) with sizes in 1..16777216 and at most 2^26 values";
    return false;
  }
  *s = shape{v[0], v[1], v[2]};
  return true;
}

}  // namespace

std::string sequential::text() const {
  ::ringmaster::json j = {{"layers", layers}};
  return j.dump();
}

bool parse_model_desc(const std::string& text, model_desc* out, std::string* error) {
  *out = model_desc{};
  if (text == "cnn") {
    using namespace layers;
    // As Keras writes it: Conv2D(32, 3, activation="relu"), MaxPooling2D(2), ..., Dropout(0.5), Dense(10).
    out->layers = {conv2d(32, 3, 1, "valid", "relu"), max_pool2d(2), conv2d(64, 3, 1, "valid", "relu"), max_pool2d(2),
                   flatten(), dropout(0.5), dense(10)};
    return true;
  }
  if (text.size() > max_text) return *error = "model description over 64 KiB", false;
  const size_t first = text.find_first_not_of(" \t\r\n");
  if (first == std::string::npos || (text[first] != '{' && text[first] != '[')) return parse_mlp(text, out, error);
  if (json_depth(text) > max_depth) return *error = "model description nested deeper than 16 levels", false;
  // JSON allows a NUL byte nowhere; the parser would stop at one and quietly ignore what follows.
  if (text.find('\0') != std::string::npos) return *error = "model description holds a NUL byte", false;
  std::string twice;
  std::string why;
  const json j = parse_json(text, &twice, &why);
  if (j.is_discarded()) return *error = "model description is not valid JSON" + (why.empty() ? "" : " (" + why + ")"), false;
  if (!twice.empty()) return *error = "model description: key " + ringmaster::quoted(twice) + " appears twice in one object", false;
  const json* list = &j;
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it)
      if (it.key() != "layers" && it.key() != "input")
        return *error = "model description: unknown key " + quoted(it.key()) + " (known: input, layers)", false;
    auto in = j.find("input");
    if (in != j.end()) {
      if (!read_shape(*in, &out->input, error)) return false;
      out->has_input_shape = true;
    }
    auto ls = j.find("layers");
    if (ls == j.end()) return *error = "model description has no \"layers\"", false;
    list = &*ls;
  }
  if (!list->is_array() || list->empty()) return *error = "model description: \"layers\" must be a non-empty array", false;
  if (list->size() > max_layers) return *error = "model description has more than 1024 layers", false;
  for (const json& l : *list) out->layers.push_back(l);
  return true;
}

std::shared_ptr<const model> model::build(const std::string& text, const layer_registry& reg, const shape& input,
                                          std::string* error) {
  model_desc d;
  if (!parse_model_desc(text, &d, error)) return nullptr;
  // First: a negative dimension would be read as billions of features below.
  if (input.c < 1 || input.h < 1 || input.w < 1 || double(input.c) * input.h * input.w > double(size_t(1) << 26)) {
    *error = "input " + input.str() + " is empty or too large";
    return nullptr;
  }
  if (d.input_width && size_t(d.input_width) != input.size()) {
    *error = "model input width " + std::to_string(d.input_width) + " does not match the data's " +
             std::to_string(input.size()) + " features";
    return nullptr;
  }
  if (d.has_input_shape && d.input != input) {
    *error = "model expects input " + d.input.str() + " but the data's samples are " + input.str();
    return nullptr;
  }
  auto m = std::shared_ptr<model>(new model());
  m->input_ = input;
  shape cur = input;
  std::map<std::string, int> per_type;
  std::vector<std::string> types;  // each layer's type(), asked once
  std::set<std::string> names;     // the parameters', which name them in saved files
  for (size_t i = 0; i < d.layers.size(); ++i) {
    std::string why;
    entry e;
    e.impl = reg.create(d.layers[i], &why);
    const std::string where = "layer " + std::to_string(i);
    if (!e.impl) {
      *error = where + ": " + why;
      return nullptr;
    }
    std::string type;
    try {  // a user layer's, like build below
      type = e.impl->type();
    } catch (...) {
    }
    if (type.empty()) {
      *error = where + ": its type() threw or is empty";
      return nullptr;
    }
    types.push_back(type);
    e.name = type + "_" + std::to_string(per_type[type]++);
    e.in = cur;
    std::vector<param_info> ps;
    bool built = false;
    try {  // a user layer's build may throw; a description from the network must not end the process
      built = e.impl->build(cur, &e.out, &ps, &why);
    } catch (const std::exception& x) {
      why = x.what();
    } catch (...) {
      why = "its build() threw";
    }
    if (!built) {
      *error = where + " (" + e.name + "): " + (why.empty() ? "its build() failed and said nothing" : why);
      return nullptr;
    }
    if (e.out.size() == 0 || e.out.size() > (size_t(1) << 26) || e.out.c < 1 || e.out.h < 1 || e.out.w < 1) {
      *error = where + " (" + e.name + "): output shape " + e.out.str() + " is empty or too large";
      return nullptr;
    }
    e.first_param = m->params_.size();
    e.param_count = ps.size();
    for (const param_info& p : ps) {
      size_t n = 1;
      for (size_t dim : p.dims) n = dim && n <= (size_t(1) << 30) / dim ? n * dim : (size_t(1) << 31);
      if (p.dims.empty() || n == 0 || n > (size_t(1) << 30)) {
        *error = where + " (" + e.name + "): parameter '" + p.name + "' is empty or has over 2^30 values";
        return nullptr;
      }
      // Two of one name would be one tensor in a saved file (a checkpoint would then not resume bit for
      // bit), and glorot_uniform over no fan would start at infinity.
      if (p.name.empty() || !names.insert(e.name + "/" + p.name).second) {
        *error = where + " (" + e.name + "): parameter '" + p.name + "' is " + (p.name.empty() ? "unnamed" : "named twice");
        return nullptr;
      }
      if (p.init == param_init::glorot_uniform && p.fan_in + p.fan_out == 0) {
        *error = where + " (" + e.name + "): parameter '" + p.name + "' is glorot_uniform with fan_in and fan_out 0";
        return nullptr;
      }
      m->params_.push_back({e.name + "/" + p.name, p.dims, m->param_count_, n, p.init, p.fan_in, p.fan_out});
      m->param_count_ += n;
      if (m->param_count_ > (size_t(1) << 30)) {
        *error = "model has over 2^30 parameters";
        return nullptr;
      }
    }
    cur = e.out;
    m->layers_.push_back(std::move(e));
  }
  m->output_ = cur;
  if (cur.size() < 2) {
    *error = "layer " + std::to_string(m->layers_.size() - 1) + " (" + m->layers_.back().name + "), the last, gives " +
             std::to_string(cur.size()) + " output(s); the loss needs at least 2 classes";
    return nullptr;
  }
  json canonical = {{"input", {input.c, input.h, input.w}}, {"layers", json::array()}};
  for (size_t i = 0; i < m->layers_.size(); ++i) {
    const entry& e = m->layers_[i];
    json l;
    try {
      l = e.impl->config();
    } catch (...) {
      *error = "layer " + e.name + ": its config() threw";
      return nullptr;
    }
    if (!l.is_object()) l = json::object();
    l["type"] = types[i];
    canonical["layers"].push_back(l);
  }
  m->text_ = canonical.dump();
  // The canonical text travels back in a node's reply (a 64 KiB control message): it must fit there.
  if (m->text_.size() > max_canonical) {
    *error = "model description too long: " + std::to_string(m->text_.size()) + " bytes written out in full (limit " +
             std::to_string(max_canonical) + ")";
    return nullptr;
  }
  m->label_ = d.input_width ? text.substr(0, 80) : text == "cnn" ? "cnn" : "JSON, " + std::to_string(m->layers_.size()) + (m->layers_.size() == 1 ? " layer" : " layers");
  return m;
}

std::shared_ptr<const model> model::build(const std::string& text, const layer_registry& reg, std::string* error) {
  model_desc d;
  if (!parse_model_desc(text, &d, error)) return nullptr;
  if (!d.has_input_shape) {
    *error = "the model description does not name its input shape";
    return nullptr;
  }
  return build(text, reg, d.input, error);
}

std::shared_ptr<const model> build_model(const std::string& text, const shape& input, std::string* error) {
  return model::build(text, layer_registry::with_builtins(), input, error);
}

double model::memory_floats(int batch) const {
  const double b = batch;
  // Per parameter: its value, its gradient, two optimizer moments (Adam) and, measured, near one more for
  // the all-reduce's chunks in flight.
  double widest = double(input_.size()), total = 5.0 * double(param_count_) + b * double(input_.size());
  for (const entry& e : layers_) {
    total += b * double(e.out.size()) + double(e.impl->workspace(e.in, e.out, batch));
    widest = std::max(widest, double(e.out.size()));
  }
  return total + 2 * b * widest;  // the two activation-gradient buffers
}

double model::largest_buffer_floats(int batch) const {
  double largest = double(param_count_) + double(batch) * double(input_.size());
  for (const entry& e : layers_)
    largest = std::max({largest, double(batch) * double(e.out.size()), double(e.impl->workspace(e.in, e.out, batch))});
  return largest;
}

std::string model::summary() const {
  std::ostringstream s;
  char line[160];
  std::snprintf(line, sizeof line, "%-20s %-18s %12s\n", "Layer", "Output shape", "Params");
  s << line;
  for (const entry& e : layers_) {
    size_t n = 0;
    for (size_t p = e.first_param; p < e.first_param + e.param_count; ++p) n += params_[p].count;
    std::snprintf(line, sizeof line, "%-20s %-18s %12zu\n", e.name.c_str(), e.out.str().c_str(), n);
    s << line;
  }
  s << "Total params: " << param_count_ << " (input " << input_.str() << ")\n";
  return s.str();
}

uint64_t model::fingerprint() const {
  // FNV-1a from a basis a digit short of FNV's: kept as it was, since checkpoints carry this fingerprint.
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](const void* p, size_t n) { h = fnv1a64(p, n, h); };
  mix(text_.data(), text_.size());
  for (const param_entry& p : params_) {
    mix(p.name.data(), p.name.size());
    for (size_t d : p.dims) mix(&d, sizeof d);
    mix(&p.offset, sizeof p.offset);
  }
  return h;
}

size_t param_info::count() const {
  size_t n = 1;
  for (size_t d : dims) n *= d;
  return n;
}

std::vector<float> init_params(const model& m, uint64_t seed) {
  std::vector<float> p(m.param_count(), 0.0f);
  std::mt19937_64 rng(seed);
  for (const param_entry& e : m.params()) {
    float* w = p.data() + e.offset;
    if (e.init == param_init::ones) std::fill(w, w + e.count, 1.0f);
    if (e.init != param_init::glorot_uniform) continue;
    const double limit = std::sqrt(6.0 / double(e.fan_in + e.fan_out));
    // Our own uniform mapping (24 random bits) so every standard library gives the same weights.
    for (size_t i = 0; i < e.count; ++i) {
      const double u = double(rng() >> 40) * (1.0 / 16777216.0);  // [0, 1)
      w[i] = float((2.0 * u - 1.0) * limit);
    }
  }
  return p;
}

// ---- network ----------------------------------------------------------------------------------------

network::network(backend& be, std::shared_ptr<const model> m, int max_batch, optimizer_config opt, float* host_grads)
    : be_(be), m_(std::move(m)), max_batch_(0), opt_(opt) {
  const size_t n = m_->param_count();
  if (host_grads && !be_.is_host()) throw std::invalid_argument("host memory for the gradients of a model on " + be_.name());
  params_ = device_buffer<float>(be_, n);
  if (!host_grads) grads_ = device_buffer<float>(be_, n);
  grads_at_ = host_grads ? host_grads : grads_.data();
  m1_ = device_buffer<float>(be_, n);
  if (opt_.kind == optimizer_config::adam) m2_ = device_buffer<float>(be_, n);
  for (const model::entry& e : m_->layers()) {
    std::vector<const float*> pv;
    std::vector<float*> gv;
    for (size_t p = e.first_param; p < e.first_param + e.param_count; ++p) {
      pv.push_back(params_.data() + m_->params()[p].offset);
      gv.push_back(grads_at_ + m_->params()[p].offset);
    }
    pviews_.push_back(std::move(pv));
    gviews_.push_back(std::move(gv));
  }
  allocate_batch(std::max(1, max_batch));
}

// Everything whose size depends on the batch.
void network::allocate_batch(int max_batch) {
  const size_t B = size_t(max_batch);
  const shape& in = m_->input();
  input_ = in.c > 1 && !in.flat() ? device_buffer<float>(be_, B * in.size()) : device_buffer<float>();
  acts_.clear();
  work_.clear();
  size_t widest = in.size();
  for (const model::entry& e : m_->layers()) {
    acts_.emplace_back(be_, B * e.out.size());
    work_.emplace_back(be_, e.impl->workspace(e.in, e.out, int(B)));
    widest = std::max(widest, e.out.size());
  }
  dbuf_a_ = device_buffer<float>(be_, B * widest);
  dbuf_b_ = device_buffer<float>(be_, B * widest);
  max_batch_ = max_batch;
}

void network::reserve(int max_batch) {
  if (max_batch <= max_batch_) return;
  be_.synchronize();  // no kernel still uses the buffers that go
  allocate_batch(max_batch);
}

void network::set_params(const float* host) { be_.copy_in(params(), host, size() * sizeof(float)); }
void network::get_params(float* host) const { be_.copy_out(host, params_.data(), size() * sizeof(float)); }

layer_io network::io(size_t l, const float* x, int B, bool training, const sample_key& key) {
  const model::entry& e = m_->layers()[l];
  layer_io io(be_);
  io.batch = B;
  io.in = e.in;
  io.out = e.out;
  io.x = x;
  io.y = acts_[l].data();
  io.params = pviews_[l].data();
  io.grads = gviews_[l].data();
  io.work = work_[l].data();
  io.training = training;
  io.key = key;
  io.layer_index = l;
  return io;
}

// The input of layer 0: x itself, or its channels-last copy when it has several channels.
const float* network::forward(const float* x, int B, bool training, const sample_key& key) {
  const shape& in = m_->input();
  if (input_.data()) {
    be_.nchw_to_nhwc(input_.data(), x, B, in.c, in.h, in.w);
    x = input_.data();
  }
  const float* first = x;
  for (size_t l = 0; l < m_->layers().size(); ++l) {
    m_->layers()[l].impl->forward(io(l, x, B, training, key));
    x = acts_[l].data();
  }
  return first;
}

batch_metrics network::forward_backward(const float* x, const int32_t* y, int B, float grad_scale, sample_key key,
                                        const std::function<void(size_t)>& ready) {
  batch_metrics m;
  m.count = B;
  const float* x0 = forward(x, B, true, key);
  const size_t L = m_->layers().size();
  float* dout = dbuf_a_.data();
  float* dnext = dbuf_b_.data();
  be_.softmax_xent(dout, acts_[L - 1].data(), y, B, m_->classes(), grad_scale);
  for (size_t l = L; l-- > 0;) {
    const float* in = l ? acts_[l - 1].data() : x0;
    m_->layers()[l].impl->backward(io(l, in, B, true, key), dout, l ? dnext : nullptr);
    std::swap(dout, dnext);
    if (ready && m_->layers()[l].param_count) ready(m_->params()[m_->layers()[l].first_param].offset);
  }
  be_.take_metrics(&m.loss_sum, &m.correct);  // on a GPU: the one wait, with the whole step queued
  return m;
}

batch_metrics network::evaluate(const float* x, const int32_t* y, int B) {
  batch_metrics m;
  m.count = B;
  forward(x, B, false, sample_key{});
  be_.softmax_xent(nullptr, acts_[m_->layers().size() - 1].data(), y, B, m_->classes(), 0.0f);
  be_.take_metrics(&m.loss_sum, &m.correct);
  return m;
}

void network::save_state(network_state* out) const {
  const size_t n = size();
  out->steps = step_;
  out->params.resize(n);
  out->m1.resize(n);
  out->m2.resize(m2_.data() ? n : 0);
  get_params(out->params.data());
  be_.copy_out(out->m1.data(), m1_.data(), n * sizeof(float));
  if (m2_.data()) be_.copy_out(out->m2.data(), m2_.data(), n * sizeof(float));
}

void network::read_state(const std::function<void(int part, const float* p, size_t n)>& take) const {
  constexpr size_t kPiece = size_t(1) << 20;
  const size_t n = size();
  std::vector<float> buf(be_.is_host() ? 0 : std::min(n, kPiece));
  const float* parts[] = {params_.data(), m1_.data(), m2_.data()};
  for (int p = 0; p < 3 && parts[p]; ++p)
    for (size_t at = 0; at < n; at += kPiece) {
      const size_t k = std::min(kPiece, n - at);
      if (be_.is_host()) {
        take(p, parts[p] + at, k);
      } else {
        be_.copy_out(buf.data(), parts[p] + at, k * sizeof(float));
        take(p, buf.data(), k);
      }
    }
}

bool network::load_state(const network_state& s, std::string* error) {
  const size_t n = size(), moments = m2_.data() ? n : 0;
  if (s.params.size() != n || s.m1.size() != n || s.m2.size() != moments || s.steps < 0) {
    *error = "the state holds " + std::to_string(s.params.size()) + "/" + std::to_string(s.m1.size()) + "/" +
             std::to_string(s.m2.size()) + " floats (parameters/first/second moment), this network needs " +
             std::to_string(n) + "/" + std::to_string(n) + "/" + std::to_string(moments);
    return false;
  }
  set_params(s.params.data());
  be_.copy_in(m1_.data(), s.m1.data(), n * sizeof(float));
  if (moments) be_.copy_in(m2_.data(), s.m2.data(), n * sizeof(float));
  step_ = s.steps;
  return true;
}

void network::apply(const float* g) {
  apply_part(g, 0, size());
  end_step();
}

void network::apply_part(const float* g, size_t lo, size_t hi) {
  if (lo >= hi || hi > size()) return;
  const size_t n = hi - lo;
  if (opt_.kind == optimizer_config::adam)
    be_.adam_update(params() + lo, m1_.data() + lo, m2_.data() + lo, g + lo, n, opt_.lr, opt_.beta1, opt_.beta2,
                    opt_.eps, step_ + 1);
  else
    be_.sgd_update(params() + lo, m1_.data() + lo, g + lo, n, opt_.lr, opt_.momentum);
}

}  // namespace ringmaster
