"""update_and_attend's window and softcap, in the C++ kernel and the Python path, against plain torch: a dense
score matrix over each session's whole history, masked by hand."""
import pytest
import torch

from kvcache import REGISTRY, Sizing
from kvcache.registry import CacheRegistry
from kvcache.step import ActiveStep

from .test_native_attention import clone, make_caches

LAYERS = 2


def needs_native():
    if not CacheRegistry().native_attention():
        pytest.skip("no AVX2 CPU or compiler here")


def reference(caches, sizes, q, k, v, layer, scale, window, softcap=0.0, sinks=None):
    """What each span's tokens see, from the caches as they were before the step -> [1, H_q, S, D_v] float32;
    `sinks` [H_q]: gpt-oss's sink logits, one more column of each softmax, whose value is nothing."""
    outs, at = [], 0
    for cache, n in zip(caches, sizes):
        old_k, old_v = cache.history(layer)  # [H_kv, T, D]
        dtype = cache.config.dtype  # the step's own k/v are read back as the cache stores them
        keys = torch.cat((old_k, k[0, :, at : at + n].to(dtype)), dim=1).double()  # [H_kv, T + n, D]
        values = torch.cat((old_v, v[0, :, at : at + n].to(dtype)), dim=1).double()
        group = q.shape[1] // keys.shape[0]
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)  # [H_q, T + n, D]
        scores = q[0, :, at : at + n].double() @ keys.transpose(1, 2) * scale  # [H_q, n, T + n]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        total = keys.shape[1]
        q_pos = torch.arange(total - n, total).unsqueeze(1)
        k_pos = torch.arange(total).unsqueeze(0)
        seen = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)  # [n, T + n]
        scores = scores.masked_fill(~seen, float("-inf"))
        if sinks is not None:
            scores = torch.cat((scores, sinks.double().view(-1, 1, 1).expand(-1, n, 1)), dim=-1)  # [H_q, n, T + n + 1]
        weights = scores.softmax(-1)[..., :total]  # the sink's column dropped
        outs.append((weights @ values).float())
        at += n
    return torch.cat(outs, dim=1).unsqueeze(0)


def step_outputs(caches, sizes, native, q, k, v, window, softcap=0.0):
    """Every layer of one step -> [L] outputs [1, H_q, S, D_v]; the step is committed."""
    step = ActiveStep(list(zip(caches, sizes)), native=native)
    position = torch.cat([torch.arange(c.length, c.length + n) for c, n in zip(caches, sizes)]).unsqueeze(1)
    scale = q.shape[-1] ** -0.5
    outs = [step.attend(q[i], k[i], v[i], position, i, scale, torch.float32, window, softcap) for i in range(LAYERS)]
    step.commit()
    return outs


def check_against_reference(histories, sizes, window, softcap=0.0, dtype=torch.float32, kv_heads=2, q_heads=6, dim=64,
                            native=True):
    before = make_caches(histories, Sizing.DYNAMIC, dtype, kv_heads, dim, LAYERS)
    s = sum(sizes)
    # [L, 1, H, S, D] views of [L, 1, S, H, D] storage: strided, as the model hands them over
    q, k, v = (torch.randn(LAYERS, 1, s, h, dim).transpose(2, 3) for h in (q_heads, kv_heads, kv_heads))
    served = clone(before)
    got = step_outputs(served, sizes, native, q, k, v, window, softcap)
    for layer in range(LAYERS):
        want = reference(before, sizes, q[layer], k[layer], v[layer], layer, dim**-0.5, window, softcap)
        torch.testing.assert_close(got[layer], want, atol=3e-5, rtol=1e-4)
    assert [c.length for c in served] == [h + n for h, n in zip(histories, sizes)]


# (histories, sizes, window): a prefill from nothing across the window's edge; a chunk continuing a history
# past the window; decodes whose window starts chunks into their history; several sessions in one step, a
# long span among them (many jobs, each row's window beginning inside a block and a kernel chunk); a window
# of one (each token sees only itself).
CASES = [
    ([0], [40], 8),
    ([30], [25], 8),
    ([100, 7, 300], [1, 1, 1], 16),
    ([50, 3, 200], [1, 37, 1], 24),
    ([5, 90], [300, 2], 40),
    ([20], [9], 1),
]


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("histories,sizes,window", CASES)
def test_window_matches_a_dense_masked_reference(native, dtype, histories, sizes, window):
    torch.manual_seed(10)
    if native:
        needs_native()
    check_against_reference(histories, sizes, window, dtype=dtype, native=native)


# The vector paths (head dims 64, 128) and the scalar one (any other), one KV head or several.
@pytest.mark.parametrize("kv_heads,q_heads,dim", [(1, 4, 64), (2, 4, 128), (2, 6, 40)])
@pytest.mark.parametrize("window,softcap", [(12, 0.0), (0, 5.0), (12, 5.0)])
def test_window_and_softcap_on_every_kernel_path(kv_heads, q_heads, dim, window, softcap):
    torch.manual_seed(11)
    needs_native()
    for native in (True, False):
        check_against_reference([70, 0], [1, 33], window, softcap, kv_heads=kv_heads, q_heads=q_heads, dim=dim,
                                native=native)


def test_softcap_saturates_scores_far_past_the_cap():
    """Scores of hundreds against a cap of 2: tanh rounds to +-1, and every capped score ties."""
    torch.manual_seed(12)
    needs_native()
    before = make_caches([40], Sizing.DYNAMIC)
    q, k, v = (torch.randn(LAYERS, 1, h, 3, 64) * 30 for h in (6, 2, 2))
    got = step_outputs(clone(before), [3], True, q, k, v, 10, 2.0)
    for layer in range(LAYERS):
        want = reference(before, [3], q[layer], k[layer], v[layer], layer, 64**-0.5, 10, 2.0)
        torch.testing.assert_close(got[layer], want, atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_window_past_the_history_is_bitwise_no_window(dtype):
    """window=0 computes what it did: a window longer than every history reads the same keys in the same order."""
    torch.manual_seed(13)
    needs_native()
    before = make_caches([33, 0, 120], Sizing.DYNAMIC, dtype)
    sizes = [1, 50, 2]
    q, k, v = (torch.randn(LAYERS, 1, h, sum(sizes), 64) for h in (6, 2, 2))
    plain = step_outputs(clone(before), sizes, True, q, k, v, 0)
    wide = step_outputs(clone(before), sizes, True, q, k, v, 10_000)
    assert all(torch.equal(a, b) for a, b in zip(plain, wide))


def test_the_op_passes_window_and_softcap_to_the_bound_step_and_defaults_them():
    """Through torch.ops.kvcache.update_and_attend with a bound step: the window and cap reach the kernel, and a
    call that omits them (a program saved before they existed) attends the whole history uncapped."""
    torch.manual_seed(15)
    needs_native()
    before = make_caches([45, 12], Sizing.DYNAMIC)
    sizes = [1, 20]
    q, k, v = (torch.randn(LAYERS, 1, h, sum(sizes), 64) for h in (6, 2, 2))
    position = torch.tensor([[45]] + [[12 + i] for i in range(20)])
    for window, softcap, args in ((6, 3.0, (6, 3.0)), (0, 0.0, ())):
        served = clone(before)
        keys = [f"window-op-{i}" for i in range(len(served))]
        for key, cache in zip(keys, served):
            REGISTRY.install(key, cache)
        try:
            with REGISTRY.active(list(zip(keys, sizes))):
                got = [torch.ops.kvcache.update_and_attend(q[i], k[i], v[i], position, i, 0.125, torch.float32, *args)
                       for i in range(LAYERS)]
        finally:
            for key in keys:
                REGISTRY.uninstall(key)
        for layer in range(LAYERS):
            want = reference(before, sizes, q[layer], k[layer], v[layer], layer, 0.125, window, softcap)
            torch.testing.assert_close(got[layer], want, atol=3e-5, rtol=1e-4)


def test_a_negative_window_or_cap_is_refused():
    cache = make_caches([3], Sizing.DYNAMIC)[0]
    q, k, v = (torch.randn(1, h, 1, 64) for h in (6, 2, 2))
    REGISTRY.install("window-refused", cache)
    try:
        for window, softcap in ((-1, 0.0), (0, -2.0)):
            with pytest.raises(ValueError, match="window and softcap"), REGISTRY.active([("window-refused", 1)]):
                torch.ops.kvcache.update_and_attend(q, k, v, torch.tensor([[3]]), 0, 0.125, torch.float32, window, softcap)
    finally:
        REGISTRY.uninstall("window-refused")
