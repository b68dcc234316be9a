// Float64 reference code shared by test_layers.cpp and test_models.cpp: the built-in registry, random
// test data, and every built-in layer (and a whole model of them) computed in double with Keras/TensorFlow
// semantics, samples channels-last (h, w, c).
#pragma once
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/counter_rng.hpp"
#include "kernels/layers.hpp"
#include "kernels/model.hpp"
#include "kernels/registry.hpp"
#include "tests/test_util.hpp"  // randv

namespace ringmaster::test {

using dvec = std::vector<double>;

inline const layer_registry& builtins() {
  static const layer_registry reg = layer_registry::with_builtins();
  return reg;
}

inline dvec to_d(const std::vector<float>& v) { return dvec(v.begin(), v.end()); }

// ---- float64 references (TensorFlow semantics; samples channels-last (h, w, c)) ------------------------

inline dvec ref_dense(const dvec& x, const dvec& w, const dvec& b, int B, int IN, int OUT) {
  dvec y(size_t(B) * OUT);
  for (int i = 0; i < B; ++i)
    for (int j = 0; j < OUT; ++j) {
      double acc = b[j];
      for (int k = 0; k < IN; ++k) acc += x[size_t(i) * IN + k] * w[size_t(k) * OUT + j];
      y[size_t(i) * OUT + j] = acc;
    }
  return y;
}

struct window {
  int KH = 1, KW = 1, SH = 1, SW = 1;
  bool same = false;
};

// TensorFlow's output size and leading padding along one axis.
inline void tf_axis(int in, int k, int s, bool same, int* out, int* pad) {
  if (same) {
    *out = (in + s - 1) / s;
    *pad = std::max((*out - 1) * s + k - in, 0) / 2;
  } else {
    *out = (in - k) / s + 1;
    *pad = 0;
  }
}

// Keras Conv2D: kernel (KH, KW, C, F), bias (F).
inline dvec ref_conv(const dvec& x, const dvec& k, const dvec& bias, int B, const shape& in, int F,
                     const window& g, shape* out) {
  int OH, OW, PT, PL;
  tf_axis(in.h, g.KH, g.SH, g.same, &OH, &PT);
  tf_axis(in.w, g.KW, g.SW, g.same, &OW, &PL);
  *out = shape{F, OH, OW};
  const int H = in.h, W = in.w, C = in.c;
  dvec y(size_t(B) * OH * OW * F);
  for (int b = 0; b < B; ++b)
    for (int oy = 0; oy < OH; ++oy)
      for (int ox = 0; ox < OW; ++ox)
        for (int f = 0; f < F; ++f) {
          double acc = bias[f];
          for (int kh = 0; kh < g.KH; ++kh)
            for (int kw = 0; kw < g.KW; ++kw) {
              const int iy = oy * g.SH + kh - PT, ix = ox * g.SW + kw - PL;
              if (iy < 0 || iy >= H || ix < 0 || ix >= W) continue;  // zero padding
              for (int c = 0; c < C; ++c)
                acc += x[((size_t(b) * H + iy) * W + ix) * C + c] * k[((size_t(kh) * g.KW + kw) * C + c) * F + f];
            }
          y[((size_t(b) * OH + oy) * OW + ox) * F + f] = acc;
        }
  return y;
}

// Keras MaxPooling2D, valid padding.
inline dvec ref_pool(const dvec& x, int B, const shape& in, const window& g, shape* out) {
  const int OH = (in.h - g.KH) / g.SH + 1, OW = (in.w - g.KW) / g.SW + 1, C = in.c;
  *out = shape{C, OH, OW};
  dvec y(size_t(B) * OH * OW * C);
  for (int b = 0; b < B; ++b)
    for (int oy = 0; oy < OH; ++oy)
      for (int ox = 0; ox < OW; ++ox)
        for (int c = 0; c < C; ++c) {
          double m = -1e300;
          for (int kh = 0; kh < g.KH; ++kh)
            for (int kw = 0; kw < g.KW; ++kw)
              m = std::max(m, x[((size_t(b) * in.h + oy * g.SH + kh) * in.w + ox * g.SW + kw) * C + c]);
          y[((size_t(b) * OH + oy) * OW + ox) * C + c] = m;
        }
  return y;
}

inline dvec ref_relu(dvec x) {
  for (double& v : x) v = std::max(0.0, v);
  return x;
}

// The dropout mask as documented (kernels/counter_rng.hpp, cpu_kernels.hpp): element e of global sample s
// is kept when uniform01(dropout_stream(seed, layer, epoch), s, e) >= rate.
inline bool kept(const sample_key& key, uint64_t layer, int64_t sample, size_t e, double rate) {
  return double(uniform01(dropout_stream(key.seed, layer, key.epoch), sample, e)) >= rate;
}

inline dvec ref_dropout(dvec x, int B, size_t n, double rate, const sample_key& key, uint64_t layer) {
  for (int b = 0; b < B; ++b)
    for (size_t e = 0; e < n; ++e) {
      double& v = x[size_t(b) * n + e];
      v = kept(key, layer, key.first_sample + b, e, rate) ? v / (1.0 - rate) : 0.0;
    }
  return x;
}

// Mean-free softmax cross-entropy summed over the batch.
inline double ref_xent(const dvec& z, const std::vector<int32_t>& y, int B, int C) {
  double loss = 0;
  for (int i = 0; i < B; ++i) {
    double m = -1e300, s = 0;
    for (int c = 0; c < C; ++c) m = std::max(m, z[size_t(i) * C + c]);
    for (int c = 0; c < C; ++c) s += std::exp(z[size_t(i) * C + c] - m);
    loss += std::log(s) + m - z[size_t(i) * C + y[i]];
  }
  return loss;
}

// A whole model in float64 from its layers' settings (config()), the data in NCHW as data sets give it.
// training: dropout masks from key (as forward_backward); else dropout passes everything through.
inline double ref_model_loss(const model& m, const dvec& p, const std::vector<float>& x_nchw,
                             const std::vector<int32_t>& y, int B, bool training = false, sample_key key = {}) {
  const shape in = m.input();
  dvec a(x_nchw.size());
  for (int b = 0; b < B; ++b)  // NCHW -> NHWC, written out here
    for (int c = 0; c < in.c; ++c)
      for (int h = 0; h < in.h; ++h)
        for (int w = 0; w < in.w; ++w)
          a[((size_t(b) * in.h + h) * in.w + w) * in.c + c] = x_nchw[((size_t(b) * in.c + c) * in.h + h) * in.w + w];
  for (size_t l = 0; l < m.layers().size(); ++l) {
    const model::entry& e = m.layers()[l];
    const std::string t = e.impl->type();
    const json cfg = e.impl->config();
    auto param = [&](size_t i) {
      const param_entry& pe = m.params()[e.first_param + i];
      return dvec(p.begin() + ptrdiff_t(pe.offset), p.begin() + ptrdiff_t(pe.offset + pe.count));
    };
    shape out;
    if (t == "dense") {
      a = ref_dense(a, param(0), param(1), B, int(e.in.size()), cfg["units"].get<int>());
      if (cfg.value("activation", "linear") == "relu") a = ref_relu(a);
    } else if (t == "conv2d") {
      window g{cfg["kernel"][0].get<int>(), cfg["kernel"][1].get<int>(), cfg["stride"][0].get<int>(),
               cfg["stride"][1].get<int>(), cfg["padding"] == "same"};
      a = ref_conv(a, param(0), param(1), B, e.in, cfg["filters"].get<int>(), g, &out);
      REQUIRE(out == e.out);
      if (cfg.value("activation", "linear") == "relu") a = ref_relu(a);
    } else if (t == "max_pool2d") {
      window g{cfg["size"][0].get<int>(), cfg["size"][1].get<int>(), cfg["stride"][0].get<int>(),
               cfg["stride"][1].get<int>(), false};
      a = ref_pool(a, B, e.in, g, &out);
      REQUIRE(out == e.out);
    } else if (t == "relu") {
      a = ref_relu(a);
    } else if (t == "dropout") {
      if (training) a = ref_dropout(a, B, e.in.size(), cfg["rate"].get<double>(), key, l);
    } else if (t != "flatten") {
      FAIL("no reference for layer type " << t);
    }
  }
  return ref_xent(a, y, B, m.classes());
}

}  // namespace ringmaster::test
