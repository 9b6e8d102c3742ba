// x @ w[layer] (or x @ w[layer]^T) for few rows of x, reading one layer of the stacked weights
// in place: an XLA FFI handler for the CPU.
//
// A decode step multiplies a handful of token rows by every weight matrix once, so its cost is
// reading the weights. Inside the layer scan, XLA copies each layer's slice of the stacked
// [L, In, Out] weights before its matmul (a dynamic slice), and its matmul of a few rows packs
// the weights again; this kernel reads the layer's rows straight from the stacked buffer, once.
//
// Buffers (row-major):
//   x      f32  [T, In]
//   w      f32  [L, In, Out], or [L, Out, In] with the attribute transpose (a tied embedding
//              as the vocabulary projection)
//   layer  s32  []
//   out    f32  [T, Out]
// or x and w bf16, out bf16 or f32: products summed in float32 (as XLA's dot with a float32
// accumulator), then rounded to bfloat16 (to nearest even) for a bf16 out. With AVX-512 BF16,
// vdpbf16ps multiplies pairs of bfloat16 lanes: along In for [L, Out, In]; for [L, In, Out]
// (Out a multiple of 32) the first tile of x interleaves weight rows k and k + 1 into the
// pairs the other tiles read. Elsewhere bfloat16 weights are widened to float32 as loaded.
// From kGemmX rows of x (prefill, larger decode batches) with AVX-512 BF16, both layouts take
// the packed product instead (Gemm below): the weights packed into pairs once, the threads
// splitting the output (blocks of rows of x times strips of columns) rather than the weight
// rows, so no thread sums a [T, Out] partial.
//
// [L, In, Out]: each thread of XLA's intra-op pool takes a contiguous range of the weight rows
// and walks it a block of rows at a time (one contiguous piece of memory, read once,
// prefetched one block ahead); within a block, strips of kNV vectors of columns
// accumulate tiles of up to kMR rows of x in registers. Each range sums into its own partial
// output; the partials are added at the end, by all threads. (Walking each column strip down
// all rows instead reads the same bytes in a strided order, well below the rate of a
// sequential read; scripts/bench_linear.py measures the kernel.) Float32 from kStripsX rows
// of x, where the products set the time, splits the columns instead (LinearStrips below).
// [L, Out, In]: each output is a dot product of two contiguous rows; threads take ranges of
// weight rows (read sequentially), kDotRows of them at a time against tiles of kMR rows of x,
// and a whole 4 x 4 tile's sums are reduced together. From kPanelX rows of x (where the
// products, not the reads, set the time) a panel of kStrip weight rows is transposed in
// 16 x 16 blocks into a buffer and the broadcast tiles of [L, In, Out] multiply it: no lane
// sums, and x's rows are read kStrip outputs at a time instead of kDotRows.
// float32 [L, In, Out] from kGemmXF32 rows of x, at every build level, takes the packed
// product (Gemm below) as bfloat16 does: strips of kStrip weight columns packed once, the
// threads splitting the output into blocks of rows of x times strips, so no [T, Out] partials.
// With the attribute invariant, an output's sum never depends on T (batch-invariant
// numerics): [L, In, Out] sums each output over ranges of kInvariantBlocks blocks of weight
// rows (not ranges per thread, nor blocks sized by T) added in order; [L, Out, In] sums lanes
// one by one for every tile and takes no panels.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

#include "cpu_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#ifdef __AVX512F__
constexpr int kV = 16;  // floats per vector
constexpr int kNV = 6;  // vectors per strip: 4 x 6 accumulators + 6 weights + 1 broadcast
#else
constexpr int kV = 8;
constexpr int kNV = 3;  // 4 x 3 accumulators + 3 weights + 1 broadcast (16 ymm registers)
#endif
constexpr int kMR = 4;  // rows of x per tile
constexpr int kDotRows = 4;  // weight rows per tile of the transposed product
constexpr int kDotAheadTiles = 2;  // tiles of rows the transposed product prefetches ahead
constexpr int kSpread = 8;  // tiles of x over which the prefetching of weights is spread
constexpr int kHint = 1;  // __builtin_prefetch locality of weights (1 beat 2 and 3 side by side)
// Weight rows a range takes at a time: fewer for few rows of x (side by side in bench_linear,
// 16 beat 32 by 3-10% at 4-16 rows on a Zen 5 box, was even at 32 and lost 4% at 64; on a
// Zen 4 box, with half the FMA rate, 32 beat 16 by 5-6% at 24 and 32 rows).
constexpr int kBlockRows = 32;
constexpr int kBlockRowsFewX = 16;  // up to kFewX rows of x
constexpr int kFewX = 16;
constexpr int kItemsPerThread = 4;  // ranges per thread of the transposed product
// From kPanelX rows of x on, the transposed product transposes panels of kStrip weight rows
// and runs the broadcast tiles on them (with AVX-512; while a panel fits in L2: K <= kPanelMaxK).
constexpr int kPanelX = 24;
constexpr int kPanelMaxK = 1024;
// Blocks of weight rows per range under `invariant`: ranges (so the order of the sums) then
// follow In alone, not T or the thread count.
constexpr int64_t kInvariantBlocks = 8;
constexpr int64_t kParallelSumFloats = 1 << 14;  // outputs from which partials sum in parallel

constexpr int kStrip = kNV * kV;  // columns of a strip

typedef float Vec __attribute__((vector_size(kV * sizeof(float))));

inline Vec LoadV(const float* p) { return kvjax::LoadVec<Vec>(p); }
inline void StoreV(float* p, Vec x) { kvjax::StoreVec<Vec>(p, x); }
// acc + a * b, by one fused multiply-add where the CPU has it: spelled out, so that every
// instantiation of a tile rounds its products alike (the compiler contracts `acc += a * b`
// into an FMA in some and not in others, and the invariant order needs them all the same).
inline Vec MulAdd(Vec a, Vec b, Vec acc) {
#if defined(__AVX512F__)
  return (Vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#elif defined(__FMA__)
  return (Vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
  return acc + a * b;
#endif
}

// bfloat16 as its bits: the upper half of a float32's.
using Bf16 = uint16_t;
typedef uint32_t Bits __attribute__((vector_size(kV * sizeof(uint32_t))));
typedef Bf16 HalfBits __attribute__((vector_size(kV * sizeof(Bf16))));

inline float ToFloat(float x) { return x; }
inline float ToFloat(Bf16 x) {
  const uint32_t u = uint32_t{x} << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
// kV weights as floats: bfloat16 widened exactly (its bits shifted into a float's upper half).
inline Vec LoadW(const float* p) { return LoadV(p); }
inline Vec LoadW(const Bf16* p) {
  HalfBits h;
  std::memcpy(&h, p, sizeof(h));
  return (Vec)(__builtin_convertvector(h, Bits) << 16);
}

// Rounds float32 bits to bfloat16 as XLA's convert does: to nearest, ties to even; a NaN stays
// a (quiet) NaN, subnormals are kept.
template <typename U>
inline U RoundBits(U u) {
  const U rounded = (u + 0x7fff + ((u >> 16) & 1)) >> 16;
  return (u & 0x7fffffff) > 0x7f800000 ? (u >> 16) | 0x40 : rounded;
}

// dst[i] = src[i] rounded to bfloat16, for i < n.
void RoundToBf16(const float* src, int64_t n, Bf16* dst) {
  int64_t i = 0;
  for (; i + kV <= n; i += kV) {
    Bits u;
    std::memcpy(&u, src + i, sizeof(u));
    const HalfBits h = __builtin_convertvector(RoundBits(u), HalfBits);
    std::memcpy(dst + i, &h, sizeof(h));
  }
  for (; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, src + i, sizeof(u));
    dst[i] = static_cast<Bf16>(RoundBits(u));
  }
}

// dst[i] = src[i] widened to float32, for i < n.
void WidenBf16(const Bf16* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + kV <= n; i += kV) StoreV(dst + i, LoadW(src + i));
  for (; i < n; ++i) dst[i] = ToFloat(src[i]);
}

// Prefetching `units` rows of weights is spread over the first tiles of x, so that the requests
// overlap more of the arithmetic than one burst during the first tile does (at 8-64 rows of x;
// scripts/bench_linear.py): tile i of x's `tiles` issues units [lo, hi).
struct Part {
  int64_t lo = 0, hi = 0;  // none by default
};
inline Part PartOf(int64_t i, int64_t tiles, int64_t units) {
  const int64_t spread = std::max<int64_t>(std::min<int64_t>({tiles, units, kSpread}), 1);
  const int64_t per = (units + spread - 1) / spread;
  const int64_t lo = std::min(units, i * per);
  return {lo, std::min(units, lo + per)};
}

// A tile's weights: rows w + k * ldw. With `pack`, the tile also copies them there, kStrip
// floats apart, for the other tiles of x to read (a block's rows of a strip lie N floats apart,
// and with N = 1536 they fall into few L1 sets; the packed copy is contiguous). Steps k in
// [ahead.lo, ahead.hi) prefetch row k of `next`, rows ld_next apart.
template <typename W = float, typename P = W>  // the types of w and of next
struct Weights {
  const W* w;
  int64_t ldw;
  float* pack = nullptr;
  const P* next = nullptr;
  int64_t ld_next = 0;
  Part ahead = {};
};

// out[0:MR, 0:NV*kV] (+)= x[0:MR, 0:K] @ w[0:K, 0:NV*kV] (leading dimensions ldx, ldo; adding
// to out with `accumulate`). Inlined into each caller (as TileOf is; see PanelTile). W: the
// weights' type (bfloat16 weights are widened as they are loaded; the packed copy holds floats).
template <int MR, int NV, typename W, typename P>
[[gnu::always_inline]] inline void Tile(const float* x, int64_t ldx, const Weights<W, P>& wt,
                                        int64_t K, float* out, int64_t ldo, bool accumulate) {
  Vec acc[MR][NV] = {};
  if (accumulate)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NV; ++j) acc[i][j] = LoadV(out + i * ldo + j * kV);
  // Locals, so that the stores to pack and out need not reload them.
  const W* const w = wt.w;
  float* const pack = wt.pack;
  const P* const next = wt.next;
  const int64_t ldw = wt.ldw, ld_next = wt.ld_next, lo = wt.ahead.lo, hi = wt.ahead.hi;
  for (int64_t k = 0; k < K; ++k) {
    const W* row = w + k * ldw;
    if (k >= lo && k < hi) {
      for (int j = 0; j < NV * kV; j += 64 / sizeof(P))
        __builtin_prefetch(next + k * ld_next + j, 0, kHint);
    }
    Vec wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = LoadW(row + j * kV);
    if (pack)
      for (int j = 0; j < NV; ++j) StoreV(pack + k * kStrip + j * kV, wv[j]);
    for (int i = 0; i < MR; ++i) {
      const Vec xi = Vec{} + x[i * ldx + k];
      for (int j = 0; j < NV; ++j) acc[i][j] = MulAdd(xi, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) StoreV(out + i * ldo + j * kV, acc[i][j]);
}

template <int NV = kNV, typename W, typename P>
[[gnu::always_inline]] inline void TileOf(int mr, int nv, const float* x, int64_t ldx,
                                          const Weights<W, P>& wt, int64_t K, float* out,
                                          int64_t ldo, bool accumulate) {
  if constexpr (NV > 0) {
    if (nv != NV) return TileOf<NV - 1>(mr, nv, x, ldx, wt, K, out, ldo, accumulate);
    switch (mr) {
      case 1: return Tile<1, NV>(x, ldx, wt, K, out, ldo, accumulate);
      case 2: return Tile<2, NV>(x, ldx, wt, K, out, ldo, accumulate);
      case 3: return Tile<3, NV>(x, ldx, wt, K, out, ldo, accumulate);
      default: return Tile<kMR, NV>(x, ldx, wt, K, out, ldo, accumulate);
    }
  }
}

inline float Sum(Vec x) {
  float s = 0.0f;
  for (int i = 0; i < kV; ++i) s += x[i];
  return s;
}

#ifdef __AVX512F__
// out[i, j] = the sum of acc[i][j]'s lanes for i, j < 4, the 16 sums reduced together.
inline void SumTiles4x4(const Vec (&acc)[4][4], float* out, int64_t ldo) {
  __m512 v[16];
  for (int k = 0; k < 16; ++k) v[k] = (__m512)acc[k % 4][k / 4];
  const __m512 sums = kvjax::SumLanes16(v);  // lane 4i + j: acc[i][j]
  for (int i = 0; i < 4; ++i)
    _mm_storeu_ps(out + i * ldo, _mm512_extractf32x4_ps(sums, i));
}
#endif

// out[t, n] = dot(x[t, :K], w[n, :K]) for t < MR, n < NR (leading dimensions ldx, ldw, ldo);
// each step also prefetches its columns of weight rows [ahead.lo, ahead.hi) of `next`.
template <int MR, int NR, typename W>
void DotTile(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, float* out,
             int64_t ldo, const W* next, Part ahead, bool invariant) {
  Vec acc[MR][NR] = {};
  const int64_t whole = K / kV * kV;
  for (int64_t k = 0; k < whole; k += kV) {
    for (int64_t j = ahead.lo; j < ahead.hi; ++j)
      __builtin_prefetch(next + j * ldw + k, 0, kHint);
    Vec wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = LoadW(w + j * ldw + k);
    for (int i = 0; i < MR; ++i) {
      const Vec xi = LoadV(x + i * ldx + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = MulAdd(xi, wv[j], acc[i][j]);
    }
  }
#ifdef __AVX512F__
  if constexpr (MR == 4 && NR == 4) {
    if (whole == K && !invariant) return SumTiles4x4(acc, out, ldo);
  }
#endif
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = Sum(acc[i][j]);
      for (int64_t k = whole; k < K; ++k) s += x[i * ldx + k] * ToFloat(w[j * ldw + k]);
      out[i * ldo + j] = s;
    }
}

#ifdef __AVX512BF16__
// ---- bfloat16 x and w with AVX-512 BF16: vdpbf16ps adds the products of a pair of bfloat16
// lanes to a float32 lane (exact products, float32 sums), twice the products of an FMA. ----
constexpr int kPiece = 32;  // columns of one load of a bfloat16 weight row
constexpr int kPieces = kNV / 2;  // pieces of a strip

// Pair order: unpacking weight rows k and k + 1 interleaves their words within 128-bit lanes,
// so of a 32-column piece, vector 0 holds column 8l + e (e < 4) in lane 4l + e and vector 1
// column 8l + 4 + e. The row-block product sums in that order; Unpair puts columns back.
inline __m512i PairOf(const Bf16* x, bool second) {  // (x[0], x[1]) in every 32-bit lane
  uint32_t pair = x[0];
  if (second) std::memcpy(&pair, x, sizeof(pair));  // one broadcast from memory
  return _mm512_set1_epi32(static_cast<int>(pair));
}
inline __m512 Dot2(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// Weight rows of a pair tile: rows w + k * ldw (or, from_packed, the pairs the first tile of
// x interleaved into `pack`, kNV vectors per pair); prefetching as Weights.
struct PairWeights {
  const Bf16* w;
  int64_t ldw;
  __m512i* pack;
  const Bf16* next;
  int64_t ld_next;
  Part ahead;
};

// Rows k and k + 1 (`second`; else a zero row) of the tile's 2 * NP weight vectors, in pair
// order, and their products with MR rows of x added to acc.
template <int MR, int NP, bool kFromPacked>
[[gnu::always_inline]] inline void PairStep(const Bf16* x, int64_t ldx, const PairWeights& wt,
                                            int64_t k, bool second, __m512 (&acc)[MR][2 * NP]) {
  for (int64_t r = k; r < k + 2; ++r)
    if (r >= wt.ahead.lo && r < wt.ahead.hi)
      for (int j = 0; j < NP * kPiece; j += 64 / sizeof(Bf16))
        __builtin_prefetch(wt.next + r * wt.ld_next + j, 0, kHint);
  __m512i wv[2 * NP];
  if constexpr (kFromPacked) {
    for (int j = 0; j < 2 * NP; ++j) wv[j] = _mm512_load_si512(wt.pack + k / 2 * kNV + j);
  } else {
    for (int q = 0; q < NP; ++q) {
      const __m512i a = _mm512_loadu_si512(wt.w + k * wt.ldw + q * kPiece);
      const __m512i b = second ? _mm512_loadu_si512(wt.w + (k + 1) * wt.ldw + q * kPiece)
                               : _mm512_setzero_si512();
      wv[2 * q] = _mm512_unpacklo_epi16(a, b);
      wv[2 * q + 1] = _mm512_unpackhi_epi16(a, b);
    }
    if (wt.pack)
      for (int j = 0; j < 2 * NP; ++j) _mm512_store_si512(wt.pack + k / 2 * kNV + j, wv[j]);
  }
  for (int i = 0; i < MR; ++i) {
    const __m512i xi = PairOf(x + i * ldx + k, second);
    for (int j = 0; j < 2 * NP; ++j) acc[i][j] = Dot2(acc[i][j], xi, wv[j]);
  }
}

// out[0:MR, 0:NP*kPiece] (+)= x[0:MR, 0:K] @ w[0:K, 0:NP*kPiece], columns in pair order.
template <int MR, int NP, bool kFromPacked>
[[gnu::always_inline]] inline void PairTile(const Bf16* x, int64_t ldx, const PairWeights& wt,
                                            int64_t K, float* out, int64_t ldo,
                                            bool accumulate) {
  __m512 acc[MR][2 * NP];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 2 * NP; ++j)
      acc[i][j] = accumulate ? _mm512_loadu_ps(out + i * ldo + j * 16) : _mm512_setzero_ps();
  for (int64_t k = 0; k + 1 < K; k += 2) PairStep<MR, NP, kFromPacked>(x, ldx, wt, k, true, acc);
  if (K % 2) PairStep<MR, NP, kFromPacked>(x, ldx, wt, K - 1, false, acc);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 2 * NP; ++j) _mm512_storeu_ps(out + i * ldo + j * 16, acc[i][j]);
}

template <int NP = kPieces, bool kFromPacked>
void PairTileOf(int mr, int np, const Bf16* x, int64_t ldx, const PairWeights& wt, int64_t K,
                float* out, int64_t ldo, bool accumulate) {
  if constexpr (NP > 0) {
    if (np != NP) return PairTileOf<NP - 1, kFromPacked>(mr, np, x, ldx, wt, K, out, ldo,
                                                         accumulate);
    switch (mr) {
      case 1: return PairTile<1, NP, kFromPacked>(x, ldx, wt, K, out, ldo, accumulate);
      case 2: return PairTile<2, NP, kFromPacked>(x, ldx, wt, K, out, ldo, accumulate);
      case 3: return PairTile<3, NP, kFromPacked>(x, ldx, wt, K, out, ldo, accumulate);
      default: return PairTile<kMR, NP, kFromPacked>(x, ldx, wt, K, out, ldo, accumulate);
    }
  }
}

// RowBlock on bfloat16 x and w (N a multiple of kPiece): o in pair order; the first tile of x
// interleaves the pairs into `packed` for the others.
void RowBlock(const Bf16* xk, int64_t T, int64_t K, const Bf16* wk, int64_t N, int64_t rows,
              const Bf16* next, float* o, bool add, float* packed_floats) {
  __m512i* packed = reinterpret_cast<__m512i*>(packed_floats);
  const int64_t pieces = N / kPiece;
  const int64_t tiles = (T + kMR - 1) / kMR;
  for (int64_t s = 0; s * kPieces < pieces; ++s) {
    const int np = static_cast<int>(std::min<int64_t>(kPieces, pieces - s * kPieces));
    const int64_t n0 = s * kStrip;
    for (int64_t t = 0; t < T; t += kMR) {
      const int mr = static_cast<int>(std::min<int64_t>(kMR, T - t));
      const PairWeights wt{wk + n0, N, T > kMR || t > 0 ? packed : nullptr,
                           next ? next + n0 : nullptr, N,
                           next ? PartOf(t / kMR, tiles, rows) : Part{}};
      if (t == 0) {
        PairTileOf<kPieces, false>(mr, np, xk + t * K, K, wt, rows, o + t * N + n0, N, add);
      } else {
        PairTileOf<kPieces, true>(mr, np, xk + t * K, K, wt, rows, o + t * N + n0, N, add);
      }
    }
  }
}

// o [T, N] from pair order to column order, in place (N a multiple of kPiece).
void Unpair(float* o, int64_t T, int64_t N) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22,
                                          23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28,
                                           29, 30, 31);
  for (int64_t i = 0; i < T * N; i += kPiece) {
    const __m512 lo = _mm512_loadu_ps(o + i), hi = _mm512_loadu_ps(o + i + 16);
    _mm512_storeu_ps(o + i, _mm512_permutex2var_ps(lo, first, hi));
    _mm512_storeu_ps(o + i + 16, _mm512_permutex2var_ps(lo, second, hi));
  }
}

// The transposed product's tile on bfloat16 rows: out[t, n] = dot(x[t, :K], w[n, :K]),
// kPiece columns of both per vdpbf16ps (the rows' tails loaded under a mask, as zeros).
template <int MR, int NR>
void DotTile(const Bf16* x, int64_t ldx, const Bf16* w, int64_t ldw, int64_t K, float* out,
             int64_t ldo, const Bf16* next, Part ahead, bool invariant) {
  Vec acc[MR][NR] = {};
  for (int64_t k = 0; k < K; k += kPiece) {
    const __mmask32 m = K - k >= kPiece ? ~__mmask32{0} : (__mmask32{1} << (K - k)) - 1;
    for (int64_t j = ahead.lo; j < ahead.hi; ++j)
      __builtin_prefetch(next + j * ldw + k, 0, kHint);
    __m512i wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm512_maskz_loadu_epi16(m, w + j * ldw + k);
    for (int i = 0; i < MR; ++i) {
      const __m512i xi = _mm512_maskz_loadu_epi16(m, x + i * ldx + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = (Vec)Dot2((__m512)acc[i][j], xi, wv[j]);
    }
  }
  if constexpr (MR == 4 && NR == 4) {
    if (!invariant) return SumTiles4x4(acc, out, ldo);
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[i * ldo + j] = Sum(acc[i][j]);
}
#endif

// Outputs [n0, n0 + NR) of every row of x; the weight rows kDotAheadTiles tiles further on
// are prefetched meanwhile (spread over x's first tiles). X: float32, or bfloat16 pairs.
template <int NR, typename X, typename W>
void DotRows(const X* x, int64_t T, int64_t K, const W* w, int64_t N, float* out,
             int64_t n0, bool invariant) {
  const W* wn = w + n0 * K;
  const W* next = wn + kDotAheadTiles * NR * K;
  const bool room = n0 + (kDotAheadTiles + 1) * NR <= N;
  const int64_t tiles = (T + kMR - 1) / kMR;
  for (int64_t t = 0; t < T; t += kMR) {
    const X* xt = x + t * K;
    float* ot = out + t * N + n0;
    const Part ahead = room ? PartOf(t / kMR, tiles, NR) : Part{};
    switch (std::min<int64_t>(kMR, T - t)) {
      case 1: DotTile<1, NR>(xt, K, wn, K, K, ot, N, next, ahead, invariant); break;
      case 2: DotTile<2, NR>(xt, K, wn, K, K, ot, N, next, ahead, invariant); break;
      case 3: DotTile<3, NR>(xt, K, wn, K, K, ot, N, next, ahead, invariant); break;
      default: DotTile<kMR, NR>(xt, K, wn, K, K, ot, N, next, ahead, invariant); break;
    }
  }
}

using kvjax::ParallelFor;

#ifdef __AVX512F__
// dst[j * ldd + i] = src[i * lds + j] for i, j < 16: one 16 x 16 block transposed in registers
// (pairs of rows interleaved, then pairs of pairs, then 128-bit lanes; 64 shuffles).
inline void Transpose16x16(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);  // per 128-bit lane: a0 b0 a1 b1
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);  // a2 b2 a3 b3
  }
  // Now r[4g + e], 128-bit lane l: element 4l + e of rows 4g .. 4g + 3.
  for (int g = 0; g < 4; ++g) {
    const __m512* a = t + 4 * g;
    r[4 * g] = _mm512_shuffle_ps(a[0], a[2], 0x44);
    r[4 * g + 1] = _mm512_shuffle_ps(a[0], a[2], 0xEE);
    r[4 * g + 2] = _mm512_shuffle_ps(a[1], a[3], 0x44);
    r[4 * g + 3] = _mm512_shuffle_ps(a[1], a[3], 0xEE);
  }
  // Column 4l + e gathers lane l of r[e], r[4 + e], r[8 + e], r[12 + e].
  for (int e = 0; e < 4; ++e) {
    const __m512 v0 = _mm512_shuffle_f32x4(r[e], r[4 + e], 0x88);
    const __m512 v1 = _mm512_shuffle_f32x4(r[e], r[4 + e], 0xDD);
    const __m512 v2 = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0x88);
    const __m512 v3 = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0xDD);
    _mm512_storeu_ps(dst + e * ldd, _mm512_shuffle_f32x4(v0, v2, 0x88));
    _mm512_storeu_ps(dst + (4 + e) * ldd, _mm512_shuffle_f32x4(v1, v3, 0x88));
    _mm512_storeu_ps(dst + (8 + e) * ldd, _mm512_shuffle_f32x4(v0, v2, 0xDD));
    _mm512_storeu_ps(dst + (12 + e) * ldd, _mm512_shuffle_f32x4(v1, v3, 0xDD));
  }
}

// A tile of a panel: the row-block product's tile, in a copy of its own (sharing one out-of-line
// copy, or inlining it here as well, made one of the two products clearly slower side by side
// in bench_linear: GCC's code for the tile differs with its caller).
[[gnu::noinline]] void PanelTile(int mr, const float* x, int64_t ldx, const Weights<>& wt,
                                 int64_t K, float* out, int64_t ldo) {
  TileOf(mr, kNV, x, ldx, wt, K, out, ldo, false);
}

// out[:, n0 : n0 + kStrip] = x [T, K] @ w[n0 : n0 + kStrip, :]^T with the broadcast tiles of
// the untransposed product: the panel of kStrip weight rows is transposed into `packed`
// ([K, kStrip], in L2) and every tile of x multiplies it. The next panel (contiguous: K rows
// of kStrip floats) is prefetched meanwhile, spread over the first tiles.
void PanelRows(const float* x, int64_t T, int64_t K, const float* w, int64_t N, float* out,
               int64_t n0, float* packed) {
  const float* wp = w + n0 * K;
  const int64_t whole = K / 16 * 16;
  for (int64_t r = 0; r < kStrip; r += 16)
    for (int64_t c = 0; c < whole; c += 16)
      Transpose16x16(wp + r * K + c, K, packed + c * kStrip + r, kStrip);
  for (int64_t c = whole; c < K; ++c)
    for (int64_t r = 0; r < kStrip; ++r) packed[c * kStrip + r] = wp[r * K + c];
  const int64_t tiles = (T + kMR - 1) / kMR;
  for (int64_t t = 0; t < T; t += kMR) {
    Weights<> wt{packed, kStrip};
    if (n0 + 2 * kStrip <= N) {
      wt.next = wp + kStrip * K;
      wt.ld_next = kStrip;
      wt.ahead = PartOf(t / kMR, tiles, K);
    }
    const int mr = static_cast<int>(std::min<int64_t>(kMR, T - t));
    PanelTile(mr, x + t * K, K, wt, K, out + t * N + n0, N);
  }
}
#endif

// fn(lo, hi) for ranges of [0, units) on the pool's threads, about kItemsPerThread per thread
// (ranges of rows or panels of the transposed product: its threads finish closer together).
template <typename Fn>
void ParallelRanges(ffi::ThreadPool& pool, int64_t units, Fn fn) {
  if (units <= 0) return;
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t per_item = std::max<int64_t>(1, units / (threads * kItemsPerThread));
  ParallelFor(pool, (units + per_item - 1) / per_item, [&](int64_t i) {
    fn(i * per_item, std::min(units, (i + 1) * per_item));
  });
}

// x [T, K] @ w[N, K]^T. `invariant`: every output by the same sequence of operations (lane
// sums one by one, no panels) whatever T, so a row's result does not follow the batch.
// Panels transpose float32 weights only.
template <typename X, typename W>
void LinearTransposed(ffi::ThreadPool& pool, const X* xp, int64_t T, int64_t K,
                      const W* wp, int64_t N, float* op, bool invariant) {
  int64_t done = 0;  // rows of w
#ifdef __AVX512F__
  if (std::is_same_v<X, float> && std::is_same_v<W, float> && T >= kPanelX && K <= kPanelMaxK && !invariant) {
    const int64_t panels = N / kStrip;
    ParallelRanges(pool, panels, [&](int64_t lo, int64_t hi) {
      std::unique_ptr<float[]> packed(new float[K * kStrip]);
      for (int64_t p = lo; p < hi; ++p)
        PanelRows(reinterpret_cast<const float*>(xp), T, K, reinterpret_cast<const float*>(wp),
                  N, op, p * kStrip, packed.get());
    });
    done = panels * kStrip;
  }
#endif
  const int64_t tiles = (N - done) / kDotRows;
  ParallelRanges(pool, tiles, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r)
      DotRows<kDotRows>(xp, T, K, wp, N, op, done + r * kDotRows, invariant);
  });
  for (int64_t n = done + tiles * kDotRows; n < N; ++n)
    DotRows<1>(xp, T, K, wp, N, op, n, invariant);
}

// One block of `rows` weight rows (wk [rows, N]) times x's columns xk [T, rows] (rows K
// apart) into o [T, N], added to it with `add`; the first tile of x copies each strip's rows
// into `packed` for the others. `next`: the next block's rows, prefetched meanwhile.
template <typename W>
[[gnu::always_inline]] inline void RowBlock(const float* xk, int64_t T, int64_t K, const W* wk,
                                            int64_t N, int64_t rows, const W* next, float* o,
                                            bool add, float* packed) {
  const int64_t vectors = N / kV;
  const int64_t strips = (vectors + kNV - 1) / kNV;
  const int64_t tiles = (T + kMR - 1) / kMR;  // of x
  for (int64_t s = 0; s < strips; ++s) {
    const int nv = static_cast<int>(std::min<int64_t>(kNV, vectors - s * kNV));
    const int64_t n0 = s * kStrip;
    for (int64_t t = 0; t < T; t += kMR) {
      const float* xt = xk + t * K;
      float* ot = o + t * N + n0;
      const int mr = static_cast<int>(std::min<int64_t>(kMR, T - t));
      const W* next_n0 = next ? next + n0 : nullptr;
      const Part ahead = next ? PartOf(t / kMR, tiles, rows) : Part{};
      if constexpr (std::is_same_v<W, float>) {  // one call site: as tuned
        Weights<> wt = t == 0 ? Weights<>{wk + n0, N, T > kMR ? packed : nullptr}
                              : Weights<>{packed, kStrip};
        wt.next = next_n0;
        wt.ld_next = N;
        wt.ahead = ahead;
        TileOf(mr, nv, xt, K, wt, rows, ot, N, add);
      } else if (t == 0) {
        TileOf(mr, nv, xt, K, Weights<W>{wk + n0, N, T > kMR ? packed : nullptr, next_n0, N,
                                         ahead}, rows, ot, N, add);
      } else {
        TileOf(mr, nv, xt, K, Weights<float, W>{packed, kStrip, nullptr, next_n0, N, ahead},
               rows, ot, N, add);
      }
    }
  }
  for (int64_t t = 0; t < T; ++t)  // columns past the last whole vector
    for (int64_t n = vectors * kV; n < N; ++n) {
      float acc = add ? o[t * N + n] : 0.0f;
      for (int64_t k = 0; k < rows; ++k) acc += xk[t * K + k] * ToFloat(wk[k * N + n]);
      o[t * N + n] = acc;
    }
}

// x [T, K] @ w[K, N] (see the top of the file): range i of the rows sums into out (i = 0) or
// a partial (every range is non-empty, and its first block writes all of its partial).
// X = W = Bf16 (AVX-512 BF16, N a multiple of kPiece): pair tiles, out in pair order.
template <typename X, typename W>
void LinearRowBlocks(ffi::ThreadPool& pool, const X* xp, int64_t T, int64_t K,
                     const W* wp, int64_t N, float* op, bool invariant) {
  const int64_t block = T <= kFewX && !invariant ? kBlockRowsFewX : kBlockRows;
  const int64_t blocks = (K + block - 1) / block;
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t blocks_per_item =
      invariant ? kInvariantBlocks : (blocks + threads - 1) / threads;
  const int64_t items = (blocks + blocks_per_item - 1) / blocks_per_item;
  const int64_t per = blocks_per_item * block;
  const int64_t size = T * N;
  std::unique_ptr<float[]> partial(new float[(items - 1) * size]);  // left uninitialized
  ParallelFor(pool, items, [&](int64_t i) {
    float* o = i == 0 ? op : partial.get() + (i - 1) * size;
    alignas(64) float packed[kBlockRows * kStrip];
    const int64_t k_end = std::min(K, (i + 1) * per);
    for (int64_t k0 = i * per; k0 < k_end; k0 += block) {
      const W* wk = wp + k0 * N;
      RowBlock(xp + k0, T, K, wk, N, std::min<int64_t>(block, k_end - k0),
               k0 + block < k_end ? wk + block * N : nullptr, o, k0 > i * per, packed);
    }
  });
  if (items == 1) return;
  // All threads add the partials, each over its own piece of the output (one thread adding
  // them left the other idle for a few percent of a 32-row step's matmul time).
  const int64_t pieces = size >= kParallelSumFloats ? threads : 1;
  const int64_t piece = (size + pieces - 1) / pieces;
  ParallelFor(pool, pieces, [&](int64_t c) {
    const int64_t j0 = c * piece, j1 = std::min(size, j0 + piece);
    for (int64_t i = 1; i < items; ++i) {
      const float* p = partial.get() + (i - 1) * size;
      for (int64_t j = j0; j < j1; ++j) op[j] += p[j];
    }
  });
}

// float32 [L, In, Out] from kStripsX rows of x (below kGemmXF32), not under `invariant`, N a
// multiple of kV: the threads split the output's columns instead of the weight rows, a strip
// of kStrip columns per item, so no [T, Out] partials are summed at the end. An item walks
// its strip kStripDepth weight rows at a time (prefetching the next chunk's rows meanwhile):
// the first tile of x copies the chunk into `packed` for the others, and the strip's [T,
// kStrip] outputs are reloaded per chunk from L1 rather than a whole [T, Out] partial per
// block from L2.
constexpr int64_t kStripsX = 16;
constexpr int64_t kStripDepth = 64;

void LinearStrips(ffi::ThreadPool& pool, const float* xp, int64_t T, int64_t K,
                  const float* wp, int64_t N, float* op) {
  const int64_t strips = (N / kV + kNV - 1) / kNV;
  const int64_t tiles = (T + kMR - 1) / kMR;  // of x
  ParallelFor(pool, strips, [&](int64_t s) {
    alignas(64) float packed[kStripDepth * kStrip];
    const int nv = static_cast<int>(std::min<int64_t>(kNV, N / kV - s * kNV));
    const int64_t n0 = s * kStrip;
    for (int64_t k0 = 0; k0 < K; k0 += kStripDepth) {
      const int64_t rows = std::min(kStripDepth, K - k0);
      const float* wk = wp + k0 * N + n0;
      const float* next = k0 + kStripDepth < K ? wk + kStripDepth * N : nullptr;
      const int64_t next_rows = next ? std::min(kStripDepth, K - k0 - kStripDepth) : 0;
      for (int64_t t = 0; t < T; t += kMR) {
        const int mr = static_cast<int>(std::min<int64_t>(kMR, T - t));
        Weights<> wt = t == 0 ? Weights<>{wk, N, T > kMR ? packed : nullptr}
                              : Weights<>{packed, kStrip};
        wt.next = next;
        wt.ld_next = N;
        wt.ahead = next ? PartOf(t / kMR, tiles, next_rows) : Part{};
        TileOf(mr, nv, xp + t * K + k0, K, wt, rows, op + t * N + n0, N, k0 > 0);
      }
    }
  });
}

// ---- The packed product (float32 [L, In, Out] at every level from kGemmXF32 rows of x;
// bfloat16 with AVX-512 BF16 from kGemmX): the row blocks give each thread a range of weight rows summing
// a whole [T, Out] partial, which at hundreds of rows of x (megabytes) is loaded and stored
// again for every block of weight rows. Here the weights of a strip of kStrip columns are
// packed once (contiguous, zeros past Out), and the threads split the output: an item is a
// block of up to kGemmRows rows of x times one strip, its tiles summing kGemmDepth weight
// rows at a time in registers (that much of the packed strip stays in L2) into a scratch
// that stays in L1, stored once at the end. Each output is one sum over In in order,
// whatever T; but the row blocks below kGemmXF32 rows sum in another order, so the invariant
// order never takes this path. ----
constexpr int64_t kGemmRows = 64;  // rows of x per item
constexpr int64_t kGemmDepth = 256;  // weight rows per pass of a tile (even)
// Rows of x from which float32 [L, In, Out] runs the packed product (bench_linear side by
// side with the row blocks: level at 1024 rows, 0.77x their time at 2048; docs/benchmarks.md
// "The float32 packed matmul").
constexpr int64_t kGemmXF32 = 1024;
constexpr int64_t kPackAhead = 16;  // weight rows PackStrip prefetches ahead

// What a packed strip is made of, and how many of them it takes for K weight rows: float32
// rows of kStrip floats (kNV vectors per row).
template <typename X>
struct Packed;
template <>
struct Packed<float> {
  using Unit = Vec;
  static int64_t Size(int64_t K) { return K * kNV; }
};

// w [K, N]'s columns [n0, n0 + kStrip) as K rows of kStrip floats (zeros past N) at b.
void PackStrip(const float* w, int64_t K, int64_t N, int64_t n0, Vec* b) {
  float* d = reinterpret_cast<float*>(b);
  const int64_t cols = std::min<int64_t>(kStrip, N - n0);
  for (int64_t k = 0; k < K; ++k) {
    if (k + kPackAhead < K)
      for (int64_t j = 0; j < cols; j += 64 / sizeof(float))
        __builtin_prefetch(w + (k + kPackAhead) * N + n0 + j, 0, kHint);
    std::memcpy(d + k * kStrip, w + k * N + n0, cols * sizeof(float));
    std::fill(d + k * kStrip + cols, d + (k + 1) * kStrip, 0.0f);
  }
}

// out[0:rows, 0:cols] = x[0:rows, 0:K] @ a packed float32 strip b (leading dimensions ldx,
// ldo): rows <= kGemmRows, cols <= kStrip; the row-block product's broadcast tiles.
void GemmBlock(const float* x, int64_t ldx, int64_t rows, int64_t K, const Vec* b,
               float* out, int64_t ldo, int64_t cols) {
  alignas(64) float scratch[kGemmRows * kStrip];
  const float* bf = reinterpret_cast<const float*>(b);
  for (int64_t k0 = 0; k0 < K; k0 += kGemmDepth) {
    const int64_t depth = std::min(kGemmDepth, K - k0);
    const Weights<> wt{bf + k0 * kStrip, kStrip};
    for (int64_t t = 0; t < rows; t += kMR) {
      const int mr = static_cast<int>(std::min<int64_t>(kMR, rows - t));
      TileOf(mr, kNV, x + t * ldx + k0, ldx, wt, depth, scratch + t * kStrip, kStrip, k0 > 0);
    }
  }
  for (int64_t t = 0; t < rows; ++t)
    std::memcpy(out + t * ldo, scratch + t * kStrip, cols * sizeof(float));
}

#ifdef __AVX512BF16__
// ---- The packed product on bfloat16 x and w: per column, weight rows k and k + 1 in one
// 32-bit lane (columns in order), multiplied by vdpbf16ps. ----
// Rows of x from which the packed product runs (bench_linear --dtype=bfloat16, side by side
// with the row blocks at 32-64 rows: 0.4-0.9x their time on a loaded machine).
constexpr int64_t kGemmX = 32;

template <>
struct Packed<Bf16> {
  using Unit = __m512i;
  static int64_t Size(int64_t K) { return (K + 1) / 2 * kNV; }
};

// scratch[0:MR, 0:kStrip] (+)= x[0:MR, 0:K] @ the pairs b (kNV vectors per pair of weight
// rows; an odd K's last pair has a zero second row, and x's word past K is not read).
template <int MR>
[[gnu::always_inline]] inline void GemmTile(const Bf16* x, int64_t ldx, const __m512i* b,
                                            int64_t K, float* scratch, bool accumulate) {
  __m512 acc[MR][kNV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kNV; ++j)
      acc[i][j] = accumulate ? _mm512_load_ps(scratch + i * kStrip + j * 16)
                             : _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 1 < K; k += 2, b += kNV) {
    __m512i wv[kNV];
    for (int j = 0; j < kNV; ++j) wv[j] = _mm512_load_si512(b + j);
    for (int i = 0; i < MR; ++i) {
      const __m512i xi = PairOf(x + i * ldx + k, true);
      for (int j = 0; j < kNV; ++j) acc[i][j] = Dot2(acc[i][j], xi, wv[j]);
    }
  }
  if (k < K) {
    for (int i = 0; i < MR; ++i) {
      const __m512i xi = PairOf(x + i * ldx + k, false);
      for (int j = 0; j < kNV; ++j) acc[i][j] = Dot2(acc[i][j], xi, _mm512_load_si512(b + j));
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kNV; ++j) _mm512_store_ps(scratch + i * kStrip + j * 16, acc[i][j]);
}

inline void StoreRow(const float* src, int64_t n, float* dst) {
  std::memcpy(dst, src, n * sizeof(float));
}
inline void StoreRow(const float* src, int64_t n, Bf16* dst) { RoundToBf16(src, n, dst); }

// out[0:rows, 0:cols] = x[0:rows, 0:K] @ a strip's pairs b (leading dimensions ldx, ldo):
// rows <= kGemmRows, cols <= kStrip. O: float, or bfloat16 (rounded to nearest even).
template <typename O>
void GemmBlock(const Bf16* x, int64_t ldx, int64_t rows, int64_t K, const __m512i* b,
               O* out, int64_t ldo, int64_t cols) {
  alignas(64) float scratch[kGemmRows * kStrip];
  for (int64_t k0 = 0; k0 < K; k0 += kGemmDepth) {
    const int64_t depth = std::min(kGemmDepth, K - k0);
    const __m512i* bk = b + k0 / 2 * kNV;
    for (int64_t t = 0; t < rows; t += kMR) {
      const Bf16* xt = x + t * ldx + k0;
      float* st = scratch + t * kStrip;
      switch (std::min<int64_t>(kMR, rows - t)) {
        case 1: GemmTile<1>(xt, ldx, bk, depth, st, k0 > 0); break;
        case 2: GemmTile<2>(xt, ldx, bk, depth, st, k0 > 0); break;
        case 3: GemmTile<3>(xt, ldx, bk, depth, st, k0 > 0); break;
        default: GemmTile<kMR>(xt, ldx, bk, depth, st, k0 > 0); break;
      }
    }
  }
  for (int64_t t = 0; t < rows; ++t) StoreRow(scratch + t * kStrip, cols, out + t * ldo);
}

// The pairs of w [K, N]'s columns [n0, n0 + kStrip) (zeros past N, and a zero row past K):
// pair p at b + p * kNV.
void PackStrip(const Bf16* w, int64_t K, int64_t N, int64_t n0, __m512i* b) {
  alignas(64) uint16_t first[32], second[32];  // words of rows k (< 32) and k + 1 (>= 32)
  for (int j = 0; j < 16; ++j) {
    first[2 * j] = j, first[2 * j + 1] = 32 + j;
    second[2 * j] = 16 + j, second[2 * j + 1] = 48 + j;
  }
  const __m512i lo = _mm512_load_si512(first), hi = _mm512_load_si512(second);
  for (int64_t p = 0; 2 * p < K; ++p) {
    for (int q = 0; q < kPieces; ++q) {
      const int64_t c = n0 + q * kPiece;
      const __mmask32 m = c >= N ? 0 : N - c >= kPiece ? ~__mmask32{0}
                                                      : (__mmask32{1} << (N - c)) - 1;
      const __m512i a = _mm512_maskz_loadu_epi16(m, w + 2 * p * N + c);
      const __m512i e = 2 * p + 1 < K ? _mm512_maskz_loadu_epi16(m, w + (2 * p + 1) * N + c)
                                      : _mm512_setzero_si512();
      b[p * kNV + 2 * q] = _mm512_permutex2var_epi16(a, lo, e);
      b[p * kNV + 2 * q + 1] = _mm512_permutex2var_epi16(a, hi, e);
    }
  }
}

// The pairs of the transposed weights w [N, K]'s rows [n0, n0 + kStrip) as PackStrip's:
// a row's pairs are its own 32-bit words, so with K even a 32-bit transpose of 16 x 16 blocks
// (Transpose16x16 moves bits, whatever the floats) packs them; the rest word by word.
void PackPanel(const Bf16* w, int64_t N, int64_t K, int64_t n0, __m512i* b) {
  uint32_t* d = reinterpret_cast<uint32_t*>(b);
  const int64_t pairs = (K + 1) / 2, rows = std::min<int64_t>(kStrip, N - n0);
  const int64_t whole = K % 2 == 0 ? K / 2 / 16 * 16 : 0, full = rows / 16 * 16;
  for (int64_t r = 0; r < full; r += 16)
    for (int64_t c = 0; c < whole; c += 16)
      Transpose16x16(reinterpret_cast<const float*>(w + (n0 + r) * K) + c, K / 2,
                     reinterpret_cast<float*>(d + c * kStrip + r), kStrip);
  auto word = [&](int64_t r, int64_t c) {
    if (r >= rows) return uint32_t{0};
    const Bf16* s = w + (n0 + r) * K + 2 * c;
    return s[0] | (2 * c + 1 < K ? uint32_t{s[1]} << 16 : 0u);
  };
  for (int64_t c = 0; c < whole; ++c)
    for (int64_t r = full; r < kStrip; ++r) d[c * kStrip + r] = word(r, c);
  for (int64_t c = whole; c < pairs; ++c)
    for (int64_t r = 0; r < kStrip; ++r) d[c * kStrip + r] = word(r, c);
}


#endif

// x [T, K] @ w[K, N] (w[N, K]^T with `transpose`, bfloat16 only) into out [T, N]: the packed
// product, on float32 x and w (out float32) or bfloat16 (out float32, or bfloat16 rounded).
// Untransposed, all strips are packed first (in parallel), then items of blocks of rows of x
// times strips run; transposed, each range of panels packs one panel at a time and
// multiplies every row of x by it. (float32 panels: PanelRows, which the packed product did
// not beat on the output head at 16-2048 rows.)
template <typename X, typename O>
void Gemm(ffi::ThreadPool& pool, const X* x, int64_t T, int64_t K, const X* w, int64_t N,
          bool transpose, O* out) {
  using Unit = typename Packed<X>::Unit;
  const int64_t strips = (N + kStrip - 1) / kStrip, size = Packed<X>::Size(K);
  const int64_t blocks = (T + kGemmRows - 1) / kGemmRows;
  if constexpr (!std::is_same_v<X, float>) {
    if (transpose) {
      ParallelRanges(pool, strips, [&](int64_t lo, int64_t hi) {
        std::unique_ptr<Unit[]> packed(new Unit[size]);
        for (int64_t s = lo; s < hi; ++s) {
          PackPanel(w, N, K, s * kStrip, packed.get());
          for (int64_t t0 = 0; t0 < T; t0 += kGemmRows)
            GemmBlock(x + t0 * K, K, std::min(kGemmRows, T - t0), K, packed.get(),
                      out + t0 * N + s * kStrip, N, std::min<int64_t>(kStrip, N - s * kStrip));
        }
      });
      return;
    }
  }
  std::unique_ptr<Unit[]> packed(new Unit[strips * size]);
  ParallelFor(pool, strips, [&](int64_t s) {
    PackStrip(w, K, N, s * kStrip, packed.get() + s * size);
  });
  ParallelFor(pool, blocks * strips, [&](int64_t i) {  // a block of x, strip after strip
    const int64_t s = i % strips, t0 = i / strips * kGemmRows;
    GemmBlock(x + t0 * K, K, std::min(kGemmRows, T - t0), K, packed.get() + s * size,
              out + t0 * N + s * kStrip, N, std::min<int64_t>(kStrip, N - s * kStrip));
  });
}

// x [T, K] @ w[K, N] (w[N, K]^T with `transpose`) on float32: untransposed, the packed
// product from kGemmXF32 rows of x, never under `invariant`; else the row blocks, or the
// transposed rows and panels.
void LinearF32(ffi::ThreadPool& pool, const float* x, int64_t T, int64_t K, const float* w,
               int64_t N, bool transpose, float* out, bool invariant) {
  if (!transpose && T >= kGemmXF32 && !invariant) return Gemm(pool, x, T, K, w, N, false, out);
  if (transpose) return LinearTransposed(pool, x, T, K, w, N, out, invariant);
  if (T >= kStripsX && !invariant && N % kV == 0) return LinearStrips(pool, x, T, K, w, N, out);
  LinearRowBlocks(pool, x, T, K, w, N, out, invariant);
}

// x [T, K] @ w[K, N] (w[N, K]^T with `transpose`) on bfloat16 x and w, summed in float32 into
// out: float32 (out_f32), or rounded to bfloat16. With AVX-512 BF16, pairs of bfloat16 lanes
// (row blocks where N is a multiple of kPiece); else x and w widened to float32.
void LinearBf16(ffi::ThreadPool& pool, const Bf16* xp, int64_t T, int64_t K, const Bf16* wp,
                int64_t N, bool transpose, void* out, bool out_f32) {
#ifdef __AVX512BF16__
  if (T >= kGemmX) {
    if (out_f32) return Gemm(pool, xp, T, K, wp, N, transpose, static_cast<float*>(out));
    return Gemm(pool, xp, T, K, wp, N, transpose, static_cast<Bf16*>(out));
  }
#endif
  std::unique_ptr<float[]> sums(out_f32 ? nullptr : new float[T * N]);
  float* op = out_f32 ? static_cast<float*>(out) : sums.get();
#ifdef __AVX512BF16__
  if (transpose) {
    LinearTransposed(pool, xp, T, K, wp, N, op, false);
  } else if (N % kPiece == 0) {
    LinearRowBlocks(pool, xp, T, K, wp, N, op, false);
    Unpair(op, T, N);
  }
  const bool done = transpose || N % kPiece == 0;
#else
  const bool done = false;
#endif
  if (!done) {
    std::unique_ptr<float[]> x(new float[T * K]);
    WidenBf16(xp, T * K, x.get());
    if (transpose) {
      LinearTransposed(pool, x.get(), T, K, wp, N, op, false);
    } else {
      LinearRowBlocks(pool, x.get(), T, K, wp, N, op, false);
    }
  }
  if (!out_f32) RoundToBf16(op, T * N, static_cast<Bf16*>(out));
}

// x, w: both float32 (out float32) or both bfloat16 (out bfloat16 or float32).
ffi::Error Linear(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                  ffi::Buffer<ffi::S32> layer, bool transpose, bool invariant,
                  ffi::Result<ffi::AnyBuffer> out) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[transpose ? 2 : 1] != xd[1])
    return ffi::Error::InvalidArgument(
        "linear: x must be [T, In] and w [L, In, Out] ([L, Out, In] transposed)");
  const int64_t T = xd[0], K = xd[1], N = wd[transpose ? 1 : 2];
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("linear: layer out of range");
  const auto type = x.element_type(), out_type = out->element_type();
  if (type == ffi::DataType::F32 && w.element_type() == type && out_type == type) {
    const float* xp = static_cast<const float*>(x.untyped_data());
    const float* wp = static_cast<const float*>(w.untyped_data()) + l * K * N;
    LinearF32(pool, xp, T, K, wp, N, transpose, static_cast<float*>(out->untyped_data()),
              invariant);
    return ffi::Error::Success();
  }
  if (type != ffi::DataType::BF16 || w.element_type() != type ||
      (out_type != type && out_type != ffi::DataType::F32))
    return ffi::Error::InvalidArgument(
        "linear: x and w must be float32 (out float32) or bfloat16 (out bfloat16 or float32)");
  if (invariant)
    return ffi::Error::InvalidArgument("linear: the invariant order multiplies float32 only");
  LinearBf16(pool, static_cast<const Bf16*>(x.untyped_data()), T, K,
             static_cast<const Bf16*>(w.untyped_data()) + l * K * N, N, transpose,
             out->untyped_data(), out_type == ffi::DataType::F32);
  return ffi::Error::Success();
}

template <typename A, typename B>
bool SameDims(const A& a, const B& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

// Row t of y (+ bias) turned by RoPE's rotate-half pairs of cos, sin [D/2] in each of its
// heads, stored at dst. Each element rounds as XLA's CPU backend computes `kvjax.models.rope.
// turn` (x1 * cos - x2 * sin as fma(x1, cos, -(x2 * sin)), x2 * cos + x1 * sin as
// fma(x2, cos, x1 * sin)); no other contraction (tests/kv/test_fused_write.py holds it to
// XLA's bits, which the batch-invariant mode needs).
[[gnu::optimize("fp-contract=off")]] void TurnRow(const float* y, const float* bias,
                                                  const float* cos, const float* sin,
                                                  int64_t heads, int64_t D, float* dst) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const float* yh = y + h * D;
    const float* bh = bias == nullptr ? nullptr : bias + h * D;
    float* dh = dst + h * D;
    for (int64_t i = 0; i < half; ++i) {
      const float a = bh == nullptr ? yh[i] : yh[i] + bh[i];
      const float b = bh == nullptr ? yh[i + half] : yh[i + half] + bh[i + half];
      dh[i] = std::fma(a, cos[i], -(b * sin[i]));
      dh[i + half] = std::fma(b, cos[i], a * sin[i]);
    }
  }
}

// Row y (+ bias) normalized in place head by head: each head's D values times
// 1 / sqrt(mean of their squares + eps), times w (1 + w with unit_offset): the per-head key
// RMSNorm of qk_norm models (Qwen3, Gemma 3), in float32 like `kvjax.models.llama.norm`
// (which rounds otherwise: close, not bitwise).
void NormHeads(float* y, const float* bias, const float* w, int64_t heads, int64_t D,
               float eps, bool unit_offset) {
  for (int64_t h = 0; h < heads; ++h) {
    float* yh = y + h * D;
    if (bias != nullptr) {
      for (int64_t i = 0; i < D; ++i) yh[i] += bias[h * D + i];
    }
    float sum = 0.0f;
    for (int64_t i = 0; i < D; ++i) sum += yh[i] * yh[i];
    const float scale = 1.0f / std::sqrt(sum / static_cast<float>(D) + eps);
    for (int64_t i = 0; i < D; ++i)
      yh[i] = yh[i] * scale * (unit_offset ? 1.0f + w[i] : w[i]);
  }
}

// The fused KV write: K = RoPE(norm(x @ wk[layer] + bk)) and V = x @ wv[layer] + bv, row t written
// into flat slot slots[t] of layer pool_layer of the pools (slots < 0 or past the pool are
// dropped). The pools are the outputs, aliased to the inputs (XLA donates them), so only the
// written rows change. K and V pass through a scratch of T rows, one at a time, which stays in
// cache for a step's few rows instead of two [T, K, D] arrays written, then read by a scatter.
//   x      f32 [T, In]           wk, wv  f32 [L, In, K*D]      layer, pool_layer  s32 []
//   bk, bv f32 [K*D], the layer's biases (read with the attribute has_bias; else any shape)
//   k_norm f32 [D], the keys' per-head RMSNorm weight (read with has_norm, norm_eps and
//          unit_offset; else any shape; not with invariant)
//   cos, sin f32 [T, D/2]        slots   s32 [T]
//   k_pages, v_pages f32 [Lp, num_pages, P, K, D] -> the same, rows written
ffi::Error LinearKVWrite(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> wk,
                         ffi::Buffer<ffi::F32> wv, ffi::Buffer<ffi::F32> bk,
                         ffi::Buffer<ffi::F32> bv, ffi::Buffer<ffi::S32> layer,
                         ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                         ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> pool_layer,
                         ffi::Buffer<ffi::F32> k_in, ffi::Buffer<ffi::F32> v_in,
                         ffi::Buffer<ffi::F32> k_norm, bool has_bias, bool invariant,
                         bool has_norm, float norm_eps, bool unit_offset,
                         ffi::Result<ffi::Buffer<ffi::F32>> k_out,
                         ffi::Result<ffi::Buffer<ffi::F32>> v_out) {
  auto xd = x.dimensions();
  auto wd = wk.dimensions();
  auto pd = k_in.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[1] != xd[1] || pd.size() != 5 ||
      !SameDims(wv.dimensions(), wd) || !SameDims(v_in.dimensions(), pd) ||
      wd[2] != pd[3] * pd[4] ||
      pd[4] % 2 != 0 || slots.dimensions().size() != 1 || slots.dimensions()[0] != xd[0])
    return ffi::Error::InvalidArgument(
        "linear_kv_write: x [T, In], wk, wv [L, In, K*D], pages [Lp, num_pages, P, K, D] "
        "and slots [T] expected");
  const int64_t T = xd[0], In = xd[1], N = wd[2], heads = pd[3], D = pd[4];
  const int64_t num_slots = pd[1] * pd[2];
  const int64_t l = layer.typed_data()[0], pl = pool_layer.typed_data()[0];
  if (l < 0 || l >= wd[0] || pl < 0 || pl >= pd[0])
    return ffi::Error::InvalidArgument("linear_kv_write: layer out of range");
  if (has_bias && (bk.element_count() != N || bv.element_count() != N))
    return ffi::Error::InvalidArgument("linear_kv_write: bk, bv must be [K*D]");
  if (has_norm && (k_norm.element_count() != D || invariant))
    return ffi::Error::InvalidArgument(
        "linear_kv_write: k_norm must be [D], and the invariant order takes no norm");
  float* kp = k_out->typed_data();
  float* vp = v_out->typed_data();
  // Aliased: the outputs are the inputs' buffers. Were XLA to hand a copy instead, it copies.
  if (kp != k_in.typed_data()) std::memcpy(kp, k_in.typed_data(), k_in.size_bytes());
  if (vp != v_in.typed_data()) std::memcpy(vp, v_in.typed_data(), v_in.size_bytes());
  const int32_t* sp = slots.typed_data();
  const float* cp = cos.typed_data();
  const float* snp = sin.typed_data();
  std::unique_ptr<float[]> y(new float[T * N]);
  const int64_t layer_floats = num_slots * N;
  LinearF32(pool, x.typed_data(), T, In, wk.typed_data() + l * In * N, N, false, y.get(),
            invariant);
  const float* bkp = has_bias ? bk.typed_data() : nullptr;
  for (int64_t t = 0; t < T; ++t) {
    if (sp[t] < 0 || sp[t] >= num_slots) continue;
    float* row = y.get() + t * N;
    if (has_norm) {
      NormHeads(row, bkp, k_norm.typed_data(), heads, D, norm_eps, unit_offset);
      TurnRow(row, nullptr, cp + t * (D / 2), snp + t * (D / 2), heads, D,
              kp + pl * layer_floats + sp[t] * N);
    } else {
      TurnRow(row, bkp, cp + t * (D / 2), snp + t * (D / 2), heads, D,
              kp + pl * layer_floats + sp[t] * N);
    }
  }
  LinearF32(pool, x.typed_data(), T, In, wv.typed_data() + l * In * N, N, false, y.get(),
            invariant);
  const float* bvp = has_bias ? bv.typed_data() : nullptr;
  for (int64_t t = 0; t < T; ++t) {
    if (sp[t] < 0 || sp[t] >= num_slots) continue;
    float* dst = vp + pl * layer_floats + sp[t] * N;
    const float* row = y.get() + t * N;
    if (bvp == nullptr) {
      std::memcpy(dst, row, N * sizeof(float));
    } else {
      for (int64_t n = 0; n < N; ++n) dst[n] = row[n] + bvp[n];
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxLinearKVWrite, LinearKVWrite,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // wk
                                  .Arg<ffi::Buffer<ffi::F32>>()  // wv
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bk
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bv
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sin
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pool_layer
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_pages
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_pages
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_norm
                                  .Attr<bool>("has_bias")
                                  .Attr<bool>("invariant")
                                  .Attr<bool>("has_norm")
                                  .Attr<float>("norm_eps")
                                  .Attr<bool>("unit_offset")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // k_pages
                                  .Ret<ffi::Buffer<ffi::F32>>());  // v_pages

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxLinear, Linear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Attr<bool>("transpose")
                                  .Attr<bool>("invariant")
                                  .Ret<ffi::AnyBuffer>());
