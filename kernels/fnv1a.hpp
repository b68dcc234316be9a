// FNV-1a, 64 bits (Fowler, Noll and Vo; http://www.isthe.com/chongo/tech/comp/fnv/): the checksum of the
// final weights users compare between runs (ringmaster-mnist prints it as fnv1a64: any FNV-1a tool over
// the --save'd tensors' bytes, in order, gives the same), and a few ids. Not a cryptographic hash.
#pragma once
#include <cstddef>
#include <cstdint>

namespace ringmaster {

constexpr uint64_t kFnv1aBasis = 14695981039346656037ull;  // FNV's offset basis
constexpr uint64_t kFnv1aPrime = 1099511628211ull;

// Continues hash `h` over n bytes (start with kFnv1aBasis).
inline uint64_t fnv1a64(const void* p, size_t n, uint64_t h = kFnv1aBasis) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * kFnv1aPrime;
  return h;
}

}  // namespace ringmaster
