// The test data: the first n samples of Fashion-MNIST's "train" or "t10k" set.
#pragma once
#include <catch2/catch.hpp>
#include <memory>

#include "kernels/dataset.hpp"

namespace ringmaster::test {

inline std::shared_ptr<const dataset> load(const char* prefix, size_t n) {
  auto d = std::make_shared<dataset>();
  std::string err;
  if (!load_mnist(RINGMASTER_DATA_DIR, prefix, 10, d.get(), &err)) FAIL(err);
  truncate(*d, n);
  return d;
}

}  // namespace ringmaster::test
