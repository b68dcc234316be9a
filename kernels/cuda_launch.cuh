// How the CUDA kernels launch: grid-stride loops sized to the device, 32-bit indices where they fit.
// Shared by the .cu files of kernels/; not part of the public API.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/cuda_kernels.hpp"

namespace ringmaster::cuda {

constexpr int threads_per_block = 256;

// Blocks for a grid-stride loop over n items: enough to fill every SM several times, no more.
inline int grid_for(const cuda_context& ctx, size_t n) {
  const size_t want = (n + threads_per_block - 1) / threads_per_block;
  const size_t cap = size_t(ctx.sm_count > 0 ? ctx.sm_count : 1) * 16;
  return int(want < cap ? (want > 0 ? want : 1) : cap);
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Kernels that split a flat index into coordinates do it in 32 bits whenever every index they form is
// below 2^31 (a 32-bit division costs a fraction of a 64-bit one); `extent` is the largest array size
// the kernel indexes. Below 2^31, i + grid stride cannot wrap a uint32_t.
inline bool fits32(size_t extent) { return extent < (size_t(1) << 31); }

// Launches KERNEL<uint32_t> or KERNEL<size_t> as a grid-stride loop over n items, then checks the launch.
#define RM_LAUNCH_INDEXED(KERNEL, ctx, n, extent, ...)                                                     \
  do {                                                                                                     \
    if (fits32(extent))                                                                                    \
      KERNEL<uint32_t><<<grid_for(ctx, n), threads_per_block, 0, (ctx).stream>>>(uint32_t(n), __VA_ARGS__); \
    else                                                                                                   \
      KERNEL<size_t><<<grid_for(ctx, n), threads_per_block, 0, (ctx).stream>>>(size_t(n), __VA_ARGS__);    \
    RM_CUDA_CHECK(cudaGetLastError());                                                                     \
  } while (0)

// for (I i = this thread's first; i < n; i += all threads)
#define RM_GRID_STRIDE(I, i, n) \
  for (I i = I(blockIdx.x) * I(blockDim.x) + threadIdx.x; i < (n); i += I(gridDim.x) * I(blockDim.x))


}  // namespace ringmaster::cuda
