// libFuzzer harness: a received multipart message as the bridge sees it (net/wire.hpp's check_message:
// frame count, header, payload size, the answer to another version's hello), key=value payloads and step
// records (actors/report_kv.hpp).
//
// Input: byte 0 = number of frames (mod 4), byte 1 = length of the header frame (cut to what is there),
// then the header frame's bytes, then the payload frame's (the rest).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <vector>

#include "actors/report_kv.hpp"
#include "net/wire.hpp"
#include "tests/fuzz/fuzz_util.hpp"

using namespace ringmaster;
using fuzz::require;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const size_t count = data[0] % 4;
  const size_t header_size = std::min<size_t>(data[1], size - 2);
  // Each frame in an allocation of its own size, so that ASan sees a read past either frame's end.
  const std::vector<uint8_t> header(data + 2, data + 2 + header_size), body(data + 2 + header_size, data + size);
  const wire::frame frames[2] = {{header.data(), header.size()}, {body.data(), body.size()}};

  wire::header h;
  std::string err;
  const wire::verdict v = wire::check_message(frames, count, &h, &err);
  require((v == wire::verdict::accept) == err.empty(), "a refusal says why, an accepted message has no error", err);
  uint16_t version = 0, type = 0;
  const bool peeked = wire::peek_version(header.data(), header.size(), &version, &type);
  if (v == wire::verdict::accept) {
    // Every header field is read and written back: the frame comes back byte for byte.
    const wire::header_bytes again = wire::encode(h);
    require(header.size() == wire::kHeaderSize && std::memcmp(again.data(), header.data(), header.size()) == 0,
            "an accepted header encodes back to its frame");
    require(h.payload_bytes == (count == 2 ? body.size() : 0), "payload_bytes is the payload frame's size");
    require(!wire::is_tensor_type(h.type) || h.elements * sizeof(float) == h.payload_bytes, "tensor sizes agree");
    require(wire::validate(h, &err), "an accepted header validates", err);
    require(peeked && version == wire::kProtocolVersion, "an accepted header has our version");
  }
  if (v == wire::verdict::answer_version || v == wire::verdict::other_version)
    require(peeked && version != wire::kProtocolVersion, "a version mismatch has another version");
  if (v == wire::verdict::answer_version) require(type == uint16_t(wire::msg_type::hello), "only a hello is answered");

  // The payload as key=value text: what decodes encodes, and decodes to the same map.
  wire::kv_map kv, back;
  const std::string_view text(reinterpret_cast<const char*>(body.data()), body.size());
  if (wire::decode_kv(text, &kv, &err)) {
    std::string encoded;
    require(wire::encode_kv(kv, &encoded, &err), "decoded key=value pairs encode", err);
    require(encoded.size() == text.size(), "key=value text keeps its size");
    require(wire::decode_kv(encoded, &back, &err) && back == kv, "key=value round trip", err);
  }
  // The payload as step records: what decodes encodes back to the same bytes (every bit is read).
  std::vector<step_report> steps;
  err.clear();
  if (decode_steps(body.data(), body.size(), &steps, &err)) {
    require(encode_steps(steps.data(), steps.size()) == text, "step records round trip");
  } else {
    require(!err.empty(), "a refused step record says why");
  }
  return 0;
}
