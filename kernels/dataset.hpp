// MNIST-format data: IDX files (raw or .gz) with validation, and the per-epoch shuffle shared by
// every replica so that N replicas at global batch B see exactly the samples one replica would.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/shape.hpp"

namespace ringmaster {

// Samples of shape (channels, rows, cols), stored (count, channels, rows, cols): NCHW. IDX image files
// load as (N, 1, 28, 28); a flat feature vector of n values is (n, 1, 1).
struct dataset {
  size_t count = 0;
  int channels = 1, rows = 0, cols = 0;
  std::vector<float> pixels;     // (count, channels, rows, cols); images scaled to [0, 1]
  std::vector<int32_t> labels;   // (count)
  // Optional, for byte images (load_mnist and make_dataset fill it): the same samples as bytes, pixels[i]
  // being exactly bytes[i] * (1/255.f). Batches are gathered from these (a quarter of the memory traffic,
  // the same bits) once bytes_agree says they still hold what pixels hold: a program may have changed
  // pixels since (normalized them, say); then batches come from pixels.
  std::vector<uint8_t> bytes;
  size_t features() const { return size_t(channels) * rows * cols; }
  shape sample() const { return shape{channels, rows, cols}; }
};

// An in-memory data set from arrays a program already has: features (count, C, H, W) and labels in
// [0, classes). False with *error when the sizes disagree or a label is out of range. Features that are all
// byte images (each exactly b * (1/255.f), b in 0..255) are kept as `bytes` too.
bool make_dataset(const shape& sample, std::vector<float> features, std::vector<int32_t> labels, int classes,
                  dataset* out, std::string* error);

// Reads one IDX file (gzip or raw). expect_dims is 3 for images, 1 for labels. On failure returns
// false and *error names the file and what is wrong with it.
bool read_idx(const std::string& path, int expect_dims, std::vector<uint32_t>* dims,
              std::vector<uint8_t>* data, std::string* error);

// The same from bytes in memory, gzip-compressed (they start with 1f 8b) or raw; errors name `name`.
// read_idx reads the file and calls this, so tests and the fuzzer (tests/fuzz) need no files.
bool read_idx_bytes(const std::string& name, const void* bytes, size_t size, int expect_dims,
                    std::vector<uint32_t>* dims, std::vector<uint8_t>* data, std::string* error);

// Loads images + labels ("train" or "t10k" prefix) from dir, trying NAME then NAME.gz.
// Checks that the counts agree and that every label is below `classes`.
bool load_mnist(const std::string& dir, const std::string& prefix, int classes, dataset* out,
                std::string* error);
// Whether load_mnist's error comes from this process's state (out of memory, a bound set by its memory,
// out of file descriptors), not from the files: a try elsewhere, or later, may pass.
bool load_error_is_resource(const std::string& error);

// Whether d.bytes hold exactly the samples d.pixels hold (one pass over them).
bool bytes_agree(const dataset& d);
// Copies samples idx[0..n) into x (n, features) and y (n); from d.bytes if from_bytes (bytes_agree(d)).
void gather_samples(const dataset& d, const uint32_t* idx, size_t n, float* x, int32_t* y, bool from_bytes);

// Keeps the first n samples (for quick runs and tests).
void truncate(dataset& d, size_t n);

// A CRC-32 (zlib's) of the samples' shape, values (pixels) and labels: two data sets of one count differ
// in it (MNIST and Fashion-MNIST, or a copy that is not the same). Damage, not a forger, is what it tells;
// 0 is never returned (0 means "not known" where it is kept). About 35 ms for Fashion-MNIST's 60,000.
uint32_t data_fingerprint(const dataset& d);

// The permutation of [0, n) used in epoch `epoch`: a pure function of (seed, epoch, n).
std::vector<uint32_t> epoch_permutation(size_t n, uint64_t seed, int64_t epoch);

// Steps per epoch: every replica runs this many, so no replica waits for a batch that never comes.
// The last partial global batch of an epoch is dropped (a different remainder every epoch).
inline size_t steps_per_epoch(size_t samples, size_t global_batch) { return samples / global_batch; }

}  // namespace ringmaster
