// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), small and self-contained: the rendezvous
// store (store_server.cpp, store_client.cpp) proves the job's secret with them and signs each
// message. Checked against the FIPS and RFC 4231 vectors (tests/comm/store_test.cpp). Not for
// bulk data: about 200 MB/s, which is plenty for store messages of a few hundred bytes.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace strata::comm::detail {

using Digest = std::array<uint8_t, 32>;

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t size);
  void update(const std::string& s) { update(s.data(), s.size()); }
  Digest finish();

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t used_ = 0;
  uint64_t total_ = 0;
};

// HMAC-SHA256 with `key`, fed in parts.
class Hmac {
 public:
  explicit Hmac(const std::string& key);
  void update(const void* data, size_t size) { inner_.update(data, size); }
  void update(const std::string& s) { inner_.update(s); }
  Digest finish();

 private:
  Sha256 inner_;
  uint8_t outer_pad_[64];
};

Digest hmac_sha256(const std::string& key, const std::string& message);

// Compares in time that does not depend on where the digests differ.
bool equal_digests(const uint8_t* a, const uint8_t* b, size_t size = 32);

// Lower-case hex, for tests and for printing digests (never secrets).
std::string to_hex(const uint8_t* data, size_t size);

// `size` bytes from the kernel's random source (getrandom); throws strata::Error if none.
std::string random_bytes(size_t size);

}  // namespace strata::comm::detail
