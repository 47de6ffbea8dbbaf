// HMAC-SHA256 (RFC 2104) through OpenSSL's libcrypto: the rendezvous store (store_server.cpp,
// store.cpp, store_wire.cpp) proves the job's secret with it and signs each message. A security
// boundary uses a vetted library, not hand-written hashing; the RFC 4231 vectors stay as tests
// (tests/comm/store_test.cpp). The digest comparison is Strata's own, in constant time.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

// libcrypto's context, declared as <openssl/types.h> does, so this header needs no OpenSSL.
struct evp_mac_ctx_st;

namespace strata::comm::detail {

using Digest = std::array<uint8_t, 32>;

// HMAC-SHA256 with `key`, fed in parts. Throws strata::Error if libcrypto fails.
class Hmac {
 public:
  explicit Hmac(const std::string& key);
  ~Hmac();
  Hmac(const Hmac&) = delete;
  Hmac& operator=(const Hmac&) = delete;

  void update(const void* data, size_t size);
  void update(const std::string& s) { update(s.data(), s.size()); }
  // Once: the context is spent after it.
  Digest finish();

 private:
  evp_mac_ctx_st* ctx_ = nullptr;
};

Digest hmac_sha256(const std::string& key, const std::string& message);

// Compares in time that does not depend on where the digests differ.
bool equal_digests(const uint8_t* a, const uint8_t* b, size_t size = 32);

// Lower-case hex, for tests and for printing digests (never secrets).
std::string to_hex(const uint8_t* data, size_t size);

// `size` bytes from the kernel's random source (getrandom); throws strata::Error if none.
std::string random_bytes(size_t size);

}  // namespace strata::comm::detail
