// The q4 decoder's layers as one op: the exported graph calls it once a step where it would call three
// ops a layer, and each call from the graph (Python, argument conversion, the GIL taken back after it)
// costs about as much as a small matmul at batch 1. Every layer still attends through
// kvcache::update_and_attend, called here through the dispatcher: the cache contract is the graph's.
//
// Op contract (kvserve_native::decoder_q4, float32, weights as the panels linear_q4 takes):
//   decoder_q4(x [1, n, C], positions [n, 1], cos [n, D], sin [n, D], input_norm [L, C], qkv [L, ...],
//              o [L, ...], post_norm [L, C], gate_up [L, ...], down [L, ...], qkv_bias [L, (Hq + 2 Hkv) D]?,
//              Hq, Hkv, eps, scale) -> [1, n, C]
//   each weight kind stacked over the L layers (one tensor a kind, so a step hands over six, not six a
//   layer); layer l runs, with its slice of each,
//       q, k, v = rope_qkv(linear_q4(rms_norm(x)) + qkv_bias)        (head)
//       a = kvcache::update_and_attend(q, k, v, positions, l, scale)
//       h = x + linear_q4(a as [1, n, Hq Dv]); x = h + linear_q4(silu_mul(linear_q4(rms_norm(h))))   (tail)
// The parts are the registered ops of quant_matmul.cpp and fused.cpp, called through the dispatcher; each
// linear's row count follows from the shapes: qkv (Hq + 2 Hkv) D, o and down C, gate_up twice down's K.
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

Tensor decoder_q4(const Tensor& x_in, const Tensor& positions, const Tensor& cos, const Tensor& sin, const Tensor& input_norm,
                  const Tensor& qkv, const Tensor& o, const Tensor& post_norm, const Tensor& gate_up, const Tensor& down,
                  const std::optional<Tensor>& qkv_bias, int64_t Hq, int64_t Hkv, double eps, double scale) {
  using Attend = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, double, at::ScalarType);
  static const auto attend = op<Attend>("kvcache::update_and_attend");
  const int64_t L = input_norm.dim() == 2 ? input_norm.size(0) : 0;
  TORCH_CHECK(L > 0, "decoder_q4 takes the input norms of its layers as [L, C]");
  for (const Tensor* w : {&qkv, &o, &post_norm, &gate_up, &down})
    TORCH_CHECK(w->dim() >= 2 && w->size(0) == L, "decoder_q4 takes every weight kind stacked over its ", L, " layers");
  TORCH_CHECK(!qkv_bias.has_value() || (qkv_bias->dim() == 2 && qkv_bias->size(0) == L),
              "decoder_q4 takes one qkv bias a layer, stacked");
  Tensor x = x_in;
  for (int64_t l = 0; l < L; ++l) {
    const std::optional<Tensor> bias = qkv_bias.has_value() ? std::optional<Tensor>(qkv_bias->select(0, l)) : std::nullopt;
    // [1, H, n, D] each
    const auto [q, k, v] = block_head(x, input_norm.select(0, l), qkv.select(0, l), bias, cos, sin, Hq, Hkv, eps);
    const Tensor attn = attend.call(q, k, v, positions, l, scale, x.scalar_type());  // [1, Hq, n, Dv]
    x = block_tail(x, attn, o.select(0, l), post_norm.select(0, l), gate_up.select(0, l), down.select(0, l),
                   eps);  // [1, n, C]
  }
  return x;
}

// Shapes only, for tracing and export (symbolic token counts).
Tensor decoder_q4_meta(const Tensor& x, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                       const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&, int64_t, int64_t, double, double) {
  return at::empty_like(x);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_native, m) {
  m.def("decoder_q4(Tensor x, Tensor positions, Tensor cos, Tensor sin, Tensor input_norm, Tensor qkv, Tensor o, "
        "Tensor post_norm, Tensor gate_up, Tensor down, Tensor? qkv_bias, int n_heads, int n_kv_heads, float eps, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_native, CPU, m) { m.impl("decoder_q4", &decoder_q4); }

TORCH_LIBRARY_IMPL(kvserve_native, Meta, m) { m.impl("decoder_q4", &decoder_q4_meta); }
