// kvcache_native::attend_spans as a C++ function, for the bound step (bound_step.cpp) to call directly.
#pragma once
#include <ATen/ATen.h>
#include <optional>

namespace kvcache_kernels {

// Contract as the op's, at the top of attend_spans.cpp.
at::Tensor attend_spans(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t layer, double scale,
                        at::TensorList k_pools, at::TensorList v_pools, const at::Tensor& tables,
                        at::IntArrayRef table_starts, at::IntArrayRef offsets, at::IntArrayRef lengths,
                        at::IntArrayRef sizes, int64_t window = 0, double softcap = 0.0,
                        const std::optional<at::Tensor>& sinks = std::nullopt);

}  // namespace kvcache_kernels
