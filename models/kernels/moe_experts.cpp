// The experts of a mixture-of-experts layer whose weights are held as panels: the rows grouped by the
// expert they chose, each chosen expert's products run once over all its rows, and every expert's
// products one parallel loop of equal slices, which the threads take as they come free.
//
// Op contracts:
//   moe_experts(x [n, C], logits [n, E], top_k, routing, weights, ns, kinds, gate_bias?, up_bias?, down_bias?,
//               swiglu_limit, swiglu_alpha) -> [n, C] in x's dtype: models/moe.py's kvserve::moe_experts, for
//               experts held as panels: each row's experts picked as moe.route picks them, then moe_blocks
// kvserve_native::moe_blocks:
//   moe_blocks(x [n, C] f32, ids [n, k] i64, route_weights [n, k] f32, weights [gate, up, down],
//              ns [F, F, C], kinds [3], gate_bias?, up_bias?, down_bias?, swiglu_limit, swiglu_alpha) -> [n, C] f32
//   gate, up [E, P, C/unit, bytes] and down [E, P', F/unit, bytes] uint8: each expert's panels of its kind
//   (quant_matmul.cpp); biases [E, F], [E, F], [E, C] f32 or none
//   swiglu_limit 0: silu(gate) * up; > 0: (up + 1) * gate * sigmoid(alpha * gate), gate clamped above and
//   up both ways at the limit (gpt-oss)
//   A row's output is the sum over j of route_weights[r, j] times its j-th expert's output, added in j's
//   order: the same float operations whatever else shares the step, and the same as models/moe.py's.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include "block_products.h"
#include <algorithm>
#include <atomic>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using kvserve_blocks::Activations;
using kvserve_blocks::GROUP_FEATURES;

// Features a slice of work covers: each slice is one product of a few panel groups, small enough that an
// expert's weight splits over many threads, large enough that a slice's set-up is a small share of it.
constexpr int64_t SLICE = 16 * GROUP_FEATURES;

struct Slice {
  int64_t expert, part, col;  // part: which weight; col: its first output feature
};

// Runs fn(slice) for every slice, the threads taking the next one as they come free: the experts' row
// counts differ, and a static split of the list would leave one thread waiting on the other.
template <class Fn>
void each_slice(const std::vector<Slice>& slices, Fn&& fn) {
  std::atomic<int64_t> next{0};
  const int64_t count = static_cast<int64_t>(slices.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < count; i = next++) fn(slices[i]);
  });
}

at::Tensor moe_blocks(const at::Tensor& x_in, const at::Tensor& ids_in, const at::Tensor& route_in, at::TensorList ws,
                      at::IntArrayRef ns, at::IntArrayRef kinds, const std::optional<at::Tensor>& gate_bias,
                      const std::optional<at::Tensor>& up_bias, const std::optional<at::Tensor>& down_bias,
                      double swiglu_limit, double swiglu_alpha) {
  TORCH_CHECK(ws.size() == 3 && ns.size() == 3 && kinds.size() == 3, "weights, ns and kinds are gate, up and down");
  const at::Tensor x = x_in.to(at::kFloat).contiguous(), ids = ids_in.to(at::kLong).contiguous();
  const at::Tensor route = route_in.to(at::kFloat).contiguous();
  TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && ids.size(0) == x.size(0) && route.sizes() == ids.sizes(),
              "x must be [n, C], ids and route_weights [n, k]");
  const int64_t n = x.size(0), C = x.size(1), k = ids.size(1), E = ws[0].size(0), F = ns[0], nk = n * k;
  TORCH_CHECK(ns[1] == F && ns[2] == C, "ns must be [F, F, C]");
  for (int i = 0; i < 3; ++i) {
    TORCH_CHECK(ws[i].dim() == 4 && ws[i].size(0) == E && ws[i].is_contiguous(), "each weight must be [E, P, units, bytes]");
    kvserve_blocks::check_weight(ws[i][0], ns[i], i < 2 ? C : F, kinds[i]);
  }
  if (n == 0) return at::empty({0, C}, x.options());

  // The choices grouped by expert, each expert's in their order: sorted position c holds choice slot[c]
  // (row slot[c] / k), and expert e's rows are positions begin[e] .. begin[e + 1].
  const int64_t* ip = ids.data_ptr<int64_t>();
  std::vector<int64_t> begin(E + 1, 0);
  for (int64_t c = 0; c < nk; ++c) {
    TORCH_CHECK(ip[c] >= 0 && ip[c] < E, "expert id ", ip[c], " is out of range for ", E, " experts");
    ++begin[ip[c] + 1];
  }
  for (int64_t e = 0; e < E; ++e) begin[e + 1] += begin[e];
  const auto longs = at::TensorOptions().dtype(at::kLong);
  at::Tensor slot = at::empty({nk}, longs), rows = at::empty({nk}, longs), expert = at::empty({nk}, longs);
  {
    std::vector<int64_t> fill(begin.begin(), begin.end() - 1);
    int64_t *sp = slot.data_ptr<int64_t>(), *rp = rows.data_ptr<int64_t>(), *ep = expert.data_ptr<int64_t>();
    for (int64_t c = 0; c < nk; ++c) {
      const int64_t at = fill[ip[c]]++;
      sp[at] = c, rp[at] = c / k, ep[at] = ip[c];
    }
  }
  auto slices = [&](std::initializer_list<int64_t> parts, int64_t width) {
    std::vector<Slice> out;
    for (int64_t e = 0; e < E; ++e)
      if (begin[e + 1] > begin[e])
        for (int64_t part : parts)
          for (int64_t col = 0; col < width; col += SLICE) out.push_back({e, part, col});
    return out;
  };
  const int64_t group_bytes[3] = {kvserve_blocks::group_bytes(kinds[0], C), kvserve_blocks::group_bytes(kinds[1], C),
                                  kvserve_blocks::group_bytes(kinds[2], F)};
  // One expert's part `part` over its rows, features col .. col + SLICE, into out (rows ld apart).
  auto run = [&](const Slice& s, const Activations& a, float* out, int64_t ld) {
    const at::Tensor& w = ws[s.part];
    const uint8_t* panels = w.data_ptr<uint8_t>() + s.expert * w.stride(0) + s.col / GROUP_FEATURES * group_bytes[s.part];
    const int64_t r0 = begin[s.expert], m = begin[s.expert + 1] - r0;
    kvserve_blocks::product(a, kinds[s.part], r0, m, panels, std::min(SLICE, ns[s.part] - s.col), out + r0 * ld + s.col, ld);
  };

  // gate and up, side by side [nk, 2F]
  const at::Tensor xs = x.index_select(0, rows);  // [nk, C], by expert
  const Activations gate_x = kvserve_blocks::quantize(xs, kinds[0]);
  std::optional<Activations> own_up;
  if (!kvserve_blocks::same_activations(kinds[0], kinds[1])) own_up = kvserve_blocks::quantize(xs, kinds[1]);
  const Activations& up_x = own_up ? *own_up : gate_x;
  at::Tensor gate_up = at::empty({nk, 2 * F}, x.options());
  float* gu = gate_up.data_ptr<float>();
  each_slice(slices({0, 1}, F), [&](const Slice& s) { run(s, s.part == 0 ? gate_x : up_x, gu + s.part * F, 2 * F); });
  if (gate_bias) gate_up.narrow(1, 0, F).add_(gate_bias->index_select(0, expert));
  if (up_bias) gate_up.narrow(1, F, F).add_(up_bias->index_select(0, expert));
  // fused.cpp's row by row, as models/moe.py's reference calls it: ATen's silu would give each thread's
  // last elements a scalar exp, and a row's bits would move with the batch and the threads
  const at::Tensor h = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("kvserve_native::swiglu", "")
                           .typed<at::Tensor(const at::Tensor&, double, double)>()
                           .call(gate_up, swiglu_limit, swiglu_alpha);  // [nk, F]

  // down [nk, C], each choice's output weighted, then summed per row in the router's order
  const Activations down_x = kvserve_blocks::quantize(h.contiguous(), kinds[2]);
  at::Tensor y = at::empty({nk, C}, x.options());
  float* yp = y.data_ptr<float>();
  each_slice(slices({2}, C), [&](const Slice& s) { run(s, down_x, yp, C); });
  if (down_bias) y = y + down_bias->index_select(0, expert);
  y = y * route.view({-1}).index_select(0, slot).unsqueeze(1);
  at::Tensor picked = at::empty({nk, C}, x.options()).index_copy_(0, slot, y).view({n, k, C});
  at::Tensor out = picked.select(1, 0);
  for (int64_t j = 1; j < k; ++j) out = out + picked.select(1, j);
  return out;
}

// models/moe_config.py's ROUTINGS
enum Routing : int64_t { SOFTMAX = 0, SOFTMAX_NORM = 1, TOPK_SOFTMAX = 2 };

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& logits_in, int64_t top_k, int64_t routing, at::TensorList ws,
                       at::IntArrayRef ns, at::IntArrayRef kinds, const std::optional<at::Tensor>& gate_bias,
                       const std::optional<at::Tensor>& up_bias, const std::optional<at::Tensor>& down_bias,
                       double swiglu_limit, double swiglu_alpha) {
  TORCH_CHECK(routing >= SOFTMAX && routing <= TOPK_SOFTMAX, "unknown routing ", routing);
  const at::Tensor logits = logits_in.to(at::kFloat);
  at::Tensor ids, weights;
  if (routing == TOPK_SOFTMAX) {
    at::Tensor top;
    std::tie(top, ids) = logits.topk(top_k, -1);
    weights = top.softmax(-1);
  } else {
    std::tie(weights, ids) = logits.softmax(-1).topk(top_k, -1);
    if (routing == SOFTMAX_NORM) weights = weights / weights.sum(-1, true);
  }
  return moe_blocks(x, ids, weights, ws, ns, kinds, gate_bias, up_bias, down_bias, swiglu_limit, swiglu_alpha)
      .to(x.scalar_type());
}

at::Tensor moe_experts_meta(const at::Tensor& x, const at::Tensor&, int64_t, int64_t, at::TensorList, at::IntArrayRef,
                            at::IntArrayRef, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                            const std::optional<at::Tensor>&, double, double) {
  return at::empty_symint(x.sym_sizes(), x.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_native, m) {
  m.def("moe_blocks(Tensor x, Tensor ids, Tensor route_weights, Tensor[] weights, int[] ns, int[] kinds, "
        "Tensor? gate_bias, Tensor? up_bias, Tensor? down_bias, float swiglu_limit, float swiglu_alpha) -> Tensor");
  m.def("moe_experts(Tensor x, Tensor logits, int top_k, int routing, Tensor[] weights, int[] ns, int[] kinds, "
        "Tensor? gate_bias, Tensor? up_bias, Tensor? down_bias, float swiglu_limit, float swiglu_alpha) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_native, CPU, m) {
  m.impl("moe_blocks", &moe_blocks);
  m.impl("moe_experts", &moe_experts);
}

TORCH_LIBRARY_IMPL(kvserve_native, Meta, m) { m.impl("moe_experts", &moe_experts_meta); }
