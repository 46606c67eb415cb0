// The batched path of the block matmuls (quant_matmul.cpp takes it from BATCH_ROWS rows on): the same
// int16-activation by integer-weight products as the few-row path, laid out as a GEMM.
//
// Contract: int_linear(xq: M activation rows quantized per block of 32 to int16 (quantize_rows), w:
// [N, K/32 * block bytes] Q4_1 or Q8_0 rows, out: float32 [M, N]).
// Why: vpmaddwd does 16 multiply-adds per instruction and this Zen 3 issues two a cycle (measured, as
// fast as vfmadd231ps, which does 8), with the vpaddd that accumulates it on the other vector pipes.
// Each weight is unpacked once, on first use, to one byte (its nibble, or int8) in panels of 8
// output features by pairs of k: one extending load gives [8 features x 2 k] int16 lanes, and one
// broadcast activation pair multiplies it whole. Sums stay int32 within a block of 32 and are then
// scaled in float32, as in the few-row path, so a row's result does not depend on its batch beyond
// float summation order. It replaced fbgemm's fp16 GEMM on the same weights, having measured faster at
// every row count tried (docs/performance.md).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include "quant_blocks.h"
#include <algorithm>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace kvserve_quant {
namespace {

constexpr int64_t PANEL = 8;          // output features per packed panel (one int32 lane each)
constexpr int64_t PAIRS = QK / 2;     // k pairs per block
constexpr int64_t PANEL_BLOCK = PAIRS * 2 * PANEL;  // bytes of one panel's block: 256
// A tile's ROWS x GROUP int32 sums, GROUP weight vectors and a broadcast fit the 16 ymm registers; at
// 4 x 2 or 3 x 3 gcc spilled a sum, and the store-to-load round trip on it halved the throughput.
constexpr int64_t ROWS = 3;           // activation rows per tile
constexpr int64_t GROUP = 2;          // panels per tile
constexpr int64_t ROW_CHUNK = 128;    // activation rows kept in L2 while a thread walks its panels

struct PackedInt {
  at::Tensor weight;  // keeps the source alive, so its address is not reused while memoized
  at::Tensor quants;  // [P, nb, 16 pairs, 8 features, 2] uint8 (Q4_1 nibbles) or int8 (Q8_0)
  at::Tensor scales;  // [P, nb, 8] float32
  at::Tensor mins;    // [P, nb, 8] float32 (Q4_1; zeros for Q8_0)
};  // P = the weight's rows / 8, rounded up to whole tiles and padded with zero weights

struct IntMemo {
  std::mutex lock;
  std::unordered_map<const void*, PackedInt> entries;  // weight data ptr -> its panels
};

IntMemo& int_memo() {
  static IntMemo memo;
  return memo;
}

// Weight k of block b of row `row` as a byte: Q4_1 byte j holds k = j (low nibble) and j + 16.
inline uint8_t weight_byte(const uint8_t* row, int64_t b, int64_t k, Blocks blocks) {
  if (blocks == Blocks::Q8_0) return row[b * Q8_QUANT_BYTES + k];
  const uint8_t byte = row[b * Q4_QUANT_BYTES + (k & 15)];
  return k < 16 ? byte & 0x0F : byte >> 4;
}

const PackedInt& packed_int(const at::Tensor& w, int64_t K, Blocks blocks) {
  IntMemo& memo = int_memo();
  std::lock_guard<std::mutex> guard(memo.lock);
  auto it = memo.entries.find(w.data_ptr());
  if (it != memo.entries.end()) return it->second;
  const int64_t N = w.size(0), nb = K / QK, panels = (N + GROUP * PANEL - 1) / (GROUP * PANEL) * GROUP;
  const int64_t row_bytes = w.size(1), quant_bytes = blocks == Blocks::Q4_1 ? Q4_QUANT_BYTES : Q8_QUANT_BYTES;
  const auto bytes = at::TensorOptions().dtype(at::kByte), floats = at::TensorOptions().dtype(at::kFloat);
  PackedInt p{w, at::zeros({panels, nb, PANEL_BLOCK}, bytes), at::zeros({panels, nb, PANEL}, floats),
              at::zeros({panels, nb, PANEL}, floats)};
  const uint8_t* wp = w.data_ptr<uint8_t>();
  uint8_t* qp = p.quants.data_ptr<uint8_t>();
  float *dp = p.scales.data_ptr<float>(), *mp = p.mins.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = wp + n * row_bytes;
      const int64_t panel = n / PANEL, f = n % PANEL;
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* block = qp + (panel * nb + b) * PANEL_BLOCK;
        for (int64_t k = 0; k < QK; ++k) block[(k / 2) * 2 * PANEL + 2 * f + (k & 1)] = weight_byte(row, b, k, blocks);
        dp[(panel * nb + b) * PANEL + f] = half_at(row + nb * quant_bytes + 2 * b);
        if (blocks == Blocks::Q4_1) mp[(panel * nb + b) * PANEL + f] = half_at(row + nb * (quant_bytes + 2) + 2 * b);
      }
    }
  });
  return memo.entries.emplace(w.data_ptr(), std::move(p)).first->second;
}

template <bool Signed>
inline __m256i widen(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return Signed ? _mm256_cvtepi8_epi16(bytes) : _mm256_cvtepu8_epi16(bytes);
}

// out[r][0..8 * GROUP) for R activation rows by GROUP consecutive panels: per block, R x GROUP int32
// accumulators over 16 k pairs, then acc += float(sum) * (d_w * d_x) + m_w * s_x.
template <bool Signed, bool HasMin, int R>
inline void tile(const uint8_t* q, const float* d, const float* m, int64_t nb, const int16_t* xq,
                 const float* xd, const float* xs, int64_t K, float* out, int64_t ldo, int64_t width) {
  constexpr int C = GROUP;
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const int64_t next = nb * PANEL_BLOCK;  // from one panel to the next
  for (int64_t b = 0; b < nb; ++b) {
    __m256i sum[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) sum[r][c] = _mm256_setzero_si256();
    const uint8_t* qb = q + b * PANEL_BLOCK;
    const int32_t* xb[R];  // each row's block as k pairs
    for (int r = 0; r < R; ++r) xb[r] = reinterpret_cast<const int32_t*>(xq + r * K + b * QK);
#pragma GCC unroll 4
    for (int64_t j = 0; j < PAIRS; ++j) {
      __m256i w[C];
      for (int c = 0; c < C; ++c) w[c] = widen<Signed>(qb + c * next + j * 2 * PANEL);
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_set1_epi32(xb[r][j]);
        for (int c = 0; c < C; ++c) sum[r][c] = _mm256_add_epi32(sum[r][c], _mm256_madd_epi16(w[c], x));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 dx = _mm256_set1_ps(xd[r * nb + b]), sx = _mm256_set1_ps(xs[r * nb + b]);
      for (int c = 0; c < C; ++c) {
        const __m256 dw = _mm256_loadu_ps(d + (c * nb + b) * PANEL);
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][c]), _mm256_mul_ps(dw, dx), acc[r][c]);
        if (HasMin) acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(m + (c * nb + b) * PANEL), sx, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float row[C * PANEL];
    float* to = width == C * PANEL ? out + r * ldo : row;  // the weight's last, padded features go through row
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(to + c * PANEL, acc[r][c]);
    if (to == row) std::memcpy(out + r * ldo, row, width * sizeof(float));
  }
}

using TileFn = void (*)(const uint8_t*, const float*, const float*, int64_t, const int16_t*, const float*, const float*,
                        int64_t, float*, int64_t, int64_t);

template <bool Signed, bool HasMin>
constexpr TileFn tiles[ROWS] = {tile<Signed, HasMin, 1>, tile<Signed, HasMin, 2>, tile<Signed, HasMin, 3>};

}  // namespace

void int_linear(const QuantizedRows& x, int64_t M, int64_t K, const at::Tensor& w, Blocks blocks, float* out) {
  const PackedInt& p = packed_int(w, K, blocks);
  const int64_t nb = K / QK, N = p.weight.size(0), groups = p.quants.size(0) / GROUP, cols = GROUP * PANEL;
  const TileFn* fns = blocks == Blocks::Q4_1 ? tiles<false, true> : tiles<true, false>;
  const uint8_t* qp = p.quants.data_ptr<uint8_t>();
  const float *dp = p.scales.data_ptr<float>(), *mp = p.mins.data_ptr<float>();
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < M; r0 += ROW_CHUNK) {
      const int64_t r1 = std::min(M, r0 + ROW_CHUNK);
      for (int64_t g = begin; g < end; ++g) {
        const int64_t col = g * cols, width = std::min(cols, N - col);
        const uint8_t* q = qp + GROUP * g * nb * PANEL_BLOCK;
        const float *d = dp + GROUP * g * nb * PANEL, *m = mp + GROUP * g * nb * PANEL;
        for (int64_t r = r0; r < r1; r += ROWS) {
          const int64_t rows = std::min(ROWS, r1 - r);
          fns[rows - 1](q, d, m, nb, x.q + r * K, x.d + r * nb, x.s + r * nb, K, out + r * N + col, N, width);
        }
      }
    }
  });
}

}  // namespace kvserve_quant
