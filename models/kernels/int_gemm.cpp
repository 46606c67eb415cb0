// The batched path of the block matmuls (quant_matmul.cpp takes it from BATCH_ROWS rows on): the same
// int16-activation by integer-weight products as the few-row path, laid out as a GEMM.
//
// Contract: pack_panels(w: [N, K/32 * block bytes] Q4_1 or Q8_0 rows) -> panels [P, K/32, PANEL_BLOCK]
// uint8; int_linear(xq: M activation rows quantized per block of 32 to int16 (quantize_rows), w, panels,
// out: float32 [M, N]). The panels are the model's, made once when it loads, and passed to every call:
// nothing here outlives the tensors it is given.
// Why: vpmaddwd does 16 multiply-adds per instruction and this Zen 3 issues two a cycle (measured, as
// fast as vfmadd231ps, which does 8), with the vpaddd that accumulates it on the other vector pipes.
// Each weight is unpacked once, when the model loads, to one byte (its nibble, or int8) in panels of 8
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

namespace kvserve_quant {
namespace {

constexpr int64_t PANEL = 8;          // output features per packed panel (one int32 lane each)
constexpr int64_t PAIRS = QK / 2;     // k pairs per block
constexpr int64_t PANEL_QUANTS = PAIRS * 2 * PANEL;  // weight bytes of one panel's block: 256
// A panel's block: its 256 weight bytes, then 8 float32 scales and 8 float32 mins (zeros for Q8_0).
constexpr int64_t PANEL_BLOCK = PANEL_QUANTS + 2 * PANEL * sizeof(float);
// A tile's ROWS x GROUP int32 sums, GROUP weight vectors and a broadcast fit the 16 ymm registers; at
// 4 x 2 or 3 x 3 gcc spilled a sum, and the store-to-load round trip on it halved the throughput.
constexpr int64_t ROWS = 3;           // activation rows per tile
constexpr int64_t GROUP = 2;          // panels per tile
constexpr int64_t ROW_CHUNK = 128;    // activation rows kept in L2 while a thread walks its panels

// Weight k of block b of row `row` as a byte: Q4_1 byte j holds k = j (low nibble) and j + 16.
inline uint8_t weight_byte(const uint8_t* row, int64_t b, int64_t k, Blocks blocks) {
  if (blocks == Blocks::Q8_0) return row[b * Q8_QUANT_BYTES + k];
  const uint8_t byte = row[b * Q4_QUANT_BYTES + (k & 15)];
  return k < 16 ? byte & 0x0F : byte >> 4;
}

template <bool Signed>
inline __m256i widen(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return Signed ? _mm256_cvtepi8_epi16(bytes) : _mm256_cvtepu8_epi16(bytes);
}

// out[r][0..8 * GROUP) for R activation rows by GROUP consecutive panels: per block, R x GROUP int32
// accumulators over 16 k pairs, then acc += float(sum) * (d_w * d_x) + m_w * s_x.
template <bool Signed, bool HasMin, int R>
inline void tile(const uint8_t* q, int64_t nb, const int16_t* xq, const float* xd, const float* xs, int64_t K,
                 float* out, int64_t ldo, int64_t width) {
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
        const float* dm = reinterpret_cast<const float*>(qb + c * next + PANEL_QUANTS);  // 8 scales, 8 mins
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][c]), _mm256_mul_ps(_mm256_loadu_ps(dm), dx), acc[r][c]);
        if (HasMin) acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(dm + PANEL), sx, acc[r][c]);
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

using TileFn = void (*)(const uint8_t*, int64_t, const int16_t*, const float*, const float*, int64_t, float*, int64_t,
                        int64_t);

template <bool Signed, bool HasMin>
constexpr TileFn tiles[ROWS] = {tile<Signed, HasMin, 1>, tile<Signed, HasMin, 2>, tile<Signed, HasMin, 3>};

}  // namespace

int64_t panel_count(int64_t N) { return (N + GROUP * PANEL - 1) / (GROUP * PANEL) * GROUP; }

at::Tensor pack_panels(const at::Tensor& w_in, Blocks blocks) {
  const at::Tensor w = w_in.contiguous();
  const int64_t quant_bytes = blocks == Blocks::Q4_1 ? Q4_QUANT_BYTES : Q8_QUANT_BYTES;
  const int64_t block_bytes = blocks == Blocks::Q4_1 ? Q4_BYTES : Q8_BYTES;
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.size(1) % block_bytes == 0,
              "w must be [N, K/32 * ", block_bytes, "] uint8");
  const int64_t N = w.size(0), row_bytes = w.size(1), nb = row_bytes / block_bytes, panels = panel_count(N);
  at::Tensor out = at::zeros({panels, nb, PANEL_BLOCK}, at::TensorOptions().dtype(at::kByte));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = wp + n * row_bytes;
      const int64_t panel = n / PANEL, f = n % PANEL;
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* block = op + (panel * nb + b) * PANEL_BLOCK;
        float* dm = reinterpret_cast<float*>(block + PANEL_QUANTS);
        for (int64_t k = 0; k < QK; ++k) block[(k / 2) * 2 * PANEL + 2 * f + (k & 1)] = weight_byte(row, b, k, blocks);
        dm[f] = half_at(row + nb * quant_bytes + 2 * b);
        if (blocks == Blocks::Q4_1) dm[PANEL + f] = half_at(row + nb * (quant_bytes + 2) + 2 * b);
      }
    }
  });
  return out;
}

void check_panels(const at::Tensor& panels, int64_t N, int64_t K) {
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kByte && panels.is_contiguous() &&
                  panels.size(0) == panel_count(N) && panels.size(1) == K / QK && panels.size(2) == PANEL_BLOCK,
              "panels must be pack_panels(w) for this weight: [", panel_count(N), ", ", K / QK, ", ", PANEL_BLOCK,
              "] uint8, got ", panels.sizes());
}

void int_linear(const QuantizedRows& x, int64_t M, int64_t K, int64_t N, const at::Tensor& panels, Blocks blocks,
                float* out) {
  const int64_t nb = K / QK, groups = panels.size(0) / GROUP, cols = GROUP * PANEL;
  const TileFn* fns = blocks == Blocks::Q4_1 ? tiles<false, true> : tiles<true, false>;
  const uint8_t* qp = panels.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < M; r0 += ROW_CHUNK) {
      const int64_t r1 = std::min(M, r0 + ROW_CHUNK);
      for (int64_t g = begin; g < end; ++g) {
        const int64_t col = g * cols, width = std::min(cols, N - col);
        const uint8_t* q = qp + GROUP * g * nb * PANEL_BLOCK;
        for (int64_t r = r0; r < r1; r += ROWS) {
          const int64_t rows = std::min(ROWS, r1 - r);
          fns[rows - 1](q, nb, x.q + r * K, x.d + r * nb, x.s + r * nb, K, out + r * N + col, N, width);
        }
      }
    }
  });
}

}  // namespace kvserve_quant
