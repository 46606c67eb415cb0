// Weight-only quantized linear layers for AVX2 CPUs, on GGUF's block formats held as panels.
//
// Op contracts (registered as kvserve_native::*):
//   linear_blocks(x [..., K] f32, ws [w_i], ns [n_i], kinds [kind_i]) -> [..., sum n_i] f32 (a kind's
//       INT8_ACTIVATIONS bit: int8 activations)
//       each w_i the n_i-row weight as panels of its kind (panel_formats.h; models/formats/panels.py
//       writes them): [P, units, unit bytes], panel p holding rows 8p..8p+7, and its blocks their blocks,
//       the quants by pairs of k, feature beside feature, then the 8 features' fields; a unit is one
//       block, or a K-quant super-block's blocks and then their shared fields. P = n/8 rounded up to an
//       even count.
//       The parts' outputs sit side by side, in order.
//   rows_blocks(w, index [R] i64, kind) -> [R, K] f32: rows `index` of that weight, dequantized (an
//       embedding's lookup), each weight scale*q + min
// Why this layout: vpmaddwd does 16 multiply-adds an instruction, two a cycle on Zen 3, and one extending
// load of a panel gives two k of its 8 features as int16, which a broadcast pair of activations multiplies
// whole. The panels hold the same bytes per weight as the row blocks, so one copy serves both loads: at
// batch 1 streaming the weights once near the read bandwidth, and in a batch re-reading each panel from
// cache for every activation row. One kernel for every row count also means a row's output is bitwise
// the same whatever shares its step. Where the CPU has AVX-512 with VNNI, the wide tiles (wide_tile.h)
// run instead at every row count: vpdpwssd, a multiply-add and its accumulation in one instruction, on
// 512 bits, bitwise the same.
// The activations are quantized per block of 32 (16 for Q6_K) to int16 (scale amax/32767), each block's
// products summed in int32, then scaled in f32: int8 activations, as llama.cpp uses, flip many greedy
// tokens. A kind or'ed with INT8_ACTIVATIONS quantizes them to int8 instead (scale amax/127): a k quad
// of bytes a lane (panel_formats.h's quads), twice the products an instruction for the steps the
// multiply-adds bound, at llama.cpp's precision (figures in docs/performance.md).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include "simd.h"
#include "panel_formats.h"
#include "block_products.h"
#include <algorithm>
#include <cstring>
#include <optional>
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
constexpr int64_t PREFETCH_GROUPS = 2;  // how many groups ahead a one-pass panel tile prefetches
// Where the CPU has AVX-512 with VNNI, the wide tiles (wide_tile.h) run at every row count: twice the
// multiply-adds an instruction, and half the instructions to unpack a panel's bytes, which a one-row
// step's stream of weights also spends less time on. The 256-bit panel tiles serve the other CPUs.
// Below this many rows each tile of rows unpacks the panels' pairs in registers as it goes; from it they
// are unpacked once into memory for all the rows (writing and reading them back cost more than a few
// tiles' unpacking).
constexpr int64_t UNPACK_WIDE_FROM = 16;

#include "quantized_rows.h"

using namespace kvserve_panels;

// The bytes of one panel of F holding nb blocks.
template <class F>
constexpr int64_t panel_bytes(int64_t nb) { return nb / F::sub * F::bytes; }

// GROUP panels of F, nb blocks each from q -> the same panels unpacked to a byte a weight (F::Batch)
// at `to`: from unpack_from rows on, the tile is then bound by the multiply-adds alone, and the unpacking,
// once per chunk of rows, costs less than it saves.
template <class F>
inline void unpack_bytes(const uint8_t* q, int64_t nb, uint8_t* to) {
  using U = typename F::Batch;
  for (int64_t c = 0; c < GROUP; ++c, q += panel_bytes<F>(nb))
    for (int64_t b = 0; b < nb; ++b, to += U::bytes) {
      const uint8_t* block = F::block(q, b);
      for (int64_t j = 0; j < F::qk / 4; ++j) {
        __m256i lo, hi;
        F::pairs(block, j, lo, hi);
        // packs interleaves 128-bit lanes (lo0 hi0 lo1 hi1); the permute restores lo0 lo1 hi0 hi1
        const __m256i packed = U::is_signed ? _mm256_packs_epi16(lo, hi) : _mm256_packus_epi16(lo, hi);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + 32 * j), _mm256_permute4x64_epi64(packed, 0xD8));
      }
      _mm256_storeu_ps(reinterpret_cast<float*>(to + U::quants), F::scales(q, b));
      if (U::has_min) _mm256_storeu_ps(reinterpret_cast<float*>(to + U::quants) + 8, F::mins(q, b));
    }
}

template <class X>
using TileFn = void (*)(const uint8_t*, int64_t, const X*, const float*, const float*, const int32_t*, int64_t, float*,
                        int64_t, int64_t, const uint8_t*);

// Prefetch block b's share of the GROUP panels of F at `ahead`: over a tile's blocks, the group it reads next.
template <class F>
inline void prefetch_share(const uint8_t* ahead, int64_t b) {
  for (int64_t at = b * GROUP * F::bytes / F::sub; at < (b + 1) * GROUP * F::bytes / F::sub; at += 64)
    _mm_prefetch(reinterpret_cast<const char*>(ahead + at), _MM_HINT_T0);
}

namespace avx2 {
#include "panel_tile.h"
}  // namespace avx2

int64_t panel_count(int64_t N) { return (N + GROUP * PANEL - 1) / (GROUP * PANEL) * GROUP; }

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
namespace wide {
#include "packed_wide_tile.h"
#include "wide_tile.h"
}  // namespace wide
#pragma GCC pop_options

// A fact of the CPU, read once: whether the wide tiles run.
bool has_wide() {
  static const bool wide = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  }();
  return wide;
}

// out [M, N] (rows ldo apart) = x [M, K] by the N-feature weight held as these panels of F.
template <class F, class X>
void panel_linear(const QuantizedRows<X>& x, int64_t M, int64_t K, int64_t N, const uint8_t* panels, float* out, int64_t ldo) {
  using U = typename F::Batch;
  const int64_t nb = K / F::qk, groups = panel_count(N) / GROUP, cols = GROUP * PANEL, group_bytes = GROUP * panel_bytes<F>(nb);
  if (has_wide())
    return M < UNPACK_WIDE_FROM ? wide::packed_wide_linear<F>(x, M, K, N, panels, out, ldo)
                                : wide::wide_linear<F>(x, M, K, N, panels, out, ldo, ROW_CHUNK);
  const TileFn<X>* packed_tiles = avx2::tiles<F, X>;
  const TileFn<X>* unpacked_tiles = avx2::tiles<U, X>;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint8_t> unpacked;
    if (F::unpack_from && M >= F::unpack_from) unpacked.resize(GROUP * nb * U::bytes);
    for (int64_t r0 = 0; r0 < M; r0 += ROW_CHUNK) {
      const int64_t r1 = std::min(M, r0 + ROW_CHUNK);
      const bool one_pass = r1 - r0 <= ROWS;  // each panel read once: stream them, prefetching ahead
      const bool unpack = F::unpack_from && r1 - r0 >= F::unpack_from;
      for (int64_t g = begin; g < end; ++g) {
        const int64_t col = g * cols, width = std::min(cols, N - col);
        const uint8_t* q = panels + g * group_bytes;
        if (unpack) unpack_bytes<F>(q, nb, unpacked.data());
        // past the weight's end a prefetch is only wasted, never a fault
        const uint8_t* ahead = one_pass ? q + PREFETCH_GROUPS * group_bytes : nullptr;
        for (int64_t r = r0; r < r1; r += ROWS) {
          const int64_t rows = std::min(ROWS, r1 - r);
          const X* xq = x.q + r * K;
          const float *xd = x.d + r * nb, *xs = x.s + r * nb;
          const int32_t* xt = x.t + r * nb;
          float* o = out + r * ldo + col;
          if (unpack) unpacked_tiles[rows - 1](unpacked.data(), nb, xq, xd, xs, xt, K, o, ldo, width, nullptr);
          else packed_tiles[rows - 1](q, nb, xq, xd, xs, xt, K, o, ldo, width, ahead);
        }
      }
    }
  });
}

template <class F>
void check_panels(const at::Tensor& w, int64_t N, int64_t K) {
  constexpr int64_t unit = F::qk * F::sub;  // weights a unit
  TORCH_CHECK(K % unit == 0, "x's last dimension must be a whole number of blocks of ", unit, ", got ", K);
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(0) == panel_count(N) &&
                  w.size(1) == K / unit && w.size(2) == F::bytes,
              "w must be the panels of a ", N, "-row weight for K=", K, ": [", panel_count(N), ", ", K / unit, ", ",
              F::bytes, "] uint8, got ", w.sizes());
}

template <class T>
struct Tag {
  using type = T;
};

// Calls fn(Tag<F>{}) with the panel format F of `kind` (its activations' flag aside).
template <class Fn>
void with_format(int64_t kind, Fn&& fn) {
  switch (kind & ~INT8_ACTIVATIONS) {
    case KIND_Q4_1: return fn(Tag<Q4_1>{});
    case KIND_Q8_0: return fn(Tag<Q8_0>{});
    case KIND_Q4_0: return fn(Tag<Q4_0>{});
    case KIND_Q4_K: return fn(Tag<Q4_K>{});
    case KIND_U8: return fn(Tag<U8>{});
    case KIND_Q6_K: return fn(Tag<Q6_K>{});
    case KIND_MXFP4: return fn(Tag<MXFP4>{});
  }
  TORCH_CHECK(false, "unknown panel format ", kind);
}

// out [..., sum(ns)] = x [..., K] by each part's weight (ns[i] rows as panels of kinds[i]), side by side:
// a projection whose parts a file holds in different formats (a Q4_K_M's q, k and v) is still one op.
at::Tensor linear_blocks(const at::Tensor& x_in, at::TensorList ws, at::IntArrayRef ns, at::IntArrayRef kinds) {
  TORCH_CHECK(x_in.dim() >= 1, "x must be [..., K]");
  TORCH_CHECK(!ws.empty() && ws.size() == ns.size() && ws.size() == kinds.size(), "one n and one kind a weight part");
  // aten::to is a dispatcher call even when it has nothing to do; 4 per layer add up at batch 1
  const at::Tensor x = (x_in.scalar_type() == at::kFloat ? x_in : x_in.to(at::kFloat)).contiguous().view({-1, x_in.size(-1)});
  const int64_t M = x.size(0), K = x.size(1);
  int64_t total = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    with_format(kinds[i], [&](auto tag) { check_panels<typename decltype(tag)::type>(ws[i], ns[i], K); });
    total += ns[i];
  }
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = total;
  at::Tensor out = at::empty({M, total}, x.options());
  if (M == 0) return out.view(shape);
  // the activations quantized once for each block size and precision the parts use
  std::optional<QuantizedRows<int16_t>> rows16[2];
  std::optional<QuantizedRows<int8_t>> rows8[2];
  int64_t col = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    with_format(kinds[i], [&](auto tag) {
      using F = typename decltype(tag)::type;
      auto product = [&](auto& rows) {
        auto& xq = rows[F::qk == QK ? 0 : 1];
        using X = std::remove_const_t<std::remove_pointer_t<decltype(xq->q)>>;
        if (!xq) xq = quantize_rows<F::qk, X>(x);
        panel_linear<F>(*xq, M, K, ns[i], ws[i].data_ptr<uint8_t>(), out.data_ptr<float>() + col, total);
      };
      if (kinds[i] & INT8_ACTIVATIONS) product(rows8);
      else product(rows16);
    });
    col += ns[i];
  }
  return out.view(shape);
}

// rows `index` [R] of the weight held as panels of `kind` -> [R, K] f32, each weight scale*q + min.
at::Tensor rows_blocks(const at::Tensor& w, const at::Tensor& index_in, int64_t kind) {
  at::Tensor out;
  with_format(kind, [&](auto tag) {
    using F = typename decltype(tag)::type;
    TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(2) == F::bytes,
                "w must be panels [P, K/", F::qk * F::sub, ", ", F::bytes, "] uint8, got ", w.sizes());
    const at::Tensor index = index_in.to(at::kLong).contiguous();
    const int64_t R = index.numel(), nb = w.size(1) * F::sub, rows = w.size(0) * PANEL;
    out = at::empty({R, nb * F::qk}, at::TensorOptions().dtype(at::kFloat));
    const int64_t* ip = index.data_ptr<int64_t>();
    const uint8_t* wp = w.data_ptr<uint8_t>();
    float* op = out.data_ptr<float>();
    for (int64_t r = 0; r < R; ++r) TORCH_CHECK(ip[r] >= 0 && ip[r] < rows, "row ", ip[r], " is out of range for ", rows, " rows");
    at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int f = static_cast<int>(ip[r] % PANEL);
        const uint8_t* panel = wp + (ip[r] / PANEL) * panel_bytes<F>(nb);
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* block = F::block(panel, b);
          alignas(32) float s[PANEL], m[PANEL];
          _mm256_store_ps(s, F::scales(panel, b));
          _mm256_store_ps(m, F::mins(panel, b));
          float* o = op + (r * nb + b) * F::qk;
          for (int k = 0; k < F::qk; ++k) o[k] = s[f] * static_cast<float>(F::quant(block, f, k)) + m[f];
        }
      }
    });
  });
  return out;
}

// Shapes only, for tracing and export (symbolic M).
at::Tensor linear_blocks_meta(const at::Tensor& x, at::TensorList, at::IntArrayRef ns, at::IntArrayRef) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  int64_t total = 0;
  for (int64_t n : ns) total += n;
  shape.back() = total;
  return at::empty_symint(shape, x.options().dtype(at::kFloat));
}

at::Tensor rows_blocks_meta(const at::Tensor& w, const at::Tensor& index, int64_t kind) {
  int64_t qk = 0;
  with_format(kind, [&](auto tag) { qk = decltype(tag)::type::qk * decltype(tag)::type::sub; });
  return at::empty_symint({index.sym_numel(), w.sym_size(1) * qk}, w.options().dtype(at::kFloat));
}

}  // namespace

// The products for other kernels' own loops (block_products.h).
namespace kvserve_blocks {

Activations quantize(const at::Tensor& x, int64_t kind) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [M, K] f32, contiguous");
  Activations a;
  a.kind = kind, a.K = x.size(1);
  with_format(kind, [&](auto tag) {
    using F = typename decltype(tag)::type;
    const int64_t M = x.size(0), nb = a.K / F::qk;
    a.d.resize(M * nb), a.s.resize(M * nb), a.t.resize(M * nb);
    if (kind & INT8_ACTIVATIONS) {
      a.q8.resize(M * a.K);
      quantize_rows_into<F::qk>(x, a.q8.data(), a.d.data(), a.s.data(), a.t.data());
    } else {
      a.q16.resize(M * a.K);
      quantize_rows_into<F::qk>(x, a.q16.data(), a.d.data(), a.s.data(), a.t.data());
    }
  });
  return a;
}

bool same_activations(int64_t a, int64_t b) {
  int64_t qa = 0, qb = 0;
  with_format(a, [&](auto tag) { qa = decltype(tag)::type::qk; });
  with_format(b, [&](auto tag) { qb = decltype(tag)::type::qk; });
  return qa == qb && (a & INT8_ACTIVATIONS) == (b & INT8_ACTIVATIONS);
}

void product(const Activations& x, int64_t kind, int64_t row0, int64_t M, const uint8_t* panels, int64_t N, float* out,
             int64_t ldo) {
  TORCH_CHECK(same_activations(x.kind, kind), "activations quantized for kind ", x.kind, " cannot multiply kind ", kind);
  with_format(kind, [&](auto tag) {
    using F = typename decltype(tag)::type;
    const int64_t K = x.K, nb = K / F::qk;
    auto run = [&](const auto* q) {
      using X = std::remove_const_t<std::remove_pointer_t<decltype(q)>>;
      const QuantizedRows<X> rows{q + row0 * K, x.d.data() + row0 * nb, x.s.data() + row0 * nb, x.t.data() + row0 * nb};
      panel_linear<F>(rows, M, K, N, panels, out, ldo);
    };
    if (x.kind & INT8_ACTIVATIONS) run(x.q8.data());
    else run(x.q16.data());
  });
}

int64_t group_bytes(int64_t kind, int64_t K) {
  int64_t bytes = 0;
  with_format(kind, [&](auto tag) { bytes = GROUP * panel_bytes<typename decltype(tag)::type>(K / decltype(tag)::type::qk); });
  return bytes;
}

void check_weight(const at::Tensor& w, int64_t N, int64_t K, int64_t kind) {
  with_format(kind, [&](auto tag) { check_panels<typename decltype(tag)::type>(w, N, K); });
}

}  // namespace kvserve_blocks

TORCH_LIBRARY(kvserve_native, m) {
  m.def("linear_blocks(Tensor x, Tensor[] ws, int[] ns, int[] kinds) -> Tensor");
  m.def("rows_blocks(Tensor w, Tensor index, int kind) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_native, CPU, m) {
  m.impl("linear_blocks", &linear_blocks);
  m.impl("rows_blocks", &rows_blocks);
}

TORCH_LIBRARY_IMPL(kvserve_native, Meta, m) {
  m.impl("linear_blocks", &linear_blocks_meta);
  m.impl("rows_blocks", &rows_blocks_meta);
}
