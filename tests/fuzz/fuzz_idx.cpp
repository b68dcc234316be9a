// libFuzzer harness: IDX data files (kernels/dataset.hpp's read_idx_bytes), raw and gzip-compressed.
//
// Input: byte 0 picks the case: bit 0 images (3 dimensions) or labels (1); bit 1 also gzip the rest
// here, as one member or (bit 2) two, split at byte 1's share of it, so the inflating path sees valid
// streams of any content; the rest is the file. The compressed file must read exactly as the raw one.
#include <zlib.h>

#include <cstdint>
#include <vector>

#include "kernels/dataset.hpp"
#include "tests/fuzz/fuzz_util.hpp"

using namespace ringmaster;
using fuzz::require;

namespace {

void gzip_append(const uint8_t* in, size_t size, std::vector<uint8_t>* out) {
  z_stream z{};
  require(deflateInit2(&z, 1, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) == Z_OK, "deflateInit2");
  const size_t at = out->size();
  out->resize(at + deflateBound(&z, uLong(size)));
  z.next_in = const_cast<Bytef*>(in);
  z.avail_in = uInt(size);
  z.next_out = out->data() + at;
  z.avail_out = uInt(out->size() - at);
  require(deflate(&z, Z_FINISH) == Z_STREAM_END, "deflate");
  out->resize(out->size() - z.avail_out);
  deflateEnd(&z);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const int dims_wanted = (data[0] & 1) ? 3 : 1;
  const uint8_t* file = data + 2;
  const size_t file_size = size - 2;
  std::vector<uint32_t> dims;
  std::vector<uint8_t> bytes;
  std::string err;
  const bool ok = read_idx_bytes("fuzz", file, file_size, dims_wanted, &dims, &bytes, &err);
  require(ok == err.empty(), "a refusal says why, a read file has no error", err);
  if (ok) {
    size_t total = 1;
    for (uint32_t d : dims) total *= d;
    require(dims.size() == size_t(dims_wanted) && total == bytes.size(), "the data is what the dimensions say");
  }
  const bool gzipped_already = file_size >= 2 && file[0] == 0x1f && file[1] == 0x8b;
  if (!(data[0] & 2) || gzipped_already) return 0;
  std::vector<uint8_t> gz;
  const size_t split = (data[0] & 4) ? file_size * data[1] / 255 : file_size;
  gzip_append(file, split, &gz);
  if (split < file_size) gzip_append(file + split, file_size - split, &gz);
  std::vector<uint32_t> gz_dims;
  std::vector<uint8_t> gz_bytes;
  std::string gz_err;
  const bool gz_ok = read_idx_bytes("fuzz", gz.data(), gz.size(), dims_wanted, &gz_dims, &gz_bytes, &gz_err);
  require(gz_ok == ok && gz_err == err && gz_dims == dims && gz_bytes == bytes, "gzip reads as raw", gz_err);
  return 0;
}
