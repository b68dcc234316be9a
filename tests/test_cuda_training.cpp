// GPU training against CPU training from the same parameters (layer by layer, step by step), a whole
// local job on GPU replicas against the same job on CPUs, and the ring summing GPU buffers. Part of
// ringmaster_cuda_tests (main in test_cuda.cpp: without a GPU it exits 77, reported as skipped).
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "actors/local_ring.hpp"
#include "actors/training.hpp"
#include "cuda_test_util.hpp"
#include "kernels/backend.hpp"
#include "kernels/counter_rng.hpp"
#include "kernels/layers.hpp"
#include "kernels/model.hpp"

using namespace ringmaster;
using namespace ringmaster::test;

namespace {

// max |got - want| / max |want| over a whole tensor: how far apart two computations of it are relative to
// its scale (infinite when got holds a non-finite value). Rounding differences of long sums are
// proportional to the sizes of their terms, not of their result, so this is the measure for results of
// many summed terms (a gradient) where an elementwise one would rate near-cancelled entries.
double normwise(const std::vector<float>& got, const std::vector<float>& want) {
  REQUIRE(got.size() == want.size());
  double d = 0, m = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i]) && std::isfinite(want[i])) return INFINITY;
    d = std::max(d, std::abs(double(got[i]) - double(want[i])));
    m = std::max(m, std::abs(double(want[i])));
  }
  return m > 0 ? d / m : (d > 0 ? INFINITY : 0.0);
}

// What a model's layers make of one batch, layer by layer, run through the layer API on a backend as
// network::forward runs them (the same parameter layout, workspaces and sample key): to see where the CPU
// and the GPU part ways, and why.
struct layer_trace {
  std::vector<std::vector<float>> out;    // per layer: its output (B, out)
  std::vector<std::vector<int32_t>> arg;  // per max_pool2d layer: where each maximum was; others empty
};

layer_trace trace_forward(backend& be, const model& m, const std::vector<float>& params, const std::vector<float>& x,
                          int B, const sample_key& key) {
  layer_trace t;
  device_buffer<float> p(be, params.size()), in(be, x.size()), nhwc;
  be.copy_in(p.data(), params.data(), params.size() * sizeof(float));
  be.copy_in(in.data(), x.data(), x.size() * sizeof(float));
  const float* cur = in.data();
  const shape& s = m.input();
  if (s.c > 1 && !s.flat()) {  // as network::forward: an input with several channels goes channels-last
    nhwc = device_buffer<float>(be, x.size());
    be.nchw_to_nhwc(nhwc.data(), in.data(), B, s.c, s.h, s.w);
    cur = nhwc.data();
  }
  std::vector<device_buffer<float>> outs, works;
  for (size_t l = 0; l < m.layers().size(); ++l) {
    const model::entry& e = m.layers()[l];
    outs.emplace_back(be, size_t(B) * e.out.size());
    works.emplace_back(be, e.impl->workspace(e.in, e.out, B));
    std::vector<const float*> pv;
    std::vector<float*> gv(e.param_count + 1, nullptr);  // forward writes no gradient
    for (size_t k = e.first_param; k < e.first_param + e.param_count; ++k) pv.push_back(p.data() + m.params()[k].offset);
    pv.push_back(nullptr);
    layer_io io{be};
    io.batch = B;
    io.in = e.in;
    io.out = e.out;
    io.x = cur;
    io.y = outs.back().data();
    io.params = pv.data();
    io.grads = gv.data();
    io.work = works.back().data();
    io.training = true;
    io.key = key;
    io.layer_index = l;
    e.impl->forward(io);
    std::vector<float> h(outs.back().size());
    be.copy_out(h.data(), outs.back().data(), h.size() * sizeof(float));
    t.out.push_back(std::move(h));
    std::vector<int32_t> a;
    if (e.impl->type() == "max_pool2d") {  // its workspace starts with the recorded maxima
      a.resize(size_t(B) * e.out.size());
      be.copy_out(a.data(), works.back().data(), a.size() * sizeof(int32_t));
    }
    t.arg.push_back(std::move(a));
    cur = outs.back().data();
  }
  be.synchronize();
  return t;
}

// A layer whose output passed a ReLU: the relu layer, or a layer with a fused one (activation "relu").
bool relu_output(const layer& l) {
  if (l.type() == "relu") return true;
  const json c = l.config();
  return c.is_object() && c.contains("activation") && c["activation"] == "relu";
}

// Where two runs of one batch from the same parameters sit on opposite sides of a discontinuity of the
// backward pass: a ReLU output that is zero on one side and positive on the other, or a max-pool window
// whose maximum is another element (two values equal within rounding). The forward values still agree
// (both functions are continuous there; the traces are compared first), but that sample's gradient
// legitimately differs by far more than rounding: a discrete flip, not a wrong kernel.
struct flip_report {
  std::vector<char> sample;  // per sample: it has a flip
  size_t samples = 0, places = 0;
  std::string first;  // the first flip, described
};

flip_report find_flips(const model& m, const layer_trace& c, const layer_trace& g, int B) {
  flip_report f;
  f.sample.assign(size_t(B), 0);
  for (size_t l = 0; l < m.layers().size(); ++l) {
    const model::entry& e = m.layers()[l];
    const bool relu = relu_output(*e.impl), pool = !c.arg[l].empty();
    if (!relu && !pool) continue;
    const size_t per = e.out.size();
    for (size_t i = 0; i < size_t(B) * per; ++i) {
      const bool flip = relu ? (c.out[l][i] > 0.0f) != (g.out[l][i] > 0.0f) : c.arg[l][i] != g.arg[l][i];
      if (!flip) continue;
      const size_t b = i / per;
      ++f.places;
      if (!f.sample[b]) f.sample[b] = 1, ++f.samples;
      if (f.first.empty()) {
        std::ostringstream s;
        s << e.name << ", sample " << b << ", element " << i % per << ": ";
        if (relu) s << "output CPU " << c.out[l][i] << ", GPU " << g.out[l][i];
        else s << "maximum at CPU " << c.arg[l][i] << ", GPU " << g.arg[l][i] << " (value " << c.out[l][i] << ")";
        f.first = s.str();
      }
    }
  }
  return f;
}

// Samples with a valid label whose logits' first maximum differs: their hit counts on one side only.
int64_t argmax_flips(const std::vector<float>& c, const std::vector<float>& g, const std::vector<int32_t>& labels,
                     int C) {
  int64_t n = 0;
  auto argmax = [C](const float* z) {
    int a = 0;
    for (int k = 1; k < C; ++k)
      if (z[k] > z[a]) a = k;
    return a;
  };
  for (size_t b = 0; b < labels.size(); ++b)
    if (labels[b] >= 0 && labels[b] < C) n += argmax(&c[b * C]) != argmax(&g[b * C]);
  return n;
}

struct twin_case {
  std::string model;
  shape input;
  optimizer_config::kind_t opt;
  int batch, steps;
  double act_tol, grad_tol;  // normwise() bounds: each layer's forward output, each parameter's gradient
  sample_key key;            // step s uses first_sample + s * batch
};

// Trains the model on the CPU for tc.steps steps of random data, and at every step gives the GPU the same
// parameters and batch and compares, in order:
//   1. every layer's forward output (trace_forward), within act_tol: a wrong forward kernel fails here;
//   2. the rounding flips between the two forwards (find_flips): reported, and the labels of the samples
//      holding one set to -1 for this step (zero gradient on both sides, exactly), since a flipped ReLU
//      or max-pool choice legitimately changes that sample's gradient. More than a quarter of the batch
//      flipping is not rounding: that fails;
//   3. network::forward_backward: loss, hits (up to the argmax flips) and every parameter's gradient
//      within grad_tol: a wrong backward kernel fails here, at every step;
//   4. network::apply of the same (CPU) gradient with the same optimizer history: the updated parameters
//      within 1e-4: a wrong optimizer kernel fails here.
// Nothing accumulates: each step starts from the CPU's parameters, so a flip at one step cannot grow into
// a difference at a later one (which is what a comparison after N independent steps measures).
void twin_steps(const twin_case& tc) {
  // Every element must also be within 1e-2 of its counterpart (compare(), 0.1 rms floor): catches garbage
  // (an unwritten, poisoned element) too small to move the normwise figure.
  const double elementwise_tol = 1e-2;
  std::string err;
  auto m = build_model(tc.model, tc.input, &err);
  INFO(tc.model << ": " << err);
  REQUIRE(m);
  optimizer_config opt;
  opt.kind = tc.opt;
  opt.lr = tc.opt == optimizer_config::adam ? 1e-3f : 1e-2f;
  const std::string label = m->label() + (tc.opt == optimizer_config::adam ? " adam" : " sgd") + " batch " +
                            std::to_string(tc.batch);
  INFO(label);
  auto cpu_be = make_cpu_backend();
  auto gpu_be = make_backend("cuda:0", &err);
  INFO(err);
  REQUIRE(gpu_be);
  const int B = tc.batch;
  const size_t n = m->param_count(), xs = size_t(B) * m->input().size();
  double worst_act = 0, worst_grad = 0, worst_update = 0;
  std::string act_at, grad_at, first_flip;
  int flip_steps = 0, first_flip_step = -1;
  size_t masked = 0;
  {
    network cpu_net(*cpu_be, m, B, opt), gpu_net(*gpu_be, m, B, opt);
    std::vector<float> params = init_params(*m, 42);
    cpu_net.set_params(params.data());
    device_buffer<float> x(*gpu_be, xs), grad(*gpu_be, n);
    device_buffer<int32_t> y(*gpu_be, size_t(B));
    std::mt19937 rng(8);
    std::uniform_int_distribution<int> cls(0, m->classes() - 1);
    for (int step = 0; step < tc.steps; ++step) {
      INFO("step " << step);
      auto hx = randv(xs, rng, 0, 1);  // like pixels in [0, 1]
      std::vector<int32_t> hy(static_cast<size_t>(B));
      for (auto& v : hy) v = cls(rng);
      sample_key key = tc.key;
      key.first_sample += int64_t(step) * B;

      // 1. the forward pass, layer by layer
      const layer_trace tc_cpu = trace_forward(*cpu_be, *m, params, hx, B, key);
      const layer_trace tc_gpu = trace_forward(*gpu_be, *m, params, hx, B, key);
      for (size_t l = 0; l < m->layers().size(); ++l) {
        INFO("forward output of " << m->layers()[l].name);
        const double d = normwise(tc_gpu.out[l], tc_cpu.out[l]);
        if (d > worst_act) worst_act = d, act_at = m->layers()[l].name;
        CHECK(d <= tc.act_tol);
        CHECK_CLOSE_TOL(tc_gpu.out[l], tc_cpu.out[l], elementwise_tol);
      }

      // 2. knife edges
      const flip_report f = find_flips(*m, tc_cpu, tc_gpu, B);
      INFO(f.places << " rounding flips in " << f.samples << " samples; first: " << f.first);
      REQUIRE(f.samples <= size_t(B) / 4);  // more is not rounding
      if (f.samples) {
        if (!flip_steps++) first_flip_step = step, first_flip = f.first;
        masked += f.samples;
      }
      std::vector<int32_t> ym = hy;
      for (size_t b = 0; b < ym.size(); ++b)
        if (f.sample[b]) ym[b] = -1;

      // 3. forward and backward through the networks
      gpu_net.set_params(params.data());
      gpu_be->copy_in(x.data(), hx.data(), xs * sizeof(float));
      gpu_be->copy_in(y.data(), ym.data(), ym.size() * sizeof(int32_t));
      const float scale = 1.0f / float(B);
      const batch_metrics mc = cpu_net.forward_backward(hx.data(), ym.data(), B, scale, key);
      const batch_metrics mg = gpu_net.forward_backward(x.data(), y.data(), B, scale, key);
      CHECK(mg.loss_sum == Approx(mc.loss_sum).epsilon(1e-4));
      CHECK(std::abs(mg.correct - mc.correct) <= argmax_flips(tc_cpu.out.back(), tc_gpu.out.back(), ym, m->classes()));
      std::vector<float> gc(cpu_net.grads(), cpu_net.grads() + n), gg(n);
      gpu_be->copy_out(gg.data(), gpu_net.grads(), n * sizeof(float));
      for (const param_entry& p : m->params()) {
        INFO("gradient of " << p.name);
        const std::vector<float> a(gg.begin() + ptrdiff_t(p.offset), gg.begin() + ptrdiff_t(p.offset + p.count));
        const std::vector<float> b(gc.begin() + ptrdiff_t(p.offset), gc.begin() + ptrdiff_t(p.offset + p.count));
        const double d = normwise(a, b);
        if (d > worst_grad) worst_grad = d, grad_at = p.name;
        CHECK(d <= tc.grad_tol);
        CHECK_CLOSE_TOL(a, b, elementwise_tol);
      }

      // 4. the update, from the same parameters, gradient and optimizer history
      gpu_be->copy_in(grad.data(), gc.data(), n * sizeof(float));
      cpu_net.apply(cpu_net.grads());
      gpu_net.apply(grad.data());
      std::vector<float> pg(n);
      cpu_net.get_params(params.data());
      gpu_net.get_params(pg.data());
      const double d = normwise(pg, params);
      worst_update = std::max(worst_update, d);
      CHECK(d <= 1e-6);  // one update from the same inputs: a few float roundings, no sums
      CHECK_CLOSE(pg, params);
    }
  }
  std::ostringstream flips;
  if (flip_steps)
    flips << "rounding flips at " << flip_steps << " of " << tc.steps << " steps, first at step " << first_flip_step
          << " (" << first_flip << "); " << masked << " sample(s) masked out of those steps' gradient comparison";
  else
    flips << "no rounding flips";
  WARN(label << ": GPU vs CPU from the same parameters, " << tc.steps << " steps: forward worst " << worst_act
             << " (" << act_at << "), gradients worst " << worst_grad << " (" << grad_at << "), update worst "
             << worst_update << "; " << flips.str());
}

}  // namespace

TEST_CASE("training steps on the GPU match the CPU's from the same parameters", "[train]") {
  // Bounds on rounding, not on a trajectory: every step starts from the CPU's parameters. (Comparing the
  // weights after 20 steps each side took on its own measured flips, not kernels: 784-512-512-10 sgd
  // agreed to 1.8e-7..4.8e-7 per step for 9 steps, then a ReLU flipped and the runs parted by 1.5e-2.)
  // Measured on the CPU against a twin summing every dense layer sequentially in float (the worst order):
  // forward <= 1.7e-6, gradients <= 1.1e-6 normwise; a broken kernel is off by 1e-2 or more.
  const twin_case cases[] = {{"784-64-10", shape{784, 1, 1}, optimizer_config::adam, 64, 20, 1e-4, 1e-4, {}},
                             {"784-512-512-10", shape{784, 1, 1}, optimizer_config::sgd, 128, 20, 1e-4, 1e-4, {}},
                             {"100-48-33-10", shape{100, 1, 1}, optimizer_config::sgd, 37, 20, 1e-4, 1e-4, {}},
                             {"784-512-512-10", shape{784, 1, 1}, optimizer_config::adam, 128, 20, 1e-4, 1e-4, {}}};
  for (const twin_case& tc : cases) twin_steps(tc);
}

TEST_CASE("the cnn trains on the GPU as on the CPU from the same parameters, dropout on", "[train][conv]") {
  // The Keras convnet: conv 3x3 (fused ReLU), max-pool, conv, max-pool, flatten, dropout 0.5, dense; the
  // same sample key on both sides, so the same dropout masks. Its first convolution sums 86528 patch rows
  // per weight at batch 128 (sequential float: 4.4e-6 normwise), and ReLU or max-pool flips are likelier
  // than in the MLPs (find_flips handles them; the CPU twin above met one in 3 steps).
  twin_steps({"cnn", shape{1, 28, 28}, optimizer_config::adam, 128, 3, 1e-4, 1e-4, sample_key{7, 1, 0}});
  // Several input channels (the NCHW -> NHWC step), 'same' padding, a pointwise (1x1) convolution, a
  // strided 'valid' one with a fused ReLU, separate ReLU layers, dropout on an image-shaped input.
  using namespace layers;
  const std::string custom = sequential{conv2d(8, 3, 1, "same"), relu(), max_pool2d(2), conv2d(4, 1), relu(),
                                        conv2d(6, 3, 2, "valid", "relu"), dropout(0.25), flatten(), dense(10)}
                                 .text();
  twin_steps({custom, shape{3, 12, 12}, optimizer_config::sgd, 16, 3, 1e-4, 1e-4, sample_key{3, 0, 40}});
}

TEST_CASE("a whole local job with GPU replicas trains like the same job on CPUs", "[train]") {
  // Synthetic data: 640 samples of 784 features, 10 steps of 64 per epoch.
  auto data = std::make_shared<dataset>();
  data->count = 640;
  data->rows = 28;
  data->cols = 28;
  std::mt19937 rng(9);
  data->pixels = randv(data->count * data->features(), rng, 0, 1);
  data->labels.resize(data->count);
  for (size_t i = 0; i < data->count; ++i) data->labels[i] = int32_t(rng() % 10);
  auto run = [&](const std::vector<std::string>& devices) {
    train_config c;
    c.model = "784-64-10";
    c.replicas = int(devices.size());
    c.devices = devices;
    c.global_batch = 64;
    c.epochs = 2;
    c.train = data;
    c.test = data;  // exercises evaluate() on the device too
    return train(c);
  };
  train_result cpu = run({"cpu", "cpu"}), gpu = run({"cuda:0", "cuda:0"});
  INFO(gpu.error);
  REQUIRE(cpu.ok);
  REQUIRE(gpu.ok);
  CHECK(gpu.identical);
  REQUIRE(gpu.weights.size() == cpu.weights.size());
  double d = 0, m = 0;
  for (size_t i = 0; i < cpu.weights.size(); ++i) {
    d = std::max(d, std::abs(double(gpu.weights[i]) - cpu.weights[i]));
    m = std::max(m, std::abs(double(cpu.weights[i])));
  }
  WARN("local job, 2 GPU replicas vs 2 CPU replicas: max |a-b| / max |b| = " << d / m);
  CHECK(d / m <= 1e-4);
  CHECK(gpu.history.back().val_accuracy == Approx(cpu.history.back().val_accuracy).margin(2.0 / 640));
}

TEST_CASE("the ring sums GPU buffers on the GPUs: shared device, and across devices where there are several", "[ring]") {
  std::vector<std::vector<int>> layouts = {{0, 0}, {0, 0, 0}};
  if (cuda_device_count() > 1) layouts.push_back({0, 1}), layouts.push_back({1, 0, 1});
  caf::actor_system_config cfg;
  configure(cfg, 0);
  caf::actor_system sys{cfg};
  std::string err;
  for (const auto& layout : layouts) {
    const int n = int(layout.size());
    std::vector<std::unique_ptr<backend>> bes;
    for (int g : layout) {
      bes.push_back(make_backend("cuda:" + std::to_string(g), &err));
      INFO(err);
      REQUIRE(bes.back());
      CHECK(bes.back()->device() == g);
    }
    {
      local_ring ring(sys, n);
      // 5 floats: some chunks empty; 40000: copied chunks (< 64 KB each); 3000001: read in place.
      for (size_t len : {size_t(5), size_t(40000), size_t(3000001)}) {
        INFO(n << " ranks, " << len << " floats");
        std::vector<device_buffer<float>> bufs;
        std::vector<float*> ptrs;
        std::vector<backend*> devs;
        for (int r = 0; r < n; ++r) {
          bufs.emplace_back(*bes[r], len);
          ptrs.push_back(bufs.back().data());
          devs.push_back(bes[r].get());
        }
        for (int rep = 0; rep < 2; ++rep) {  // the second time reuses the reducers' staging buffers
          for (int r = 0; r < n; ++r) {
            std::vector<float> h(len);
            for (size_t i = 0; i < len; ++i) h[i] = float(r + 1) + float(i % 64);
            bes[r]->copy_in(ptrs[r], h.data(), len * sizeof(float));
          }
          REQUIRE(ring.allreduce(ptrs, len, devs) == "");
          size_t wrong = 0;
          for (int r = 0; r < n; ++r) {
            std::vector<float> h(len);
            bes[r]->copy_out(h.data(), ptrs[r], len * sizeof(float));
            for (size_t i = 0; i < len; ++i) wrong += h[i] != float(n * (n + 1) / 2) + float(n) * float(i % 64);
          }
          CHECK(wrong == 0);
        }
      }
    }  // the ring ends before the backends it staged on
  }
  // Pinned host memory for chunks that leave the process.
  auto be = make_backend("cuda:0", &err);
  REQUIRE(be);
  std::shared_ptr<void> host = be->alloc_host(1024 * sizeof(float));
  float* pinned = static_cast<float*>(host.get());
  REQUIRE(pinned);
  {
    device_buffer<float> d(*be, 1024);  // device memory goes before its backend (pinned memory need not)
    for (int i = 0; i < 1024; ++i) pinned[i] = float(i);
    be->copy(d.data(), pinned, 1024 * sizeof(float));  // copy() takes host sources too
    be->synchronize();
    std::vector<float> back(1024);
    be->copy_out(back.data(), d.data(), 1024 * sizeof(float));
    CHECK(back[1023] == 1023.0f);
  }
  be.reset();  // pinned memory outlives its backend (ZeroMQ may still hold a chunk)
  pinned[5] = 1.0f;
  host.reset();
}
