// Sealed messages: the ring's bulk data between two nodes, encrypted and authenticated with AES-128-OCB
// (RFC 7253, OpenSSL) instead of CurveZMQ's XSalsa20-Poly1305.
//
// Why: encrypting every gradient was what made encrypted training slow, and the cipher's time comes out
// of the cores that train. On this hardware (AES-NI, VAES) OpenSSL seals and opens 1 MiB with AES-128-OCB
// at about twice the speed of AES-256-GCM (whose GHASH sets its pace: AES-128-GCM is no faster) and
// some 7x CurveZMQ's cipher (libsodium). OCB makes one pass (no separate MAC) and is free of patents
// since 2021. 128-bit keys match the ~128-bit security of X25519, which makes them. Commands, plans and
// reports still travel over CurveZMQ; only ring chunks are sealed.
//
// Keys: two nodes of a job share a key without sending it. Each holds its CurveZMQ secret key and knows
// the other's public key (the job plan names every node's), so X25519 gives both the same secret, and
// HKDF-SHA256 turns it into the pair's key for this job only (salt: the plan's random seal_salt; info: the
// job id, both node numbers and the lives both are in, so a node that comes back has new keys). A node that does not hold its key cannot make or read the pair's messages.
//
// A sealed message is the usual header (net/wire.hpp) and payload plus a trailer (kTrailerBytes):
//   0  u64 job     the job whose pair keys sealed it (the plan's job id)
//   8  u32 sender  the sending node's number in the plan
//  12  u64 count   the sender's message counter for this pair: with the sender's number, the nonce
//  20  16 bytes    the OCB tag
// The payload is encrypted; the header and the trailer's first 20 bytes are authenticated. Sealed messages
// go over TCP connections of their own (net/tcp_link.hpp), one per pair: the sender logs in to the
// receiver's ring port with a sealed hello, which only a holder of the pair key can make, so a stranger
// is dropped before the node reads any payload from it. A receiver takes a pair's counters only in increasing
// order (one connection keeps the order), so nothing can be replayed, and a sender never reuses a nonce:
// its counter lives as long as the job's pair key.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "net/keys.hpp"

namespace ringmaster::net {

// The cipher, as logs and --help name it.
constexpr const char* kSealCipher = "AES-128-OCB";
constexpr size_t kSealKeyBytes = 16;  // AES-128: X25519, which makes the pair key, gives ~128-bit security
constexpr size_t kSealSaltBytes = 32;
constexpr size_t kSealTagBytes = 16;
constexpr size_t kTrailerBytes = 36;
// The largest payload a message on a ring port may carry, sealed or plain (net/tcp_link.hpp): ring
// chunks are cut into segments of 1 MiB (net/ring_driver.hpp), so strangers on the ring port can make us
// hold at most this per message.
constexpr size_t kMaxRingPayload = size_t(4) << 20;
// Each key seals at most this many messages (256 GiB at most, 2^34 blocks, under TLS 1.3's limit of
// 2^34.5 for AES-GCM); then the next, derived from the pair key, takes over (seal.cpp): one HKDF each.
constexpr uint64_t kMessagesPerKey = uint64_t(1) << 16;

using seal_key = std::array<unsigned char, kSealKeyBytes>;

// The key nodes `a` and `b` of job `job` share (the same whichever of them asks). `salt` is the plan's
// seal_salt, hex (2 * kSealSaltBytes characters). life_a, life_b: the lives a and b are in (plan_node::life,
// 0 for a job's first nodes): a node that comes back gets keys of its own, so its counters, which start
// again at 0, never meet a nonce an earlier life used. False with *error for a malformed key or salt.
bool pair_key(const key_pair& mine, const std::string& their_public, const std::string& salt_hex, uint64_t job,
              uint32_t a, uint32_t b, uint32_t life_a, uint32_t life_b, seal_key* out, std::string* error);
// Overwrites a key in a way the compiler keeps (OPENSSL_cleanse).
void wipe(seal_key& key);
// A fresh random salt, hex.
std::string make_seal_salt();
// 2 * kSealSaltBytes lowercase hex digits. Inline and free of OpenSSL, like is_key, for the plan's decoder.
inline bool is_seal_salt(std::string_view text) {
  if (text.size() != 2 * kSealSaltBytes) return false;
  for (char c : text)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

struct trailer {
  uint64_t job = 0;
  uint32_t sender = 0;
  uint64_t count = 0;
};
bool read_trailer(const void* data, size_t size, trailer* out);
// A trailer with no tag (zeros): what plain messages carry on an unsealed link (net/tcp_link.hpp).
void write_trailer(const trailer& t, unsigned char out[kTrailerBytes]);
// Whether a trailer carries no tag (all zeros): a plain message's. A plain link refuses a tagged one, so
// that a sealed peer's ciphertext is never taken for gradients.
bool untagged(const unsigned char trailer_bytes[kTrailerBytes]);

// One direction of one pair: seals what node `sender` sends with the pair's key. Not thread-safe: its
// tcp_sender (net/tcp_link.hpp) uses it one message at a time, in the order messages go out.
class sealer {
 public:
  sealer(const seal_key& key, uint64_t job, uint32_t sender, uint64_t messages_per_key = kMessagesPerKey);
  ~sealer();
  sealer(const sealer&) = delete;
  sealer& operator=(const sealer&) = delete;
  // Encrypts n bytes from `in` to `out` (may be the same) and writes the trailer. False if OpenSSL fails.
  bool seal(const void* header, size_t header_bytes, const void* in, void* out, size_t n,
            unsigned char trailer_out[kTrailerBytes]);

 private:
  struct impl;
  std::unique_ptr<impl> d_;
};

// The other direction: opens what one node of the pair sent, in place, refusing a forged, altered or
// replayed message. Thread-safe (one lock per call).
class opener {
 public:
  opener(const seal_key& key, uint64_t job, uint32_t sender, uint64_t messages_per_key = kMessagesPerKey);
  ~opener();
  opener(const opener&) = delete;
  opener& operator=(const opener&) = delete;
  // `trailer_bytes` came with the message (its job and sender already matched to this opener). Decrypts
  // `data` in place; false with *error ("bad tag", "a counter already used (N): a replayed, reordered or forged
  // message") and data undefined.
  bool open(const void* header, size_t header_bytes, void* data, size_t n, const void* trailer_bytes,
            std::string* error);

 private:
  struct impl;
  std::unique_ptr<impl> d_;
};

}  // namespace ringmaster::net
