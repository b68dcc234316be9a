// What the harnesses and the seed writer share.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <string>

namespace ringmaster::fuzz {

// A broken property is a crash, which libFuzzer reports and keeps the input of.
inline void require(bool ok, const char* what, const std::string& detail = {}) {
  if (ok) return;
  std::fprintf(stderr, "fuzz property failed: %s %s\n", what, detail.c_str());
  std::abort();
}

// The safetensors harness reads weights for these: an MLP of input (4, 1, 1) and a conv net of input
// (1, 4, 4), whose tensors are conv2d_0/kernel (3, 3, 1, 2), conv2d_0/bias (2), dense_0/kernel (8, 2)
// and dense_0/bias (2). The seed writer writes files for both.
constexpr const char* kMlpModel = "4-3-2";
constexpr const char* kConvModel =
    R"({"layers": [{"type": "conv2d", "filters": 2, "kernel": 3}, {"type": "flatten"}, {"type": "dense", "units": 2}]})";

}  // namespace ringmaster::fuzz
