#include "kernels/dataset.hpp"

#include <zlib.h>

#include <random>

namespace ringmaster {
namespace {

uint32_t be32(const uint8_t* p) { return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3]; }

// Reads the whole (possibly gzip-compressed) file; zlib reads uncompressed files transparently.
bool slurp(const std::string& path, std::vector<uint8_t>* out, std::string* error) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) {
    *error = path + ": cannot open file";
    return false;
  }
  out->clear();
  std::vector<uint8_t> chunk(1 << 20);
  for (;;) {
    int n = gzread(f, chunk.data(), unsigned(chunk.size()));
    if (n < 0) {
      int code = 0;
      const char* msg = gzerror(f, &code);
      *error = path + ": corrupt or unreadable gzip data (" + msg + ")";
      gzclose(f);
      return false;
    }
    if (n == 0) break;
    out->insert(out->end(), chunk.begin(), chunk.begin() + n);
    if (out->size() > (size_t(4) << 30)) {
      *error = path + ": larger than 4 GiB, not an MNIST-style file";
      gzclose(f);
      return false;
    }
  }
  int code = 0;
  const char* msg = gzerror(f, &code);
  if (code != Z_OK && code != Z_BUF_ERROR) {
    *error = path + ": corrupt or truncated gzip data (" + msg + ")";
    gzclose(f);
    return false;
  }
  gzclose(f);
  return true;
}

bool exists(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f) std::fclose(f);
  return f != nullptr;
}

}  // namespace

bool read_idx(const std::string& path, int expect_dims, std::vector<uint32_t>* dims,
              std::vector<uint8_t>* data, std::string* error) {
  std::vector<uint8_t> raw;
  if (!slurp(path, &raw, error)) return false;
  if (raw.size() < 4) {
    *error = path + ": truncated: " + std::to_string(raw.size()) + " bytes, too short for an IDX header";
    return false;
  }
  // Magic: two zero bytes, type 0x08 (unsigned byte), number of dimensions.
  if (raw[0] != 0 || raw[1] != 0 || raw[2] != 0x08 || raw[3] != expect_dims) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "0x%02x%02x%02x%02x", raw[0], raw[1], raw[2], raw[3]);
    char want[16];
    std::snprintf(want, sizeof want, "0x000008%02x", expect_dims);
    *error = path + ": wrong magic " + buf + " (expected " + want + ": unsigned bytes, " +
             std::to_string(expect_dims) + " dimension" + (expect_dims > 1 ? "s)" : ")");
    return false;
  }
  const size_t header = 4 + 4 * size_t(expect_dims);
  if (raw.size() < header) {
    *error = path + ": truncated header (" + std::to_string(raw.size()) + " of " + std::to_string(header) +
             " bytes)";
    return false;
  }
  dims->clear();
  size_t total = 1;
  for (int i = 0; i < expect_dims; ++i) {
    uint32_t d = be32(raw.data() + 4 + 4 * i);
    if (d == 0) {
      *error = path + ": dimension " + std::to_string(i) + " is zero";
      return false;
    }
    dims->push_back(d);
    total *= d;
    if (total > (size_t(4) << 30)) {
      *error = path + ": dimensions describe more than 4 GiB of data";
      return false;
    }
  }
  const size_t have = raw.size() - header;
  if (have < total) {
    *error = path + ": truncated: header promises " + std::to_string(total) + " data bytes, file has " +
             std::to_string(have);
    return false;
  }
  if (have > total) {
    *error = path + ": inconsistent: " + std::to_string(have - total) +
             " bytes beyond what the header's dimensions describe";
    return false;
  }
  data->assign(raw.begin() + header, raw.end());
  return true;
}

bool load_mnist(const std::string& dir, const std::string& prefix, int classes, dataset* out,
                std::string* error) {
  auto find = [&](const std::string& name) {
    std::string p = dir + "/" + name;
    return exists(p) ? p : (exists(p + ".gz") ? p + ".gz" : std::string());
  };
  const std::string img_name = prefix + "-images-idx3-ubyte", lbl_name = prefix + "-labels-idx1-ubyte";
  std::string img = find(img_name), lbl = find(lbl_name);
  if (img.empty() || lbl.empty()) {
    *error = dir + ": no " + (img.empty() ? img_name : lbl_name) + "[.gz] there (is --data the right folder?)";
    return false;
  }
  std::vector<uint32_t> idims, ldims;
  std::vector<uint8_t> ibytes, lbytes;
  if (!read_idx(img, 3, &idims, &ibytes, error) || !read_idx(lbl, 1, &ldims, &lbytes, error)) return false;
  if (idims[0] != ldims[0]) {
    *error = img + " has " + std::to_string(idims[0]) + " images but " + lbl + " has " +
             std::to_string(ldims[0]) + " labels";
    return false;
  }
  dataset d;
  d.count = idims[0];
  d.rows = int(idims[1]);
  d.cols = int(idims[2]);
  d.labels.resize(d.count);
  for (size_t i = 0; i < d.count; ++i) {
    if (lbytes[i] >= classes) {
      *error = lbl + ": label " + std::to_string(lbytes[i]) + " at index " + std::to_string(i) +
               " is out of range for " + std::to_string(classes) + " classes";
      return false;
    }
    d.labels[i] = lbytes[i];
  }
  d.pixels.resize(ibytes.size());
  for (size_t i = 0; i < ibytes.size(); ++i) d.pixels[i] = float(ibytes[i]) * (1.0f / 255.0f);
  *out = std::move(d);
  return true;
}

void truncate(dataset& d, size_t n) {
  if (n >= d.count) return;
  d.count = n;
  d.pixels.resize(n * d.features());
  d.labels.resize(n);
}

std::vector<uint32_t> epoch_permutation(size_t n, uint64_t seed, int64_t epoch) {
  std::vector<uint32_t> p(n);
  for (size_t i = 0; i < n; ++i) p[i] = uint32_t(i);
  // Fisher-Yates with our own bounded draw: std::uniform_int_distribution differs between libraries.
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + uint64_t(epoch) * 0xBF58476D1CE4E5B9ull + 1);
  for (size_t i = n; i > 1; --i) {
    size_t j = size_t((unsigned __int128)rng() * i >> 64);
    std::swap(p[i - 1], p[j]);
  }
  return p;
}

}  // namespace ringmaster

namespace ringmaster {

bool make_dataset(const shape& sample, std::vector<float> features, std::vector<int32_t> labels, int classes,
                  dataset* out, std::string* error) {
  if (sample.c < 1 || sample.h < 1 || sample.w < 1 || sample.size() > (size_t(1) << 26)) {
    *error = "bad sample shape " + sample.str();
    return false;
  }
  if (labels.empty() || features.size() != labels.size() * sample.size()) {
    *error = std::to_string(features.size()) + " feature values for " + std::to_string(labels.size()) +
             " labels of samples " + sample.str() + " (expected " + std::to_string(labels.size() * sample.size()) + ")";
    return false;
  }
  for (size_t i = 0; i < labels.size(); ++i)
    if (labels[i] < 0 || labels[i] >= classes) {
      *error = "label " + std::to_string(labels[i]) + " of sample " + std::to_string(i) + " is not in 0.." +
               std::to_string(classes - 1);
      return false;
    }
  out->count = labels.size();
  out->channels = sample.c;
  out->rows = sample.h;
  out->cols = sample.w;
  out->pixels = std::move(features);
  out->labels = std::move(labels);
  return true;
}

}  // namespace ringmaster
