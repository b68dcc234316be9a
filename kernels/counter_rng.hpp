// A counter-based random number: a pure function of its key, the same on the CPU and on a GPU, so a
// dropout mask depends only on (seed, layer, epoch, sample, element) and never on which replica or how
// many replicas draw it. SplitMix64's finalizer over the mixed key.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define RM_HOST_DEVICE __host__ __device__
#else
#define RM_HOST_DEVICE
#endif

namespace ringmaster {

RM_HOST_DEVICE inline uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The stream of one layer in one epoch; then one draw per (sample, element).
RM_HOST_DEVICE inline uint64_t dropout_stream(uint64_t seed, uint64_t layer, int64_t epoch) {
  return mix64(mix64(mix64(seed) ^ layer) ^ uint64_t(epoch));
}

// Uniform in [0, 1) with 24 random bits (exact in float).
RM_HOST_DEVICE inline float uniform01(uint64_t stream, int64_t sample, uint64_t element) {
  const uint64_t r = mix64(mix64(stream ^ uint64_t(sample)) ^ element);
  return float(r >> 40) * (1.0f / 16777216.0f);
}

}  // namespace ringmaster
