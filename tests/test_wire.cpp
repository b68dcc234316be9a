// The wire format: round trips, and a decoder that rejects every kind of bad frame with a clear message.
#include <catch2/catch.hpp>
#include <random>
#include <vector>

#include "net/wire.hpp"

using namespace ringmaster;
using wire::msg_type;

namespace {

wire::header sample_chunk() {
  wire::header h;
  h.type = msg_type::chunk;
  h.job_id = 0x0123456789abcdefULL;
  h.step = 4242;
  h.sender_rank = 3;
  h.round = 5;
  h.segment = 17;
  h.elements = 1000;
  h.payload_bytes = 4000;
  return h;
}

std::string decode_error(const wire::header_bytes& b) {
  wire::header out;
  std::string err;
  CHECK_FALSE(wire::decode(b.data(), b.size(), &out, &err));
  return err;
}

}  // namespace

TEST_CASE("wire: header round trip keeps every field", "[wire]") {
  const wire::header h = sample_chunk();
  const wire::header_bytes b = wire::encode(h);
  REQUIRE(b.size() == wire::kHeaderSize);
  wire::header out;
  std::string err;
  REQUIRE(wire::decode(b.data(), b.size(), &out, &err));
  CHECK(out.version == wire::kProtocolVersion);
  CHECK(out.type == h.type);
  CHECK(out.job_id == h.job_id);
  CHECK(out.step == h.step);
  CHECK(out.sender_rank == h.sender_rank);
  CHECK(out.round == h.round);
  CHECK(out.segment == h.segment);
  CHECK(out.elements == h.elements);
  CHECK(out.payload_bytes == h.payload_bytes);
  // Every type survives, and -1 (no rank) is allowed.
  for (uint16_t t = wire::kFirstType; t <= wire::kLastType; ++t) {
    wire::header x;
    x.type = msg_type(t);
    x.sender_rank = -1;
    if (wire::is_tensor_type(x.type)) x.elements = 2, x.payload_bytes = 8;
    if (x.type == msg_type::steps) x.elements = 2, x.payload_bytes = 2 * wire::kStepRecordBytes;
    const auto bx = wire::encode(x);
    REQUIRE(wire::decode(bx.data(), bx.size(), &out, &err));
    CHECK(out.type == x.type);
    CHECK(out.sender_rank == -1);
    CHECK(std::string(wire::type_name(x.type)) != "unknown");
  }
}

TEST_CASE("wire: the layout is little-endian and explicit", "[wire]") {
  wire::header h;
  h.type = msg_type::hello;  // 1
  h.job_id = 0x0102030405060708ULL;
  const auto b = wire::encode(h);
  CHECK(b[0] == 0x31);  // "RMG1" as a little-endian u32 0x524D4731
  CHECK(b[1] == 0x47);
  CHECK(b[2] == 0x4D);
  CHECK(b[3] == 0x52);
  CHECK(b[4] == wire::kProtocolVersion);
  CHECK(b[5] == 0);
  CHECK(b[6] == 1);
  CHECK(b[8] == 0x08);
  CHECK(b[15] == 0x01);
}

TEST_CASE("wire: truncated and oversized header frames are rejected", "[wire]") {
  const auto b = wire::encode(sample_chunk());
  wire::header out;
  std::string err;
  for (size_t n : {size_t(0), size_t(1), size_t(7), size_t(8), wire::kHeaderSize - 1}) {
    CHECK_FALSE(wire::decode(b.data(), n, &out, &err));
    CHECK(err == "header frame is " + std::to_string(n) + " bytes, expected 56");
  }
  std::vector<unsigned char> big(b.begin(), b.end());
  big.push_back(0);
  CHECK_FALSE(wire::decode(big.data(), big.size(), &out, &err));
  CHECK(err == "header frame is 57 bytes, expected 56");
  CHECK_FALSE(wire::decode(nullptr, 56, &out, &err));
}

TEST_CASE("wire: wrong magic, version, type and counts are named", "[wire]") {
  auto b = wire::encode(sample_chunk());
  b[0] = 'X';
  CHECK(decode_error(b).rfind("bad magic 0x", 0) == 0);

  wire::header h = sample_chunk();
  h.version = wire::kProtocolVersion + 1;
  CHECK(decode_error(wire::encode(h)) == "protocol version " + std::to_string(wire::kProtocolVersion + 1) + ", this build speaks " + std::to_string(wire::kProtocolVersion));
  uint16_t version = 0, type = 0;
  const auto v2 = wire::encode(h);
  REQUIRE(wire::peek_version(v2.data(), v2.size(), &version, &type));
  CHECK(version == wire::kProtocolVersion + 1);
  CHECK(type == uint16_t(msg_type::chunk));

  h = sample_chunk();
  h.type = msg_type(99);
  CHECK(decode_error(wire::encode(h)) == "unknown message type 99");
  h.type = msg_type(0);
  CHECK(decode_error(wire::encode(h)) == "unknown message type 0");

  h = sample_chunk();
  h.payload_bytes = 3999;
  CHECK(decode_error(wire::encode(h)) == "chunk message says 1000 floats but 3999 payload bytes");
  h.elements = uint64_t(1) << 62;  // * 4 would wrap to 0
  h.payload_bytes = 0;
  CHECK(decode_error(wire::encode(h)).find("floats but 0 payload bytes") != std::string::npos);

  h = sample_chunk();
  h.type = msg_type::job;
  h.elements = 0;
  h.payload_bytes = wire::kMaxPayloadBytes + 1;
  CHECK(decode_error(wire::encode(h)) == "payload of 1073741825 bytes exceeds the limit of 1073741824");

  h = sample_chunk();
  h.type = msg_type::checkpoint;  // a state buffer: weights, first or second moment
  h.segment = 3;
  CHECK(decode_error(wire::encode(h)) == "checkpoint segment 3, expected 0..2");
  h.payload_bytes = 3999;
  h.segment = 2;
  CHECK(decode_error(wire::encode(h)) == "checkpoint message says 1000 floats but 3999 payload bytes");

  h = sample_chunk();
  h.step = -1;
  CHECK(decode_error(wire::encode(h)) == "negative step -1");
  h = sample_chunk();
  h.sender_rank = -2;
  CHECK(decode_error(wire::encode(h)) == "bad sender rank -2");
  h = sample_chunk();
  h.round = -5;
  CHECK(decode_error(wire::encode(h)) == "negative round -5");
  h = sample_chunk();
  h.segment = INT32_MIN;
  CHECK(decode_error(wire::encode(h)).rfind("negative segment", 0) == 0);
  h = sample_chunk();
  h.flags = 6;
  CHECK(decode_error(wire::encode(h)) == "unknown flags 0x00000006");
}

TEST_CASE("wire: check_payload compares the frame with the header", "[wire]") {
  const wire::header h = sample_chunk();
  std::string err;
  CHECK(wire::check_payload(h, 4000, &err));
  CHECK_FALSE(wire::check_payload(h, 4, &err));
  CHECK(err == "chunk payload frame is 4 bytes, header says 4000");
  CHECK_FALSE(wire::check_payload(h, 0, &err));
}

TEST_CASE("wire: 10,000 random frames are rejected without a crash", "[wire]") {
  std::mt19937_64 rng(12345);
  std::vector<unsigned char> buf;
  int accepted = 0;
  for (int i = 0; i < 10000; ++i) {
    // Half of them random bytes, half a valid header with a few bytes flipped (closer to the edge).
    const bool mutate = i % 2;
    size_t n = mutate ? wire::kHeaderSize : size_t(rng() % 128);
    buf.resize(n);
    if (mutate) {
      const auto b = wire::encode(sample_chunk());
      std::copy(b.begin(), b.end(), buf.begin());
      for (int k = 0; k < 3; ++k) buf[rng() % n] ^= static_cast<unsigned char>(1 + rng() % 255);
    } else {
      for (auto& c : buf) c = static_cast<unsigned char>(rng());
    }
    wire::header out;
    std::string err;
    if (wire::decode(buf.data(), buf.size(), &out, &err)) {
      // Only flips that left every checked field valid can pass; then it re-validates as such.
      ++accepted;
      CHECK(wire::validate(out, &err));
    } else {
      CHECK_FALSE(err.empty());
    }
  }
  CHECK(accepted < 10000 / 2);
}

TEST_CASE("wire: key=value text round trip and validation", "[wire]") {
  wire::kv_map kv{{"rank", "3"}, {"model", "784-512-10"}, {"empty", ""}, {"spaces ok", "a b=c"}};
  std::string text, err;
  REQUIRE(wire::encode_kv(kv, &text, &err));
  CHECK(text == "empty=\nmodel=784-512-10\nrank=3\nspaces ok=a b=c\n");
  wire::kv_map back;
  REQUIRE(wire::decode_kv(text, &back, &err));
  CHECK(back == kv);
  REQUIRE(wire::decode_kv("", &back, &err));
  CHECK(back.empty());

  CHECK_FALSE(wire::encode_kv({{"a=b", "1"}}, &text, &err));
  CHECK(err == "key 'a=b' contains '=' or a newline");
  CHECK_FALSE(wire::encode_kv({{"a\nb", "1"}}, &text, &err));
  CHECK_FALSE(wire::encode_kv({{"", "1"}}, &text, &err));
  CHECK(err == "empty key");
  CHECK_FALSE(wire::encode_kv({{"a", "x\ny"}}, &text, &err));
  CHECK(err == "value of 'a' contains a newline");
  CHECK_FALSE(wire::encode_kv({{"big", std::string(wire::kMaxKvBytes, 'x')}}, &text, &err));

  CHECK_FALSE(wire::decode_kv("a=1\nb=2", &back, &err));
  CHECK(err == "line 2 does not end with a newline");
  CHECK_FALSE(wire::decode_kv("a=1\nnoequals\n", &back, &err));
  CHECK(err == "line 2 has no '='");
  CHECK_FALSE(wire::decode_kv("=1\n", &back, &err));
  CHECK(err == "line 1 has an empty key");
  CHECK_FALSE(wire::decode_kv("a=1\na=2\n", &back, &err));
  CHECK(err == "key 'a' appears twice");
  CHECK_FALSE(wire::decode_kv(std::string(wire::kMaxKvBytes + 1, 'x'), &back, &err));
  CHECK(err.find("exceeds") != std::string::npos);
}

TEST_CASE("wire: check_message decides what the bridge does with a received message", "[wire]") {
  wire::header h = sample_chunk();
  const wire::header_bytes hb = wire::encode(h);
  const std::vector<unsigned char> body(4000, 0);
  wire::header out;
  std::string err;
  const wire::frame both[2] = {{hb.data(), hb.size()}, {body.data(), body.size()}};
  CHECK(wire::check_message(both, 2, &out, &err) == wire::verdict::accept);
  CHECK(out.step == h.step);
  CHECK(out.payload_bytes == 4000);
  // Frame counts: none, or more than a header and a payload (frames beyond two are not even read).
  CHECK(wire::check_message(nullptr, 0, &out, &err) == wire::verdict::malformed);
  CHECK(err == "0 frames, expected a header and at most one payload");
  CHECK(wire::check_message(both, 3, &out, &err) == wire::verdict::malformed);
  CHECK(err == "3 frames, expected a header and at most one payload");
  // The header says 4000 payload bytes: a missing or shorter payload frame is refused.
  CHECK(wire::check_message(both, 1, &out, &err) == wire::verdict::malformed);
  CHECK(err == "chunk payload frame is 0 bytes, header says 4000");
  const wire::frame short_body[2] = {{hb.data(), hb.size()}, {body.data(), 3999}};
  CHECK(wire::check_message(short_body, 2, &out, &err) == wire::verdict::malformed);
  // A header frame of the wrong size, or with our version but a bad field, is malformed.
  const wire::frame cut[1] = {{hb.data(), 7}};
  CHECK(wire::check_message(cut, 1, &out, &err) == wire::verdict::malformed);
  CHECK(err == "header frame is 7 bytes, expected 56");
  h.step = -1;
  const wire::header_bytes negative = wire::encode(h);
  const wire::frame bad[1] = {{negative.data(), negative.size()}};
  CHECK(wire::check_message(bad, 1, &out, &err) == wire::verdict::malformed);
  // Another version: a hello is answered (with err as the text), anything else only dropped.
  wire::header hello;
  hello.type = wire::msg_type::hello;
  hello.version = wire::kProtocolVersion + 1;
  const wire::header_bytes hv = wire::encode(hello);
  const wire::frame other[1] = {{hv.data(), hv.size()}};
  CHECK(wire::check_message(other, 1, &out, &err) == wire::verdict::answer_version);
  CHECK(err == "protocol version " + std::to_string(wire::kProtocolVersion + 1) + ", this build speaks " +
                   std::to_string(wire::kProtocolVersion));
  hello.type = wire::msg_type::error;  // never answer an error: two builds would ping-pong
  const wire::header_bytes he = wire::encode(hello);
  const wire::frame error_frame[1] = {{he.data(), he.size()}};
  CHECK(wire::check_message(error_frame, 1, &out, &err) == wire::verdict::other_version);
  // A frame too short to say its version is only malformed.
  const wire::frame tiny[1] = {{hv.data(), 6}};
  CHECK(wire::check_message(tiny, 1, &out, &err) == wire::verdict::malformed);
}
