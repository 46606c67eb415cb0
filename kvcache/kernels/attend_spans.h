// kvcache_native::attend_spans as a C++ function, for the armed step (armed_step.cpp) to call directly.
#pragma once
#include <ATen/ATen.h>

namespace kvcache_kernels {

// Contract as the op's, at the top of attend_spans.cpp.
at::Tensor attend_spans(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t layer, double scale,
                        at::TensorList k_caches, at::TensorList v_caches, at::IntArrayRef offsets,
                        at::IntArrayRef lengths, at::IntArrayRef sizes);

}  // namespace kvcache_kernels
