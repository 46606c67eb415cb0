// A Llama block's work around its attention call as native ops: the exported graph calls two ops a layer
// (layer_between, then kvcache::update_and_attend) where it would call about twelve, and each call from
// the graph costs about as much as a small matmul at batch 1. The attention stays in the graph, one
// kvcache::update_and_attend a layer: these ops fuse around it, never across it.
//
// Op contracts (kvserve_native::*, float32; each projection as the parts linear_blocks takes: panels,
// rows and kinds, models/kernels/quant_matmul.cpp):
//   layer_head(x [1, n, C], norm [C], qkv parts, qkv_bias [(Hq + 2 Hkv) D]?, cos [n, D], sin [n, D], Hq, Hkv, eps)
//       -> q [1, Hq, n, D], k [1, Hkv, n, D], v [1, Hkv, n, Dv]:  rope_qkv(linear(rms_norm(x)) + qkv_bias)
//   layer_tail(x, attn [1, Hq, n, Dv], o parts, post_norm [C], gate_up parts, down parts, eps) -> [1, n, C]:
//       h = x + linear_o(attn as [1, n, Hq Dv]);  h + linear_down(silu_mul(linear_gate_up(rms_norm(h))))
//   layer_between(x, attn, <layer_tail's weights>, next_norm, <layer_head's qkv parts and bias>, cos, sin, Hq,
//       Hkv, eps) -> (x', q, k, v): layer_tail of one layer, then layer_head of the next on its output
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

// A projection's weight as the op takes it: its parts' panels, rows and kinds (linear_blocks).
struct Parts {
  at::TensorList ws;
  at::IntArrayRef ns, kinds;
};

Tensor rms_norm(const Tensor& x, const Tensor& w, double eps) {
  static const auto handle = op<Tensor(const Tensor&, const Tensor&, double)>("kvserve_native::rms_norm");
  return handle.call(x, w, eps);
}

Tensor linear(const Tensor& x, const Parts& w) {
  static const auto handle = op<Tensor(const Tensor&, at::TensorList, at::IntArrayRef, at::IntArrayRef)>("kvserve_native::linear_blocks");
  return handle.call(x, w.ws, w.ns, w.kinds);
}


QKV head(const Tensor& x, const Tensor& norm_w, const Parts& qkv_w, const std::optional<Tensor>& qkv_bias, const Tensor& cos,
         const Tensor& sin, int64_t Hq, int64_t Hkv, double eps) {
  static const auto rope = op<QKV(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t)>("kvserve_native::rope_qkv");
  Tensor qkv = linear(rms_norm(x, norm_w, eps), qkv_w);  // [1, n, (Hq + 2 Hkv) D]
  if (qkv_bias.has_value()) qkv.add_(*qkv_bias);
  return rope.call(qkv, cos, sin, Hq, Hkv);
}

Tensor tail(const Tensor& x, const Tensor& attn, const Parts& o_w, const Tensor& norm_w, const Parts& gate_up_w,
            const Parts& down_w, double eps) {
  static const auto silu_mul = op<Tensor(const Tensor&)>("kvserve_native::silu_mul");
  TORCH_CHECK(x.dim() == 3 && attn.dim() == 4 && attn.size(2) == x.size(1), "x must be [1, n, C] and attn [1, H, n, Dv]");
  const int64_t n = x.size(1);
  const Tensor heads = attn.transpose(1, 2).reshape({1, n, attn.size(1) * attn.size(3)});  // [1, n, H * Dv]
  Tensor h = linear(heads, o_w);  // [1, n, C]
  h.add_(x);
  const Tensor gate_up = linear(rms_norm(h, norm_w, eps), gate_up_w);  // [1, n, 2 F]
  Tensor out = linear(silu_mul.call(gate_up), down_w);  // [1, n, C]
  return out.add_(h);
}

QKV layer_head(const Tensor& x, const Tensor& norm_w, at::TensorList qkv, at::IntArrayRef qkv_ns, at::IntArrayRef qkv_kinds,
               const std::optional<Tensor>& qkv_bias, const Tensor& cos, const Tensor& sin, int64_t Hq, int64_t Hkv, double eps) {
  return head(x, norm_w, {qkv, qkv_ns, qkv_kinds}, qkv_bias, cos, sin, Hq, Hkv, eps);
}

Tensor layer_tail(const Tensor& x, const Tensor& attn, at::TensorList o, at::IntArrayRef o_ns, at::IntArrayRef o_kinds,
                  const Tensor& norm_w, at::TensorList gate_up, at::IntArrayRef gate_up_ns, at::IntArrayRef gate_up_kinds,
                  at::TensorList down, at::IntArrayRef down_ns, at::IntArrayRef down_kinds, double eps) {
  return tail(x, attn, {o, o_ns, o_kinds}, norm_w, {gate_up, gate_up_ns, gate_up_kinds}, {down, down_ns, down_kinds}, eps);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> layer_between(
    const Tensor& x, const Tensor& attn, at::TensorList o, at::IntArrayRef o_ns, at::IntArrayRef o_kinds, const Tensor& post_norm,
    at::TensorList gate_up, at::IntArrayRef gate_up_ns, at::IntArrayRef gate_up_kinds, at::TensorList down,
    at::IntArrayRef down_ns, at::IntArrayRef down_kinds, const Tensor& next_norm, at::TensorList qkv, at::IntArrayRef qkv_ns,
    at::IntArrayRef qkv_kinds, const std::optional<Tensor>& qkv_bias, const Tensor& cos, const Tensor& sin, int64_t Hq,
    int64_t Hkv, double eps) {
  Tensor out = tail(x, attn, {o, o_ns, o_kinds}, post_norm, {gate_up, gate_up_ns, gate_up_kinds}, {down, down_ns, down_kinds}, eps);
  auto [q, k, v] = head(out, next_norm, {qkv, qkv_ns, qkv_kinds}, qkv_bias, cos, sin, Hq, Hkv, eps);
  return {out, q, k, v};
}

// Shapes only, for tracing and export (symbolic token counts).
int64_t rows(at::IntArrayRef ns) {
  int64_t total = 0;
  for (int64_t n : ns) total += n;
  return total;
}

QKV head_meta(const Tensor& x, int64_t qkv_rows, const Tensor& cos, int64_t Hq, int64_t Hkv) {
  const c10::SymInt D = cos.sym_size(1), Dv = (qkv_rows - (Hq + Hkv) * D) / Hkv;
  auto o = x.options();
  return {at::empty_symint({1, Hq, x.sym_size(1), D}, o), at::empty_symint({1, Hkv, x.sym_size(1), D}, o),
          at::empty_symint({1, Hkv, x.sym_size(1), Dv}, o)};
}

QKV layer_head_meta(const Tensor& x, const Tensor&, at::TensorList, at::IntArrayRef qkv_ns, at::IntArrayRef,
                    const std::optional<Tensor>&, const Tensor& cos, const Tensor&, int64_t Hq, int64_t Hkv, double) {
  return head_meta(x, rows(qkv_ns), cos, Hq, Hkv);
}

Tensor layer_tail_meta(const Tensor& x, const Tensor&, at::TensorList, at::IntArrayRef, at::IntArrayRef, const Tensor&,
                       at::TensorList, at::IntArrayRef, at::IntArrayRef, at::TensorList, at::IntArrayRef, at::IntArrayRef, double) {
  return at::empty_like(x);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> layer_between_meta(
    const Tensor& x, const Tensor&, at::TensorList, at::IntArrayRef, at::IntArrayRef, const Tensor&, at::TensorList,
    at::IntArrayRef, at::IntArrayRef, at::TensorList, at::IntArrayRef, at::IntArrayRef, const Tensor&, at::TensorList,
    at::IntArrayRef qkv_ns, at::IntArrayRef, const std::optional<Tensor>&, const Tensor& cos, const Tensor&, int64_t Hq,
    int64_t Hkv, double) {
  auto [q, k, v] = head_meta(x, rows(qkv_ns), cos, Hq, Hkv);
  return {at::empty_like(x), q, k, v};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_native, m) {
  m.def("layer_head(Tensor x, Tensor norm, Tensor[] qkv, int[] qkv_ns, int[] qkv_kinds, Tensor? qkv_bias, Tensor cos, "
        "Tensor sin, int n_heads, int n_kv_heads, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("layer_tail(Tensor x, Tensor attn, Tensor[] o, int[] o_ns, int[] o_kinds, Tensor post_norm, Tensor[] gate_up, "
        "int[] gate_up_ns, int[] gate_up_kinds, Tensor[] down, int[] down_ns, int[] down_kinds, float eps) -> Tensor");
  m.def("layer_between(Tensor x, Tensor attn, Tensor[] o, int[] o_ns, int[] o_kinds, Tensor post_norm, Tensor[] gate_up, "
        "int[] gate_up_ns, int[] gate_up_kinds, Tensor[] down, int[] down_ns, int[] down_kinds, Tensor next_norm, "
        "Tensor[] qkv, int[] qkv_ns, int[] qkv_kinds, Tensor? qkv_bias, Tensor cos, Tensor sin, int n_heads, "
        "int n_kv_heads, float eps) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvserve_native, CPU, m) {
  m.impl("layer_head", &layer_head);
  m.impl("layer_tail", &layer_tail);
  m.impl("layer_between", &layer_between);
}

TORCH_LIBRARY_IMPL(kvserve_native, Meta, m) {
  m.impl("layer_head", &layer_head_meta);
  m.impl("layer_tail", &layer_tail_meta);
  m.impl("layer_between", &layer_between_meta);
}
