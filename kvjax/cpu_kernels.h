// What the project's C++ CPU kernels share (kvjax.cpu_kernels builds them with this folder on
// the include path).
#ifndef KVJAX_CPU_KERNELS_H_
#define KVJAX_CPU_KERNELS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace kvjax {

#ifdef __AVX512F__
// The lane sums of sixteen vectors at once: lane 4i + j of the result is the sum of v[i + 4j]'s
// lanes. One tree of 128-bit-lane and in-lane shuffles (45 instructions) against about eight
// dependent instructions per vector for sixteen separate sums.
inline __m512 SumLanes16(const __m512 (&v)[16]) {
  // Halves of pairs: lanes 0-7 hold v[2k]'s two halves summed, lanes 8-15 v[2k+1]'s.
  __m512 a[8];
  for (int k = 0; k < 8; ++k)
    a[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  // 128-bit lane l of b[k] holds four partial sums of v[4k + l].
  __m512 b[4];
  for (int k = 0; k < 4; ++k)
    b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xDD));
  // 128-bit lane l of c[k]: [two partials of v[8k + l], two of v[8k + 4 + l]].
  __m512 c[2];
  for (int k = 0; k < 2; ++k)
    c[k] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * k], b[2 * k + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * k], b[2 * k + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
}
#endif

// A vector of floats (GCC vector extensions) from and to unaligned memory.
template <typename Vec>
inline Vec LoadVec(const float* p) {
  Vec x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
template <typename Vec>
inline void StoreVec(float* p, Vec x) {
  std::memcpy(p, &x, sizeof(x));
}

// e^f for |f| <= ln2 / 2 by its Taylor polynomial to degree 7 (relative error < 1e-8, below
// float32 rounding), on a float or lane-wise on a vector of floats.
template <typename T>
inline T ExpTaylor(T f) {
  T p = f * 0.0f + 1.0f / 5040.0f;
  p = p * f + 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  return p * f + 1.0f;
}

// Runs fn(i) for i in [0, n) on the caller and the pool's threads. Items are claimed from a
// shared counter, so a task the pool starts late finds nothing left and returns; the caller
// waits only for items already claimed (no deadlock when the pool is busy).
template <typename Fn>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, Fn fn) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  auto work = [state, n, fn]() {
    for (int64_t i; (i = state->next.fetch_add(1)) < n;) {
      fn(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule(decltype(work)(work));
  work();
  while (state->done.load(std::memory_order_acquire) < n) {
  }
}

}  // namespace kvjax

#endif  // KVJAX_CPU_KERNELS_H_
