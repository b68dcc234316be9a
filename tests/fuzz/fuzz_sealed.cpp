// libFuzzer harness: sealed ring chunks (net/seal.hpp), as the ring port opens them.
//
// Input: byte 0 = mode, byte 1 = header length, byte 2 = where to flip a bit (mode 0) or the trailer's
// length (mode 1), then the bytes.
//   mode 0: the bytes (header, then payload) are sealed and opened again: they must come back unchanged,
//           a replay must be refused, and so must a copy with any one bit flipped (header, payload or trailer).
//   mode 1: header, trailer and payload as a stranger sends them: without the key, nothing opens.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "net/seal.hpp"
#include "tests/fuzz/fuzz_util.hpp"

using namespace ringmaster;
using fuzz::require;

namespace {

net::seal_key fixed_key() {
  net::seal_key k;
  k.fill(0x42);
  return k;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  const uint8_t mode = data[0] & 1, split = data[1], third = data[2];
  data += 3;
  size -= 3;
  const size_t hlen = std::min<size_t>(split, size);
  // Each part in an allocation of its own size, so that ASan sees a read past its end.
  const std::vector<uint8_t> header(data, data + hlen);
  std::string err;
  net::opener open(fixed_key(), 7, 0);
  if (mode == 1) {
    const size_t tlen = std::min<size_t>(third, size - hlen);
    const std::vector<uint8_t> trailer(data + hlen, data + hlen + tlen);
    std::vector<uint8_t> payload(data + hlen + tlen, data + size);
    net::trailer t;
    const bool readable = net::read_trailer(trailer.data(), trailer.size(), &t);
    require(readable == (trailer.size() == net::kTrailerBytes), "a trailer is read exactly when it has its size");
    if (readable)
      require(!open.open(header.data(), header.size(), payload.data(), payload.size(), trailer.data(), &err),
              "a message made without the key does not open");
    return 0;
  }
  const std::vector<uint8_t> plain(data + hlen, data + size);
  net::sealer seal(fixed_key(), 7, 0);
  std::vector<uint8_t> sealed(plain.size());
  uint8_t trailer[net::kTrailerBytes];
  require(seal.seal(header.data(), header.size(), plain.data(), sealed.data(), sealed.size(), trailer), "sealing works");
  // One bit flipped anywhere: refused (by a fresh opener, so that only the tag can refuse it).
  std::vector<uint8_t> h2 = header, p2 = sealed;
  uint8_t t2[net::kTrailerBytes];
  std::memcpy(t2, trailer, sizeof t2);
  const size_t total = h2.size() + p2.size() + sizeof t2;
  const size_t at = (size_t(third) * 131) % total;
  uint8_t* byte = at < h2.size() ? &h2[at] : at < h2.size() + p2.size() ? &p2[at - h2.size()] : &t2[at - h2.size() - p2.size()];
  *byte ^= uint8_t(1u << (third % 8));
  net::opener fresh(fixed_key(), 7, 0);
  require(!fresh.open(h2.data(), h2.size(), p2.data(), p2.size(), t2, &err), "a flipped bit is refused");
  // The message itself opens to what was sealed, once.
  std::vector<uint8_t> copy = sealed;
  require(open.open(header.data(), header.size(), copy.data(), copy.size(), trailer, &err), "a sealed message opens", err);
  require(copy == plain, "it opens to what was sealed");
  copy = sealed;
  require(!open.open(header.data(), header.size(), copy.data(), copy.size(), trailer, &err), "a replay is refused");
  return 0;
}
