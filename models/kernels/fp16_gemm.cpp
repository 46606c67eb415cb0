// The batched path of the block matmuls (quant_matmul.cpp takes it from FP16_ROWS rows on): fbgemm's
// fp16 GEMM on the weights dequantized and packed once, which beats the integer dot products there.
// fp16 rounds the weights to 11 significant bits; products and sums stay float32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include "quant_blocks.h"
#include <algorithm>
#include <cstring>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

namespace kvserve_quant {
namespace {

// Weight rows [n0, n1) -> float32 [n1 - n0, K].
void dequantize_q4(const uint8_t* w, int64_t nb, int64_t n0, int64_t n1, float* out) {
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * nb * Q4_BYTES;
    for (int64_t b = 0; b < nb; ++b, out += QK) {
      const __m256 d = _mm256_set1_ps(half_at(row + nb * 16 + 2 * b)), m = _mm256_set1_ps(half_at(row + nb * 18 + 2 * b));
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
      const __m128i halves[2] = {_mm_and_si128(raw, low), _mm_and_si128(_mm_srli_epi16(raw, 4), low)};
      for (int h = 0; h < 2; ++h) {
        const __m256i a = _mm256_cvtepu8_epi32(halves[h]), bq = _mm256_cvtepu8_epi32(_mm_srli_si128(halves[h], 8));
        _mm256_storeu_ps(out + 16 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), d, m));
        _mm256_storeu_ps(out + 16 * h + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(bq), d, m));
      }
    }
  }
}

void dequantize_q8(const uint8_t* w, int64_t nb, int64_t n0, int64_t n1, float* out) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * nb * Q8_BYTES;
    for (int64_t b = 0; b < nb; ++b, out += QK) {
      const __m256 d = _mm256_set1_ps(half_at(row + nb * 32 + 2 * b));
      for (int i = 0; i < 4; ++i) {
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + b * 32 + 8 * i));
        _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
      }
    }
  }
}

// fbgemm packs each weight once, on its first call with many rows, in column slices: its fp16 GEMM
// runs on the calling thread only, so each thread of the parallel_for below takes an equal run of
// slices of the output features. A slice holds at most SLICE_BYTES of packed weights, because fbgemm
// walks all of a call's columns once per 6 rows: the lm_head's 28 MB half per thread ran at 49-53
// GMAC/s at 32-64 rows, in slices of 0.6-2.4 MB at 67-85 (min of 8 calls, three alternating rounds);
// the decoder's weights fit one slice a thread. Packing is a pure function of the weight, so this is
// a memo; each entry holds its weight tensor, so no freed weight's address can be reused by another
// while the memo knows it.
constexpr int64_t SLICE_BYTES = 2 << 20;

struct PackedSlices {
  at::Tensor weight;
  std::vector<int64_t> starts;  // slice i packs weight rows starts[i] .. starts[i + 1]
  std::vector<at::Tensor> packed;
};

struct PackedMemo {
  std::mutex lock;
  std::unordered_map<const void*, PackedSlices> entries;  // weight data ptr -> its packed slices
};

PackedMemo& packed_memo() {
  static PackedMemo memo;
  return memo;
}

const PackedSlices& packed_f16(const at::Tensor& w, int64_t K, Blocks blocks) {
  PackedMemo& memo = packed_memo();
  std::lock_guard<std::mutex> guard(memo.lock);
  auto it = memo.entries.find(w.data_ptr());
  if (it != memo.entries.end()) return it->second;
  const int64_t N = w.size(0), nb = K / QK, threads = std::max(at::get_num_threads(), 1);
  const int64_t per_thread = (N / threads * K * 2 + SLICE_BYTES - 1) / SLICE_BYTES;  // slices of <= SLICE_BYTES of fp16 each
  const int64_t n_slices = std::min<int64_t>(threads * std::max<int64_t>(per_thread, 1), (N + 63) / 64);
  at::Tensor dense = at::empty({N, K}, at::TensorOptions().dtype(at::kFloat));
  float* dp = dense.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const auto dequantize = blocks == Blocks::Q4_1 ? dequantize_q4 : dequantize_q8;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) { dequantize(wp, nb, begin, end, dp + begin * K); });
  PackedSlices slices{w, {}, {}};
  for (int64_t i = 0; i <= n_slices; ++i) slices.starts.push_back(i == n_slices ? N : N * i / n_slices / 8 * 8);
  for (int64_t i = 0; i < n_slices; ++i)
    slices.packed.push_back(at::fbgemm_pack_gemm_matrix_fp16(dense.slice(0, slices.starts[i], slices.starts[i + 1])));
  return memo.entries.emplace(w.data_ptr(), std::move(slices)).first->second;
}

// x [M, K] by every packed slice, each thread its run of slices -> out [M, N]. The slices land by
// memcpy: worker threads do not inherit the caller's inference mode, so an ATen in-place copy there
// would be refused.
void fp16_gemm(const at::Tensor& x, const PackedSlices& w, float* out) {
  const int64_t M = x.size(0), N = w.starts.back(), n_slices = w.packed.size();
  at::parallel_for(0, n_slices, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const at::Tensor part = at::fbgemm_linear_fp16_weight_fp32_activation(x, w.packed[i], std::nullopt);  // [M, width]
      const int64_t width = w.starts[i + 1] - w.starts[i];
      const float* src = part.data_ptr<float>();
      for (int64_t m = 0; m < M; ++m) std::memcpy(out + m * N + w.starts[i], src + m * width, width * sizeof(float));
    }
  });
}

}  // namespace

void fp16_linear(const at::Tensor& x, const at::Tensor& w, Blocks blocks, float* out) {
  fp16_gemm(x, packed_f16(w, x.size(1), blocks), out);
}

}  // namespace kvserve_quant
