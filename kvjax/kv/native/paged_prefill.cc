// Causal prefill attention over float32 or bfloat16 KV pages read in place: an XLA FFI handler
// for the CPU (bfloat16 pages are widened to float32 as they are read; all math is float32).
//
// Buffers (row-major):
//   q        f32 [B, C, N, D]  query i of row b sits at kv_lens[b] - q_lens[b] + i and sees the
//                              keys up to it; queries i >= q_lens[b] get zeros
//   k, v     f32 | bf16 [L, num_pages, P, K, D] (both the same)
//   layer    s32 []
//   window   s32 []             a sliding window W > 0: query at t sees keys (t - W, t] only;
//                              <= 0: none
//   tables   s32 [B, W]         block tables
//   kv_lens  s32 [B]
//   q_lens   s32 [B]
//   out      f32 [B, C, N, D]
// Attributes: sm_scale, soft_cap (logits -> soft_cap * tanh(logits / soft_cap) when > 0: Gemma
// 2's attention logit cap).
//
// Two passes over XLA's intra-op threads. First, each row's keys of each kv head are copied
// transposed into a scratch [D, S], so that the scores of kLanes keys against one query are
// one vector: a broadcast query channel times a row of the scratch. Then each work item takes
// a row, a kv head and a tile of kTileQueries queries (all G query heads of each): it walks
// key blocks of kKeys up to its last query's position (causal: blocks past it are never
// read), computing the block's scores kScoreRows query heads at a time in registers, an
// online softmax on whole vectors (a vectorized exp; a mask only on the blocks that cross the
// tile's diagonal, or, with a window, the window's lower edge; keys before the window of the
// row's first query are neither transposed nor read), and the values' sum PVRows() query
// heads at a time (24 accumulators), each value row read once from its page. Items are
// claimed longest first (the last tiles see the most keys). GCC vector extensions (g++ builds it; another compiler failing leaves
// the engine on the jnp path).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// A vector is one register: 16 lanes with AVX-512, else 8 (AVX2). 16-lane vectors on an AVX2
// build are pairs of registers, and the score and value accumulators spilled to the stack:
// 6x slower on a Zen 2 box.
#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
constexpr int kKeys = 32;  // keys per block: kKeyVecs vectors of scores per query head
constexpr int kKeyVecs = kKeys / kLanes;
constexpr int kTileQueries = 16;
constexpr int kScoreRows = 12;  // query heads whose scores are accumulated together

typedef float V __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t IV __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline V Load(const float* p) { return kvjax::LoadVec<V>(p); }
inline void Store(float* p, V x) { kvjax::StoreVec<V>(p, x); }
inline V Splat(float x) { return V{} + x; }

// A page element as float32: bfloat16 (stored as its bits) is the top half of a float32.
inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// kLanes page elements from p as one float32 vector.
inline V LoadRow(const float* p) { return Load(p); }
inline V LoadRow(const uint16_t* p) {
  typedef uint16_t HV __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  HV h;
  std::memcpy(&h, p, sizeof(h));
  const IV bits = __builtin_convertvector(h, IV) << 16;
  V x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// Lane-wise max and sum of a vector, by halving shuffles (a tree, not a chain of 15).
template <typename Op>
inline float ReduceLanes(V x, Op op) {
#ifdef __AVX512F__
  x = op(x, __builtin_shuffle(x, IV{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
  x = op(x, __builtin_shuffle(x, IV{4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3}));
  x = op(x, __builtin_shuffle(x, IV{2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1}));
  x = op(x, __builtin_shuffle(x, IV{1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0}));
#else
  x = op(x, __builtin_shuffle(x, IV{4, 5, 6, 7, 0, 1, 2, 3}));
  x = op(x, __builtin_shuffle(x, IV{2, 3, 0, 1, 2, 3, 0, 1}));
  x = op(x, __builtin_shuffle(x, IV{1, 0, 1, 0, 1, 0, 1, 0}));
#endif
  return x[0];
}
inline float MaxLanes(V x) {
  return ReduceLanes(x, [](V a, V b) { return a > b ? a : b; });
}
inline float SumLanes(V x) {
  return ReduceLanes(x, [](V a, V b) { return a + b; });
}

// e^x for x <= 0, lane-wise: 2^n * e^f with |f| <= ln2/2 (kvjax::ExpTaylor); x below -87
// gives about 1e-38.
inline V ExpNonPositive(V x) {
  const V t = (x < -87.0f ? Splat(-87.0f) : x) * 1.44269504088896341f;
  const IV n = __builtin_convertvector(t - 0.5f, IV);  // t <= 0: rounds to nearest
  V p = kvjax::ExpTaylor((t - __builtin_convertvector(n, V)) * 0.693147180559945309f);
  IV bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += n << 23;
  std::memcpy(&p, &bits, sizeof(p));
  return p;
}

struct Geometry {
  int64_t rows, chunk, heads, kv_heads, page_size, num_pages, width;
  int64_t window;  // sliding window in tokens (<= 0: none)
  int64_t group() const { return heads / kv_heads; }
  // The first token of the page holding the oldest key a query at `pos` sees: pages before
  // it may have gone back to the pool, so they are never read.
  int64_t FirstToken(int64_t pos) const {
    return window > 0 ? std::max<int64_t>(pos - window + 1, 0) / page_size * page_size : 0;
  }
  // The key block (a multiple of kKeys) holding FirstToken(pos).
  int64_t FirstKey(int64_t pos) const { return FirstToken(pos) / kKeys * kKeys; }
};

// A value row for keys that are not read (zero bits are 0.0 in float32 and bfloat16).
alignas(64) constexpr float kZeros[256] = {};
alignas(64) constexpr uint16_t kZerosBf16[256] = {};
inline const float* Zeros(const float*) { return kZeros; }
inline const uint16_t* Zeros(const uint16_t*) { return kZerosBf16; }

// How a query-key dot product becomes a softmax logit: times `scale`, then soft-capped at
// `soft_cap` when it is > 0.
struct Logits {
  float scale, soft_cap;
};

// Token t's row of kv head h in layer `layer` of pages [L, num_pages, P, K, kD], by the row's
// block table.
template <int kD, typename T>
inline const T* TokenRow(const Geometry& g, const T* pages, int64_t layer,
                         const int32_t* table, int64_t t, int64_t h) {
  const int64_t P = g.page_size;
  return pages + (((layer * g.num_pages + table[t / P]) * P + t % P) * g.kv_heads + h) * kD;
}

inline int64_t Stride(int64_t len) { return (len + kKeys - 1) / kKeys * kKeys; }

// Row b's keys [readable, len) of kv head h in layer `layer`, into kt [D, Stride(len - base)]
// (base <= readable; zero before readable and past len): key t at column t - base.
template <int kD, typename T>
void TransposeKeys(const Geometry& g, const T* k, int64_t layer, const int32_t* table,
                   int64_t base, int64_t readable, int64_t len, int64_t h, float* kt) {
  const int64_t stride = Stride(len - base);
  for (int64_t d = 0; d < kD; ++d)
    std::fill(kt + d * stride, kt + d * stride + readable - base, 0.0f);
  for (int64_t t = readable; t < len; ++t) {
    const T* row = TokenRow<kD>(g, k, layer, table, t, h);
    for (int64_t d = 0; d < kD; ++d) kt[d * stride + t - base] = ToFloat(row[d]);
  }
  for (int64_t d = 0; d < kD; ++d)
    std::fill(kt + d * stride + len - base, kt + (d + 1) * stride, 0.0f);
}

// Scores of query heads qs[0:R] (scaled, [R, kD]) against keys [key0, key0 + kKeys) of kt.
template <int kD, int R>
void Scores(const float* qs, const float* kt, int64_t stride, int64_t key0, float* s) {
  V acc[R][kKeyVecs] = {};
  for (int64_t d = 0; d < kD; ++d) {
    V kv[kKeyVecs];
    for (int j = 0; j < kKeyVecs; ++j) kv[j] = Load(kt + d * stride + key0 + j * kLanes);
    for (int r = 0; r < R; ++r) {
      const V x = Splat(qs[r * kD + d]);
      for (int j = 0; j < kKeyVecs; ++j) acc[r][j] += x * kv[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kKeyVecs; ++j) Store(s + r * kKeys + j * kLanes, acc[r][j]);
}

template <int kD, int R = kScoreRows>
void ScoresOf(int rows, const float* qs, const float* kt, int64_t stride, int64_t key0,
              float* s) {
  if constexpr (R > 0) {
    if (rows != R) return ScoresOf<kD, R - 1>(rows, qs, kt, stride, key0, s);
    Scores<kD, R>(qs, kt, stride, key0, s);
  }
}

// o[0:R] = o[0:R] * alpha[0:R] + p[0:R, 0:n] @ values (n rows at vrow(t)).
template <int kD, int R, typename VRow>
void AccumulateValues(const float* p, int64_t n, VRow vrow, const float* alpha, float* o) {
  constexpr int kDV = kD / kLanes;
  V acc[R][kDV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kDV; ++j) acc[r][j] = Load(o + r * kD + j * kLanes) * alpha[r];
  for (int64_t t = 0; t < n; ++t) {
    const auto* row = vrow(t);
    V vv[kDV];
    for (int j = 0; j < kDV; ++j) vv[j] = LoadRow(row + j * kLanes);
    for (int r = 0; r < R; ++r) {
      const V w = Splat(p[r * kKeys + t]);
      for (int j = 0; j < kDV; ++j) acc[r][j] += w * vv[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kDV; ++j) Store(o + r * kD + j * kLanes, acc[r][j]);
}

template <int kD>
constexpr int PVRows() {
  return std::max(1, 24 / (kD / kLanes));  // 24 accumulators
}

template <int kD, int R = PVRows<kD>(), typename VRow>
void AccumulateValuesOf(int rows, const float* p, int64_t n, VRow vrow, const float* alpha,
                        float* o) {
  if constexpr (R > 0) {
    if (rows != R) return AccumulateValuesOf<kD, R - 1>(rows, p, n, vrow, alpha, o);
    AccumulateValues<kD, R>(p, n, vrow, alpha, o);
  }
}

// One item: row b, kv head h, queries [q0, q0 + kTileQueries).
// kt holds the row's keys from `base` on (TransposeKeys); values before `readable` are not
// read (their weights are 0).
template <int kD, typename T>
void AttendTile(const Geometry& g, const float* q, const float* kt, int64_t base,
                int64_t readable, const T* v, int64_t layer, const int32_t* table,
                int64_t len, int64_t q_len, int64_t b, int64_t h, int64_t q0, Logits logits,
                float* out) {
  const int64_t G = g.group(), N = g.heads;
  const int64_t queries = std::min<int64_t>(kTileQueries, g.chunk - q0);
  const int64_t valid = std::clamp<int64_t>(q_len - q0, 0, queries);
  for (int64_t i = valid; i < queries; ++i)  // past the row's queries: zeros
    std::fill(out + ((b * g.chunk + q0 + i) * N + h * G) * kD,
              out + ((b * g.chunk + q0 + i) * N + h * G + G) * kD, 0.0f);
  if (valid == 0) return;
  const int64_t M = valid * G;  // query heads: row r is query r / G, head h * G + r % G
  std::vector<float> qs(M * kD), o(M * kD, 0.0f), s(M * kKeys), m(M, -INFINITY), alpha(M);
  std::vector<V> l(M, V{});  // softmax denominators, summed across lanes at the end
  for (int64_t r = 0; r < M; ++r) {
    const float* src = q + ((b * g.chunk + q0 + r / G) * N + h * G + r % G) * kD;
    for (int64_t d = 0; d < kD; ++d) qs[r * kD + d] = src[d] * logits.scale;
  }
  const int64_t first = len - q_len + q0;  // position of the tile's first query
  const int64_t end = first + valid;       // keys [0, end) are seen by some query
  // With a window, keys before FirstKey(first) are seen by none; the blocks up to the last
  // query's window edge hide some keys from some queries.
  const int64_t stride = Stride(len - base);
  const bool windowed = g.window > 0;
  for (int64_t key0 = g.FirstKey(first); key0 < end; key0 += kKeys) {
    for (int64_t r = 0; r < M; r += kScoreRows)
      ScoresOf<kD>(static_cast<int>(std::min<int64_t>(kScoreRows, M - r)), qs.data() + r * kD,
                   kt, stride, key0 - base, s.data() + r * kKeys);
    const bool diagonal = key0 + kKeys - 1 > first ||  // some key is past some query
                          (windowed && key0 <= end - 1 - g.window);  // or before its window
    for (int64_t r = 0; r < M; ++r) {
      float* sr = s.data() + r * kKeys;
      if (logits.soft_cap > 0.0f)  // keys past the row's end are masked below
        for (int64_t t = 0; t < kKeys; ++t)
          sr[t] = logits.soft_cap * std::tanh(sr[t] / logits.soft_cap);
      V x[kKeyVecs];
      for (int j = 0; j < kKeyVecs; ++j) x[j] = Load(sr + j * kLanes);
      IV seen[kKeyVecs];  // lanes of keys the query sees
      if (diagonal) {
        const int32_t last = static_cast<int32_t>(first + r / G - key0);
        // Lanes above `oldest` - 1 are inside the window (all lanes without one).
        const int32_t oldest = static_cast<int32_t>(
            windowed ? std::max<int64_t>(last - g.window + 1, -1) : -1);
        for (int j = 0; j < kKeyVecs; ++j) {
          IV lane;
          for (int i = 0; i < kLanes; ++i) lane[i] = j * kLanes + i;
          seen[j] = (lane <= last) & (lane >= oldest);
          x[j] = seen[j] ? x[j] : Splat(-INFINITY);
        }
      }
      V top = x[0];
      for (int j = 1; j < kKeyVecs; ++j) top = top > x[j] ? top : x[j];
      // A query whose window starts past this block sees none of it: mx stays -inf, alpha 1,
      // and every weight is masked to 0 below.
      const float mx = std::max(m[r], MaxLanes(top));
      alpha[r] = m[r] == mx ? 1.0f : std::exp(m[r] - mx);  // m = -inf first: 0
      V sum = l[r] * alpha[r];
      for (int j = 0; j < kKeyVecs; ++j) {
        V p = ExpNonPositive(x[j] - mx);
        if (diagonal) p = seen[j] ? p : V{};
        sum += p;
        Store(sr + j * kLanes, p);
      }
      l[r] = sum;
      m[r] = mx;
    }
    const int64_t n = std::min<int64_t>(kKeys, end - key0);
    auto vrow = [&](int64_t t) {
      return key0 + t < readable ? Zeros(v) : TokenRow<kD>(g, v, layer, table, key0 + t, h);
    };
    for (int64_t r = 0; r < M; r += PVRows<kD>())
      AccumulateValuesOf<kD>(static_cast<int>(std::min<int64_t>(PVRows<kD>(), M - r)),
                             s.data() + r * kKeys, n, vrow, alpha.data() + r,
                             o.data() + r * kD);
  }
  for (int64_t r = 0; r < M; ++r) {
    float* dst = out + ((b * g.chunk + q0 + r / G) * N + h * G + r % G) * kD;
    const float inv = 1.0f / SumLanes(l[r]);  // every valid query sees its own key
    for (int64_t d = 0; d < kD; ++d) dst[d] = o[r * kD + d] * inv;
  }
}

using kvjax::ParallelFor;

template <int kD, typename T>
void Run(ffi::ThreadPool& pool, const Geometry& g, const float* q, const T* k,
         const T* v, int64_t layer, const int32_t* tables, const int32_t* lens,
         const int32_t* q_lens, Logits logits, float* out) {
  const int64_t B = g.rows, K = g.kv_heads;
  // Row b's scratch holds its keys from base[b] on (the window of its first query); rows
  // without queries have none.
  std::vector<int64_t> offset(B + 1, 0), base(B, 0), readable(B, 0);
  for (int64_t b = 0; b < B; ++b) {
    readable[b] = q_lens[b] > 0 ? g.FirstToken(lens[b] - q_lens[b]) : 0;
    base[b] = readable[b] / kKeys * kKeys;
    offset[b + 1] = offset[b] + (q_lens[b] > 0 ? K * kD * Stride(lens[b] - base[b]) : 0);
  }
  std::vector<float> kt(offset[B]);
  auto scratch = [&](int64_t b, int64_t h) {
    return kt.data() + offset[b] + h * kD * Stride(lens[b] - base[b]);
  };
  ParallelFor(pool, B * K, [&](int64_t i) {
    const int64_t b = i / K;
    if (q_lens[b] > 0)
      TransposeKeys<kD>(g, k, layer, tables + b * g.width, base[b], readable[b], lens[b], i % K,
                        scratch(b, i % K));
  });
  const int64_t tiles = (g.chunk + kTileQueries - 1) / kTileQueries;
  ParallelFor(pool, B * K * tiles, [&](int64_t i) {
    const int64_t tile = tiles - 1 - i / (B * K);  // the longest (last) tiles first
    const int64_t b = i % (B * K) / K, h = i % K;
    AttendTile<kD>(g, q, scratch(b, h), base[b], readable[b], v, layer,
                   tables + b * g.width, lens[b], q_lens[b], b, h, tile * kTileQueries,
                   logits, out);
  });
}

ffi::Error PagedPrefill(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v,
                        ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> window,
                        ffi::Buffer<ffi::S32> tables,
                        ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> q_lens,
                        float sm_scale, float soft_cap,
                        ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto qd = q.dimensions(), kd = k.dimensions(), td = tables.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || td.size() != 2 || td[0] != qd[0] ||
      kd[4] != qd[3] || qd[2] % kd[3] != 0 || k.element_type() != v.element_type() ||
      k.element_count() != v.element_count())
    return ffi::Error::InvalidArgument(
        "paged_prefill: q must be [B, C, N, D], k and v pages [L, num_pages, P, K, D] of one "
        "dtype with K dividing N, block tables [B, W]");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= kd[0]) return ffi::Error::InvalidArgument("paged_prefill: bad layer");
  const int32_t* lens = kv_lens.typed_data();
  const int32_t* ql = q_lens.typed_data();
  for (int64_t b = 0; b < qd[0]; ++b)
    if (lens[b] < 0 || lens[b] > td[1] * kd[2] || ql[b] < 0 ||
        ql[b] > std::min<int64_t>(lens[b], qd[1]))
      return ffi::Error::InvalidArgument("paged_prefill: a row's kv_len or q_len is out of range");
  const Geometry g{qd[0], qd[1], qd[2], kd[3], kd[2], kd[1], td[1], window.typed_data()[0]};
  auto run = [&](auto page) {
    using T = decltype(page);
    const T* kp = static_cast<const T*>(k.untyped_data());
    const T* vp = static_cast<const T*>(v.untyped_data());
    const Logits logits{sm_scale, soft_cap};
    if (qd[3] == 64)
      Run<64>(pool, g, q.typed_data(), kp, vp, l, tables.typed_data(), lens, ql, logits,
              out->typed_data());
    else if (qd[3] == 128)
      Run<128>(pool, g, q.typed_data(), kp, vp, l, tables.typed_data(), lens, ql, logits,
               out->typed_data());
    else
      return ffi::Error::InvalidArgument("paged_prefill: head_dim must be 64 or 128");
    return ffi::Error::Success();
  };
  if (k.element_type() == ffi::F32) return run(float{});
  if (k.element_type() == ffi::BF16) return run(uint16_t{});
  return ffi::Error::InvalidArgument("paged_prefill: pages must be f32 or bf16");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxPagedPrefill, PagedPrefill,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k pages (f32 or bf16)
                                  .Arg<ffi::AnyBuffer>()  // v pages (the same dtype)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q lens
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());
