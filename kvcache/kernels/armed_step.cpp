// The native half of the registry's active step. Once layer 0 has validated a step whose spans are
// all short (kvcache/step.py), the step arms this slot, and kvcache::update_and_attend runs the armed
// layers here, straight from the graph: no Python, no argument lists to convert. At batch 1 that path
// (op boxed into Python, the step's checks, the attend_spans call from Python) cost about twice the
// attention itself.
//
// Op contracts:
//   kvcache_native::arm_step(Tensor[] k_caches, Tensor[] v_caches, int[] offsets, int[] lengths, int[] sizes,
//                            int first_layer, int last_layer) -> ()
//       as attend_spans takes them; layers first_layer..last_layer, in order, run natively
//   kvcache_native::disarm_step() -> int: the next layer the armed step expected, or -1 if none was armed
//   kvcache::update_and_attend, CPU kernel: the next armed layer here; every other call (first and last
//       layers, mixed or float16-query steps, bad input) goes to kvcache::attend_active_step, the
//       registry's Python path, which validates, falls back to SDPA and commits.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <optional>
#include <vector>
#include "attend_spans.h"

namespace {

struct ArmedStep {
  std::vector<at::Tensor> k_caches, v_caches;
  std::vector<int64_t> offsets, lengths, sizes;
  int64_t next_layer, last_layer;
};

// Written only by the registry's active step (arm at layer 0, disarm on the Python path and whenever the
// registry changes steps); read by the forward, which runs on one thread.
std::optional<ArmedStep> armed;

void arm_step(at::TensorList k_caches, at::TensorList v_caches, at::IntArrayRef offsets, at::IntArrayRef lengths,
              at::IntArrayRef sizes, int64_t first_layer, int64_t last_layer) {
  armed = ArmedStep{k_caches.vec(), v_caches.vec(), offsets.vec(), lengths.vec(), sizes.vec(), first_layer, last_layer};
}

int64_t disarm_step() {
  const int64_t next = armed ? armed->next_layer : -1;
  armed.reset();
  return next;
}

at::Tensor update_and_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& position,
                             int64_t layer_id, double scale, at::ScalarType out_dtype) {
  // The Python path raises the typed errors, so any doubt about the input goes there.
  const bool ours = armed && armed->next_layer == layer_id && layer_id <= armed->last_layer && q.dim() == 4 &&
                    k.dim() == 4 && v.dim() == 4 && q.scalar_type() == at::kFloat && q.size(0) == 1 &&
                    q.size(1) % k.size(1) == 0 && position.dim() == 2 && position.size(0) == q.size(2) &&
                    position.size(1) == 1;
  if (!ours) {
    static const auto python_path =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("kvcache::attend_active_step", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double,
                              at::ScalarType)>();
    return python_path.call(q, k, v, position, layer_id, scale, out_dtype);
  }
  const at::Tensor out = kvcache_kernels::attend_spans(q, k, v, layer_id, scale, armed->k_caches, armed->v_caches,
                                                       armed->offsets, armed->lengths, armed->sizes);  // [1, H_q, S, D_v]
  armed->next_layer = layer_id + 1;
  return out.scalar_type() == out_dtype ? out : out.to(out_dtype);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcache_native, m) {
  m.def("arm_step(Tensor[] k_caches, Tensor[] v_caches, int[] offsets, int[] lengths, int[] sizes, int first_layer, "
        "int last_layer) -> ()");
  m.def("disarm_step() -> int");
}

TORCH_LIBRARY_IMPL(kvcache_native, CatchAll, m) {
  m.impl("arm_step", &arm_step);
  m.impl("disarm_step", &disarm_step);
}

TORCH_LIBRARY_IMPL(kvcache, CPU, m) { m.impl("update_and_attend", &update_and_attend); }
