// The native half of a registry's active step. When a step is activated (kvcache/step.py), it is
// validated and its blocks reserved in Python, then bound here, to the thread that activated it, and
// kvcache::update_and_attend runs every layer of the forward straight from the graph: no Python, no
// argument lists to convert. The binding is per thread, so two engines (each stepping on its own model
// thread, with its own registry) never read each other's step, and nothing here is process-wide.
//
// Op contracts:
//   kvcache_native::bind_step(Tensor[] k_pools, Tensor[] v_pools, Tensor tables, int[] table_starts,
//                             int[] offsets, int[] lengths, int[] sizes, int native_layers) -> ()
//       as attend_spans takes them; layers 0..native_layers-1 then run here, in order (the step
//       binds all of its layers; any later ones would go to the Python path)
//   kvcache_native::unbind_step() -> (): this thread holds no step
//   kvcache_native::bound_next_layer() -> int: the layer the bound step expects next (the layer count
//       once the forward is done), or -1 if this thread holds none
//   kvcache_native::attend_bound(q, k, v, layer, scale, window=0, softcap=0.0, sinks=None) -> Tensor: one layer
//       of the bound step, for the Python path once it has validated the call
//   kvcache::update_and_attend, CPU kernel: the bound step's next layer here, its window, soft cap and sinks as
//       attend_spans takes them; every other call (no step bound, a layer out of turn, positions that do
//       not continue the histories, a float16 query, bad shapes, a negative window or cap, sinks that are not
//       finite float32 [H_q]) goes to
//       kvcache::attend_active_step, the registry's Python path, which raises the typed errors or takes
//       the call itself.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>
#include "attend_spans.h"

namespace {

struct BoundStep {
  std::vector<at::Tensor> k_pools, v_pools;
  at::Tensor tables;
  std::vector<int64_t> table_starts, offsets, lengths, sizes, positions;  // positions: what layer 0 must be given
  int64_t next_layer, native_layers;
};

thread_local std::optional<BoundStep> bound;

void bind_step(at::TensorList k_pools, at::TensorList v_pools, const at::Tensor& tables, at::IntArrayRef table_starts,
               at::IntArrayRef offsets, at::IntArrayRef lengths, at::IntArrayRef sizes, int64_t native_layers) {
  std::vector<int64_t> positions;
  for (size_t i = 0; i < sizes.size(); ++i)
    for (int64_t j = 0; j < sizes[i]; ++j) positions.push_back(lengths[i] + j);
  bound = BoundStep{k_pools.vec(), v_pools.vec(), tables.contiguous(), table_starts.vec(), offsets.vec(),
                    lengths.vec(), sizes.vec(), std::move(positions), 0, native_layers};
}

void unbind_step() { bound.reset(); }

int64_t bound_next_layer() { return bound ? bound->next_layer : -1; }

at::Tensor attend_bound(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t layer, double scale,
                        int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(bound && bound->next_layer == layer, "no bound step expects layer ", layer);
  at::Tensor out = kvcache_kernels::attend_spans(q, k, v, layer, scale, bound->k_pools, bound->v_pools, bound->tables,
                                                 bound->table_starts, bound->offsets, bound->lengths, bound->sizes,
                                                 window, softcap, sinks);
  bound->next_layer = layer + 1;
  return out;  // [1, H_q, S, D_v] float32
}

bool positions_match(const at::Tensor& position) {
  if (position.scalar_type() != at::kLong || !position.is_contiguous()) return false;
  const int64_t* p = position.data_ptr<int64_t>();
  const auto& want = bound->positions;
  for (size_t i = 0; i < want.size(); ++i)
    if (p[i] != want[i]) return false;
  return true;
}

// The op's checks on sinks (kvcache/op.py): float32 [H_q], every logit finite.
bool sinks_fit(const std::optional<at::Tensor>& sinks, int64_t heads) {
  if (!sinks) return true;
  if (sinks->scalar_type() != at::kFloat || sinks->dim() != 1 || sinks->size(0) != heads || !sinks->is_contiguous())
    return false;
  const float* s = sinks->data_ptr<float>();
  return std::all_of(s, s + heads, [](float x) { return std::isfinite(x); });
}

at::Tensor update_and_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& position,
                             int64_t layer_id, double scale, at::ScalarType out_dtype, int64_t window, double softcap,
                             const std::optional<at::Tensor>& sinks) {
  // The Python path raises the typed errors, so any doubt about the input goes there.
  const bool ours = bound && bound->next_layer == layer_id && layer_id < bound->native_layers && window >= 0 &&
                    softcap >= 0.0 && q.dim() == 4 && k.dim() == 4 && v.dim() == 4 &&
                    q.scalar_type() == at::kFloat && q.size(0) == 1 && q.size(1) % k.size(1) == 0 &&
                    position.dim() == 2 && position.size(0) == q.size(2) && position.size(1) == 1 &&
                    q.size(2) == static_cast<int64_t>(bound->positions.size()) &&
                    sinks_fit(sinks, q.size(1)) && (layer_id != 0 || positions_match(position));
  if (!ours) {
    static const auto python_path =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("kvcache::attend_active_step", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double,
                              at::ScalarType, int64_t, double, const std::optional<at::Tensor>&)>();
    return python_path.call(q, k, v, position, layer_id, scale, out_dtype, window, softcap, sinks);
  }
  const at::Tensor out = attend_bound(q, k, v, layer_id, scale, window, softcap, sinks);
  return out.scalar_type() == out_dtype ? out : out.to(out_dtype);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcache_native, m) {
  m.def("bind_step(Tensor[] k_pools, Tensor[] v_pools, Tensor tables, int[] table_starts, int[] offsets, "
        "int[] lengths, int[] sizes, int native_layers) -> ()");
  m.def("unbind_step() -> ()");
  m.def("bound_next_layer() -> int");
  m.def("attend_bound(Tensor q, Tensor k, Tensor v, int layer, float scale, int window=0, float softcap=0.0, "
        "Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvcache_native, CatchAll, m) {
  m.impl("bind_step", &bind_step);
  m.impl("unbind_step", &unbind_step);
  m.impl("bound_next_layer", &bound_next_layer);
}

TORCH_LIBRARY_IMPL(kvcache_native, CPU, m) { m.impl("attend_bound", &attend_bound); }

TORCH_LIBRARY_IMPL(kvcache, CPU, m) { m.impl("update_and_attend", &update_and_attend); }
