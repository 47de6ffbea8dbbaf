// CRC32C (Castagnoli), as TFRecord files use it: a table-driven software implementation, and the
// "masked" form that TFRecord stores so that a CRC of data which itself holds CRCs stays strong.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace strata::monitor {

// Continues `crc` (a finished CRC32C of the bytes before) over `n` more bytes; 0 starts afresh.
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n);

inline uint32_t crc32c(const void* data, size_t n) { return crc32c_extend(0, data, n); }
inline uint32_t crc32c(std::string_view bytes) { return crc32c(bytes.data(), bytes.size()); }

// TFRecord's mask: rotate right by 15 bits, add a constant (tensorflow/core/lib/hash/crc32c.h).
inline uint32_t mask_crc(uint32_t crc) {
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

}  // namespace strata::monitor
