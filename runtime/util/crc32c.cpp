#include "runtime/util/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define STRATA_CRC32C_SSE42 1
#endif

namespace strata {
namespace {

// The reflected Castagnoli polynomial 0x1EDC6F41.
constexpr uint32_t kPoly = 0x82f63b78u;

using Tables = std::array<std::array<uint32_t, 256>, 8>;

// tables[k][b]: the CRC of byte b followed by k zero bytes (slicing-by-8).
constexpr Tables make_tables() {
  Tables t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int bit = 0; bit < 8; ++bit) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    t[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i)
    for (int k = 1; k < 8; ++k) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xffu];
  return t;
}

constexpr Tables kTables = make_tables();

// `c` is the running (inverted) register in both helpers.
uint32_t update_portable(uint32_t c, const unsigned char* p, size_t n) {
  for (; n >= 8; p += 8, n -= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;  // little-endian load; big-endian hosts are refused by the checkpoint writers
    c = kTables[7][lo & 0xff] ^ kTables[6][(lo >> 8) & 0xff] ^ kTables[5][(lo >> 16) & 0xff] ^
        kTables[4][lo >> 24] ^ kTables[3][hi & 0xff] ^ kTables[2][(hi >> 8) & 0xff] ^
        kTables[1][(hi >> 16) & 0xff] ^ kTables[0][hi >> 24];
  }
  for (; n > 0; --n) c = kTables[0][(c ^ *p++) & 0xffu] ^ (c >> 8);
  return c;
}

#ifdef STRATA_CRC32C_SSE42
__attribute__((target("sse4.2"))) uint32_t update_sse42(uint32_t c, const unsigned char* p,
                                                         size_t n) {
  uint64_t c64 = c;
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c64 = _mm_crc32_u64(c64, v);
  }
  c = static_cast<uint32_t>(c64);
  for (; n > 0; --n) c = _mm_crc32_u8(c, *p++);
  return c;
}

bool has_sse42() {
  static const bool has = (__builtin_cpu_init(), __builtin_cpu_supports("sse4.2") != 0);
  return has;
}
#endif

}  // namespace

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
#ifdef STRATA_CRC32C_SSE42
  if (has_sse42()) return ~update_sse42(~crc, p, n);
#endif
  return ~update_portable(~crc, p, n);
}

uint32_t crc32c_extend_portable(uint32_t crc, const void* data, size_t n) {
  return ~update_portable(~crc, static_cast<const unsigned char*>(data), n);
}

}  // namespace strata
