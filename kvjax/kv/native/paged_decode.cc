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
// Buffers (row-major):
//   q            f32  [B, N, D]
//   k, v         f32 | bf16 | s8  [L, num_pages, P, K, D]
//   k_scale,     f32  [L, num_pages, P, K]   (s8 codes only: x = code * scale; else [1])
//   v_scale
//   layer        s32  []
//   block_tables s32  [B, W]
//   kv_lens      s32  [B]
//   out          f32  [B, N, D]
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

constexpr int kMaxGroup = 16;   // query heads per kv head
constexpr int kMaxHeadDim = 256;
constexpr int kMaxPage = 256;

inline float Load(const float* x, int64_t i) { return x[i]; }
inline float Load(const uint16_t* x, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float Load(const int8_t* x, int64_t i) { return static_cast<float>(x[i]); }

struct Geometry {
  int64_t num_rows, num_heads, head_dim, num_pages, page_size, num_kv_heads, width;
  int64_t group() const { return num_heads / num_kv_heads; }
};

// One (row, kv head): out[b, h*G:(h+1)*G, :] from the row's pages of `layer`. kD and kG are
// the head dim and group size when known at compile time (0: read from g), so the common
// shapes get fully unrolled, vectorized inner loops.
template <int kD, int kG, typename T>
void AttendOne(const Geometry& g, int64_t b, int64_t h, const float* q, const T* k,
               const T* v, const float* k_scale, const float* v_scale, int64_t layer,
               const int32_t* block_tables, const int32_t* kv_lens, float sm_scale,
               float* out) {
  const int64_t G = kG ? kG : g.group(), D = kD ? kD : g.head_dim, P = g.page_size;
  const int64_t K = g.num_kv_heads;
  float* o = out + (b * g.num_heads + h * G) * D;
  const int64_t len = kv_lens[b];
  if (len <= 0) {
    std::fill(o, o + G * D, 0.0f);
    return;
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
      const T* kr = k + (base + p * K) * D;
      float x[kD ? kD : kMaxHeadDim];
      for (int64_t d = 0; d < D; ++d) x[d] = Load(kr, d);
      const float ks = k_scale ? k_scale[base + p * K] : 1.0f;
      for (int64_t j = 0; j < G; ++j) {
        float dot = 0.0f;
        for (int64_t d = 0; d < D; ++d) dot += qs[j][d] * x[d];
        s[j][p] = dot * ks;
      }
    }
    for (int64_t j = 0; j < G; ++j) {
      float mx = m[j];
      for (int64_t p = 0; p < n; ++p) mx = std::max(mx, s[j][p]);
      const float alpha = std::exp(m[j] - mx);  // exp(-inf) = 0 on the first page
      float sum = 0.0f;
      for (int64_t p = 0; p < n; ++p) {
        s[j][p] = std::exp(s[j][p] - mx);
        sum += s[j][p];
      }
      l[j] = l[j] * alpha + sum;
      if (alpha != 1.0f)
        for (int64_t d = 0; d < D; ++d) acc[j][d] *= alpha;
      m[j] = mx;
    }
    for (int64_t p = 0; p < n; ++p) {
      const T* vr = v + (base + p * K) * D;
      float x[kD ? kD : kMaxHeadDim];
      const float vs = v_scale ? v_scale[base + p * K] : 1.0f;
      for (int64_t d = 0; d < D; ++d) x[d] = Load(vr, d) * vs;
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

template <typename T>
ffi::Error Run(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, const T* k, const T* v,
               const float* k_scale, const float* v_scale, int64_t layer,
               ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> kv_lens,
               ffi::AnyBuffer::Dimensions kv_dims, float sm_scale,
               ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto qd = q.dimensions();
  Geometry g{qd[0], qd[1], qd[2], kv_dims[1], kv_dims[2], kv_dims[3],
             block_tables.dimensions()[1]};
  if (kv_dims[4] != g.head_dim || g.num_heads % g.num_kv_heads || g.group() > kMaxGroup ||
      g.head_dim > kMaxHeadDim || g.page_size > kMaxPage || layer < 0 ||
      layer >= kv_dims[0])
    return ffi::Error::InvalidArgument("paged_decode: unsupported shapes");
  const float* qp = q.typed_data();
  const int32_t* bt = block_tables.typed_data();
  const int32_t* lens = kv_lens.typed_data();
  float* o = out->typed_data();
  auto attend = [&](auto one) {
    ParallelFor(pool, g.num_rows * g.num_kv_heads, [&, one](int64_t i) {
      one(g, i / g.num_kv_heads, i % g.num_kv_heads, qp, k, v, k_scale, v_scale, layer, bt,
          lens, sm_scale, o);
    });
  };
  const int64_t G = g.group();
  if (g.head_dim == 64 && G == 1) attend(AttendOne<64, 1, T>);
  else if (g.head_dim == 64 && G == 2) attend(AttendOne<64, 2, T>);
  else if (g.head_dim == 64 && G == 3) attend(AttendOne<64, 3, T>);
  else if (g.head_dim == 64 && G == 4) attend(AttendOne<64, 4, T>);
  else if (g.head_dim == 128 && G == 1) attend(AttendOne<128, 1, T>);
  else if (g.head_dim == 128 && G == 4) attend(AttendOne<128, 4, T>);
  else if (g.head_dim == 128 && G == 8) attend(AttendOne<128, 8, T>);
  else attend(AttendOne<0, 0, T>);
  return ffi::Error::Success();
}

ffi::Error PagedDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                       ffi::AnyBuffer v, ffi::Buffer<ffi::F32> k_scale,
                       ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> layer,
                       ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> kv_lens,
                       float sm_scale, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  if (k.dimensions().size() != 5 || k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument("paged_decode: k and v must be [L, pages, P, K, D]");
  const int64_t lay = layer.typed_data()[0];
  switch (k.element_type()) {
    case ffi::F32:
      return Run(pool, q, static_cast<const float*>(k.untyped_data()),
                 static_cast<const float*>(v.untyped_data()), nullptr, nullptr, lay,
                 block_tables, kv_lens, k.dimensions(), sm_scale, out);
    case ffi::BF16:
      return Run(pool, q, static_cast<const uint16_t*>(k.untyped_data()),
                 static_cast<const uint16_t*>(v.untyped_data()), nullptr, nullptr, lay,
                 block_tables, kv_lens, k.dimensions(), sm_scale, out);
    case ffi::S8:
      return Run(pool, q, static_cast<const int8_t*>(k.untyped_data()),
                 static_cast<const int8_t*>(v.untyped_data()), k_scale.typed_data(),
                 v_scale.typed_data(), lay, block_tables, kv_lens, k.dimensions(), sm_scale,
                 out);
    default:
      return ffi::Error::InvalidArgument("paged_decode: pages must be f32, bf16 or s8");
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
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Attr<float>("sm_scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
