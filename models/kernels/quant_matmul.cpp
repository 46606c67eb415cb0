// Weight-only quantized linear layers for AVX2 CPUs, in llama.cpp's block formats.
//
// Op contracts (registered as kvserve_native::*):
//   linear_q4(x [..., K] f32, w [N, K/32*20] u8, panels = pack_panels_q4(w)) -> [..., N] f32
//       a w row holds llama.cpp's Q4_1 blocks of 32 weights, stored as arrays: nb*16 bytes of nibbles
//       (byte j of a block holds weight j in its low nibble and j+16 in its high one), then nb fp16
//       scales d, then nb fp16 mins m; w = d*q + m.
//   linear_q8(x [..., K] f32, w [N, K/32*34] u8, panels = pack_panels_q8(w)) -> [..., N] f32
//       a w row holds Q8_0 blocks as arrays: nb*32 int8, then nb fp16 scales d; w = d*q.
//   pack_panels_q4(w) / pack_panels_q8(w) -> the same weights unpacked for the batched path (int_gemm.cpp);
//       the model makes them once and owns them, as it owns w.
// Scales as arrays rather than inside each block let the kernels load and convert four at a time.
// The activations are quantized per block of 32 to int16 (scale amax/32767; int8, as llama.cpp uses,
// was faster but flipped many greedy tokens even on the qkv and gate/up projections alone; figures in
// docs/performance.md), and each block's products are summed in int32 by madd, then scaled in f32. Below
// BATCH_ROWS rows that runs here, straight off the blocks: at batch 1 reading 0.6 (Q4) or 1.06 (Q8)
// bytes per weight instead of 4, streaming them near the read bandwidth (software prefetch), and
// integer dot products that use few instructions per block are the levers; activation rows share
// each weight block load. From BATCH_ROWS rows on, the same products run as a GEMM (int_gemm.cpp).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include "simd.h"
#include "quant_blocks.h"
#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

namespace {

using kvserve_quant::Blocks;
using kvserve_quant::half_at;
using kvserve_quant::Q4_BYTES;
using kvserve_quant::Q8_BYTES;
using kvserve_quant::QK;
using kvserve_quant::QuantizedRows;
constexpr int64_t MAX_ROWS = 3;   // activation rows sharing one weight-block load (BATCH_ROWS - 1)
// From this many activation rows on, int_gemm.cpp's panels beat these dot products, which re-read
// and re-unpack each weight block per group of MAX_ROWS rows.
constexpr int64_t BATCH_ROWS = MAX_ROWS + 1;
constexpr int64_t PREFETCH_SPANS = 2;  // how many row groups ahead dot_rows prefetches

inline __m128 four_halves(const uint8_t* p) {
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// [b0 b1 b2 b3] per-block int32 partial vectors -> one vector whose low lanes hold blocks 0..3's
// sums over elements 0..3 of each partial and high lanes over 4..7 (summing all lanes is exact).
// A transpose by unpacks and adds: hadd would spend 3 uops where these spend 1.
inline __m256 four_block_sums(const __m256i p[4]) {
  const __m256i a = _mm256_add_epi32(_mm256_unpacklo_epi32(p[0], p[1]), _mm256_unpackhi_epi32(p[0], p[1]));  // b0 b1 b0 b1
  const __m256i b = _mm256_add_epi32(_mm256_unpacklo_epi32(p[2], p[3]), _mm256_unpackhi_epi32(p[2], p[3]));  // b2 b3 b2 b3
  return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b)));  // b0 b1 b2 b3
}

using kvserve_simd::hmax;
using kvserve_simd::hsum;
using kvserve_simd::hsum128;

// Activations: each block of 32 floats becomes 32 int16 in order, with one float scale d = amax/32767
// (and s = d * sum(q), which Q4_1's min term needs).
inline void quantize_block(const float* x, int16_t* q, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  const float scale = hmax(amax) / 32767.0f;
  const __m256 inv = _mm256_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f);
  __m256i total = _mm256_setzero_si256();
  for (int j = 0; j < 4; j += 2) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv)), b = _mm256_cvtps_epi32(_mm256_mul_ps(v[j + 1], inv));  // round to nearest
    total = _mm256_add_epi32(total, _mm256_add_epi32(a, b));
    // packs interleaves 128-bit lanes (a0 b0 a1 b1); the permute restores a0 a1 b0 b1
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 8 * j), packed);
  }
  *d = scale;
  *s = scale * hsum(_mm256_cvtepi32_ps(total));
}

// Into the calling thread's scratch (valid until its next call): at batch 1, three at::empty calls
// for these cost about as much as quantizing the row.
QuantizedRows quantize_rows(const at::Tensor& x) {
  thread_local std::vector<int16_t> q;
  thread_local std::vector<float> d, s;
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  q.resize(M * K), d.resize(M * nb), s.resize(M * nb);
  const float* xp = x.data_ptr<float>();
  int16_t* qp = q.data();
  float *dp = d.data(), *sp = s.data();
  // rows are contiguous and K is a whole number of blocks, so block i of the flat array is block i % nb of row i / nb
  at::parallel_for(0, M * nb, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) quantize_block(xp + i * QK, qp + i * QK, dp + i, sp + i);
  });
  return {qp, dp, sp};
}

inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Weight block formats: unpack() reads one block once, widened to 16 bits in order (weights 0..15,
// 16..31) by extending loads; dot() gives the int32 partial sums [8] of that block with one
// activation row's block.
// Q4_1 block bytes: byte j = q[j] | q[j+16] << 4.
struct Q4Block {
  struct W { __m256i lo, hi; };
  static constexpr int64_t quant_bytes = kvserve_quant::Q4_QUANT_BYTES;
  static constexpr bool has_min = true;
  static inline W unpack(const uint8_t* q) {
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));  // word j = byte j
    return {_mm256_and_si256(bytes, _mm256_set1_epi16(0x0F)), _mm256_srli_epi16(bytes, 4)};
  }
  static inline __m256i dot(const W& w, const int16_t* x) {
    return _mm256_add_epi32(_mm256_madd_epi16(w.lo, load256(x)), _mm256_madd_epi16(w.hi, load256(x + 16)));
  }
};

struct Q8Block {
  using W = Q4Block::W;
  static constexpr int64_t quant_bytes = kvserve_quant::Q8_QUANT_BYTES;
  static constexpr bool has_min = false;
  static inline W unpack(const uint8_t* q) {
    return {_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))),
            _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))};
  }
  static inline __m256i dot(const W& w, const int16_t* x) { return Q4Block::dot(w, x); }
};

// out[r * ldo + c] = dot(weight row c, activation row r) for C weight rows (row_bytes apart) and R
// activation rows: R*C independent accumulators. Four blocks at a time share one scale multiply.
template <class B, int R, int C>
inline void dot_rows(const uint8_t* w, int64_t row_bytes, const int16_t* xq, const float* xd, const float* xs,
                     int64_t K, int64_t nb, float* out, int64_t ldo) {
  __m256 acc[R][C];
  __m128 mins[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps(), mins[r][c] = _mm_setzero_ps();
  const int64_t scales_at = nb * B::quant_bytes, mins_at = scales_at + 2 * nb;
  // These C rows are one contiguous span; while reading it, prefetch the span PREFETCH_SPANS ahead,
  // spread over the loop (the hardware prefetcher alone reached about half of the read bandwidth).
  // Past the weight's end a prefetch is only wasted, never a fault.
  const int64_t span = C * row_bytes, per_step = (span / std::max<int64_t>(nb / 4, 1) + 63) / 64 * 64;
  const char* ahead = reinterpret_cast<const char*>(w) + PREFETCH_SPANS * span;
  int64_t b = 0;
  for (; b + 4 <= nb; b += 4) {
    for (int64_t at = b / 4 * per_step; at < std::min(span, (b / 4 + 1) * per_step); at += 64)
      _mm_prefetch(ahead + at, _MM_HINT_T0);
    for (int c = 0; c < C; ++c) {
      const uint8_t* row = w + c * row_bytes;
      const __m128 dw = four_halves(row + scales_at + 2 * b);
      typename B::W wb[4];
      for (int j = 0; j < 4; ++j) wb[j] = B::unpack(row + (b + j) * B::quant_bytes);
      for (int r = 0; r < R; ++r) {
        __m256i p[4];
        for (int j = 0; j < 4; ++j) p[j] = B::dot(wb[j], xq + r * K + (b + j) * QK);
        const __m128 scale = _mm_mul_ps(dw, _mm_loadu_ps(xd + r * nb + b));
        acc[r][c] = _mm256_fmadd_ps(four_block_sums(p), _mm256_set_m128(scale, scale), acc[r][c]);
        if (B::has_min)
          mins[r][c] = _mm_fmadd_ps(four_halves(row + mins_at + 2 * b), _mm_loadu_ps(xs + r * nb + b), mins[r][c]);
      }
    }
  }
  for (; b < nb; ++b) {  // the last nb % 4 blocks, one at a time
    for (int c = 0; c < C; ++c) {
      const uint8_t* row = w + c * row_bytes;
      const float dw = half_at(row + scales_at + 2 * b);
      const typename B::W wb = B::unpack(row + b * B::quant_bytes);
      for (int r = 0; r < R; ++r) {
        const __m256 p = _mm256_cvtepi32_ps(B::dot(wb, xq + r * K + b * QK));
        acc[r][c] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * xd[r * nb + b]), acc[r][c]);
        if (B::has_min)
          mins[r][c] = _mm_add_ss(mins[r][c], _mm_set_ss(half_at(row + mins_at + 2 * b) * xs[r * nb + b]));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = hsum(acc[r][c]) + hsum128(mins[r][c]);
}

using DotFn = void (*)(const uint8_t*, int64_t, const int16_t*, const float*, const float*, int64_t, int64_t, float*, int64_t);

struct Format {
  Blocks blocks;
  int64_t block_bytes;
  DotFn wide[MAX_ROWS];  // R = 1..3 activation rows, over WIDE[R - 1] weight rows at once
  DotFn narrow[MAX_ROWS];  // R = 1..3 activation rows, one weight row
};
constexpr int64_t WIDE[MAX_ROWS] = {4, 2, 1};

template <class B>
constexpr Format format(Blocks blocks, int64_t block_bytes) {
  return {blocks, block_bytes,
          {dot_rows<B, 1, 4>, dot_rows<B, 2, 2>, dot_rows<B, 3, 1>},
          {dot_rows<B, 1, 1>, dot_rows<B, 2, 1>, dot_rows<B, 3, 1>}};
}

const Format Q4 = format<Q4Block>(Blocks::Q4_1, Q4_BYTES);
const Format Q8 = format<Q8Block>(Blocks::Q8_0, Q8_BYTES);

// Few rows (all of them in one tile): quantize the activations and take integer dot products, reading
// each weight byte once.
void small_batch(const at::Tensor& x, const uint8_t* wp, int64_t N, const Format& f, float* op) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK, row_bytes = nb * f.block_bytes;
  const QuantizedRows xq = quantize_rows(x);
  const int16_t* qp = xq.q;
  const float *dp = xq.d, *sp = xq.s;
  TORCH_INTERNAL_ASSERT(M >= 1 && M <= MAX_ROWS, "small_batch takes 1..", MAX_ROWS, " rows, got ", M);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    const int64_t wide = WIDE[M - 1];
    int64_t n = begin;
    for (; n + wide <= end; n += wide) f.wide[M - 1](wp + n * row_bytes, row_bytes, qp, dp, sp, K, nb, op + n, N);
    for (; n < end; ++n) f.narrow[M - 1](wp + n * row_bytes, row_bytes, qp, dp, sp, K, nb, op + n, N);
  });
}

at::Tensor linear_blocks(const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& panels, const Format& f) {
  TORCH_CHECK(x_in.dim() >= 1, "x must be [..., K]");
  TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == at::kByte, "w must be [N, K/32 * block bytes] uint8");
  // aten::to is a dispatcher call even when it has nothing to do; 4 per layer add up at batch 1
  const at::Tensor x = (x_in.scalar_type() == at::kFloat ? x_in : x_in.to(at::kFloat)).contiguous().view({-1, x_in.size(-1)});
  const at::Tensor w = w_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), nb = K / QK;
  TORCH_CHECK(K % QK == 0 && w.size(1) == nb * f.block_bytes, "w holds ", w.size(1), " bytes per row; K=", K,
              " needs ", nb * f.block_bytes);
  kvserve_quant::check_panels(panels, N, K);
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out.view(shape);
  if (M >= BATCH_ROWS) {  // compute bound: the same products, as a GEMM on weights unpacked into panels
    kvserve_quant::int_linear(quantize_rows(x), M, K, N, panels, f.blocks, out.data_ptr<float>());
    return out.view(shape);
  }
  small_batch(x, w.data_ptr<uint8_t>(), N, f, out.data_ptr<float>());
  return out.view(shape);
}

at::Tensor linear_q4(const at::Tensor& x, const at::Tensor& w, const at::Tensor& p) { return linear_blocks(x, w, p, Q4); }
at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& p) { return linear_blocks(x, w, p, Q8); }
at::Tensor pack_panels_q4(const at::Tensor& w) { return kvserve_quant::pack_panels(w, Blocks::Q4_1); }
at::Tensor pack_panels_q8(const at::Tensor& w) { return kvserve_quant::pack_panels(w, Blocks::Q8_0); }

// Shapes only, for tracing and export (symbolic M).
at::Tensor linear_meta(const at::Tensor& x, const at::Tensor& w, const at::Tensor&) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape.back() = w.sym_size(0);
  return at::empty_symint(shape, x.options().dtype(at::kFloat));
}

}  // namespace

TORCH_LIBRARY(kvserve_native, m) {
  m.def("linear_q4(Tensor x, Tensor w, Tensor panels) -> Tensor");
  m.def("linear_q8(Tensor x, Tensor w, Tensor panels) -> Tensor");
  m.def("pack_panels_q4(Tensor w) -> Tensor");
  m.def("pack_panels_q8(Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_native, CPU, m) {
  m.impl("linear_q4", &linear_q4);
  m.impl("linear_q8", &linear_q8);
  m.impl("pack_panels_q4", &pack_panels_q4);
  m.impl("pack_panels_q8", &pack_panels_q8);
}

TORCH_LIBRARY_IMPL(kvserve_native, Meta, m) {
  m.impl("linear_q4", &linear_meta);
  m.impl("linear_q8", &linear_meta);
}
