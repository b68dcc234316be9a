// Sealed ring chunks (net/seal.hpp): pair keys, AES-128-OCB sealing and opening. The TCP connections they
// travel on are tests/test_tcp_link.cpp's.
#include <catch2/catch.hpp>
#include <cstring>
#include <random>
#include <string>
#include <vector>
#include <zmq.h>

#include "net/seal.hpp"
#include "net/wire.hpp"

using namespace ringmaster;

namespace {

net::key_pair fresh_keys() {
  char pub[41], sec[41];
  REQUIRE(zmq_curve_keypair(pub, sec) == 0);
  return {pub, sec};
}

net::seal_key derive(const net::key_pair& mine, const std::string& theirs, const std::string& salt, uint64_t job,
                     uint32_t a, uint32_t b, uint32_t life_a = 0, uint32_t life_b = 0) {
  net::seal_key k{};
  std::string err;
  INFO(err);
  REQUIRE(net::pair_key(mine, theirs, salt, job, a, b, life_a, life_b, &k, &err));
  return k;
}

struct sealed_message {
  wire::header_bytes header;
  std::vector<unsigned char> payload;
  unsigned char trailer[net::kTrailerBytes];
};

sealed_message seal_one(net::sealer& s, const std::vector<float>& data, uint64_t job) {
  wire::header h;
  h.type = wire::msg_type::chunk;
  h.job_id = job;
  h.sender_rank = 0;
  h.elements = data.size();
  h.payload_bytes = data.size() * sizeof(float);
  sealed_message m;
  m.header = wire::encode(h);
  m.payload.resize(h.payload_bytes);
  REQUIRE(s.seal(m.header.data(), m.header.size(), data.data(), m.payload.data(), m.payload.size(), m.trailer));
  return m;
}

bool open_one(net::opener& o, sealed_message m, std::vector<float>* out, std::string* err) {
  if (!o.open(m.header.data(), m.header.size(), m.payload.data(), m.payload.size(), m.trailer, err)) return false;
  out->resize(m.payload.size() / sizeof(float));
  if (!m.payload.empty()) std::memcpy(out->data(), m.payload.data(), m.payload.size());
  return true;
}

}  // namespace

TEST_CASE("seal: two nodes derive one pair key, which is the job's and the pair's own") {
  const auto a = fresh_keys(), b = fresh_keys(), c = fresh_keys();
  const std::string salt = net::make_seal_salt(), other_salt = net::make_seal_salt();
  REQUIRE(net::is_seal_salt(salt));
  CHECK(salt != other_salt);
  const auto ab = derive(a, b.public_key, salt, 7, 0, 1);
  CHECK(derive(b, a.public_key, salt, 7, 1, 0) == ab);  // both ends, in either order
  CHECK(derive(a, c.public_key, salt, 7, 0, 2) != ab);  // another peer
  CHECK(derive(a, b.public_key, other_salt, 7, 0, 1) != ab);  // another salt
  CHECK(derive(a, b.public_key, salt, 8, 0, 1) != ab);  // another job
  CHECK(derive(a, b.public_key, salt, 7, 0, 2) != ab);  // other node numbers
  // A node taken back in its life 3 has keys of that life with each other node, both ends agree.
  const auto rejoined = derive(a, b.public_key, salt, 7, 0, 1, 0, 3);
  CHECK(rejoined != ab);
  CHECK(derive(b, a.public_key, salt, 7, 1, 0, 3, 0) == rejoined);
  CHECK(derive(a, b.public_key, salt, 7, 0, 1, 3, 0) != rejoined);  // the life goes with its node
  CHECK(derive(a, b.public_key, salt, 7, 0, 1, 0, 5) != rejoined);  // a later life: other keys again
  // Nodes sharing one key pair (a shared home) still get a key per pair of node numbers.
  CHECK(derive(a, a.public_key, salt, 7, 0, 1) != derive(a, a.public_key, salt, 7, 0, 2));

  net::seal_key k;
  std::string err;
  CHECK_FALSE(net::pair_key(a, "not a key", salt, 7, 0, 1, 0, 0, &k, &err));
  CHECK(err == "the peer's public key is not a Z85 key");
  CHECK_FALSE(net::pair_key(a, b.public_key, "00", 7, 0, 1, 0, 0, &k, &err));
  CHECK(err == "the seal salt is not 64 hex digits");
  // A public key of small order (all zeros) would make the shared secret known: refused.
  char zero_z85[41];
  const unsigned char zeros[32] = {};
  REQUIRE(zmq_z85_encode(zero_z85, zeros, 32) != nullptr);
  CHECK_FALSE(net::pair_key(a, zero_z85, salt, 7, 0, 1, 0, 0, &k, &err));
}

TEST_CASE("seal: payloads of any length round-trip, and each key seals only so many messages before the next takes over") {
  const auto a = fresh_keys(), b = fresh_keys();
  const std::string salt = net::make_seal_salt();
  const auto k = derive(a, b.public_key, salt, 5, 0, 1);
  std::mt19937 rng(2);
  // OCB holds back a last partial block: lengths that are no multiple of its 16 bytes come out whole too.
  net::sealer s(k, 5, 0);
  net::opener o(k, 5, 0);
  for (size_t n : {0, 1, 3, 4, 5, 257, 1001}) {
    std::vector<float> data(n);
    for (float& x : data) x = std::uniform_real_distribution<float>(-1, 1)(rng);
    std::vector<float> got;
    std::string err;
    INFO(n << " floats: " << err);
    CHECK(open_one(o, seal_one(s, data, 5), &got, &err));
    CHECK(got == data);
  }
  // A sealer moving on to a new key every 3 messages: an opener that does the same opens all of them, one
  // that keeps the first key opens only the first three.
  net::sealer rotating(k, 5, 0, 3);
  net::opener follows(k, 5, 0, 3), stays(k, 5, 0);
  std::vector<float> data(33, 1.5f);
  for (int i = 0; i < 10; ++i) {
    const sealed_message m = seal_one(rotating, data, 5);
    std::vector<float> got;
    std::string err;
    INFO("message " << i);
    CHECK(open_one(follows, m, &got, &err));
    CHECK(got == data);
    CHECK(open_one(stays, m, &got, &err) == (i < 3));
  }
}

TEST_CASE("seal: a sealed message opens once, unaltered, and nothing forged, altered or replayed opens") {
  const auto a = fresh_keys(), b = fresh_keys();
  const std::string salt = net::make_seal_salt();
  const auto k = derive(a, b.public_key, salt, 42, 0, 1);
  net::sealer from_a(k, 42, 0);
  net::opener at_b(derive(b, a.public_key, salt, 42, 1, 0), 42, 0);
  std::vector<float> data(1000);
  std::mt19937 rng(1);
  for (float& x : data) x = std::uniform_real_distribution<float>(-1, 1)(rng);

  const sealed_message first = seal_one(from_a, data, 42);
  CHECK(std::memcmp(first.payload.data(), data.data(), first.payload.size()) != 0);  // not in the clear
  std::vector<float> got;
  std::string err;
  REQUIRE(open_one(at_b, first, &got, &err));
  CHECK(got == data);
  // The same message again: a replay.
  CHECK_FALSE(open_one(at_b, first, &got, &err));
  CHECK(err.find("replayed") != std::string::npos);

  // Each altered part of a fresh message is refused; the message itself still opens afterwards (a
  // failed attempt does not move the counter).
  const sealed_message next = seal_one(from_a, data, 42);
  sealed_message bad = next;
  bad.payload[17] ^= 1;
  CHECK_FALSE(open_one(at_b, bad, &got, &err));
  CHECK(err.find("bad tag") != std::string::npos);
  bad = next;
  bad.header[16] ^= 1;  // the step
  CHECK_FALSE(open_one(at_b, bad, &got, &err));
  bad = next;
  bad.trailer[net::kTrailerBytes - 1] ^= 1;  // the tag
  CHECK_FALSE(open_one(at_b, bad, &got, &err));
  bad = next;
  bad.trailer[19] ^= 0x40;  // the counter, made larger: only the tag can tell
  CHECK_FALSE(open_one(at_b, bad, &got, &err));
  CHECK(err.find("bad tag") != std::string::npos);
  bad = next;
  bad.trailer[0] ^= 1;  // the job
  CHECK_FALSE(open_one(at_b, bad, &got, &err));
  CHECK(err == "sealed for another job or sender");
  bad = next;
  bad.trailer[8] = 5;  // another sender
  CHECK_FALSE(open_one(at_b, bad, &got, &err));
  CHECK(err == "sealed for another job or sender");
  REQUIRE(open_one(at_b, next, &got, &err));
  CHECK(got == data);

  // Sealed with another key (a third node posing as node 0): refused.
  const auto c = fresh_keys();
  net::sealer from_c(derive(c, b.public_key, salt, 42, 0, 1), 42, 0);
  for (int i = 0; i < 100; ++i) seal_one(from_c, data, 42);  // its counter ahead of b's, so only the key can refuse it
  CHECK_FALSE(open_one(at_b, seal_one(from_c, data, 42), &got, &err));
  CHECK(err.find("bad tag") != std::string::npos);
  // What b sends a back (the other direction) is sealed under the same key, but it is not a's to take as
  // its own, and b's own message reflected to b is refused: the sender's number is in the nonce.
  net::sealer from_b(derive(b, a.public_key, salt, 42, 1, 0), 42, 1);
  sealed_message reflected = seal_one(from_b, data, 42);
  CHECK_FALSE(open_one(at_b, reflected, &got, &err));
  CHECK(err == "sealed for another job or sender");
  net::opener at_a(k, 42, 1);
  CHECK(open_one(at_a, reflected, &got, &err));
  CHECK(got == data);
  // A counter at its end is never taken (the next one would wrap).
  sealed_message last = seal_one(from_a, data, 42);
  std::memset(last.trailer + 12, 0xff, 8);
  CHECK_FALSE(open_one(at_b, last, &got, &err));
  CHECK(err.find("replayed") != std::string::npos);
}
