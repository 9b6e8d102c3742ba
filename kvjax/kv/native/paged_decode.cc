// Paged decode attention for the CPU, read in place from the page pool: an XLA FFI handler.
//
// The engine's jnp path gathers each block of pages into a fresh buffer and transposes it for
// the matmuls; this kernel walks each row's block table and reads every key and value straight
// from the pool (all layers' pages, one buffer), so a decode step reads each KV byte once.
// Semantics are those of kvjax.kv.attention.paged_decode_attention_reference (no sliding
// window, no soft cap): query b sits at position kv_lens[b] - 1 and sees tokens
// [0, kv_lens[b]); a row with kv_lens[b] == 0 gets zeros. Online softmax in float32, one page
// at a time.
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
// Attributes: sm_scale, bits (8, 4 or 2: the u8 code width) and group (channels per scale).
//   block_tables s32  [B, W]
//   kv_lens      s32  [B]
//   q_lens       s32  [B] (queries per row, <= num_queries)
//   out          f32  [B, N, D]   (N = num_queries * G * K, kv head h's at [h*Q*G, (h+1)*Q*G))
// Work is split over (row, kv head) pairs across XLA's intra-op thread pool.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxGroup = 32;   // query heads (times queries per row) per kv head
constexpr int kMaxHeadDim = 256;
constexpr int kMaxPage = 256;

inline float Load(const float* x, int64_t i) { return x[i]; }
inline float Load(const uint16_t* x, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Row readers: decode the `dim` channels of stored row `row` (the flat (layer, page, slot, kv
// head) index) into floats. Codes are decoded in registers; nothing is written back. `dim` is
// passed by the caller, where it is a compile-time constant for the common head dims.
template <typename T>
struct FloatRows {
  const T* data;
  void operator()(int64_t row, int64_t dim, float* x) const {
    const T* r = data + row * dim;
    for (int64_t d = 0; d < dim; ++d) x[d] = Load(r, d);
  }
};

struct Int8Rows {  // symmetric, one scale per token and kv head
  const int8_t* codes;
  const float* scale;
  void operator()(int64_t row, int64_t dim, float* x) const {
    const int8_t* r = codes + row * dim;
    const float s = scale[row];
    for (int64_t d = 0; d < dim; ++d) x[d] = static_cast<float>(r[d]) * s;
  }
};

template <int kBits>
struct PackedRows {  // asymmetric, a scale and zero per `group` channels
  const uint8_t* codes;
  const float* scale;
  const float* zero;
  int64_t group;
  void operator()(int64_t row, int64_t dim, float* x) const {
    constexpr int kPerByte = 8 / kBits;
    constexpr uint32_t kMask = (1u << kBits) - 1;
    const uint8_t* r = codes + row * (dim / kPerByte);
    for (int64_t i = 0; i < dim / kPerByte; ++i) {
      const uint32_t byte = r[i];
      for (int j = 0; j < kPerByte; ++j)
        x[i * kPerByte + j] = static_cast<float>((byte >> (j * kBits)) & kMask);
    }
    const int64_t groups = dim / group;
    const float* s = scale + row * groups;
    const float* z = zero + row * groups;
    for (int64_t gi = 0; gi < groups; ++gi)
      for (int64_t d = gi * group; d < (gi + 1) * group; ++d) x[d] = z[gi] + x[d] * s[gi];
  }
};

// exp(x) for x <= 0 (softmax weights after subtracting the running max), branch-free so the
// page loops vectorize: 2^(x log2 e) as 2^n * 2^f with |f| <= 1/2 and 2^f by its degree-7
// Taylor polynomial (relative error < 1e-8, below float32 rounding). Inputs below -87 give
// about 1e-38 instead of a subnormal or 0, which no softmax sum notices.
inline float ExpNonPositive(float x) {
  const float t = std::max(x, -87.0f) * 1.44269504088896341f;
  const float n = std::floor(t + 0.5f);
  const float f = (t - n) * 0.693147180559945309f;  // 2^(t - n) = e^f
  float p = 1.0f / 5040.0f;
  p = p * f + 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  uint32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<uint32_t>(static_cast<int32_t>(n)) << 23;
  std::memcpy(&p, &bits, sizeof(p));
  return p;
}

struct Geometry {
  int64_t num_rows, num_heads, head_dim, num_pages, page_size, num_kv_heads, width;
  int64_t group() const { return num_heads / num_kv_heads; }
};

// One (row, kv head): out[b, h*G:(h+1)*G, :] from the row's pages of `layer`, keys and
// values decoded by `Rows`. kD and kG are the head dim and group size when known at compile
// time (0: read from g), so the common shapes get fully unrolled, vectorized inner loops.
template <int kD, int kG, typename Rows>
void AttendOne(const Geometry& g, int64_t b, int64_t h, const float* q, const Rows& k,
               const Rows& v, int64_t layer, const int32_t* block_tables,
               const int32_t* kv_lens, const int32_t* q_lens, int64_t num_queries,
               float sm_scale, float* out) {
  const int64_t G = kG ? kG : g.group(), D = kD ? kD : g.head_dim, P = g.page_size;
  const int64_t K = g.num_kv_heads;
  float* o = out + (b * g.num_heads + h * G) * D;
  const int64_t len = kv_lens[b];
  if (len <= 0) {
    std::fill(o, o + G * D, 0.0f);
    return;
  }
  // Tokens [0, lim[j]) are visible to head j: query i = j / (G / Q) of the row.
  int64_t lim[kMaxGroup];
  const int64_t per_query = G / num_queries, first = len - q_lens[b];
  for (int64_t j = 0; j < G; ++j) {
    const int64_t i = j / per_query;
    lim[j] = i < q_lens[b] ? first + i + 1 : 0;
  }
  alignas(64) float qs[kG ? kG : kMaxGroup][kD ? kD : kMaxHeadDim];
  alignas(64) float acc[kG ? kG : kMaxGroup][kD ? kD : kMaxHeadDim];
  float m[kMaxGroup], l[kMaxGroup];
  float s[kMaxGroup][kMaxPage];
  for (int64_t j = 0; j < G; ++j) {
    const float* qj = q + (b * g.num_heads + h * G + j) * D;
    for (int64_t d = 0; d < D; ++d) qs[j][d] = qj[d] * sm_scale;
    for (int64_t d = 0; d < D; ++d) acc[j][d] = 0.0f;
    m[j] = -INFINITY;
    l[j] = 0.0f;
  }
  const int64_t num_blocks = (len + P - 1) / P;
  for (int64_t blk = 0; blk < num_blocks; ++blk) {
    const int64_t page = block_tables[b * g.width + blk];
    const int64_t n = std::min<int64_t>(P, len - blk * P);
    const int64_t base = ((layer * g.num_pages + page) * P) * K + h;  // token 0, head h
    for (int64_t p = 0; p < n; ++p) {
      alignas(64) float x[kD ? kD : kMaxHeadDim];
      k(base + p * K, D, x);
      for (int64_t j = 0; j < G; ++j) {
        float dot = 0.0f;
        for (int64_t d = 0; d < D; ++d) dot += qs[j][d] * x[d];
        s[j][p] = dot;
      }
    }
    for (int64_t j = 0; j < G; ++j) {
      const int64_t nv = std::clamp<int64_t>(lim[j] - blk * P, 0, n);  // visible tokens
      for (int64_t p = nv; p < n; ++p) s[j][p] = 0.0f;
      if (nv == 0) continue;
      float mx = m[j];
      for (int64_t p = 0; p < nv; ++p) mx = std::max(mx, s[j][p]);
      const float alpha = std::exp(m[j] - mx);  // exp(-inf) = 0 on the first page
      float sum = 0.0f;
      for (int64_t p = 0; p < nv; ++p) {
        s[j][p] = ExpNonPositive(s[j][p] - mx);
        sum += s[j][p];
      }
      l[j] = l[j] * alpha + sum;
      if (alpha != 1.0f)
        for (int64_t d = 0; d < D; ++d) acc[j][d] *= alpha;
      m[j] = mx;
    }
    for (int64_t p = 0; p < n; ++p) {
      alignas(64) float x[kD ? kD : kMaxHeadDim];
      v(base + p * K, D, x);
      for (int64_t j = 0; j < G; ++j) {
        const float w = s[j][p];
        for (int64_t d = 0; d < D; ++d) acc[j][d] += w * x[d];
      }
    }
  }
  for (int64_t j = 0; j < G; ++j) {
    const float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;
    for (int64_t d = 0; d < D; ++d) o[j * D + d] = acc[j][d] * inv;
  }
}

// Runs fn(i) for i in [0, n) on the caller and the pool's threads. Items are claimed from a
// shared counter, so a task the pool starts late finds nothing left and returns; the caller
// waits only for items already claimed (no deadlock when the pool is busy).
template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, Fn fn) {
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

template <typename Rows>
ffi::Error Run(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, const Rows& k, const Rows& v,
               int64_t layer, ffi::Buffer<ffi::S32> block_tables,
               ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> q_lens,
               int64_t num_queries, ffi::AnyBuffer::Dimensions kv_dims, int64_t head_dim,
               float sm_scale, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto qd = q.dimensions();
  Geometry g{qd[0], qd[1], qd[2], kv_dims[1], kv_dims[2], kv_dims[3],
             block_tables.dimensions()[1]};
  if (head_dim != g.head_dim || g.num_heads % g.num_kv_heads || g.group() > kMaxGroup ||
      num_queries < 1 || g.group() % num_queries || q_lens.element_count() != g.num_rows ||
      g.head_dim > kMaxHeadDim || g.page_size > kMaxPage || layer < 0 ||
      layer >= kv_dims[0])
    return ffi::Error::InvalidArgument("paged_decode: unsupported shapes");
  const float* qp = q.typed_data();
  const int32_t* bt = block_tables.typed_data();
  const int32_t* lens = kv_lens.typed_data();
  const int32_t* qlens = q_lens.typed_data();
  float* o = out->typed_data();
  auto attend = [&](auto one) {
    ParallelFor(pool, g.num_rows * g.num_kv_heads, [&, one](int64_t i) {
      one(g, i / g.num_kv_heads, i % g.num_kv_heads, qp, k, v, layer, bt, lens, qlens,
          num_queries, sm_scale, o);
    });
  };
  const int64_t G = g.group();
  if (g.head_dim == 64 && G == 1) attend(AttendOne<64, 1, Rows>);
  else if (g.head_dim == 64 && G == 2) attend(AttendOne<64, 2, Rows>);
  else if (g.head_dim == 64 && G == 3) attend(AttendOne<64, 3, Rows>);
  else if (g.head_dim == 64 && G == 4) attend(AttendOne<64, 4, Rows>);
  else if (g.head_dim == 128 && G == 1) attend(AttendOne<128, 1, Rows>);
  else if (g.head_dim == 128 && G == 4) attend(AttendOne<128, 4, Rows>);
  else if (g.head_dim == 128 && G == 8) attend(AttendOne<128, 8, Rows>);
  else attend(AttendOne<0, 0, Rows>);
  return ffi::Error::Success();
}

template <int kBits>
ffi::Error RunPacked(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                     ffi::AnyBuffer v, ffi::Buffer<ffi::F32> k_scale,
                     ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::F32> k_zero,
                     ffi::Buffer<ffi::F32> v_zero, int64_t layer,
                     ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> kv_lens,
                     ffi::Buffer<ffi::S32> q_lens, int64_t num_queries, float sm_scale,
                     int64_t group, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const int64_t dim = k.dimensions()[4] * (8 / kBits);
  const int64_t rows = k.element_count() / k.dimensions()[4];
  const int64_t metadata = rows * (dim / std::max<int64_t>(group, 1));
  if (group <= 0 || dim % group || k_scale.element_count() != metadata ||
      v_scale.element_count() != metadata || k_zero.element_count() != metadata ||
      v_zero.element_count() != metadata)
    return ffi::Error::InvalidArgument("paged_decode: scale/zero do not match codes and group");
  PackedRows<kBits> kr{static_cast<const uint8_t*>(k.untyped_data()), k_scale.typed_data(),
                       k_zero.typed_data(), group};
  PackedRows<kBits> vr{static_cast<const uint8_t*>(v.untyped_data()), v_scale.typed_data(),
                       v_zero.typed_data(), group};
  return Run(pool, q, kr, vr, layer, block_tables, kv_lens, q_lens, num_queries, k.dimensions(),
             dim, sm_scale, out);
}

ffi::Error PagedDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                       ffi::AnyBuffer v, ffi::Buffer<ffi::F32> k_scale,
                       ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::F32> k_zero,
                       ffi::Buffer<ffi::F32> v_zero, ffi::Buffer<ffi::S32> layer,
                       ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> kv_lens,
                       ffi::Buffer<ffi::S32> q_lens, float sm_scale, int32_t bits,
                       int32_t group, int32_t num_queries,
                       ffi::Result<ffi::Buffer<ffi::F32>> out) {
  if (k.dimensions().size() != 5 || k.element_type() != v.element_type() ||
      k.element_count() != v.element_count())
    return ffi::Error::InvalidArgument("paged_decode: k and v must be [L, pages, P, K, D]");
  const int64_t lay = layer.typed_data()[0];
  const int64_t dim = k.dimensions()[4];
  switch (k.element_type()) {
    case ffi::F32: {
      FloatRows<float> kr{static_cast<const float*>(k.untyped_data())};
      FloatRows<float> vr{static_cast<const float*>(v.untyped_data())};
      return Run(pool, q, kr, vr, lay, block_tables, kv_lens, q_lens, num_queries,
                 k.dimensions(), dim, sm_scale, out);
    }
    case ffi::BF16: {
      FloatRows<uint16_t> kr{static_cast<const uint16_t*>(k.untyped_data())};
      FloatRows<uint16_t> vr{static_cast<const uint16_t*>(v.untyped_data())};
      return Run(pool, q, kr, vr, lay, block_tables, kv_lens, q_lens, num_queries,
                 k.dimensions(), dim, sm_scale, out);
    }
    case ffi::S8: {
      const int64_t rows = k.element_count() / dim;
      if (k_scale.element_count() != rows || v_scale.element_count() != rows)
        return ffi::Error::InvalidArgument("paged_decode: int8 scales must be [L, pages, P, K]");
      Int8Rows kr{static_cast<const int8_t*>(k.untyped_data()), k_scale.typed_data()};
      Int8Rows vr{static_cast<const int8_t*>(v.untyped_data()), v_scale.typed_data()};
      return Run(pool, q, kr, vr, lay, block_tables, kv_lens, q_lens, num_queries,
                 k.dimensions(), dim, sm_scale, out);
    }
    case ffi::U8:
      switch (bits) {
        case 8:
          return RunPacked<8>(pool, q, k, v, k_scale, v_scale, k_zero, v_zero, lay,
                              block_tables, kv_lens, q_lens, num_queries, sm_scale, group,
                              out);
        case 4:
          return RunPacked<4>(pool, q, k, v, k_scale, v_scale, k_zero, v_zero, lay,
                              block_tables, kv_lens, q_lens, num_queries, sm_scale, group,
                              out);
        case 2:
          return RunPacked<2>(pool, q, k, v, k_scale, v_scale, k_zero, v_zero, lay,
                              block_tables, kv_lens, q_lens, num_queries, sm_scale, group,
                              out);
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
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_lens
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("bits")
                                  .Attr<int32_t>("group")
                                  .Attr<int32_t>("num_queries")
                                  .Ret<ffi::Buffer<ffi::F32>>());
