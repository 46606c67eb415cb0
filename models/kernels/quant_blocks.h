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

// The batched path's weights (int_gemm.cpp): w [N, K/32 * block bytes] unpacked to a byte a weight, in
// panels of 8 output features, made once per weight by its owner and passed to every int_linear.
at::Tensor pack_panels(const at::Tensor& w, Blocks blocks);
void check_panels(const at::Tensor& panels, int64_t N, int64_t K);

// out [M, N] = xq [M, K] by the N-feature weight whose pack_panels these are.
void int_linear(const QuantizedRows& xq, int64_t M, int64_t K, int64_t N, const at::Tensor& panels, Blocks blocks,
                float* out);

}  // namespace kvserve_quant
