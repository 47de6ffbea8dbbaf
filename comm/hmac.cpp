#include "comm/hmac.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <sys/random.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "runtime/error.h"

namespace strata::comm::detail {
namespace {

[[noreturn]] void fail(const char* what) {
  char reason[256] = "no reason given";
  if (const unsigned long e = ERR_get_error()) ERR_error_string_n(e, reason, sizeof(reason));
  ERR_clear_error();
  throw Error(fmt::format("rendezvous authentication: libcrypto's {} failed ({})", what, reason));
}

// Fetched once per process (a fetch searches libcrypto's providers) and never freed. libcrypto
// is told not to clean itself up at exit: a rank's process group may be a static whose destructor
// (after libcrypto's atexit handler) still signs its last liveness message to the store.
EVP_MAC* hmac_algorithm() {
  static EVP_MAC* const mac = [] {
    if (OPENSSL_init_crypto(OPENSSL_INIT_NO_ATEXIT, nullptr) != 1) fail("OPENSSL_init_crypto");
    EVP_MAC* m = EVP_MAC_fetch(nullptr, OSSL_MAC_NAME_HMAC, nullptr);
    if (!m) fail("EVP_MAC_fetch(HMAC)");
    return m;
  }();
  return mac;
}

}  // namespace

Hmac::Hmac(const std::string& key) {
  ctx_ = EVP_MAC_CTX_new(hmac_algorithm());
  if (!ctx_) fail("EVP_MAC_CTX_new");
  char digest[] = "SHA256";
  const OSSL_PARAM params[] = {
      OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0), OSSL_PARAM_construct_end()};
  // An empty key is a valid HMAC key; libcrypto wants a non-null pointer for it.
  static const unsigned char kNoKey = 0;
  const auto* k = key.empty() ? &kNoKey : reinterpret_cast<const unsigned char*>(key.data());
  if (EVP_MAC_init(ctx_, k, key.size(), params) != 1) {
    EVP_MAC_CTX_free(ctx_);
    fail("EVP_MAC_init(SHA256)");
  }
}

Hmac::~Hmac() { EVP_MAC_CTX_free(ctx_); }

void Hmac::update(const void* data, size_t size) {
  if (size == 0) return;
  if (EVP_MAC_update(ctx_, static_cast<const unsigned char*>(data), size) != 1)
    fail("EVP_MAC_update");
}

Digest Hmac::finish() {
  Digest d{};
  size_t written = 0;
  if (EVP_MAC_final(ctx_, d.data(), &written, d.size()) != 1 || written != d.size())
    fail("EVP_MAC_final");
  return d;
}

Digest hmac_sha256(const std::string& key, const std::string& message) {
  Hmac h(key);
  h.update(message);
  return h.finish();
}

bool equal_digests(const uint8_t* a, const uint8_t* b, size_t size) {
  uint8_t diff = 0;
  for (size_t i = 0; i < size; ++i) diff |= uint8_t(a[i] ^ b[i]);
  return diff == 0;
}

std::string to_hex(const uint8_t* data, size_t size) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < size; ++i) {
    out += digits[data[i] >> 4];
    out += digits[data[i] & 15];
  }
  return out;
}

std::string random_bytes(size_t size) {
  std::string out(size, '\0');
  size_t got = 0;
  while (got < size) {
    const ssize_t n = ::getrandom(out.data() + got, size - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      throw Error(fmt::format("cannot read random bytes for the rendezvous (getrandom: {})",
                              std::strerror(errno)));
    got += size_t(n);
  }
  return out;
}

}  // namespace strata::comm::detail
