#include "net/wire.hpp"

#include <cstdio>
#include <type_traits>

namespace ringmaster::wire {
namespace {

std::string hex32(uint32_t v) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08x", v);
  return b;
}

bool fail(std::string* error, std::string what) {
  if (error) *error = std::move(what);
  return false;
}

}  // namespace

const char* type_name(msg_type t) {
  switch (t) {
    case msg_type::hello: return "hello";
    case msg_type::hello_ack: return "hello_ack";
    case msg_type::job: return "job";
    case msg_type::job_ack: return "job_ack";
    case msg_type::chunk: return "chunk";
    case msg_type::report: return "report";
    case msg_type::done: return "done";
    case msg_type::weights: return "weights";
    case msg_type::heartbeat: return "heartbeat";
    case msg_type::abort: return "abort";
    case msg_type::error: return "error";
    case msg_type::bye: return "bye";
    case msg_type::start: return "start";
    case msg_type::checkpoint: return "checkpoint";
    case msg_type::pause: return "pause";
    case msg_type::reform: return "reform";
    case msg_type::steps: return "steps";
    case msg_type::weights_sum: return "weights_sum";
  }
  return "unknown";
}

bool is_known_type(uint16_t t) { return t >= kFirstType && t <= kLastType; }

bool is_tensor_type(msg_type t) {
  return t == msg_type::chunk || t == msg_type::weights || t == msg_type::checkpoint;
}

header_bytes encode(const header& h) {
  header_bytes b{};
  unsigned char* p = b.data();
  put_le<uint32_t>(p + 0, kMagic);
  put_le<uint16_t>(p + 4, h.version);
  put_le<uint16_t>(p + 6, static_cast<uint16_t>(h.type));
  put_le<uint64_t>(p + 8, h.job_id);
  put_le<int64_t>(p + 16, h.step);
  put_le<int32_t>(p + 24, h.sender_rank);
  put_le<int32_t>(p + 28, h.round);
  put_le<int32_t>(p + 32, h.segment);
  put_le<uint32_t>(p + 36, h.flags);
  put_le<uint64_t>(p + 40, h.elements);
  put_le<uint64_t>(p + 48, h.payload_bytes);
  return b;
}

bool validate(const header& h, std::string* error) {
  if (h.version != kProtocolVersion)
    return fail(error, "protocol version " + std::to_string(h.version) + ", this build speaks " +
                           std::to_string(kProtocolVersion));
  const auto type = static_cast<uint16_t>(h.type);
  if (!is_known_type(type)) return fail(error, "unknown message type " + std::to_string(type));
  if (h.step < 0) return fail(error, "negative step " + std::to_string(h.step));
  if (h.sender_rank < -1) return fail(error, "bad sender rank " + std::to_string(h.sender_rank));
  if (h.round < 0) return fail(error, "negative round " + std::to_string(h.round));
  if (h.segment < 0) return fail(error, "negative segment " + std::to_string(h.segment));
  if (h.flags & ~kKnownFlags) return fail(error, "unknown flags " + hex32(h.flags));
  if (h.type == msg_type::checkpoint && h.segment >= kStateBuffers)
    return fail(error, "checkpoint segment " + std::to_string(h.segment) + ", expected 0.." + std::to_string(kStateBuffers - 1));
  if (h.payload_bytes > kMaxPayloadBytes)
    return fail(error, "payload of " + std::to_string(h.payload_bytes) + " bytes exceeds the limit of " +
                           std::to_string(kMaxPayloadBytes));
  if (h.type == msg_type::steps && (h.elements < 1 || h.elements > kMaxStepRecords || h.elements * kStepRecordBytes != h.payload_bytes))
    return fail(error, "steps message says " + std::to_string(h.elements) + " records (1.." + std::to_string(kMaxStepRecords) +
                           ") in " + std::to_string(h.payload_bytes) + " payload bytes");
  if (is_tensor_type(h.type)) {
    // Compare without multiplying first: elements * 4 could overflow for a forged count.
    if (h.elements > kMaxPayloadBytes / sizeof(float) || h.elements * sizeof(float) != h.payload_bytes)
      return fail(error, std::string(type_name(h.type)) + " message says " + std::to_string(h.elements) +
                             " floats but " + std::to_string(h.payload_bytes) + " payload bytes");
  }
  return true;
}

bool decode(const void* data, size_t size, header* out, std::string* error) {
  if (!data && size) return fail(error, "null header frame");
  if (size != kHeaderSize)
    return fail(error, "header frame is " + std::to_string(size) + " bytes, expected " +
                           std::to_string(kHeaderSize));
  const auto* p = static_cast<const unsigned char*>(data);
  const auto magic = get_le<uint32_t>(p);
  if (magic != kMagic) return fail(error, "bad magic " + hex32(magic) + ", expected " + hex32(kMagic));
  header h;
  h.version = get_le<uint16_t>(p + 4);
  h.type = static_cast<msg_type>(get_le<uint16_t>(p + 6));
  h.job_id = get_le<uint64_t>(p + 8);
  h.step = get_le<int64_t>(p + 16);
  h.sender_rank = get_le<int32_t>(p + 24);
  h.round = get_le<int32_t>(p + 28);
  h.segment = get_le<int32_t>(p + 32);
  h.flags = get_le<uint32_t>(p + 36);
  h.elements = get_le<uint64_t>(p + 40);
  h.payload_bytes = get_le<uint64_t>(p + 48);
  if (!validate(h, error)) return false;
  *out = h;
  return true;
}

bool peek_version(const void* data, size_t size, uint16_t* version, uint16_t* type) {
  if (!data || size < 8) return false;
  const auto* p = static_cast<const unsigned char*>(data);
  if (get_le<uint32_t>(p) != kMagic) return false;
  *version = get_le<uint16_t>(p + 4);
  *type = get_le<uint16_t>(p + 6);
  return true;
}

bool check_payload(const header& h, size_t actual_bytes, std::string* error) {
  if (actual_bytes != h.payload_bytes)
    return fail(error, std::string(type_name(h.type)) + " payload frame is " + std::to_string(actual_bytes) +
                           " bytes, header says " + std::to_string(h.payload_bytes));
  return true;
}

verdict check_message(const frame* frames, size_t count, header* out, std::string* error) {
  if (count < 1 || count > 2) {
    fail(error, std::to_string(count) + " frames, expected a header and at most one payload");
    return verdict::malformed;
  }
  const frame& hf = frames[0];
  if (!decode(hf.data, hf.size, out, error)) {
    uint16_t version = 0, type = 0;
    if (!peek_version(hf.data, hf.size, &version, &type) || version == kProtocolVersion) return verdict::malformed;
    // Tell the peer why it gets no answer; never answer an error (two builds would ping-pong).
    return type == uint16_t(msg_type::hello) ? verdict::answer_version : verdict::other_version;
  }
  if (!check_payload(*out, count == 2 ? frames[1].size : 0, error)) return verdict::malformed;
  return verdict::accept;
}

bool encode_kv(const kv_map& kv, std::string* out, std::string* error) {
  std::string text;
  for (const auto& [k, v] : kv) {
    if (k.empty()) return fail(error, "empty key");
    if (k.find_first_of("=\n") != std::string::npos)
      return fail(error, "key '" + k + "' contains '=' or a newline");
    if (v.find('\n') != std::string::npos) return fail(error, "value of '" + k + "' contains a newline");
    text.append(k).append(1, '=').append(v).append(1, '\n');
    if (text.size() > kMaxKvBytes)
      return fail(error, "key=value text exceeds " + std::to_string(kMaxKvBytes) + " bytes");
  }
  *out = std::move(text);
  return true;
}

bool decode_kv(std::string_view text, kv_map* out, std::string* error) {
  if (text.size() > kMaxKvBytes)
    return fail(error, "key=value text of " + std::to_string(text.size()) + " bytes exceeds " +
                           std::to_string(kMaxKvBytes));
  kv_map kv;
  size_t pos = 0, line = 1;
  while (pos < text.size()) {
    const size_t nl = text.find('\n', pos);
    if (nl == std::string_view::npos)
      return fail(error, "line " + std::to_string(line) + " does not end with a newline");
    const std::string_view l = text.substr(pos, nl - pos);
    const size_t eq = l.find('=');
    if (eq == std::string_view::npos) return fail(error, "line " + std::to_string(line) + " has no '='");
    if (eq == 0) return fail(error, "line " + std::to_string(line) + " has an empty key");
    std::string key(l.substr(0, eq));
    if (kv.count(key)) return fail(error, "key '" + key + "' appears twice");
    kv.emplace(std::move(key), std::string(l.substr(eq + 1)));
    pos = nl + 1;
    ++line;
  }
  *out = std::move(kv);
  return true;
}

}  // namespace ringmaster::wire
