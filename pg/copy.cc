#include "pg/copy.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#define MC_PG_X86 1
#else
#define MC_PG_X86 0
#endif

namespace mooncake::pg {

namespace {

// Below these, plain memcpy is as good (a few lines) and keeps the data in cache.
constexpr size_t kStreamMin = 1024;
constexpr size_t kLoopMin = 256;

#if MC_PG_X86
void streamCopySse2(char* d, const char* s, size_t n) {
  for (size_t i = 0; i < n; i += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
}

void loadCopySse2(char* d, const char* s, size_t n) {
  for (size_t i = 0; i < n; i += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
}

using BodyFn = void (*)(void*, const void*, size_t);

struct Impl {
  BodyFn stream;
  BodyFn load;
};

const Impl& impl() {
  static const Impl i = [] {
#if defined(MC_PG_HAVE_AVX2_KERNELS)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) return Impl{&detail::streamCopyAvx2, &detail::loadCopyAvx2};
#endif
    return Impl{[](void* d, const void* s, size_t n) {
                  streamCopySse2(static_cast<char*>(d), static_cast<const char*>(s), n);
                },
                [](void* d, const void* s, size_t n) {
                  loadCopySse2(static_cast<char*>(d), static_cast<const char*>(s), n);
                }};
  }();
  return i;
}
#endif

}  // namespace

void copyToSharedNoFence(void* dst, const void* src, size_t n) {
#if MC_PG_X86
  if (n < kStreamMin) {
    std::memcpy(dst, src, n);
    return;
  }
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  size_t head = (32 - (reinterpret_cast<uintptr_t>(d) & 31)) & 31;  // align stores to 32
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  const size_t body = n & ~static_cast<size_t>(63);
  impl().stream(d, s, body);
  std::memcpy(d + body, s + body, n - body);
#else
  std::memcpy(dst, src, n);
#endif
}

void streamFence() {
#if MC_PG_X86
  _mm_sfence();
#endif
}

void copyToShared(void* dst, const void* src, size_t n) {
  copyToSharedNoFence(dst, src, n);
  streamFence();
}

void copyFromShared(void* dst, const void* src, size_t n) {
#if MC_PG_X86
  if (n < kLoopMin) {
    std::memcpy(dst, src, n);
    return;
  }
  const size_t body = n & ~static_cast<size_t>(63);
  impl().load(dst, src, body);
  std::memcpy(static_cast<char*>(dst) + body, static_cast<const char*>(src) + body, n - body);
#else
  std::memcpy(dst, src, n);
#endif
}

}  // namespace mooncake::pg
