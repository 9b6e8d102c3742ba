// Paged decode attention for the CPU, read in place from the page pool: an XLA FFI handler.
//
// The engine's jnp path gathers each block of pages into a fresh buffer and transposes it for
// the matmuls; this kernel walks each row's block table and reads every key and value straight
// from the pool (all layers' pages, one buffer), so a decode step reads each KV byte once.
// Semantics are those of kvjax.kv.attention.paged_decode_attention_reference: query b sits at
// position kv_lens[b] - 1 and sees tokens [0, kv_lens[b]), or with a sliding window W > 0 only
// tokens (kv_lens[b] - 1 - W, kv_lens[b] - 1]; a row with kv_lens[b] == 0 gets zeros. Online
// softmax in float32, one page at a time; pages wholly before the window are never read.
//
// A row may hold Q queries (attribute num_queries: a speculative verify row's last token and
// drafts): its q_lens[b] <= Q queries sit at positions kv_lens[b] - q_lens[b] + i and see the
// tokens up to their own (causal); queries past q_lens[b] get zeros. The Q queries of a kv
// head are laid out as Q * G consecutive heads, so each key and value is read once for all.
//
// Buffers (row-major):
//   q            f32  [B, N, D]
//   k, v         f32 | bf16 | s8  [L, num_pages, P, K, D], or
//                u8  [L, num_pages, P, K, D * bits / 8]  (packed codes, first code lowest)
//   k_scale,     f32  s8: [L, num_pages, P, K] (x = code * scale);
//   v_scale           u8: [L, num_pages, P, K, D / group] (x = zero + code * scale); else [1]
//   k_zero,      f32  u8: [L, num_pages, P, K, D / group]; else [1]
//   v_zero
//   layer        s32  []
//   window       s32  []  (the sliding window in tokens; <= 0: none)
// Attributes: sm_scale, soft_cap (logits -> soft_cap * tanh(logits / soft_cap) when > 0: Gemma
// 2's attention logit cap), bits (8, 4 or 2: the u8 code width), group (channels per scale),
// num_queries, split_rows (whether long rows may be cut into chunks; see below).
//   block_tables s32  [B, W]
//   kv_lens      s32  [B]
//   q_lens       s32  [B] (queries per row, <= num_queries)
//   out          f32  [B * N * D + B * N]: the attention [B, N, D] (N = num_queries * G * K,
//                     kv head h's at [h*Q*G, (h+1)*Q*G)), then each query head's log-sum-exp
//                     of its (scaled, capped) logits [B, N] (-inf where it saw no token), so
//                     rows split between pools merge exactly (host-resident rows)
// D must be a multiple of 8: channels are decoded and multiplied eight at a time (one AVX2
// vector; codes are widened, shifted and converted in registers, scales folded into the dot
// products and weights where they are per token), or sixteen at a time with AVX-512 where D
// (and a packed codec's group) is a multiple of 16. Sixteen 4- or 2-bit codes become their
// group's dequantized values by one permute of a 16-entry table (zero + scale * level), which
// takes a third of the instructions of widening, masking, converting and scaling.
//
// Work is cut into chunks of a row's pages, all kv heads of a page together (a page of one
// layer is one contiguous [P, K, D] block), spread over XLA's intra-op thread pool; a long row
// is cut into several chunks so that few rows still keep every thread busy, and its chunks'
// partial softmaxes are merged at the end (flash-decoding). How a row is cut follows the
// call's total work, so with split_rows off (batch-invariant numerics) every row is one chunk.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxGroup = 32;   // query heads (times queries per row) per kv head
constexpr int kMaxHeadDim = 256;
constexpr int kMaxPage = 256;
// Vectors the values loop accumulates in registers (of 32 with AVX-512, else 16).
#ifdef __AVX512F__
constexpr int kMaxAccumulators = 16;
#else
constexpr int kMaxAccumulators = 8;
#endif
// Work is cut into chunks of a row's pages (all kv heads): about kChunksPerThread per thread,
// none shorter than kMinChunkTokens (below that the merge costs more than the balance wins).
constexpr int64_t kChunksPerThread = 4;
constexpr int64_t kMinChunkTokens = 256;

// The values loop's vectors at a time: the largest power of two up to `most`, and a multiple
// of the reader's block.
constexpr int AccumulatedVecs(int most, int block) {
  int c = 1;
  while (c * 2 <= most) c *= 2;
  return std::max(c, block);
}

inline float LoadFloat(const uint16_t* x, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Eight channels as one vector: a ymm register with AVX2 (the kernel is built with
// -march=native), otherwise whatever the compiler makes of it.
typedef float F8 __attribute__((vector_size(32)));

// Sixteen channels as one zmm register (AVX-512 only).
typedef float F16 __attribute__((vector_size(64)));

template <typename V = F8>
inline V Splat(float x) { return V{} + x; }
template <typename V = F8>
inline V LoadV(const float* p) { return kvjax::LoadVec<V>(p); }
template <typename V>
inline void StoreV(float* p, V x) { kvjax::StoreVec<V>(p, x); }
inline float Sum(F8 x) {
#ifdef __AVX2__
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  return _mm_cvtss_f32(_mm_add_ss(lo, _mm_movehdup_ps(lo)));
#else
  float s = 0.0f;
  for (int t = 0; t < 8; ++t) s += x[t];
  return s;
#endif
}

// Eight consecutive codes as floats: int8 (signed), or the `kBits`-bit fields of unsigned
// bytes (first code lowest), 8 / kBits per byte.
inline F8 Codes8(const int8_t* p) {
#ifdef __AVX2__
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  F8 x;
  for (int t = 0; t < 8; ++t) x[t] = p[t];
  return x;
#endif
}

template <int kBits>
inline F8 Fields8(const uint8_t* p) {
  constexpr int kPerByte = 8 / kBits;
  constexpr uint32_t kMask = (1u << kBits) - 1;
#ifdef __AVX2__
  __m128i b;
  if constexpr (kBits == 8) {
    b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  } else if constexpr (kBits == 4) {
    uint32_t w;
    std::memcpy(&w, p, sizeof(w));
    b = _mm_cvtsi32_si128(static_cast<int>(w));
    b = _mm_unpacklo_epi8(b, b);  // each byte twice
  } else {
    uint16_t w;
    std::memcpy(&w, p, sizeof(w));
    b = _mm_cvtsi32_si128(w);
    b = _mm_unpacklo_epi8(b, b);
    b = _mm_unpacklo_epi16(b, b);  // each byte four times
  }
  __m256i x = _mm256_cvtepu8_epi32(b);
  if constexpr (kBits < 8) {
    const __m256i shifts = kBits == 4 ? _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4)
                                      : _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    x = _mm256_and_si256(_mm256_srlv_epi32(x, shifts), _mm256_set1_epi32(kMask));
  }
  return _mm256_cvtepi32_ps(x);
#else
  F8 x;
  for (int t = 0; t < 8; ++t) x[t] = (p[t / kPerByte] >> (t % kPerByte * kBits)) & kMask;
  return x;
#endif
}

// Locality 1 (to L2 and below): float32 pages read 4-7% faster than with locality 3 side by
// side in scripts/bench_native_decode.py; quantized pages the same.
inline void PrefetchBytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 1);
}

// A row's `bytes` of metadata (scales, zeros: a few bytes, many rows to a cache line), asked
// for by one row per line: the row starting within the line's first `bytes` (every line holds
// one), or the page's first row (`first`: the line it starts in may begin with another page's).
// When each row of a page is asked for once, each of its lines is asked for about once
// instead of once per row.
inline void PrefetchMetaOnce(const void* p, int64_t bytes, bool first) {
  if (bytes >= 64 || first || (reinterpret_cast<uintptr_t>(p) & 63) < static_cast<uintptr_t>(bytes))
    PrefetchBytes(p, bytes);
}

#ifdef __AVX512F__
// Sixteen codes as floats: int8 (signed) or unsigned bytes.
inline F16 Codes16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline F16 Bytes16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// The sixteen `kBits`-bit codes at p (kBits = 4 or 2; first code lowest), each replaced by
// table[its low four bits]: each lane gets its code's byte, shifted so that the code sits in
// the lowest bits, and the permute reads only the index's four lowest bits (the bits above a
// 2-bit code belong to the next codes; its table repeats every four entries).
template <int kBits>
inline F16 Lookup16(const uint8_t* p, F16 table) {
  __m128i b;
  __m512i shifts;
  if constexpr (kBits == 4) {
    b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    b = _mm_unpacklo_epi8(b, b);  // each byte twice
    shifts = _mm512_set1_epi64(int64_t{4} << 32);  // 0, 4, 0, 4, ...
  } else {
    uint32_t w;
    std::memcpy(&w, p, sizeof(w));
    b = _mm_cvtsi32_si128(static_cast<int>(w));
    b = _mm_unpacklo_epi8(b, b);
    b = _mm_unpacklo_epi16(b, b);  // each byte four times
    shifts = _mm512_set4_epi32(6, 4, 2, 0);  // 0, 2, 4, 6, ...
  }
  const __m512i idx = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(b), shifts);
  return _mm512_permutexvar_ps(idx, table);
}

// The table Lookup16 reads for a group: zero + scale * level of entry i, where level i is
// code i (4 bits) or code i mod 4 (2 bits).
template <int kBits>
inline F16 GroupTable16(float zero, float scale) {
  F16 levels;
  for (int i = 0; i < 16; ++i) levels[i] = static_cast<float>(i & ((1 << kBits) - 1));
  return Splat<F16>(zero) + Splat<F16>(scale) * levels;
}
#endif

// Row decoders: Load<V> decodes channels [d0, d0 + lanes of V) of stored row `row` (the flat
// (layer, page, slot, kv head) index) in registers; nothing is written back. F16 is asked for
// only where Reads16() (AVX-512 builds). TokenScale is a factor of the whole row that the
// caller applies to its dot products and softmax weights instead of to every channel.
// PrefetchRow asks for a row of the next page (`first`: the page's first row; the caller asks
// for each row of a page once, so metadata lines shared by rows are asked for once). `dim` is
// passed by the caller, where it is a compile-time constant for the common head dims.
//
// Readers decode kBlockVecs vectors at a time (LoadBlock); with more than one, the channels of
// each block of kBlockVecs vectors come in their own order: position i of a block holds
// channel Channel(i) of it (the caller orders its queries and accumulators alike).
struct RowsBase {
  static constexpr int kBlockVecs = 1;
  static constexpr int Channel(int i) { return i; }
};

template <typename V, typename Rows>
inline void LoadBlock(const Rows& rows, int64_t row, int64_t dim, int64_t d0, V* x) {
  if constexpr (Rows::kBlockVecs == 1) x[0] = rows.template Load<V>(row, dim, d0);
  else rows.LoadBlock(row, dim, d0, x);
}

template <typename T>
struct FloatRows : RowsBase {
  const T* data;
  bool Reads16() const { return true; }
  template <typename V>
  V Load(int64_t row, int64_t dim, int64_t d0) const {
    const T* r = data + row * dim + d0;
    if constexpr (sizeof(T) == 4) {
      return LoadV<V>(r);
    } else {  // bfloat16: the top half of a float32
#ifdef __AVX512F__
      if constexpr (sizeof(V) == 64) {
        __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      } else
#endif
      {
#ifdef __AVX2__
        __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
#else
        F8 x;
        for (int t = 0; t < 8; ++t) x[t] = LoadFloat(r, t);
        return x;
#endif
      }
    }
  }
  float TokenScale(int64_t) const { return 1.0f; }
  void PrefetchRow(int64_t row, int64_t dim, bool) const {
    PrefetchBytes(data + row * dim, dim * sizeof(T));
  }
};

struct Int8Rows : RowsBase {  // symmetric, one scale per token and kv head (the TokenScale)
  const int8_t* codes;
  const float* scale;
  bool Reads16() const { return true; }
  template <typename V>
  V Load(int64_t row, int64_t dim, int64_t d0) const {
#ifdef __AVX512F__
    if constexpr (sizeof(V) == 64) return Codes16(codes + row * dim + d0);
    else
#endif
      return Codes8(codes + row * dim + d0);
  }
  float TokenScale(int64_t row) const { return scale[row]; }
  void PrefetchRow(int64_t row, int64_t dim, bool first) const {
    PrefetchBytes(codes + row * dim, dim);
    PrefetchMetaOnce(scale + row, sizeof(float), first);
  }
};

template <int kBits>
struct PackedRows : RowsBase {  // asymmetric, a scale and zero per `group` channels
  static constexpr int kPerByte = 8 / kBits;
  const uint8_t* codes;
  const float* scale;
  const float* zero;
  int64_t group;
  int group_shift;  // log2(group) when group is a power of two, else -1
  bool Reads16() const { return group_shift >= 4; }  // 16 channels share a scale and zero
  template <typename V>
  V Load(int64_t row, int64_t dim, int64_t d0) const {
#ifdef __AVX512F__
    if constexpr (sizeof(V) == 64) {
      const int64_t at = (row * dim + d0) >> group_shift;
      const uint8_t* c = codes + static_cast<uint64_t>(row * dim + d0) / kPerByte;
      if constexpr (kBits == 8) return Splat<F16>(zero[at]) + Splat<F16>(scale[at]) * Bytes16(c);
      else return Lookup16<kBits>(c, GroupTable16<kBits>(zero[at], scale[at]));
    } else
#endif
    {
      return Load8(row, dim, d0);
    }
  }
  F8 Load8(int64_t row, int64_t dim, int64_t d0) const {
    const F8 c = Fields8<kBits>(codes + static_cast<uint64_t>(row * dim + d0) / kPerByte);
    // A shift, not divisions by the runtime group, for power-of-two groups (with a division
    // per eight channels, int4 pages decoded 20% slower: scripts/bench_native_decode.py).
    if (group_shift >= 3) {
      const int64_t at = (row * dim + d0) >> group_shift;
      return Splat(zero[at]) + Splat(scale[at]) * c;
    }
    const int64_t meta = row * (dim / group);
    if (group % 8 == 0) return Splat(zero[meta + d0 / group]) + Splat(scale[meta + d0 / group]) * c;
    F8 s, z;  // groups narrower than a vector
    for (int t = 0; t < 8; ++t) {
      s[t] = scale[meta + (d0 + t) / group];
      z[t] = zero[meta + (d0 + t) / group];
    }
    return z + s * c;
  }
  float TokenScale(int64_t) const { return 1.0f; }
  void PrefetchRow(int64_t row, int64_t dim, bool) const {
    const int64_t groups = group_shift >= 0 ? dim >> group_shift : dim / group;
    PrefetchBytes(codes + row * (dim / kPerByte), dim / kPerByte);
    // Per row, not once per line: with two metadata arrays and rows of 8 bytes, the line
    // test's branch cost int4 pages more than the repeated requests (side by side in
    // scripts/bench_native_decode.py under perf; int8's one array gains from it).
    PrefetchBytes(scale + row * groups, groups * sizeof(float));
    PrefetchBytes(zero + row * groups, groups * sizeof(float));
  }
};

#ifdef __AVX512F__
// 4- or 2-bit codes with groups of 32 channels or more, 32 channels (two F16 vectors) at a
// time in the order the bytes give them: sixteen bytes widened to sixteen lanes hold 32
// 4-bit codes, the even channels in the low and the odd ones in the high nibbles; eight bytes
// of 2-bit codes are widened twice. One table lookup per vector then gives the dequantized
// values: for int4, 4 instructions and one table (3) per 32 channels, against 10 and two
// tables in channel order.
template <int kBits>
struct PackedBlockRows : PackedRows<kBits> {
  static constexpr int kBlockVecs = 2;
  static constexpr int Channel(int i) {  // vector i / 16, lane i % 16
    const int c = i / 16, l = i % 16;
    return kBits == 4 ? 2 * l + c : 4 * (l / 2) + 2 * c + l % 2;
  }
  void LoadBlock(int64_t row, int64_t dim, int64_t d0, F16* x) const {
    const int64_t at = (row * dim + d0) >> this->group_shift;
    const uint8_t* c = this->codes + static_cast<uint64_t>(row * dim + d0) / this->kPerByte;
    const F16 table = GroupTable16<kBits>(this->zero[at], this->scale[at]);
    if constexpr (kBits == 4) {
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
      x[0] = _mm512_permutexvar_ps(b, table);
      x[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
    } else {
      __m128i w = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c));
      const __m512i b = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(w, w));  // lane 2i + e: byte i
      x[0] = _mm512_permutexvar_ps(_mm512_srlv_epi32(b, _mm512_set4_epi32(2, 0, 2, 0)), table);
      x[1] = _mm512_permutexvar_ps(_mm512_srlv_epi32(b, _mm512_set4_epi32(6, 4, 6, 4)), table);
    }
  }
};
#endif

// x[i] <- x[Channel(i)] (or, with `back`, x[Channel(i)] <- x[i]) in each block of 32 channels.
template <typename Rows>
void Reorder(float* x, int64_t n, bool back) {
  float t[32];
  for (int64_t b = 0; b < n; b += 32) {
    std::memcpy(t, x + b, sizeof(t));
    for (int i = 0; i < 32; ++i) {
      if (back) x[b + Rows::Channel(i)] = t[i];
      else x[b + i] = t[Rows::Channel(i)];
    }
  }
}

// exp(x) for x <= 0 (softmax weights after subtracting the running max), branch-free so the
// page loops vectorize: 2^(x log2 e) as 2^n * 2^f with |f| <= 1/2 and 2^f by its degree-7
// Taylor polynomial (relative error < 1e-8, below float32 rounding). Inputs below -87 give
// about 1e-38 instead of a subnormal or 0, which no softmax sum notices.
inline float ExpNonPositive(float x) {
  const float t = std::max(x, -87.0f) * 1.44269504088896341f;
  const float n = std::floor(t + 0.5f);
  float p = kvjax::ExpTaylor((t - n) * 0.693147180559945309f);  // 2^(t - n)
  uint32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<uint32_t>(static_cast<int32_t>(n)) << 23;
  std::memcpy(&p, &bits, sizeof(p));
  return p;
}

// The largest of x[v0, nv) and `init`, sixteen (or eight) lanes at a time: the compiler
// keeps a float max reduction scalar (its NaN order), one dependent max per token.
inline float MaxOf(const float* x, int64_t v0, int64_t nv, float init) {
  int64_t p = v0;
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(init);
  for (; p + 16 <= nv; p += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + p));
  if (p < nv)
    m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, static_cast<__mmask16>((1u << (nv - p)) - 1),
                                              x + p));
  return _mm512_reduce_max_ps(m);
#else
  float mx = init;
#if defined(__AVX2__)
  if (nv - p >= 8) {
    __m256 m = _mm256_set1_ps(init);
    for (; p + 8 <= nv; p += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + p));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    mx = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  }
#endif
  for (; p < nv; ++p) mx = std::max(mx, x[p]);
  return mx;
#endif
}

struct Geometry {
  int64_t num_rows, num_heads, head_dim, num_pages, page_size, num_kv_heads, width;
  int64_t window;  // the sliding window in tokens (<= 0: none)
  int64_t group() const { return num_heads / num_kv_heads; }
  // Blocks [first, end) row b reads: from the page holding its first query's oldest visible
  // token (0 without a window) to its last token's.
  int64_t FirstBlock(int64_t len, int64_t q_len) const {
    return window > 0 ? std::max<int64_t>(len - q_len + 1 - window, 0) / page_size : 0;
  }
  int64_t EndBlock(int64_t len) const {
    return (std::max<int64_t>(len, 0) + page_size - 1) / page_size;
  }
};

// How a query-key dot product becomes a softmax logit: times `scale`, then soft-capped at
// `soft_cap` when it is > 0.
struct Logits {
  float scale, soft_cap;
};

// A run of one row's blocks [first_block, end_block), all kv heads. `partial` >= 0: the row
// is split over several chunks (flash-decoding) and this one leaves its running max, sum and
// unnormalized accumulator in partial slot `partial` for MergeChunks; -1: it writes the row.
struct Chunk {
  int64_t row, first_block, end_block, partial;
};

// A row's (or a chunk's) softmax state for its N query heads: m[N], l[N], acc[N * D].
struct SoftmaxState {
  float* m;
  float* l;
  float* acc;
  static int64_t Floats(const Geometry& g) { return g.num_heads * (g.head_dim + 2); }
  static SoftmaxState At(float* base, const Geometry& g) {
    return {base, base + g.num_heads, base + 2 * g.num_heads};
  }
};

// out[b] = acc / l per query head, and its log-sum-exp m + log(l) after all rows' outputs;
// heads that saw no token get zeros and -inf.
void WriteRow(const Geometry& g, int64_t b, const SoftmaxState& st, float* out) {
  const int64_t D = g.head_dim;
  float* lse = out + g.num_rows * g.num_heads * D + b * g.num_heads;
  for (int64_t j = 0; j < g.num_heads; ++j) {
    const float inv = st.l[j] > 0.0f ? 1.0f / st.l[j] : 0.0f;
    float* o = out + (b * g.num_heads + j) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = st.acc[j * D + d] * inv;
    lse[j] = st.l[j] > 0.0f ? st.m[j] + std::log(st.l[j])
                            : -std::numeric_limits<float>::infinity();
  }
}

// Chunk c of a row: for each of its pages, each kv head's G query heads against the page's
// keys (online softmax), then its values; the next page is prefetched while this one is read.
// A page of one layer is one contiguous [P, K, D] block, so reading all kv heads of it in
// turn streams memory. kD and kG are the head dim and group size when known at compile time
// (0: read from g), so the common shapes get fully unrolled, vectorized inner loops; V is
// the vector of channels (F8, or F16 with AVX-512).
template <int kD, int kG, typename V, typename Rows>
void AttendChunk(const Geometry& g, const Chunk& c, const float* q, const Rows& k_rows,
                 const Rows& v_rows, int64_t layer, const int32_t* block_tables,
                 const int32_t* kv_lens, const int32_t* q_lens, int64_t num_queries,
                 Logits logits, float* partials, float* out) {
  const int64_t G = kG ? kG : g.group(), D = kD ? kD : g.head_dim, P = g.page_size;
  const int64_t K = g.num_kv_heads, N = g.num_heads, b = c.row;
  const int64_t len = kv_lens[b];
  // Local copies: the readers' pointers and shifts then stay in registers across the stores
  // to the scores and accumulators (through the references they were reloaded per row).
  const Rows k = k_rows, v = v_rows;
  std::vector<float> own(c.partial < 0 ? SoftmaxState::Floats(g) : 0);
  const SoftmaxState st = SoftmaxState::At(
      c.partial < 0 ? own.data() : partials + c.partial * SoftmaxState::Floats(g), g);
  std::fill(st.m, st.m + N, -INFINITY);
  std::fill(st.l, st.l + N, 0.0f);
  std::fill(st.acc, st.acc + N * D, 0.0f);
  // Tokens [0, lim[j]) are visible to head j of a kv head: query i = j / (G / Q) of the row.
  // With a window, tokens [lo[j], lim[j]) (the query's last `window` tokens).
  int64_t lim[kMaxGroup], lo[kMaxGroup];
  const int64_t per_query = G / num_queries, first = len - q_lens[b];
  for (int64_t j = 0; j < G; ++j) {
    const int64_t i = j / per_query;
    lim[j] = i < q_lens[b] ? first + i + 1 : 0;
    lo[j] = g.window > 0 ? std::max<int64_t>(lim[j] - g.window, 0) : 0;
  }
  std::vector<float> qs(N * D);  // scaled
  for (int64_t i = 0; i < N * D; ++i) qs[i] = q[b * N * D + i] * logits.scale;
  const int32_t* table = block_tables + b * g.width;
  const int64_t rows_per_page = P * K;
  constexpr int kW = sizeof(V) / sizeof(float);  // channels per vector
  constexpr int kVecs = kD ? kD / kW : kMaxHeadDim / kW;  // vectors of channels per head
  constexpr int kB = Rows::kBlockVecs;  // vectors the reader decodes at a time
  // Vectors of channels the values loop takes at a time: up to kMaxAccumulators accumulators
  // (one block at a time where the shape is not known at compile time).
  constexpr int kC = AccumulatedVecs(kD && kG ? std::min(kVecs, kMaxAccumulators / kG) : 1, kB);
  if constexpr (kB > 1) Reorder<Rows>(qs.data(), N * D, false);  // the keys' channel order
  for (int64_t blk = c.first_block; blk < c.end_block; ++blk) {
    const int64_t n = std::min<int64_t>(P, len - blk * P);
    const int64_t page_row = (layer * g.num_pages + table[blk]) * rows_per_page;
    // The next page is prefetched a row at a time alongside this page's rows, so that the
    // requests overlap the arithmetic instead of stalling in one burst.
    const int64_t next_row = blk + 1 < c.end_block
        ? (layer * g.num_pages + table[blk + 1]) * rows_per_page : -1;
    for (int64_t h = 0; h < K; ++h) {
      const float* qh = qs.data() + h * G * D;
      float* acc = st.acc + h * G * D;
      float* m = st.m + h * G;
      float* l = st.l + h * G;
      float s[kG ? kG : kMaxGroup][kMaxPage];
      V qv[kG ? kG : kMaxGroup][kVecs];  // this kv head's queries, in registers
      for (int64_t j = 0; j < G; ++j)
        for (int64_t d = 0; d < D; d += kW) qv[j][d / kW] = LoadV<V>(qh + j * D + d);
      // Token p's G dot products as vectors (their lanes still to be summed); the same row of
      // the next page is prefetched meanwhile.
      auto dots = [&](int64_t p, V (&dot)[kG ? kG : kMaxGroup]) {
        const int64_t row = page_row + p * K + h;
        if (next_row >= 0) {
          k.PrefetchRow(next_row + p * K + h, D, p + h == 0);
          v.PrefetchRow(next_row + p * K + h, D, p + h == 0);
        }
        for (int64_t j = 0; j < G; ++j) dot[j] = V{};
        for (int64_t d = 0; d < D; d += kB * kW) {
          V x[kB];
          LoadBlock(k, row, D, d, x);
          for (int i = 0; i < kB; ++i)
            for (int64_t j = 0; j < G; ++j) dot[j] += qv[j][d / kW + i] * x[i];
        }
      };
      V dot[kG ? kG : kMaxGroup];
#ifdef __AVX512F__
      if constexpr (sizeof(V) == 64) {
        // Sixteen tokens' lane sums at once per query head (SumLanes16): summing each vector
        // alone took about half of a quantized page's arithmetic (bench_native_decode).
        for (int64_t p0 = 0; p0 < n; p0 += 16) {
          __m512 sums[kG ? kG : kMaxGroup][16];
          alignas(64) float ts[16];
          for (int64_t t = 0; t < 16; ++t) {
            const int slot = t / 4 + 4 * (t % 4);  // lane t of SumLanes16's result
            if (p0 + t < n) {
              dots(p0 + t, dot);
              ts[t] = k.TokenScale(page_row + (p0 + t) * K + h);
            } else {
              for (int64_t j = 0; j < G; ++j) dot[j] = V{};
              ts[t] = 0.0f;
            }
            for (int64_t j = 0; j < G; ++j) sums[j][slot] = (__m512)dot[j];
          }
          for (int64_t j = 0; j < G; ++j)
            StoreV(s[j] + p0, (V)kvjax::SumLanes16(sums[j]) * LoadV<V>(ts));
        }
      } else
#endif
      {
        for (int64_t p = 0; p < n; ++p) {
          dots(p, dot);
          const float ts = k.TokenScale(page_row + p * K + h);
          for (int64_t j = 0; j < G; ++j) s[j][p] = Sum(dot[j]) * ts;
        }
      }
      if (next_row >= 0)  // rows of the next page past this page's last token
        for (int64_t p = n; p < P; ++p) {
          k.PrefetchRow(next_row + p * K + h, D, p + h == 0);
          v.PrefetchRow(next_row + p * K + h, D, p + h == 0);
        }
      for (int64_t j = 0; j < G; ++j) {
        const int64_t nv = std::clamp<int64_t>(lim[j] - blk * P, 0, n);  // visible: [v0, nv)
        const int64_t v0 = std::clamp<int64_t>(lo[j] - blk * P, 0, nv);
        for (int64_t p = 0; p < v0; ++p) s[j][p] = 0.0f;
        for (int64_t p = nv; p < n; ++p) s[j][p] = 0.0f;
        if (nv == v0) continue;
        if (logits.soft_cap > 0.0f)
          for (int64_t p = v0; p < nv; ++p)
            s[j][p] = logits.soft_cap * std::tanh(s[j][p] / logits.soft_cap);
        const float mx = MaxOf(s[j], v0, nv, m[j]);
        const float alpha = std::exp(m[j] - mx);  // exp(-inf) = 0 on the first page
        float sum = 0.0f;
        for (int64_t p = v0; p < nv; ++p) {
          s[j][p] = ExpNonPositive(s[j][p] - mx);
          sum += s[j][p];
        }
        l[j] = l[j] * alpha + sum;
        if (alpha != 1.0f)
          for (int64_t d = 0; d < D; ++d) acc[j * D + d] *= alpha;
        m[j] = mx;
      }
      for (int64_t p = 0; p < n; ++p) {
        const float ts = v.TokenScale(page_row + p * K + h);
        for (int64_t j = 0; j < G; ++j) s[j][p] *= ts;
      }
      // kC vectors of channels at a time over all the page's tokens, the G * kC accumulators
      // in registers: each token adds to all of them, so that the adds of consecutive tokens
      // (one dependent chain per accumulator) overlap.
      for (int64_t d = 0; d < D; d += kC * kW) {
        V a[kG ? kG : kMaxGroup][kC];
        for (int64_t j = 0; j < G; ++j)
          for (int c = 0; c < kC; ++c) a[j][c] = LoadV<V>(acc + j * D + d + c * kW);
        for (int64_t p = 0; p < n; ++p) {
          V x[kC];
          for (int c = 0; c < kC; c += kB) LoadBlock(v, page_row + p * K + h, D, d + c * kW, x + c);
          for (int64_t j = 0; j < G; ++j) {
            const V w = Splat<V>(s[j][p]);
            for (int c = 0; c < kC; ++c) a[j][c] += w * x[c];
          }
        }
        for (int64_t j = 0; j < G; ++j)
          for (int c = 0; c < kC; ++c) StoreV(acc + j * D + d + c * kW, a[j][c]);
      }
    }
  }
  if constexpr (kB > 1) Reorder<Rows>(st.acc, N * D, true);  // channels back in order
  if (c.partial < 0) WriteRow(g, b, st, out);
}

// Rows split over several chunks: the chunks' states rescaled to their common max and summed
// (the flash-decoding merge), then written like a whole row.
void MergeChunks(const Geometry& g, const std::vector<Chunk>& chunks, float* partials,
                 float* out) {
  const int64_t N = g.num_heads, D = g.head_dim, floats = SoftmaxState::Floats(g);
  for (size_t i = 0; i < chunks.size();) {
    size_t end = i + 1;
    while (end < chunks.size() && chunks[end].row == chunks[i].row) ++end;
    if (chunks[i].partial >= 0) {
      const SoftmaxState total = SoftmaxState::At(partials + chunks[i].partial * floats, g);
      for (size_t c = i + 1; c < end; ++c) {
        const SoftmaxState part = SoftmaxState::At(partials + chunks[c].partial * floats, g);
        for (int64_t j = 0; j < N; ++j) {
          if (part.l[j] == 0.0f) continue;  // the chunk showed head j no token
          const float mx = std::max(total.m[j], part.m[j]);
          const float a = std::exp(total.m[j] - mx), b = std::exp(part.m[j] - mx);
          total.l[j] = total.l[j] * a + part.l[j] * b;
          for (int64_t d = 0; d < D; ++d)
            total.acc[j * D + d] = total.acc[j * D + d] * a + part.acc[j * D + d] * b;
          total.m[j] = mx;
        }
      }
      WriteRow(g, chunks[i].row, total, out);
    }
    i = end;
  }
}

// Cuts the rows into chunks of at most `max_blocks` blocks, of near-equal size per row, so
// that a few long rows (or one) still give every thread work; a row of one chunk keeps the
// direct path. Returns the number of partial slots used.
int64_t PlanChunks(const Geometry& g, const int32_t* kv_lens, const int32_t* q_lens,
                   int64_t max_blocks, std::vector<Chunk>* chunks) {
  int64_t partials = 0;
  for (int64_t b = 0; b < g.num_rows; ++b) {
    const int64_t first = g.FirstBlock(kv_lens[b], q_lens[b]);
    const int64_t blocks = std::max<int64_t>(g.EndBlock(kv_lens[b]) - first, 0);
    const int64_t num = std::max<int64_t>(1, (blocks + max_blocks - 1) / max_blocks);
    for (int64_t c = 0; c < num; ++c)
      chunks->push_back({b, first + blocks * c / num, first + blocks * (c + 1) / num,
                         num > 1 ? partials++ : -1});
  }
  return partials;
}

using kvjax::ParallelFor;

template <typename Rows>
using ChunkFn = void (*)(const Geometry&, const Chunk&, const float*, const Rows&, const Rows&,
                         int64_t, const int32_t*, const int32_t*, const int32_t*, int64_t, Logits,
                         float*, float*);

// AttendChunk compiled for the common head dims and group sizes, else the generic one.
template <typename V, typename Rows>
ChunkFn<Rows> ChunkKernel(const Geometry& g) {
  const int64_t D = g.head_dim, G = g.group();
  if (D == 64 && G == 1) return AttendChunk<64, 1, V, Rows>;
  if (D == 64 && G == 2) return AttendChunk<64, 2, V, Rows>;
  if (D == 64 && G == 3) return AttendChunk<64, 3, V, Rows>;
  if (D == 64 && G == 4) return AttendChunk<64, 4, V, Rows>;
  if (D == 128 && G == 1) return AttendChunk<128, 1, V, Rows>;
  if (D == 128 && G == 4) return AttendChunk<128, 4, V, Rows>;
  if (D == 128 && G == 8) return AttendChunk<128, 8, V, Rows>;
  return AttendChunk<0, 0, V, Rows>;
}

template <typename Rows>
ffi::Error Run(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, const Rows& k, const Rows& v,
               int64_t layer, int64_t window, ffi::Buffer<ffi::S32> block_tables,
               ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> q_lens,
               int64_t num_queries, ffi::AnyBuffer::Dimensions kv_dims, int64_t head_dim,
               Logits logits, bool split_rows, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto qd = q.dimensions();
  Geometry g{qd[0], qd[1], qd[2], kv_dims[1], kv_dims[2], kv_dims[3],
             block_tables.dimensions()[1], window};
  if (head_dim != g.head_dim || g.num_heads % g.num_kv_heads || g.group() > kMaxGroup ||
      num_queries < 1 || g.group() % num_queries || q_lens.element_count() != g.num_rows ||
      g.head_dim > kMaxHeadDim || g.head_dim % 8 || g.page_size > kMaxPage || layer < 0 ||
      layer >= kv_dims[0])
    return ffi::Error::InvalidArgument("paged_decode: unsupported shapes");
  const float* qp = q.typed_data();
  const int32_t* bt = block_tables.typed_data();
  const int32_t* lens = kv_lens.typed_data();
  const int32_t* qlens = q_lens.typed_data();
  float* o = out->typed_data();
  // Chunks of at least kMinChunkTokens, and about kChunksPerThread per thread in all; or,
  // without split_rows, one chunk per row: a row's result then follows from its own query and
  // pages alone, whatever other rows the call holds (batch-invariant numerics).
  int64_t total_blocks = 0;
  for (int64_t b = 0; b < g.num_rows; ++b)
    total_blocks += std::max<int64_t>(g.EndBlock(lens[b]) - g.FirstBlock(lens[b], qlens[b]), 0);
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  int64_t max_blocks = std::max<int64_t>(
      {(kMinChunkTokens + g.page_size - 1) / g.page_size,
       (total_blocks + kChunksPerThread * threads - 1) / (kChunksPerThread * threads), 1});
  std::vector<Chunk> chunks;
  if (!split_rows) max_blocks = std::max<int64_t>(total_blocks, 1);
  const int64_t num_partials = PlanChunks(g, lens, qlens, max_blocks, &chunks);
  std::vector<float> partials(num_partials * SoftmaxState::Floats(g));
  float* pp = partials.data();
  ChunkFn<Rows> one;
#ifdef __AVX512F__
  if constexpr (Rows::kBlockVecs > 1) {
    one = ChunkKernel<F16, Rows>(g);  // chosen only where it reads the shape (RunPacked)
  } else {
    one = g.head_dim % 16 == 0 && k.Reads16() ? ChunkKernel<F16, Rows>(g)
                                              : ChunkKernel<F8, Rows>(g);
  }
#else
  one = ChunkKernel<F8, Rows>(g);
#endif
  ParallelFor(pool, chunks.size(), [&](int64_t i) {
    one(g, chunks[i], qp, k, v, layer, bt, lens, qlens, num_queries, logits, pp, o);
  });
  if (num_partials) MergeChunks(g, chunks, pp, o);
  return ffi::Error::Success();
}

template <int kBits>
ffi::Error RunPacked(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                     ffi::AnyBuffer v, ffi::Buffer<ffi::F32> k_scale,
                     ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::F32> k_zero,
                     ffi::Buffer<ffi::F32> v_zero, int64_t layer, int64_t window,
                     ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> kv_lens,
                     ffi::Buffer<ffi::S32> q_lens, int64_t num_queries, Logits logits,
                     int64_t group, bool split_rows, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const int64_t dim = k.dimensions()[4] * (8 / kBits);
  const int64_t rows = k.element_count() / k.dimensions()[4];
  const int64_t metadata = rows * (dim / std::max<int64_t>(group, 1));
  if (group <= 0 || dim % group || k_scale.element_count() != metadata ||
      v_scale.element_count() != metadata || k_zero.element_count() != metadata ||
      v_zero.element_count() != metadata)
    return ffi::Error::InvalidArgument("paged_decode: scale/zero do not match codes and group");
  const int shift = (group & (group - 1)) == 0 ? __builtin_ctzll(group) : -1;
  PackedRows<kBits> kr{{}, static_cast<const uint8_t*>(k.untyped_data()), k_scale.typed_data(),
                       k_zero.typed_data(), group, shift};
  PackedRows<kBits> vr{{}, static_cast<const uint8_t*>(v.untyped_data()), v_scale.typed_data(),
                       v_zero.typed_data(), group, shift};
#ifdef __AVX512F__
  if constexpr (kBits < 8) {
    if (shift >= 5 && dim % 32 == 0)
      return Run(pool, q, PackedBlockRows<kBits>{kr}, PackedBlockRows<kBits>{vr}, layer,
                 window, block_tables, kv_lens, q_lens, num_queries, k.dimensions(), dim,
                 logits, split_rows, out);
  }
#endif
  return Run(pool, q, kr, vr, layer, window, block_tables, kv_lens, q_lens, num_queries,
             k.dimensions(), dim, logits, split_rows, out);
}

ffi::Error PagedDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                       ffi::AnyBuffer v, ffi::Buffer<ffi::F32> k_scale,
                       ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::F32> k_zero,
                       ffi::Buffer<ffi::F32> v_zero, ffi::Buffer<ffi::S32> layer,
                       ffi::Buffer<ffi::S32> window, ffi::Buffer<ffi::S32> block_tables,
                       ffi::Buffer<ffi::S32> kv_lens,
                       ffi::Buffer<ffi::S32> q_lens, float sm_scale, float soft_cap,
                       int32_t bits, int32_t group, int32_t num_queries, bool split_rows,
                       ffi::Result<ffi::Buffer<ffi::F32>> out) {
  if (k.dimensions().size() != 5 || k.element_type() != v.element_type() ||
      k.element_count() != v.element_count())
    return ffi::Error::InvalidArgument("paged_decode: k and v must be [L, pages, P, K, D]");
  const int64_t lay = layer.typed_data()[0];
  const int64_t win = window.typed_data()[0];
  const int64_t dim = k.dimensions()[4];
  const Logits logits{sm_scale, soft_cap};
  switch (k.element_type()) {
    case ffi::F32: {
      FloatRows<float> kr{{}, static_cast<const float*>(k.untyped_data())};
      FloatRows<float> vr{{}, static_cast<const float*>(v.untyped_data())};
      return Run(pool, q, kr, vr, lay, win, block_tables, kv_lens, q_lens, num_queries,
                 k.dimensions(), dim, logits, split_rows, out);
    }
    case ffi::BF16: {
      FloatRows<uint16_t> kr{{}, static_cast<const uint16_t*>(k.untyped_data())};
      FloatRows<uint16_t> vr{{}, static_cast<const uint16_t*>(v.untyped_data())};
      return Run(pool, q, kr, vr, lay, win, block_tables, kv_lens, q_lens, num_queries,
                 k.dimensions(), dim, logits, split_rows, out);
    }
    case ffi::S8: {
      const int64_t rows = k.element_count() / dim;
      if (k_scale.element_count() != rows || v_scale.element_count() != rows)
        return ffi::Error::InvalidArgument("paged_decode: int8 scales must be [L, pages, P, K]");
      Int8Rows kr{{}, static_cast<const int8_t*>(k.untyped_data()), k_scale.typed_data()};
      Int8Rows vr{{}, static_cast<const int8_t*>(v.untyped_data()), v_scale.typed_data()};
      return Run(pool, q, kr, vr, lay, win, block_tables, kv_lens, q_lens, num_queries,
                 k.dimensions(), dim, logits, split_rows, out);
    }
    case ffi::U8:
      switch (bits) {
        case 8:
          return RunPacked<8>(pool, q, k, v, k_scale, v_scale, k_zero, v_zero, lay, win,
                              block_tables, kv_lens, q_lens, num_queries, logits, group,
                              split_rows, out);
        case 4:
          return RunPacked<4>(pool, q, k, v, k_scale, v_scale, k_zero, v_zero, lay, win,
                              block_tables, kv_lens, q_lens, num_queries, logits, group,
                              split_rows, out);
        case 2:
          return RunPacked<2>(pool, q, k, v, k_scale, v_scale, k_zero, v_zero, lay, win,
                              block_tables, kv_lens, q_lens, num_queries, logits, group,
                              split_rows, out);
        default:
          return ffi::Error::InvalidArgument("paged_decode: bits must be 8, 4 or 2");
      }
    default:
      return ffi::Error::InvalidArgument("paged_decode: pages must be f32, bf16, s8 or u8");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxPagedDecode, PagedDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k
                                  .Arg<ffi::AnyBuffer>()         // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_zero
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_zero
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_lens
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("bits")
                                  .Attr<int32_t>("group")
                                  .Attr<int32_t>("num_queries")
                                  .Attr<bool>("split_rows")
                                  .Ret<ffi::Buffer<ffi::F32>>());
