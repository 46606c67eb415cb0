// The block-format products of quant_matmul.cpp for kernels that run many of them in one parallel loop
// (moe_experts.cpp): activations quantized once up front, then any rows of them by any run of a weight's
// panel groups, each product serial where it runs inside a parallel region.
#pragma once
#include <ATen/ATen.h>
#include <cstdint>
#include <vector>

namespace kvserve_blocks {

// Rows of activations quantized for the products with weights of one kind (its block size and precision).
struct Activations {
  int64_t kind = -1, K = 0;
  std::vector<int16_t> q16;
  std::vector<int8_t> q8;
  std::vector<float> d, s;
  std::vector<int32_t> t;
};

// x [M, K] f32, contiguous -> its rows quantized for weights of `kind` (parallel: call it outside a loop).
Activations quantize(const at::Tensor& x, int64_t kind);

// Whether weights of kinds a and b multiply the same quantized activations.
bool same_activations(int64_t a, int64_t b);

// out [M, N] (rows ldo apart) = rows row0 .. row0 + M of x by the N-feature weight held as panels of
// `kind` at `panels` (x quantized for a kind of the same activations). A weight's features [16 g, ...) are
// the weight whose panels start group_bytes * g in.
void product(const Activations& x, int64_t kind, int64_t row0, int64_t M, const uint8_t* panels, int64_t N, float* out,
             int64_t ldo);

// The bytes of one group of panels (16 features) of a K-column weight of `kind`.
int64_t group_bytes(int64_t kind, int64_t K);

// Raises unless w is the panels [P, K/unit, bytes] of an N-feature, K-column weight of `kind`.
void check_weight(const at::Tensor& w, int64_t N, int64_t K, int64_t kind);

constexpr int64_t GROUP_FEATURES = 16;

}  // namespace kvserve_blocks
