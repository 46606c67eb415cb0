// What quant_matmul.cpp and int_gemm.cpp share: llama.cpp's block sizes and the batched path.
#pragma once
#include <ATen/ATen.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>

namespace kvserve_quant {

constexpr int64_t QK = 32;        // weights per block
constexpr int64_t Q4_QUANT_BYTES = 16;  // Q4_1's nibbles per block
constexpr int64_t Q8_QUANT_BYTES = 32;  // Q8_0's int8 per block
constexpr int64_t Q4_BYTES = Q4_QUANT_BYTES + 4;  // Q4_1: nibbles, fp16 scale, fp16 min (stored as arrays per row)
constexpr int64_t Q8_BYTES = Q8_QUANT_BYTES + 2;  // Q8_0: int8, fp16 scale

enum class Blocks { Q4_1, Q8_0 };

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Activation rows quantized per block of 32 to int16 (scale d = amax/32767; s = d * sum(q), which
// Q4_1's min term needs).
struct QuantizedRows {
  const int16_t* q;  // [M, K]
  const float *d, *s;  // [M, K/32] each
};

// out [M, N] = xq [M, K] by w [N, K/32 * block bytes]: int16 by integer weights, scaled per block
// (int_gemm.cpp), on weights unpacked into panels on first use.
void int_linear(const QuantizedRows& xq, int64_t M, int64_t K, const at::Tensor& w, Blocks blocks, float* out);

}  // namespace kvserve_quant
