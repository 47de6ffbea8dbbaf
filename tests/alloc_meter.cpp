// glibc supports replacing malloc in the program (its manual, "Replacing malloc"): these
// definitions win over libc's for every library of the process, and forward to the __libc_*
// entry points, counting each block by malloc_usable_size. No other header of the C library
// is included, so these declarations are the only ones (noexcept as glibc's __THROW is in C++).
// Under AddressSanitizer or ThreadSanitizer, which own malloc, the meter counts through the hooks
// the sanitizer's allocator calls on every allocation and release instead.
#include "tests/alloc_meter.h"
#include "tests/sanitized.h"

#include <sys/resource.h>

#include <atomic>
#include <cerrno>
#include <cstddef>


namespace {
std::atomic<int64_t> g_live{0}, g_peak{0}, g_base{0};

void count(int64_t n) {
  const int64_t live = g_live.fetch_add(n) + n;
  int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (live > peak && !g_peak.compare_exchange_weak(peak, live)) {
  }
}
}  // namespace

#if STRATA_TEST_SANITIZED
// compiler-rt's allocator interface (sanitizer/allocator_interface.h, which GCC does not ship).
extern "C" {
int __sanitizer_install_malloc_and_free_hooks(void (*malloc_hook)(const volatile void*, size_t),
                                              void (*free_hook)(const volatile void*));
size_t __sanitizer_get_allocated_size(const volatile void* p);
}

namespace {
void on_malloc(const volatile void* p, size_t n) {
  if (p) count(int64_t(n));
}
void on_free(const volatile void* p) {
  // Called before the block is released: its size is still known.
  if (p) g_live.fetch_sub(int64_t(__sanitizer_get_allocated_size(p)));
}
// Before main, so blocks allocated later and freed are counted both ways; blocks from before it
// are freed uncounted (live may go below 0 then), which moves only the base, not a peak.
const int g_hooks_installed = __sanitizer_install_malloc_and_free_hooks(on_malloc, on_free);
}  // namespace

#else
extern "C" {
void* __libc_malloc(size_t) noexcept;
void __libc_free(void*) noexcept;
void* __libc_calloc(size_t, size_t) noexcept;
void* __libc_realloc(void*, size_t) noexcept;
void* __libc_memalign(size_t, size_t) noexcept;
void* __libc_valloc(size_t) noexcept;
void* __libc_pvalloc(size_t) noexcept;
size_t malloc_usable_size(void*) noexcept;
}

namespace {

void held(void* p) {
  if (p) count(int64_t(malloc_usable_size(p)));
}

void released(void* p) {
  if (p) g_live.fetch_sub(int64_t(malloc_usable_size(p)));
}

bool power_of_two(size_t n) { return n != 0 && (n & (n - 1)) == 0; }

}  // namespace

extern "C" {

void* malloc(size_t n) noexcept {
  void* p = __libc_malloc(n);
  held(p);
  return p;
}

void free(void* p) noexcept {
  released(p);
  __libc_free(p);
}

void* calloc(size_t count, size_t size) noexcept {
  void* p = __libc_calloc(count, size);
  held(p);
  return p;
}

void* realloc(void* p, size_t n) noexcept {
  const int64_t before = p ? int64_t(malloc_usable_size(p)) : 0;
  void* q = __libc_realloc(p, n);
  if (q || n == 0) g_live.fetch_sub(before);  // moved, resized or freed; else p stays
  held(q);
  return q;
}

void* memalign(size_t alignment, size_t n) noexcept {
  void* p = __libc_memalign(alignment, n);
  held(p);
  return p;
}

void* aligned_alloc(size_t alignment, size_t n) noexcept { return memalign(alignment, n); }

int posix_memalign(void** out, size_t alignment, size_t n) noexcept {
  if (!power_of_two(alignment) || alignment % sizeof(void*) != 0) return EINVAL;
  void* p = __libc_memalign(alignment, n);
  if (!p) return ENOMEM;
  held(p);
  *out = p;
  return 0;
}

void* valloc(size_t n) noexcept {
  void* p = __libc_valloc(n);
  held(p);
  return p;
}

void* pvalloc(size_t n) noexcept {
  void* p = __libc_pvalloc(n);
  held(p);
  return p;
}

}  // extern "C"
#endif  // STRATA_TEST_SANITIZED

namespace strata::test {

bool AllocMeter::active() {
#if STRATA_TEST_SANITIZED
  return g_hooks_installed != 0;
#else
  return true;
#endif
}

void AllocMeter::reset_peak() {
  const int64_t live = g_live.load();
  g_base.store(live);
  g_peak.store(live);
}

int64_t AllocMeter::peak_since_reset() { return g_peak.load() - g_base.load(); }

int64_t AllocMeter::live() { return g_live.load(); }

int64_t peak_rss_bytes() {
  struct rusage usage {};
  ::getrusage(RUSAGE_SELF, &usage);
  return int64_t(usage.ru_maxrss) * 1024;
}

}  // namespace strata::test
