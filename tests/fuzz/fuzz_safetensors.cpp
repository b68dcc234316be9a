// libFuzzer harness: safetensors weights (kernels/safetensors.hpp's read_safetensors_bytes) for two small
// models, an MLP (4-3-2) and a conv net whose kernels have four dimensions.
//
// Input: byte 0 picks the model (bit 0), the rest is the file.
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/safetensors.hpp"
#include "tests/fuzz/fuzz_util.hpp"

using namespace ringmaster;
using fuzz::require;

namespace {

std::shared_ptr<const model> make(const std::string& text, const shape& input) {
  std::string err;
  auto m = build_model(text, input, &err);
  require(m != nullptr, "the harness's model builds", err);
  return m;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::shared_ptr<const model> mlp = make(fuzz::kMlpModel, shape{4, 1, 1});
  static const std::shared_ptr<const model> conv = make(fuzz::kConvModel, shape{1, 4, 4});
  if (size < 1) return 0;
  const model& m = (data[0] & 1) ? *conv : *mlp;
  std::vector<float> params;
  std::string err;
  const bool ok = read_safetensors_bytes("fuzz", data + 1, size - 1, m, &params, &err);
  require(ok == err.empty(), "a refusal says why, a read file has no error", err);
  if (ok) require(params.size() == m.param_count(), "every parameter is read");
  return 0;
}
