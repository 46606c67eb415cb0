// Weight-only quantized linear layers for AVX2 CPUs, on llama.cpp's Q4_1 and Q8_0 blocks held as panels.
//
// Op contracts (registered as kvserve_native::*):
//   linear_q4(x [..., K] f32, w [P, K/32, 160] u8, n) -> [..., n] f32
//   linear_q8(x [..., K] f32, w [P, K/32, 272] u8, n) -> [..., n] f32
//       w is the n-row weight as panels (models/block_quant.py, to_panels): panel p holds rows 8p..8p+7,
//       and its block b their block b of 32 weights, the quants by pairs of k, feature beside feature,
//       then 8 fp16 scales d (then 8 fp16 mins m); w = d*q (+ m). P = n/8 rounded up to an even count.
//   rows_q8(w [P, K/32, 272] u8, index [R] i64) -> [R, K] f32: rows `index` of that weight, dequantized
//       (a tied embedding's lookup), each weight d*q exactly as torch computes it
// Why this layout: vpmaddwd does 16 multiply-adds an instruction, two a cycle on Zen 3, and one extending
// load of a panel gives two k of its 8 features as int16, which a broadcast pair of activations multiplies
// whole. The panels hold the same bytes per weight as the row blocks, so one copy serves both loads: at
// batch 1 streaming the weights once near the read bandwidth, and in a batch re-reading each panel from
// cache for every activation row. One kernel for every row count also means a row's output is bitwise
// the same whatever shares its step. Where the CPU has AVX512-VNNI, the tile (panel_tile.h) runs with
// vpdpwssd, a multiply-add and its accumulation in one instruction, and from a few rows on a wide tile
// (wide_tile.h) does it on 512 bits, bitwise the same.
// The activations are quantized per block of 32 to int16 (scale amax/32767; int8, as llama.cpp uses,
// was faster but flipped many greedy tokens even on the qkv and gate/up projections alone; figures in
// docs/performance.md), each block's products are summed in int32, then scaled in f32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include "simd.h"
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using kvserve_simd::hmax;
using kvserve_simd::hsum;

constexpr int64_t QK = 32;           // weights per block
constexpr int64_t PANEL = 8;         // output features per panel (one int32 lane each)
// A tile's ROWS x GROUP int32 sums, the panels' unpacked pairs and two broadcasts fit the 16 ymm
// registers; when gcc spilled a sum, the store-to-load round trip on it halved the throughput.
constexpr int64_t ROWS = 3;          // activation rows per tile
constexpr int64_t GROUP = 2;         // panels per tile
constexpr int64_t ROW_CHUNK = 128;   // activation rows kept in L2 while a thread walks its panels
constexpr int64_t PREFETCH_GROUPS = 2;  // how many groups ahead a one-pass tile prefetches
// From this many rows in a chunk on, a Q4 group is first unpacked to a byte a weight (Q4Bytes): the tile
// is then bound by the multiply-adds alone, and the unpacking, once per chunk, costs less than it saves.
constexpr int64_t UNPACK_ROWS = 16;
// Where the CPU has AVX512-VNNI, from this many rows on the wide path (wide_tile.h) runs: its unpacking
// pays for itself from fewer rows, as its tile does twice the multiply-adds an instruction.
constexpr int64_t WIDE_FROM_ROWS = 8;

// Activation rows quantized per block of 32 to int16 (scale d = amax/32767; s = d * sum(q), which
// Q4_1's min term needs).
struct QuantizedRows {
  const int16_t* q;    // [M, K]
  const float *d, *s;  // [M, K/32] each
};

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

inline __m128i load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

inline __m256 eight_halves(const uint8_t* p) { return _mm256_cvtph_ps(load128(p)); }

// Panel block formats. pairs() gives, from chunk c of a block, k pairs 2c and 2c + 1 of the 8 features
// as int16 lanes [f][e]; scales() and mins() the features' 8 scales and mins, from the block's start.
struct Q4Panel {
  static constexpr int64_t quants = 128, bytes = 160, chunk = 16;
  static constexpr bool has_min = true;
  static inline __m256 scales(const uint8_t* p) { return eight_halves(p + quants); }
  static inline __m256 mins(const uint8_t* p) { return eight_halves(p + quants + 16); }
  static inline void pairs(const uint8_t* p, __m256i& a, __m256i& b) {
    const __m256i w = _mm256_cvtepu8_epi16(load128(p));  // byte j -> word j
    a = _mm256_and_si256(w, _mm256_set1_epi16(0x0F));
    b = _mm256_srli_epi16(w, 4);
  }
};

struct Q8Panel {
  static constexpr int64_t quants = 256, bytes = 272, chunk = 32;
  static constexpr bool has_min = false;
  static inline __m256 scales(const uint8_t* p) { return eight_halves(p + quants); }
  static inline __m256 mins(const uint8_t*) { return _mm256_setzero_ps(); }
  static inline void pairs(const uint8_t* p, __m256i& a, __m256i& b) {
    a = _mm256_cvtepi8_epi16(load128(p));
    b = _mm256_cvtepi8_epi16(load128(p + 16));
  }
};

// A Q4 panel block unpacked to a byte a weight: pairs as Q8Panel's, unsigned; then its scales and mins as
// float32.
struct Q4Bytes {
  static constexpr int64_t quants = 256, bytes = 320, chunk = 32;
  static constexpr bool has_min = true;
  static inline __m256 scales(const uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p + quants)); }
  static inline __m256 mins(const uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p + quants) + 8); }
  static inline void pairs(const uint8_t* p, __m256i& a, __m256i& b) {
    a = _mm256_cvtepu8_epi16(load128(p));
    b = _mm256_cvtepu8_epi16(load128(p + 16));
  }
};

// GROUP Q4 panels of nb blocks from q -> the same as Q4Bytes into `to`.
inline void unpack_q4(const uint8_t* q, int64_t nb, uint8_t* to) {
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t i = 0; i < GROUP * nb; ++i, q += Q4Panel::bytes, to += Q4Bytes::bytes) {
    for (int64_t c = 0; c < Q4Panel::quants / 16; ++c) {
      const __m128i v = load128(q + 16 * c);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(to + 32 * c), _mm_and_si128(v, low));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(to + 32 * c + 16), _mm_and_si128(_mm_srli_epi16(v, 4), low));
    }
    _mm256_storeu_ps(reinterpret_cast<float*>(to + Q4Bytes::quants), Q4Panel::scales(q));
    _mm256_storeu_ps(reinterpret_cast<float*>(to + Q4Bytes::quants) + 8, Q4Panel::mins(q));
  }
}

using TileFn = void (*)(const uint8_t*, int64_t, const int16_t*, const float*, const float*, int64_t, float*, int64_t,
                        int64_t, const uint8_t*);

namespace avx2 {
#define KVSERVE_DOT2(sum, lo, x0, hi, x1) \
  _mm256_add_epi32(sum, _mm256_add_epi32(_mm256_madd_epi16(lo, x0), _mm256_madd_epi16(hi, x1)))
#include "panel_tile.h"
#undef KVSERVE_DOT2
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512vnni,avx512vl")
namespace vnni {
#define KVSERVE_DOT2(sum, lo, x0, hi, x1) _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(sum, lo, x0), hi, x1)
#include "panel_tile.h"
#undef KVSERVE_DOT2
}  // namespace vnni
#pragma GCC pop_options

int64_t panel_count(int64_t N) { return (N + GROUP * PANEL - 1) / (GROUP * PANEL) * GROUP; }

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
namespace wide {
#include "wide_tile.h"
}  // namespace wide
#pragma GCC pop_options

// Facts of the CPU, read once: which tiles run.
bool has_vnni() {
  static const bool vnni = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
  }();
  return vnni;
}

bool has_wide() {
  static const bool wide = [] {
    __builtin_cpu_init();
    return has_vnni() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  }();
  return wide;
}

// out [M, N] = x [M, K] by the N-feature weight held as these panels.
template <class F>
void panel_linear(const QuantizedRows& x, int64_t M, int64_t K, int64_t N, const uint8_t* panels, float* out) {
  const int64_t nb = K / QK, groups = panel_count(N) / GROUP, cols = GROUP * PANEL, group_bytes = GROUP * nb * F::bytes;
  if (M >= WIDE_FROM_ROWS && has_wide()) return wide::wide_linear<F>(x, M, K, N, panels, out, ROW_CHUNK);
  const bool use_vnni = has_vnni();
  const TileFn* packed_tiles = use_vnni ? vnni::tiles<F> : avx2::tiles<F>;
  const TileFn* unpacked_tiles = use_vnni ? vnni::tiles<Q4Bytes> : avx2::tiles<Q4Bytes>;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint8_t> unpacked;
    if (std::is_same_v<F, Q4Panel> && M >= UNPACK_ROWS) unpacked.resize(GROUP * nb * Q4Bytes::bytes);
    for (int64_t r0 = 0; r0 < M; r0 += ROW_CHUNK) {
      const int64_t r1 = std::min(M, r0 + ROW_CHUNK);
      const bool one_pass = r1 - r0 <= ROWS;  // each panel read once: stream them, prefetching ahead
      const bool unpack = std::is_same_v<F, Q4Panel> && r1 - r0 >= UNPACK_ROWS;
      for (int64_t g = begin; g < end; ++g) {
        const int64_t col = g * cols, width = std::min(cols, N - col);
        const uint8_t* q = panels + g * group_bytes;
        if (unpack) unpack_q4(q, nb, unpacked.data());
        // past the weight's end a prefetch is only wasted, never a fault
        const uint8_t* ahead = one_pass ? q + PREFETCH_GROUPS * group_bytes : nullptr;
        for (int64_t r = r0; r < r1; r += ROWS) {
          const int64_t rows = std::min(ROWS, r1 - r);
          const int16_t* xq = x.q + r * K;
          const float *xd = x.d + r * nb, *xs = x.s + r * nb;
          float* o = out + r * N + col;
          if (unpack) unpacked_tiles[rows - 1](unpacked.data(), nb, xq, xd, xs, K, o, N, width, nullptr);
          else packed_tiles[rows - 1](q, nb, xq, xd, xs, K, o, N, width, ahead);
        }
      }
    }
  });
}

template <class F>
at::Tensor linear_panels(const at::Tensor& x_in, const at::Tensor& w, int64_t N) {
  TORCH_CHECK(x_in.dim() >= 1, "x must be [..., K]");
  // aten::to is a dispatcher call even when it has nothing to do; 4 per layer add up at batch 1
  const at::Tensor x = (x_in.scalar_type() == at::kFloat ? x_in : x_in.to(at::kFloat)).contiguous().view({-1, x_in.size(-1)});
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % QK == 0, "x's last dimension must be a whole number of blocks of ", QK, ", got ", K);
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(0) == panel_count(N) &&
                  w.size(1) == K / QK && w.size(2) == F::bytes,
              "w must be the panels of a ", N, "-row weight for K=", K, ": [", panel_count(N), ", ", K / QK, ", ",
              F::bytes, "] uint8, got ", w.sizes());
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M > 0) panel_linear<F>(quantize_rows(x), M, K, N, w.data_ptr<uint8_t>(), out.data_ptr<float>());
  return out.view(shape);
}

at::Tensor linear_q4(const at::Tensor& x, const at::Tensor& w, int64_t n) { return linear_panels<Q4Panel>(x, w, n); }
at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& w, int64_t n) { return linear_panels<Q8Panel>(x, w, n); }

at::Tensor rows_q8(const at::Tensor& w, const at::Tensor& index_in) {
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(2) == Q8Panel::bytes,
              "w must be Q8_0 panels [P, K/32, ", Q8Panel::bytes, "] uint8, got ", w.sizes());
  const at::Tensor index = index_in.to(at::kLong).contiguous();
  const int64_t R = index.numel(), nb = w.size(1), rows = w.size(0) * PANEL;
  at::Tensor out = at::empty({R, nb * QK}, at::TensorOptions().dtype(at::kFloat));
  const int64_t* ip = index.data_ptr<int64_t>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(ip[r] >= 0 && ip[r] < rows, "row ", ip[r], " is out of range for ", rows, " rows");
  at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t f = ip[r] % PANEL;
      const uint8_t* panel = wp + (ip[r] / PANEL) * nb * Q8Panel::bytes;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* block = panel + b * Q8Panel::bytes;
        uint16_t h;
        std::memcpy(&h, block + Q8Panel::quants + 2 * f, 2);
        const float d = _cvtsh_ss(h);
        float* o = op + r * nb * QK + b * QK;
        for (int64_t k = 0; k < QK; ++k) o[k] = d * static_cast<float>(static_cast<int8_t>(block[(k / 2) * 2 * PANEL + 2 * f + (k & 1)]));
      }
    }
  });
  return out;
}

// Shapes only, for tracing and export (symbolic M).
at::Tensor linear_meta(const at::Tensor& x, const at::Tensor&, int64_t n) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape.back() = n;
  return at::empty_symint(shape, x.options().dtype(at::kFloat));
}

at::Tensor rows_q8_meta(const at::Tensor& w, const at::Tensor& index) {
  return at::empty_symint({index.sym_numel(), w.sym_size(1) * QK}, w.options().dtype(at::kFloat));
}

}  // namespace

TORCH_LIBRARY(kvserve_native, m) {
  m.def("linear_q4(Tensor x, Tensor w, int n) -> Tensor");
  m.def("linear_q8(Tensor x, Tensor w, int n) -> Tensor");
  m.def("rows_q8(Tensor w, Tensor index) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_native, CPU, m) {
  m.impl("linear_q4", &linear_q4);
  m.impl("linear_q8", &linear_q8);
  m.impl("rows_q8", &rows_q8);
}

TORCH_LIBRARY_IMPL(kvserve_native, Meta, m) {
  m.impl("linear_q4", &linear_meta);
  m.impl("linear_q8", &linear_meta);
  m.impl("rows_q8", &rows_q8_meta);
}
