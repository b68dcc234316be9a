// layer_bench: where a model's training step spends its time on the CPU, one layer at a time, on one
// thread (a replica's view). For each layer: forward and backward time per call (this thread's CPU time,
// so other processes on a shared machine disturb it less than wall time; median of --repeat timed blocks
// of --iters calls), share of the step, and GFLOP/s for layers with parameters (GB/s of
// input + output for the rest). Convolutions are also split into their primitives (im2col, forward GEMM,
// dW GEMM + bias, dx GEMM, col2im). The last lines time the whole step through network (forward_backward +
// Adam) against the sum of the parts.
//
//   build/layer_bench                       # the cnn, batch 64
//   build/layer_bench --model 784-512-512-10 --batch 64
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.hpp"
#include "kernels/layer.hpp"
#include "kernels/model.hpp"
#include "tools/cli.hpp"

using namespace ringmaster;

namespace {

int iters = 20, repeat = 7;

double cpu_now() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

// Median over `repeat` blocks of `iters` calls of f; seconds per call.
double time_it(const std::function<void()>& f) {
  f();  // warm caches and pages
  std::vector<double> t;
  for (int r = 0; r < repeat; ++r) {
    const double t0 = cpu_now();
    for (int i = 0; i < iters; ++i) f();
    t.push_back((cpu_now() - t0) / iters);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Keras padding for one axis: "same" pads (out - 1) * s + k - in, the smaller half first.
int pad_before(int in, int out, int k, int s) { return std::max((out - 1) * s + k - in, 0) / 2; }

struct row {
  std::string name, what;
  double secs = 0, flops = 0, bytes = 0;
};

void print(const row& r, double step) {
  std::printf("  %-14s %-22s %9.1f %6.1f%%", r.name.c_str(), r.what.c_str(), r.secs * 1e6, 100 * r.secs / step);
  if (r.flops > 0) std::printf(" %8.1f GFLOP/s", r.flops / r.secs * 1e-9);
  else if (r.bytes > 0) std::printf(" %8.1f GB/s   ", r.bytes / r.secs * 1e-9);
  std::printf("\n");
}

int run(int argc, char** argv) {
  std::string text = "cnn";
  int B = 64;
  shape input{1, 28, 28};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) std::fprintf(stderr, "layer_bench: %s needs a value\n", a.c_str()), std::exit(2);
      return argv[++i];
    };
    auto number = [&](long long lo, long long hi, int* out) { return cli::number_flag("layer_bench", a, next(), lo, hi, out); };
    if (a == "--model") text = next();
    else if (a == "--batch") {
      if (!number(1, 65536, &B)) return 2;
    } else if (a == "--iters") {
      if (!number(1, 1000000, &iters)) return 2;
    } else if (a == "--repeat") {
      if (!number(1, 1000, &repeat)) return 2;
    } else if (a == "--help" || a == "-h") {
      std::printf("usage: layer_bench [--model cnn|784-512-512-10|JSON] [--batch 64] [--iters 20] [--repeat 7]\n");
      return 0;
    } else {
      std::fprintf(stderr, "layer_bench: unknown flag %s (try --help)\n", a.c_str());
      return 2;
    }
  }
  model_desc desc;
  std::string err;
  if (!parse_model_desc(text, &desc, &err)) return std::fprintf(stderr, "layer_bench: %s\n", err.c_str()), 2;
  if (desc.input_width) input = shape{desc.input_width, 1, 1};
  else if (desc.has_input_shape) input = desc.input;
  auto md = build_model(text, input, &err);
  if (!md) return std::fprintf(stderr, "layer_bench: %s\n", err.c_str()), 2;

  auto be = make_cpu_backend();  // one OpenBLAS thread, like a replica
  const auto& L = md->layers();
  std::vector<float> host = init_params(*md, 1);
  device_buffer<float> params(*be, md->param_count()), grads(*be, md->param_count());
  be->copy_in(params.data(), host.data(), host.size() * sizeof(float));
  std::mt19937 rng(1);
  std::vector<device_buffer<float>> x, work, dx;  // x[l]: input of layer l; x[L]: logits
  x.emplace_back(*be, size_t(B) * input.size());
  for (size_t i = 0; i < x[0].size(); ++i) x[0].data()[i] = float(rng() % 256) / 255.0f;
  for (const auto& e : L) {
    x.emplace_back(*be, size_t(B) * e.out.size());
    work.emplace_back(*be, std::max<size_t>(1, e.impl->workspace(e.in, e.out, B)));
    dx.emplace_back(*be, size_t(B) * e.in.size());
  }
  std::vector<device_buffer<float>> dy;  // a random upstream gradient per layer
  for (const auto& e : L) {
    dy.emplace_back(*be, size_t(B) * e.out.size());
    for (size_t i = 0; i < dy.back().size(); ++i) dy.back().data()[i] = (float(rng() % 2001) - 1000.0f) * 1e-6f;
  }
  std::vector<std::vector<const float*>> pv(L.size());
  std::vector<std::vector<float*>> gv(L.size());
  for (size_t l = 0; l < L.size(); ++l)
    for (size_t p = L[l].first_param; p < L[l].first_param + L[l].param_count; ++p) {
      pv[l].push_back(params.data() + md->params()[p].offset);
      gv[l].push_back(grads.data() + md->params()[p].offset);
    }
  auto io = [&](size_t l) {
    layer_io o(*be);
    o.batch = B, o.in = L[l].in, o.out = L[l].out, o.x = x[l].data(), o.y = x[l + 1].data();
    o.params = pv[l].data(), o.grads = gv[l].data(), o.work = work[l].data(), o.training = true;
    o.key = sample_key{1, 0, 0}, o.layer_index = l;
    return o;
  };
  for (size_t l = 0; l < L.size(); ++l) L[l].impl->forward(io(l));  // real activations for every layer

  std::vector<row> rows, detail;
  double sum = 0;
  for (size_t l = 0; l < L.size(); ++l) {
    const auto& e = L[l];
    double macs = 0;
    for (size_t p = e.first_param; p < e.first_param + e.param_count; ++p)
      macs += double(md->params()[p].count) * e.out.h * e.out.w;
    macs *= B;
    const double bytes_f = 4.0 * B * (e.in.size() + e.out.size());
    const layer_io o = io(l);
    float* dxp = l ? dx[l].data() : nullptr;  // the first layer computes no input gradient, as in network
    row f{e.name, "forward " + e.out.str(), time_it([&] { e.impl->forward(o); }), 2 * macs, bytes_f};
    // backward: dW (and dx unless first) -> 2 or 4 flops per MAC
    row b{e.name, std::string("backward") + (dxp ? "" : " (no dx)"),
          time_it([&] { e.impl->backward(o, dy[l].data(), dxp); }), (dxp ? 4 : 2) * macs, bytes_f + 4.0 * B * e.in.size()};
    sum += f.secs + b.secs;
    rows.push_back(f);
    rows.push_back(b);
    if (e.impl->type() == "conv2d") {  // the primitives conv2d_layer calls, timed one by one
      const json c = e.impl->config();
      conv_geometry g;
      g.H = e.in.h, g.W = e.in.w, g.C = e.in.c, g.KH = c["kernel"][0], g.KW = c["kernel"][1];
      g.SH = c["stride"][0], g.SW = c["stride"][1], g.OH = e.out.h, g.OW = e.out.w;
      if (c["padding"] == "same") g.PH = pad_before(g.H, g.OH, g.KH, g.SH), g.PW = pad_before(g.W, g.OW, g.KW, g.SW);
      const int M = B * g.OH * g.OW, K = int(g.patch()), N = e.out.c;
      device_buffer<float> col(*be, size_t(M) * K), dcol(*be, size_t(M) * K);
      be->im2col(col.data(), x[l].data(), g, B);
      const double gemm = 2.0 * M * K * N;
      char shp[96];
      std::snprintf(shp, sizeof shp, "%dx%dx%d", M, K, N);
      detail.push_back({e.name, "im2col", time_it([&] { be->im2col(col.data(), x[l].data(), g, B); }), 0,
                        4.0 * (double(B) * e.in.size() + double(M) * K)});
      detail.push_back({e.name, std::string("fwd GEMM ") + shp,
                        time_it([&] { be->dense_forward(x[l + 1].data(), col.data(), pv[l][0], pv[l][1], M, K, N, false); }),
                        gemm, 0});
      const double dw = time_it([&] {
        be->dense_backward(nullptr, gv[l][0], gv[l][1], dy[l].data(), col.data(), pv[l][0], M, K, N);
      });
      detail.push_back({e.name, "dW GEMM + bias", dw, gemm, 0});
      const double both = time_it([&] {
        be->dense_backward(dcol.data(), gv[l][0], gv[l][1], dy[l].data(), col.data(), pv[l][0], M, K, N);
      });
      // The first layer computes no dx in a real step; timed anyway, marked with '*'.
      detail.push_back({e.name, l ? "dx GEMM (both - dW)" : "dx GEMM (both - dW) *", std::max(1e-9, both - dw), gemm, 0});
      detail.push_back({e.name, l ? "col2im" : "col2im *", time_it([&] { be->col2im(dx[l].data(), dcol.data(), g, B); }), 0,
                        4.0 * (double(B) * e.in.size() + double(M) * K)});
    }
  }
  // The whole step, as a replica runs it (forward, softmax, backward, Adam).
  network net(*be, md, B, {});
  net.set_params(host.data());
  std::vector<int32_t> labels(static_cast<size_t>(B));
  for (auto& y : labels) y = int32_t(rng() % unsigned(md->classes()));
  const double step = time_it([&] { net.forward_backward(x[0].data(), labels.data(), B, 1.0f / B, sample_key{1, 0, 0}); });
  const double adam = time_it([&] { net.apply(net.grads()); });

  double macs = 0;
  for (const auto& e : L)
    for (size_t p = e.first_param; p < e.first_param + e.param_count; ++p)
      macs += double(md->params()[p].count) * e.out.h * e.out.w;
  std::printf("# layer_bench: %s, batch %d, one thread, CPU time, %d x %d calls per figure (median)\n", md->label().c_str(), B,
              repeat, iters);
  std::printf("  %-14s %-22s %9s %7s %s\n", "layer", "pass", "us/call", "step%", "rate");
  for (const row& r : rows) print(r, step + adam);
  std::printf("  %-14s %-22s %9.1f %6.1f%%\n", "sum", "layers", sum * 1e6, 100 * sum / (step + adam));
  std::printf("  %-14s %-22s %9.1f %6.1f%%\n", "adam", "update", adam * 1e6, 100 * adam / (step + adam));
  std::printf("  %-14s %-22s %9.1f %6.1f%%  %8.1f GFLOP/s  (%.0f samples/s on this thread, %zu params)\n",
              "network", "forward_backward+adam", (step + adam) * 1e6, 100.0, 6 * macs * B / (step + adam) * 1e-9,
              B / (step + adam), md->param_count());
  if (!detail.empty()) {
    std::printf("# conv2d primitives (GEMM shapes M x K x N; * not part of the step: the first layer has no dx)\n");
    for (const row& r : detail) print(r, step + adam);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::bad_alloc&) {  // the buffers for a --batch too large
    std::fprintf(stderr, "layer_bench: out of memory: try a smaller --batch\n");
    return 1;
  }
}
