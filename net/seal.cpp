#include "net/seal.hpp"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/kdf.h>
#include <openssl/rand.h>

#include <climits>
#include <cstring>
#include <mutex>

namespace ringmaster::net {
namespace {

constexpr char kInfo[] = "ringmaster seal v3";  // v3: AES-128-OCB (v2 was AES-256-GCM)
constexpr size_t kNonceBytes = 12;
constexpr size_t kAuthenticatedTrailer = 20;  // job, sender, count: the rest is the tag

void put_u32(unsigned char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
void put_u64(unsigned char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
uint32_t get_u32(const unsigned char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
uint64_t get_u64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

bool fail(std::string* error, std::string what) {
  if (error) *error = std::move(what);
  return false;
}

std::string to_hex(const unsigned char* p, size_t n) {
  static const char digits[] = "0123456789abcdef";
  std::string hex;
  for (size_t i = 0; i < n; ++i) {
    hex += digits[p[i] >> 4];
    hex += digits[p[i] & 15];
  }
  return hex;
}

bool decode_hex(const std::string& hex, unsigned char* out, size_t n) {
  if (hex.size() != 2 * n) return false;
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (size_t i = 0; i < n; ++i) {
    const int hi = digit(hex[2 * i]), lo = digit(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    out[i] = static_cast<unsigned char>(hi * 16 + lo);
  }
  return true;
}

struct pkey_free {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
struct pkey_ctx_free {
  void operator()(EVP_PKEY_CTX* c) const { EVP_PKEY_CTX_free(c); }
};
using pkey_ptr = std::unique_ptr<EVP_PKEY, pkey_free>;
using pkey_ctx_ptr = std::unique_ptr<EVP_PKEY_CTX, pkey_ctx_free>;

// The nonce: the sender's number and its counter, so the two directions of a pair never share one.
void make_nonce(unsigned char nonce[kNonceBytes], uint32_t sender, uint64_t count) {
  put_u32(nonce, sender);
  put_u64(nonce + 4, count);
}

// HKDF-SHA256 of `key` into out_len bytes. False if OpenSSL fails.
bool hkdf(const unsigned char* key, size_t key_len, const unsigned char* salt, size_t salt_len, const unsigned char* info,
          size_t info_len, unsigned char* out, size_t out_len) {
  pkey_ctx_ptr kdf(EVP_PKEY_CTX_new_id(EVP_PKEY_HKDF, nullptr));
  size_t len = out_len;
  return kdf && EVP_PKEY_derive_init(kdf.get()) == 1 && EVP_PKEY_CTX_set_hkdf_md(kdf.get(), EVP_sha256()) == 1 &&
         (salt_len == 0 || EVP_PKEY_CTX_set1_hkdf_salt(kdf.get(), salt, int(salt_len)) == 1) &&
         EVP_PKEY_CTX_set1_hkdf_key(kdf.get(), key, int(key_len)) == 1 &&
         EVP_PKEY_CTX_add1_hkdf_info(kdf.get(), info, int(info_len)) == 1 && EVP_PKEY_derive(kdf.get(), out, &len) == 1 &&
         len == out_len;
}

// An AES-128-OCB context; each message only sets its nonce (12 bytes, OCB's default). The pair key seals
// nothing itself: message `count` is sealed with key number count / per_key, derived from it, as TLS 1.3
// moves on to a new traffic key, so that no key seals so much that the mode's margin wears thin.
struct ocb {
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  seal_key base;
  uint64_t per_key;
  bool encrypt;
  uint64_t number = UINT64_MAX;  // the key ctx holds
  ocb(const ocb&) = delete;
  ocb& operator=(const ocb&) = delete;
  ocb(const seal_key& key, uint64_t messages_per_key, bool enc)
      : base(key), per_key(messages_per_key ? messages_per_key : 1), encrypt(enc) {
    static_assert(kSealKeyBytes == 16, "AES-128");
  }
  ~ocb() {
    EVP_CIPHER_CTX_free(ctx);
    OPENSSL_cleanse(base.data(), base.size());
  }
  // Keyed for message `count`. False if OpenSSL fails.
  bool key_for(uint64_t count) {
    if (!ctx) return false;
    if (count / per_key == number) return true;
    static const char label[] = "ringmaster seal key";
    unsigned char info[sizeof label - 1 + 8], key[kSealKeyBytes];
    std::memcpy(info, label, sizeof label - 1);
    put_u64(info + sizeof label - 1, count / per_key);
    const bool ok = hkdf(base.data(), base.size(), nullptr, 0, info, sizeof info, key, sizeof key) &&
                    (encrypt ? EVP_EncryptInit_ex(ctx, EVP_aes_128_ocb(), nullptr, key, nullptr)
                             : EVP_DecryptInit_ex(ctx, EVP_aes_128_ocb(), nullptr, key, nullptr)) == 1;
    OPENSSL_cleanse(key, sizeof key);
    number = ok ? count / per_key : UINT64_MAX;
    return ok;
  }
};

}  // namespace

bool pair_key(const key_pair& mine, const std::string& their_public, const std::string& salt_hex, uint64_t job,
              uint32_t a, uint32_t b, uint32_t life_a, uint32_t life_b, seal_key* out, std::string* error) {
  unsigned char secret[32], pub[32], salt[kSealSaltBytes], shared[32];
  if (!decode_key(mine.secret_key, secret)) {
    OPENSSL_cleanse(secret, sizeof secret);  // a bad key may have been decoded in part
    return fail(error, "our secret key is not a Z85 key");
  }
  if (!decode_key(their_public, pub) || !decode_hex(salt_hex, salt, sizeof salt)) {
    OPENSSL_cleanse(secret, sizeof secret);
    return fail(error, is_key(their_public) ? "the seal salt is not 64 hex digits" : "the peer's public key is not a Z85 key");
  }
  pkey_ptr ours(EVP_PKEY_new_raw_private_key(EVP_PKEY_X25519, nullptr, secret, sizeof secret));
  pkey_ptr theirs(EVP_PKEY_new_raw_public_key(EVP_PKEY_X25519, nullptr, pub, sizeof pub));
  OPENSSL_cleanse(secret, sizeof secret);
  if (!ours || !theirs) return fail(error, "OpenSSL refused an X25519 key");
  pkey_ctx_ptr dh(EVP_PKEY_CTX_new(ours.get(), nullptr));
  size_t shared_len = sizeof shared;
  // OpenSSL refuses an all-zero result (a public key of small order), so a peer cannot force a known key.
  if (!dh || EVP_PKEY_derive_init(dh.get()) != 1 || EVP_PKEY_derive_set_peer(dh.get(), theirs.get()) != 1 ||
      EVP_PKEY_derive(dh.get(), shared, &shared_len) != 1 || shared_len != sizeof shared)
    return fail(error, "X25519 with the peer's public key failed");
  unsigned char info[sizeof kInfo - 1 + 24];  // job, the lower node and the higher, their lives
  std::memcpy(info, kInfo, sizeof kInfo - 1);
  put_u64(info + sizeof kInfo - 1, job);
  put_u32(info + sizeof kInfo - 1 + 8, a < b ? a : b);
  put_u32(info + sizeof kInfo - 1 + 12, a < b ? b : a);
  put_u32(info + sizeof kInfo - 1 + 16, a < b ? life_a : life_b);
  put_u32(info + sizeof kInfo - 1 + 20, a < b ? life_b : life_a);
  const bool ok = hkdf(shared, sizeof shared, salt, sizeof salt, info, sizeof info, out->data(), out->size());
  OPENSSL_cleanse(shared, sizeof shared);
  return ok || fail(error, "HKDF failed");
}

std::string make_seal_salt() {
  unsigned char salt[kSealSaltBytes];
  return RAND_bytes(salt, sizeof salt) == 1 ? to_hex(salt, sizeof salt) : "";
}

void wipe(seal_key& key) { OPENSSL_cleanse(key.data(), key.size()); }

bool read_trailer(const void* data, size_t size, trailer* out) {
  if (size != kTrailerBytes) return false;
  const auto* p = static_cast<const unsigned char*>(data);
  *out = {get_u64(p), get_u32(p + 8), get_u64(p + 12)};
  return true;
}

void write_trailer(const trailer& t, unsigned char out[kTrailerBytes]) {
  put_u64(out, t.job);
  put_u32(out + 8, t.sender);
  put_u64(out + 12, t.count);
  std::memset(out + 20, 0, kSealTagBytes);
}

bool untagged(const unsigned char trailer_bytes[kTrailerBytes]) {
  unsigned char any = 0;
  for (size_t i = kTrailerBytes - kSealTagBytes; i < kTrailerBytes; ++i) any |= trailer_bytes[i];
  return any == 0;
}

struct sealer::impl {
  ocb cipher;
  uint64_t job;
  uint32_t sender;
  uint64_t count = 0;
  impl(const seal_key& k, uint64_t j, uint32_t s, uint64_t per_key) : cipher(k, per_key, true), job(j), sender(s) {}
};

sealer::sealer(const seal_key& key, uint64_t job, uint32_t sender, uint64_t messages_per_key)
    : d_(std::make_unique<impl>(key, job, sender, messages_per_key)) {}
sealer::~sealer() = default;

bool sealer::seal(const void* header, size_t header_bytes, const void* in, void* out, size_t n,
                  unsigned char trailer_out[kTrailerBytes]) {
  if (n > size_t(INT_MAX) || header_bytes > size_t(INT_MAX) || d_->count == UINT64_MAX || !d_->cipher.key_for(d_->count))
    return false;
  put_u64(trailer_out, d_->job);
  put_u32(trailer_out + 8, d_->sender);
  put_u64(trailer_out + 12, d_->count);
  unsigned char nonce[kNonceBytes];
  make_nonce(nonce, d_->sender, d_->count++);  // never again with this key, whatever happens next
  EVP_CIPHER_CTX* c = d_->cipher.ctx;
  int len = 0;
  if (EVP_EncryptInit_ex(c, nullptr, nullptr, nullptr, nonce) != 1 ||
      EVP_EncryptUpdate(c, nullptr, &len, static_cast<const unsigned char*>(header), int(header_bytes)) != 1 ||
      EVP_EncryptUpdate(c, nullptr, &len, trailer_out, int(kAuthenticatedTrailer)) != 1)
    return false;
  // OCB holds a partial last block back until Final: the two together write all n bytes.
  int head = 0, tail = 0;
  auto* o = static_cast<unsigned char*>(out);
  if (n > 0 && EVP_EncryptUpdate(c, o, &head, static_cast<const unsigned char*>(in), int(n)) != 1) return false;
  return EVP_EncryptFinal_ex(c, o + head, &tail) == 1 && size_t(head) + size_t(tail) == n &&
         EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_AEAD_GET_TAG, int(kSealTagBytes), trailer_out + kAuthenticatedTrailer) == 1;
}

struct opener::impl {
  ocb cipher;
  uint64_t job;
  uint32_t sender;
  uint64_t next = 0;  // the lowest counter still acceptable
  // One opener serves a pair for a whole job, while its connections come and go (net/tcp_link.hpp): a
  // login on a new one may be checked while the old one's last message is opened.
  std::mutex mu;
  impl(const seal_key& k, uint64_t j, uint32_t s, uint64_t per_key) : cipher(k, per_key, false), job(j), sender(s) {}
};

opener::opener(const seal_key& key, uint64_t job, uint32_t sender, uint64_t messages_per_key)
    : d_(std::make_unique<impl>(key, job, sender, messages_per_key)) {}
opener::~opener() = default;

bool opener::open(const void* header, size_t header_bytes, void* data, size_t n, const void* trailer_bytes,
                  std::string* error) {
  std::lock_guard<std::mutex> lock(d_->mu);
  trailer t;
  if (!read_trailer(trailer_bytes, kTrailerBytes, &t) || t.job != d_->job || t.sender != d_->sender)
    return fail(error, "sealed for another job or sender");
  if (t.count < d_->next || t.count == UINT64_MAX)
    return fail(error, "a counter already used (" + std::to_string(t.count) + "): a replayed, reordered or forged message");
  if (n > size_t(INT_MAX) || header_bytes > size_t(INT_MAX) || !d_->cipher.key_for(t.count)) return fail(error, "cannot open");
  unsigned char nonce[kNonceBytes];
  make_nonce(nonce, t.sender, t.count);
  EVP_CIPHER_CTX* c = d_->cipher.ctx;
  const auto* tb = static_cast<const unsigned char*>(trailer_bytes);
  unsigned char tag[kSealTagBytes];
  std::memcpy(tag, tb + kAuthenticatedTrailer, sizeof tag);
  int len = 0, head = 0, tail = 0;
  auto* bytes = static_cast<unsigned char*>(data);
  const bool ok = EVP_DecryptInit_ex(c, nullptr, nullptr, nullptr, nonce) == 1 &&
                  EVP_DecryptUpdate(c, nullptr, &len, static_cast<const unsigned char*>(header), int(header_bytes)) == 1 &&
                  EVP_DecryptUpdate(c, nullptr, &len, tb, int(kAuthenticatedTrailer)) == 1 &&
                  (n == 0 || EVP_DecryptUpdate(c, bytes, &head, bytes, int(n)) == 1) &&
                  EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_AEAD_SET_TAG, int(sizeof tag), tag) == 1 &&
                  EVP_DecryptFinal_ex(c, bytes + head, &tail) == 1 && size_t(head) + size_t(tail) == n;
  if (!ok) return fail(error, "bad tag: forged or altered, or sealed with another key");
  d_->next = t.count + 1;
  return true;
}

}  // namespace ringmaster::net
