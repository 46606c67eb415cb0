"""The native expert op (kernels/moe_experts.cpp), which runs a MoE layer whose experts are held as panels:
it computes the same bits as models/moe.py's per-expert path on every block format, the clamped gpt-oss
form with biases included, a row's output is the same alone or in a batch, and bad expert ids are refused."""
import numpy as np
import pytest
import torch

from models import moe
from models.formats import FORMATS
from models.formats.panels import INT8_ACTIVATIONS
from models.moe_config import ROUTINGS
from models.quant import model_kernels_available
from tests.models.gguf_files import random_blocks
from tests.models.test_formats import stored_panels

pytestmark = pytest.mark.skipif(not model_kernels_available(), reason="no AVX2 CPU or compiler here")

E, C, F = 6, 512, 512  # experts, hidden, expert FFN: whole K-quant super-blocks, two slices of the op a weight


def expert_panels(gguf_type: str, rows: int, k: int, rng) -> torch.Tensor:
    """E experts' random stored blocks of one format -> [E, P, units, bytes], as models/expert_weights.py holds them."""
    return torch.stack([stored_panels(gguf_type, random_blocks(gguf_type, rows, k, rng)) for _ in range(E)])


def layer(types: tuple[str, str, str], int8: bool, biased: bool, seed: int = 0):
    """A layer's expert weights, kinds and biases, from random blocks of the three formats."""
    rng = np.random.default_rng(seed)
    weights = [expert_panels(types[0], F, C, rng), expert_panels(types[1], F, C, rng), expert_panels(types[2], C, F, rng)]
    kinds = [FORMATS[t].kind.id | (INT8_ACTIVATIONS if int8 else 0) for t in types]
    g = torch.Generator().manual_seed(seed)
    biases = [torch.randn(E, n, generator=g) * 0.1 for n in (F, F, C)] if biased else [None, None, None]
    return weights, kinds, biases


def routed(n: int, top_k: int, routing: str, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, C, generator=g)
    ids, route_weights = moe.route(torch.randn(n, E, generator=g), top_k, ROUTINGS[routing])
    return x, ids, route_weights


CASES = {  # name: (gate, up, down formats), int8 activations, biases and the clamped SwiGLU, routing
    "qwen3-q4_k_m": (("Q4_K", "Q4_K", "Q6_K"), True, False, "softmax_norm"),
    "qwen3-q4_k-int16": (("Q4_K", "Q4_K", "Q4_K"), False, False, "softmax_norm"),
    "q8_0-q4_0": (("Q8_0", "Q4_0", "Q8_0"), True, False, "softmax"),
    "gpt-oss-mxfp4": (("MXFP4", "MXFP4", "MXFP4"), True, True, "topk_softmax"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_native_experts_compute_the_per_expert_paths_bits(case):
    types, int8, gpt, routing = CASES[case]
    weights, kinds, biases = layer(types, int8, gpt)
    limit, alpha = (7.0, 1.702) if gpt else (0.0, 0.0)
    x, ids, route_weights = routed(11, 3 if gpt else 2, routing)
    ns = [F, F, C]
    native = torch.ops.kvserve_native.moe_blocks(x, ids, route_weights, weights, ns, kinds, *biases, limit, alpha)
    want = moe._grouped(x, ids, route_weights, weights, ns, kinds, *biases, limit, alpha)
    assert native.shape == (11, C) and native.abs().sum() > 0
    assert torch.equal(native, want)
    # each row alone: its experts' products over one row instead of the batch's groups
    for r in range(11):
        alone = torch.ops.kvserve_native.moe_blocks(x[r : r + 1], ids[r : r + 1], route_weights[r : r + 1], weights, ns,
                                                    kinds, *biases, limit, alpha)
        assert torch.equal(alone[0], native[r]), r


def test_every_expert_chosen_by_many_rows_on_more_threads():
    """128 rows over 6 experts: each expert's rows span the activation chunks and tiles of a batch, and the
    threads share each expert's slices; the bits are the per-expert path's at every thread count."""
    weights, kinds, biases = layer(("Q4_K", "Q4_K", "Q6_K"), True, False)
    x, ids, route_weights = routed(128, 2, "softmax_norm")
    ns = [F, F, C]
    want = moe._grouped(x, ids, route_weights, weights, ns, kinds, *biases, 0.0, 0.0)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            got = torch.ops.kvserve_native.moe_blocks(x, ids, route_weights, weights, ns, kinds, *biases, 0.0, 0.0)
            assert torch.equal(got, want), threads
    finally:
        torch.set_num_threads(before)


def test_bad_expert_ids_and_shapes_are_refused():
    weights, kinds, biases = layer(("Q8_0", "Q8_0", "Q8_0"), False, False)
    x, ids, route_weights = routed(4, 2, "softmax")
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.kvserve_native.moe_blocks(x, ids + E, route_weights, weights, [F, F, C], kinds, *biases, 0.0, 0.0)
    with pytest.raises(RuntimeError, match="ns must be"):
        torch.ops.kvserve_native.moe_blocks(x, ids, route_weights, weights, [F, F, F + 16], kinds, *biases, 0.0, 0.0)
    empty = torch.ops.kvserve_native.moe_blocks(x[:0], ids[:0], route_weights[:0], weights, [F, F, C], kinds, *biases, 0.0, 0.0)
    assert empty.shape == (0, C)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_routed_native_op_is_the_python_ops_bits(case):
    """kvserve_native::moe_experts (routing in the op, what a program of panel experts calls) against
    kvserve::moe_experts' per-expert path on the same logits, in float32 and bfloat16 hidden states."""
    types, int8, gpt, routing = CASES[case]
    weights, kinds, biases = layer(types, int8, gpt)
    limit, alpha = (7.0, 1.702) if gpt else (0.0, 0.0)
    g = torch.Generator().manual_seed(5)
    x, logits = torch.randn(7, C, generator=g), torch.randn(7, E, generator=g)
    top_k = 3 if gpt else 2
    for dtype in (torch.float32, torch.bfloat16):
        native = torch.ops.kvserve_native.moe_experts(x.to(dtype), logits, top_k, ROUTINGS[routing], weights, [F, F, C], kinds,
                                                      *biases, limit, alpha)
        ids, route_weights = moe.route(logits, top_k, ROUTINGS[routing])
        want = moe._grouped(x.to(dtype).float(), ids, route_weights, weights, [F, F, C], kinds, *biases, limit, alpha).to(dtype)
        assert native.dtype == dtype and torch.equal(native, want)
