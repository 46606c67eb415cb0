// What quant_matmul.cpp and fp16_gemm.cpp share: llama.cpp's block sizes and the batched path.
#pragma once
#include <ATen/ATen.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>

namespace kvserve_quant {

constexpr int64_t QK = 32;        // weights per block
constexpr int64_t Q4_BYTES = 20;  // Q4_1: 16 bytes of nibbles, fp16 scale, fp16 min (stored as arrays per row)
constexpr int64_t Q8_BYTES = 34;  // Q8_0: 32 int8, fp16 scale

enum class Blocks { Q4_1, Q8_0 };

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// out [M, N] = x [M, K] (float32, contiguous) by w [N, K/32 * block bytes] through fbgemm's fp16 GEMM,
// on weights dequantized and packed on first use.
void fp16_linear(const at::Tensor& x, const at::Tensor& w, Blocks blocks, float* out);

}  // namespace kvserve_quant
