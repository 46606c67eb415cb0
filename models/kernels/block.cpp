// A q4 decoder block as two ops around its attention, so a layer dispatches three ops instead of ~13:
// at batch 1 each dispatch from the exported graph costs as much as a small matmul.
//
// Op contracts (kvserve_native::*, float32, weights as the panels linear_q4 takes; each one's row count
// follows from the shapes: qkv (Hq + 2 Hkv) D, o and down C, gate_up twice down's K):
//   block_head(x [1, n, C], norm_w [C], qkv_w, qkv_bias [(Hq + 2 Hkv) D] or None, cos [n, D],
//              sin [n, D], Hq, Hkv, eps) -> q [1, Hq, n, D], k [1, Hkv, n, D], v [1, Hkv, n, D]
//       rope_qkv(linear_q4(rms_norm(x)) + qkv_bias)
//   block_tail(x [1, n, C], attn [1, Hq, n, Dv], o_w, norm_w [C], gate_up_w, down_w, eps) -> [1, n, C]
//       h = x + linear_q4(attn as [1, n, Hq Dv]); h + linear_q4(silu_mul(linear_q4(rms_norm(h))))
// The parts are the registered ops of quant_matmul.cpp and fused.cpp, called through the dispatcher.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <optional>
#include <tuple>

namespace {

using at::Tensor;
using QKV = std::tuple<Tensor, Tensor, Tensor>;

template <class Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

Tensor linear_q4(const Tensor& x, const Tensor& w, int64_t n) {
  static const auto handle = op<Tensor(const Tensor&, const Tensor&, int64_t)>("kvserve_native::linear_q4");
  return handle.call(x, w, n);
}

Tensor rms_norm(const Tensor& x, const Tensor& w, double eps) {
  static const auto handle = op<Tensor(const Tensor&, const Tensor&, double)>("kvserve_native::rms_norm");
  return handle.call(x, w, eps);
}

QKV block_head(const Tensor& x, const Tensor& norm_w, const Tensor& qkv_w, const std::optional<Tensor>& qkv_bias, const Tensor& cos, const Tensor& sin, int64_t Hq, int64_t Hkv,
               double eps) {
  static const auto rope = op<QKV(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t)>("kvserve_native::rope_qkv");
  Tensor qkv = linear_q4(rms_norm(x, norm_w, eps), qkv_w, (Hq + 2 * Hkv) * cos.size(1));  // [1, n, (Hq + 2 Hkv) D]
  if (qkv_bias.has_value()) qkv.add_(*qkv_bias);
  return rope.call(qkv, cos, sin, Hq, Hkv);
}

Tensor block_tail(const Tensor& x, const Tensor& attn, const Tensor& o_w, const Tensor& norm_w, const Tensor& gate_up_w,
                  const Tensor& down_w, double eps) {
  static const auto silu_mul = op<Tensor(const Tensor&)>("kvserve_native::silu_mul");
  TORCH_CHECK(x.dim() == 3 && attn.dim() == 4 && attn.size(2) == x.size(1), "x must be [1, n, C] and attn [1, H, n, Dv]");
  const int64_t n = x.size(1), C = x.size(2), F = down_w.size(1) * 32;  // down's K: 32 weights a block
  const Tensor heads = attn.transpose(1, 2).reshape({1, n, attn.size(1) * attn.size(3)});  // [1, n, H * Dv]
  Tensor h = linear_q4(heads, o_w, C);  // [1, n, C]
  h.add_(x);
  const Tensor gate_up = linear_q4(rms_norm(h, norm_w, eps), gate_up_w, 2 * F);  // [1, n, 2 F]
  Tensor out = linear_q4(silu_mul.call(gate_up), down_w, C);  // [1, n, C]
  return out.add_(h);
}

// Shapes only, for tracing and export (symbolic token counts).
QKV block_head_meta(const Tensor& x, const Tensor&, const Tensor&, const std::optional<Tensor>&,
                    const Tensor& cos, const Tensor&, int64_t Hq, int64_t Hkv, double) {
  const c10::SymInt n = x.sym_size(1), D = cos.sym_size(1);
  return {at::empty_symint({1, Hq, n, D}, x.options()), at::empty_symint({1, Hkv, n, D}, x.options()),
          at::empty_symint({1, Hkv, n, D}, x.options())};
}

Tensor block_tail_meta(const Tensor& x, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double) {
  return at::empty_like(x);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_native, m) {
  m.def("block_head(Tensor x, Tensor norm_w, Tensor qkv_w, Tensor? qkv_bias, Tensor cos, Tensor sin, int n_heads, "
        "int n_kv_heads, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("block_tail(Tensor x, Tensor attn, Tensor o_w, Tensor norm_w, Tensor gate_up_w, Tensor down_w, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_native, CPU, m) {
  m.impl("block_head", &block_head);
  m.impl("block_tail", &block_tail);
}

TORCH_LIBRARY_IMPL(kvserve_native, Meta, m) {
  m.impl("block_head", &block_head_meta);
  m.impl("block_tail", &block_tail_meta);
}
