// state_checksum (actors/messages.hpp): SHA-256 through OpenSSL, not FNV-1a or CRC-32. A node that lies
// chooses the state it sends: against a linear or short checksum it could make one that matches the
// ranks' own (CRC-32 is linear; FNV-1a's 64 bits yield to search), against SHA-256 it cannot. It is also
// faster here (SHA extensions): 7 ms for 8 MB, against 11 ms for FNV-1a's byte at a time.
#include <openssl/evp.h>

#include <memory>

#include "actors/messages.hpp"

namespace ringmaster {

uint64_t state_checksum(const network_state& s) {
  std::unique_ptr<EVP_MD_CTX, void (*)(EVP_MD_CTX*)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  // Only short of memory can OpenSSL fail here: then 0, which a rank reports as no checksum at all, and
  // which refuses a state checked against the ranks' checksums.
  bool ok = ctx && EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) == 1 &&
            EVP_DigestUpdate(ctx.get(), &s.steps, sizeof s.steps) == 1;
  for (const std::vector<float>* v : {&s.params, &s.m1, &s.m2})
    ok = ok && EVP_DigestUpdate(ctx.get(), v->data(), v->size() * sizeof(float)) == 1;
  if (!ok || EVP_DigestFinal_ex(ctx.get(), md, &len) != 1 || len < 8) return 0;
  uint64_t out = 0;
  for (int i = 7; i >= 0; --i) out = out << 8 | md[i];  // its first 8 bytes, little-endian
  return out;
}

}  // namespace ringmaster
