// CRC32C (Castagnoli) for checkpoint files: the SSE4.2 instruction where the CPU has it, a
// slicing-by-8 table otherwise (several GB/s either way, so checking a checkpoint costs about
// what reading it does). Same values as runtime/util/crc32c.h, which is byte-at-a-time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace strata {

// Continues `crc` (a finished CRC32C of the bytes before) over `n` more bytes; 0 starts afresh.
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n);

inline uint32_t crc32c(const void* data, size_t n) { return crc32c_extend(0, data, n); }
inline uint32_t crc32c(std::string_view bytes) { return crc32c(bytes.data(), bytes.size()); }

// The portable path alone (tests compare it with the hardware path).
uint32_t crc32c_extend_portable(uint32_t crc, const void* data, size_t n);

}  // namespace strata
