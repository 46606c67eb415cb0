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
// integer dot products that use few instructions per block are the levers. From BATCH_ROWS rows on,
// the same products run as a GEMM (int_gemm.cpp). Both paths scale and sum a feature's blocks in one
// order, so a row's output is bitwise the same whichever path, and whatever else shares the step.
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

using kvserve_simd::hmax;
using kvserve_simd::hsum;

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

// Eight weight rows' int32 block partials [8 each] -> one vector whose lane c is row c's whole block sum
// (integer adds: exact in any order), by unpacks and adds: hadd would spend 3 uops where these spend 1.
inline __m256i eight_block_sums(const __m256i p[8]) {
  __m256i quad[2];
  for (int h = 0; h < 2; ++h) {
    const __m256i* q = p + 4 * h;
    const __m256i a = _mm256_add_epi32(_mm256_unpacklo_epi32(q[0], q[1]), _mm256_unpackhi_epi32(q[0], q[1]));
    const __m256i b = _mm256_add_epi32(_mm256_unpacklo_epi32(q[2], q[3]), _mm256_unpackhi_epi32(q[2], q[3]));
    quad[h] = _mm256_add_epi32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b));  // rows 0..3, low | high k
  }
  return _mm256_add_epi32(_mm256_permute2x128_si256(quad[0], quad[1], 0x20), _mm256_permute2x128_si256(quad[0], quad[1], 0x31));
}

inline __m128 four_halves(const uint8_t* p) {
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// Four consecutive fp16 values (four blocks' scales) from each of eight rows -> out[j], whose lane c is
// row c's value j: one load a row and a 4 x 4 transpose in each half, where gathering them one by one
// would stall on store-to-load forwarding.
inline void eight_by_four_halves(const uint8_t* const rows[8], int64_t at, __m256 out[4]) {
  __m256 m[4];
  for (int c = 0; c < 4; ++c) m[c] = _mm256_set_m128(four_halves(rows[c + 4] + at), four_halves(rows[c] + at));
  const __m256 t0 = _mm256_unpacklo_ps(m[0], m[1]), t1 = _mm256_unpackhi_ps(m[0], m[1]);  // rows 0, 1 (4, 5)
  const __m256 t2 = _mm256_unpacklo_ps(m[2], m[3]), t3 = _mm256_unpackhi_ps(m[2], m[3]);  // rows 2, 3 (6, 7)
  out[0] = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  out[1] = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  out[2] = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  out[3] = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
}

// Eight fp16 values, one from each of eight rows at the same offset, as floats in lanes 0..7 (the last
// nb % 4 blocks).
inline __m256 eight_halves(const uint8_t* const rows[8], int64_t at) {
  uint16_t h[8];
  for (int c = 0; c < 8; ++c) std::memcpy(&h[c], rows[c] + at, 2);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}

// out[r * ldo + c] = dot(weight row c, activation row r) for eight weight rows (row_bytes apart; the
// first `width` are stored) and R activation rows, one output feature a lane. Block after block:
// acc = float(block sum) * (d_w * d_x), then += m_w * s_x: the operations, in the order, of
// int_gemm.cpp's tile, so a row's result is bitwise the same on either path, whatever shares its step.
template <class B, int R>
inline void dot_rows(const uint8_t* w, int64_t row_bytes, const int16_t* xq, const float* xd, const float* xs,
                     int64_t K, int64_t nb, float* out, int64_t ldo, int64_t width) {
  const uint8_t* rows[8];
  for (int c = 0; c < 8; ++c) rows[c] = w + std::min<int64_t>(c, width - 1) * row_bytes;  // past the end: repeat the last
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int64_t scales_at = nb * B::quant_bytes, mins_at = scales_at + 2 * nb;
  // While reading these rows, prefetch the group PREFETCH_SPANS ahead, spread over the blocks (the
  // hardware prefetcher alone reached about half of the read bandwidth). Past the weight's end a
  // prefetch is only wasted, never a fault.
  const int64_t span = 8 * row_bytes, per_block = (span / std::max<int64_t>(nb, 1) + 63) / 64 * 64;
  const char* ahead = reinterpret_cast<const char*>(w) + PREFETCH_SPANS * span;
  __m256 dws[4], mws[4];
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t at = b * per_block; at < std::min(span, (b + 1) * per_block); at += 64) _mm_prefetch(ahead + at, _MM_HINT_T0);
    const int64_t j = b % 4;
    if (j == 0 && b + 4 <= nb) {
      eight_by_four_halves(rows, scales_at + 2 * b, dws);
      if (B::has_min) eight_by_four_halves(rows, mins_at + 2 * b, mws);
    } else if (b + 4 > nb && j == 0) {
      for (int64_t t = 0; t < nb - b; ++t) {
        dws[t] = eight_halves(rows, scales_at + 2 * (b + t));
        mws[t] = B::has_min ? eight_halves(rows, mins_at + 2 * (b + t)) : _mm256_setzero_ps();
      }
    }
    const __m256 dw = dws[j];
    const __m256 mw = B::has_min ? mws[j] : _mm256_setzero_ps();
    typename B::W wb[8];  // each weight block unpacked once, for every activation row
    for (int c = 0; c < 8; ++c) wb[c] = B::unpack(rows[c] + b * B::quant_bytes);
    for (int r = 0; r < R; ++r) {
      __m256i p[8];
      for (int c = 0; c < 8; ++c) p[c] = B::dot(wb[c], xq + r * K + b * QK);
      const __m256 sum = _mm256_cvtepi32_ps(eight_block_sums(p));
      acc[r] = _mm256_fmadd_ps(sum, _mm256_mul_ps(dw, _mm256_set1_ps(xd[r * nb + b])), acc[r]);
      if (B::has_min) acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[r * nb + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[r]);
    std::memcpy(out + r * ldo, lanes, width * sizeof(float));
  }
}

using DotFn = void (*)(const uint8_t*, int64_t, const int16_t*, const float*, const float*, int64_t, int64_t, float*,
                       int64_t, int64_t);

struct Format {
  Blocks blocks;
  int64_t block_bytes;
  DotFn dot[MAX_ROWS];  // R = 1..3 activation rows, eight weight rows at once
};

template <class B>
constexpr Format format(Blocks blocks, int64_t block_bytes) {
  return {blocks, block_bytes, {dot_rows<B, 1>, dot_rows<B, 2>, dot_rows<B, 3>}};
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
  at::parallel_for(0, (N + 7) / 8, 2, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n = 8 * g;
      f.dot[M - 1](wp + n * row_bytes, row_bytes, qp, dp, sp, K, nb, op + n, N, std::min<int64_t>(8, N - n));
    }
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
