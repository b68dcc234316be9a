#include "kernels/dataset.hpp"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <new>
#include <random>

#include "kernels/host_memory.hpp"

namespace ringmaster {
namespace {

uint32_t be32(const uint8_t* p) { return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3]; }

// Larger files (or their contents, uncompressed) are no MNIST-style data set: 4 GiB, and at most an
// eighth of the memory this process may use (kernels/host_memory.hpp), as loading one holds it some 6
// times over (the file, its data, the floats). A gzip bomb of a few MB, or a header that lies, is
// refused before it takes the machine down. Worked out once a process: it reads /proc and the cgroup
// files, and a reader may be called for many small inputs (the fuzzer: for each).
size_t max_idx_bytes() {
  static const size_t limit = [] {
    const memory_bound usable = usable_memory();
    const size_t cap = size_t(4) << 30;
    return usable.bytes <= 0 ? cap : std::min(cap, size_t(usable.bytes / 8));
  }();
  return limit;
}

std::string too_large(size_t limit) {
  return "more than " + std::to_string(limit >> 20) + " MiB, not an MNIST-style file here (at most 4 GiB and an eighth of "
         "the memory this process may use)";
}

// Reads the whole file as it is, compressed or not: a regular file (a FIFO would hang us, /dev/zero
// never end) of at most max_idx_bytes().
bool slurp(const std::string& path, std::vector<uint8_t>* out, std::string* error) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    *error = path + ": cannot open file (" + std::strerror(errno) + ")";
    return false;
  }
  struct stat st {};
  std::string problem;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) problem = "not a regular file";
  else if (uint64_t(st.st_size) > max_idx_bytes()) problem = too_large(max_idx_bytes());
  if (problem.empty()) {
    out->resize(size_t(st.st_size));
    size_t have = 0;
    while (have < out->size()) {
      const ssize_t n = ::read(fd, out->data() + have, out->size() - have);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      have += size_t(n);
    }
    if (have != out->size()) problem = "cannot read file (it changed while read?)";
  }
  ::close(fd);
  if (problem.empty()) return true;
  *error = path + ": " + problem;
  return false;
}

// Inflates gzip data into *out: one member or several one after another (as `cat a.gz b.gz` makes),
// at most max_idx_bytes(); anything else after the last member is refused. Once the IDX header is out,
// only the data it promises is kept: what inflates beyond is only counted (*beyond), up to the same
// limit, so a small file that inflates to gigabytes takes no memory for them, and the reader refuses
// it with the words it has for a raw file that size.
bool gunzip(const std::string& name, const uint8_t* in, size_t size, std::vector<uint8_t>* out, size_t* beyond,
            std::string* error) {
  z_stream z{};
  if (inflateInit2(&z, 16 + MAX_WBITS) != Z_OK) {  // 16: gzip wrapper only
    *error = name + ": zlib cannot start inflating";
    return false;
  }
  out->clear();
  *beyond = 0;
  const size_t limit = max_idx_bytes();
  size_t fed = 0, used = 0, keep = limit;  // keep: what the header promises, once it is out
  std::vector<uint8_t> scratch;            // where the bytes beyond it go
  std::string problem;
  for (;;) {
    if (z.avail_in == 0 && fed < size) {  // avail_in is 32 bits: feed at most 1 GiB at a time
      const size_t n = std::min(size - fed, size_t(1) << 30);
      z.next_in = const_cast<Bytef*>(in + fed);
      z.avail_in = uInt(n);
      fed += n;
    }
    if (used + *beyond >= limit) {
      problem = "uncompressed, " + too_large(limit);
      break;
    }
    const bool counting = used >= keep;
    if (!counting && used == out->size())
      out->resize(std::min(keep, std::max(used * 2, std::max(size * 4, size_t(4096)))));
    if (counting && scratch.empty()) scratch.resize(size_t(1) << 16);
    uint8_t* to = counting ? scratch.data() : out->data() + used;
    const size_t room = counting ? scratch.size() : std::min(out->size() - used, size_t(1) << 30);
    z.next_out = to;
    z.avail_out = uInt(room);
    const int rc = inflate(&z, Z_NO_FLUSH);
    (counting ? *beyond : used) += room - z.avail_out;
    // The IDX header says how much data follows (a header that promises too much is the reader's to
    // refuse; nothing more is inflated for it).
    const size_t header = used >= 4 ? 4 + 4 * size_t((*out)[3]) : SIZE_MAX;
    if (keep == limit && used >= header) {
      size_t total = 1;
      for (size_t i = 0; i < (*out)[3] && total <= limit; ++i) total *= std::max<size_t>(1, be32(out->data() + 4 + 4 * i));
      if (total > limit) break;
      keep = header + total;
      if (used > keep) *beyond += used - keep, used = keep;
    }
    const size_t left = size - fed + z.avail_in;  // input not yet inflated
    if (rc == Z_STREAM_END) {
      if (left == 0) break;
      if (left >= 2 && z.next_in[0] == 0x1f && z.next_in[1] == 0x8b && inflateReset(&z) == Z_OK) continue;
      problem = std::to_string(left) + " bytes after the end of the gzip data";
      break;
    }
    if (rc == Z_BUF_ERROR && z.avail_out > 0) {  // no progress possible: the input ran out mid-stream
      problem = "truncated gzip data";
      break;
    }
    if (rc != Z_OK && rc != Z_BUF_ERROR) {
      problem = std::string("corrupt gzip data (") + (z.msg ? z.msg : zError(rc)) + ")";
      break;
    }
  }
  inflateEnd(&z);
  out->resize(used);
  if (problem.empty()) return true;
  *error = name + ": " + problem;
  return false;
}

bool exists(const std::string& path) {  // stat, not open: opening a FIFO would wait for a writer
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// The one conversion of image bytes to [0, 1]: load_mnist and the batch gather must give the same bits.
void bytes_to_unit(const uint8_t* in, size_t n, float* out) {
  for (size_t i = 0; i < n; ++i) out[i] = float(in[i]) * (1.0f / 255.0f);
}

}  // namespace

bool read_idx(const std::string& path, int expect_dims, std::vector<uint32_t>* dims,
              std::vector<uint8_t>* data, std::string* error) {
  std::vector<uint8_t> file;
  return slurp(path, &file, error) && read_idx_bytes(path, file.data(), file.size(), expect_dims, dims, data, error);
}

bool read_idx_bytes(const std::string& name, const void* bytes, size_t size, int expect_dims,
                    std::vector<uint32_t>* dims, std::vector<uint8_t>* data, std::string* error) {
  if (!bytes && size) {
    *error = name + ": no data";
    return false;
  }
  const auto* p = static_cast<const uint8_t*>(bytes);
  std::vector<uint8_t> inflated;
  size_t beyond = 0;  // gzip: data bytes inflated beyond what the header promises (not kept)
  if (size >= 2 && p[0] == 0x1f && p[1] == 0x8b) {  // gzip; an IDX file starts with two zero bytes
    if (!gunzip(name, p, size, &inflated, &beyond, error)) return false;
    p = inflated.data();
    size = inflated.size();
  }
  if (size < 4) {
    *error = name + ": truncated: " + std::to_string(size) + " bytes, too short for an IDX header";
    return false;
  }
  // Magic: two zero bytes, type 0x08 (unsigned byte), number of dimensions.
  if (p[0] != 0 || p[1] != 0 || p[2] != 0x08 || p[3] != expect_dims) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "0x%02x%02x%02x%02x", p[0], p[1], p[2], p[3]);
    char want[16];
    std::snprintf(want, sizeof want, "0x000008%02x", expect_dims);
    *error = name + ": wrong magic " + buf + " (expected " + want + ": unsigned bytes, " +
             std::to_string(expect_dims) + " dimension" + (expect_dims > 1 ? "s)" : ")");
    return false;
  }
  const size_t header = 4 + 4 * size_t(expect_dims);
  if (size < header) {
    *error = name + ": truncated header (" + std::to_string(size) + " of " + std::to_string(header) +
             " bytes)";
    return false;
  }
  dims->clear();
  size_t total = 1;
  for (int i = 0; i < expect_dims; ++i) {
    uint32_t d = be32(p + 4 + 4 * i);
    if (d == 0) {
      *error = name + ": dimension " + std::to_string(i) + " is zero";
      return false;
    }
    dims->push_back(d);
    total *= d;
    if (total > max_idx_bytes()) {
      *error = name + ": its dimensions describe " + too_large(max_idx_bytes());
      return false;
    }
  }
  const size_t have = size - header + beyond;
  if (have < total) {
    *error = name + ": truncated: header promises " + std::to_string(total) + " data bytes, file has " +
             std::to_string(have);
    return false;
  }
  if (have > total) {
    *error = name + ": inconsistent: " + std::to_string(have - total) +
             " bytes beyond what the header's dimensions describe";
    return false;
  }
  data->assign(p + header, p + size);
  return true;
}

namespace {

bool load_files(const std::string& dir, const std::string& prefix, int classes, dataset* out, std::string* error) {
  auto find = [&](const std::string& name) {
    std::string p = dir + "/" + name;
    return exists(p) ? p : (exists(p + ".gz") ? p + ".gz" : std::string());
  };
  const std::string img_name = prefix + "-images-idx3-ubyte", lbl_name = prefix + "-labels-idx1-ubyte";
  std::string img = find(img_name), lbl = find(lbl_name);
  if (img.empty() || lbl.empty()) {
    struct stat st {};
    *error = ::stat(dir.c_str(), &st) == 0 && !S_ISDIR(st.st_mode) ? dir + " is a file, not a folder of IDX files"
                                                                    : dir + ": no " + (img.empty() ? img_name : lbl_name) + "[.gz] there (is --data the right folder?)";
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
  bytes_to_unit(ibytes.data(), ibytes.size(), d.pixels.data());
  d.bytes = std::move(ibytes);
  *out = std::move(d);
  return true;
}

}  // namespace

bool load_error_is_resource(const std::string& error) {
  const std::string bound = too_large(0);
  if (error.find(": out of memory loading the ") != std::string::npos || error.find(bound.substr(bound.find(" MiB, "))) != std::string::npos)
    return true;  // (that bound is an eighth of this process's memory)
  for (int e : {EMFILE, ENFILE, ENOMEM}) {
    std::string said = "(";
    said += std::strerror(e);
    said += ')';
    if (error.find(said) != std::string::npos) return true;
  }
  return false;
}

bool load_mnist(const std::string& dir, const std::string& prefix, int classes, dataset* out, std::string* error) {
  try {  // the limits above keep a data set under an eighth of the memory; what else runs may still take it
    return load_files(dir, prefix, classes, out, error);
  } catch (const std::bad_alloc&) {
    *error = dir + ": out of memory loading the " + prefix + " set";
    try {  // the memory freed by the failed load is likely back; if not, the plain message stays
      rlimit as{};
      const bool capped = getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY;
      const memory_bound b = usable_memory();
      std::string why = b.bytes > 0 ? describe(b) : "";
      if (capped) why += (why.empty() ? "" : ", and ") + std::string("an address-space limit (ulimit -v) of ") + std::to_string(uint64_t(as.rlim_cur) >> 20) + " MiB";
      if (!why.empty()) *error += " (the bound: " + why + ")";
    } catch (...) {
    }
    return false;
  }
}

bool bytes_agree(const dataset& d) {
  if (d.bytes.size() != d.pixels.size() || d.pixels.size() != d.count * d.features()) return false;
  constexpr size_t kBlock = 4096;
  float block[kBlock];
  for (size_t at = 0; at < d.bytes.size(); at += kBlock) {
    const size_t n = std::min(kBlock, d.bytes.size() - at);
    bytes_to_unit(d.bytes.data() + at, n, block);
    if (std::memcmp(block, d.pixels.data() + at, n * sizeof(float)) != 0) return false;
  }
  return true;
}

void gather_samples(const dataset& d, const uint32_t* idx, size_t n, float* x, int32_t* y, bool from_bytes) {
  const size_t f = d.features();
  from_bytes = from_bytes && d.bytes.size() == d.pixels.size();
  const size_t row = from_bytes ? f : f * sizeof(float);
  const auto* base = from_bytes ? static_cast<const char*>(static_cast<const void*>(d.bytes.data()))
                                : static_cast<const char*>(static_cast<const void*>(d.pixels.data()));
  constexpr size_t ahead = 4;  // rows are random and short: ask for row i+4 while copying row i (24 -> 15 us)
  for (size_t i = 0; i < n; ++i) {
    if (i + ahead < n)
      for (size_t k = 0; k < row; k += 64) __builtin_prefetch(base + idx[i + ahead] * row + k);
    const size_t s = idx[i];
    if (from_bytes)
      bytes_to_unit(d.bytes.data() + s * f, f, x + i * f);
    else
      std::memcpy(x + i * f, d.pixels.data() + s * f, f * sizeof(float));
    y[i] = d.labels[s];
  }
}

uint32_t data_fingerprint(const dataset& d) {
  uLong crc = crc32(0L, Z_NULL, 0);
  const auto add = [&crc](const void* p, size_t n) {
    for (auto* b = static_cast<const Bytef*>(p); n > 0;) {  // zlib takes at most 4 GiB a call
      const uInt k = uInt(std::min<size_t>(n, size_t(1) << 30));
      crc = crc32(crc, b, k);
      b += k, n -= k;
    }
  };
  const uint64_t head[4] = {uint64_t(d.count), uint64_t(d.channels), uint64_t(d.rows), uint64_t(d.cols)};
  add(head, sizeof head);
  add(d.pixels.data(), d.pixels.size() * sizeof(float));
  add(d.labels.data(), d.labels.size() * sizeof(int32_t));
  return crc ? uint32_t(crc) : 1;
}

void truncate(dataset& d, size_t n) {
  if (n >= d.count) return;
  if (d.bytes.size() == d.pixels.size())
    d.bytes.resize(n * d.features());
  else
    d.bytes.clear();  // they did not hold the samples pixels hold: padding them would make it look so
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
namespace {

// The bytes behind features that are all byte images (v == b * (1/255.f), bit for bit); else empty.
std::vector<uint8_t> as_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    if (!(v[i] >= 0.0f && v[i] <= 1.0f)) return {};
    b[i] = uint8_t(v[i] * 255.0f + 0.5f);
    float back;
    bytes_to_unit(&b[i], 1, &back);
    if (std::memcmp(&back, &v[i], sizeof back) != 0) return {};
  }
  return b;
}

}  // namespace

bool make_dataset(const shape& sample, std::vector<float> features, std::vector<int32_t> labels, int classes,
                  dataset* out, std::string* error) {
  if (sample.c < 1 || sample.h < 1 || sample.w < 1 || sample.size() > (size_t(1) << 26)) {
    *error = "bad sample shape " + sample.str();
    return false;
  }
  if (labels.empty()) {
    *error = "no samples (no labels)";
    return false;
  }
  if (classes < 1) {
    *error = "classes must be at least 1, not " + std::to_string(classes);
    return false;
  }
  if (features.size() != labels.size() * sample.size()) {
    *error = std::to_string(features.size()) + " feature values for " + std::to_string(labels.size()) +
             " labels of samples " + sample.str() + " (expected " + std::to_string(labels.size() * sample.size()) + ")";
    return false;
  }
  // A NaN or infinite input makes every loss after it NaN: named here, not as "too high a learning rate".
  if (auto bad = std::find_if(features.begin(), features.end(), [](float x) { return !std::isfinite(x); }); bad != features.end()) {
    const size_t at = size_t(bad - features.begin());
    *error = "feature value " + std::to_string(at % sample.size()) + " of sample " + std::to_string(at / sample.size()) + " is " +
             (std::isnan(*bad) ? "NaN" : "infinite");
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
  out->bytes = as_bytes(features);
  out->pixels = std::move(features);
  out->labels = std::move(labels);
  return true;
}

}  // namespace ringmaster
