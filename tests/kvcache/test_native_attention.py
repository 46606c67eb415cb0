"""The C++ span attention, reading histories through block tables, against the per-span SDPA path."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvcache import REGISTRY, CacheConfig, CacheError, SessionCache, Sizing
from kvcache.registry import CacheRegistry
from kvcache.step import ActiveStep

LAYERS, KV_HEADS, Q_HEADS, DIM = 2, 2, 6, 64
LONG_SPAN = 516  # longer than any prefill chunk the server plans, across 33 blocks


def make_caches(histories, sizing, dtype=torch.float32, kv_heads=KV_HEADS, dim=DIM, layers=LAYERS):
    caches = []
    for i, n in enumerate(histories):
        c = SessionCache(CacheConfig(layers, kv_heads, dim, capacity=LONG_SPAN + 64, sizing=sizing, dtype=dtype), key=f"s{i}")
        c.reserve(n)
        for layer in range(layers):
            c.write(layer, torch.randn(kv_heads, n, dim), torch.randn(kv_heads, n, dim))
        c.commit(n)
        caches.append(c)
    return caches


def clone(caches):
    out = []
    for c in caches:
        copy = SessionCache(c.config, key=c.key)
        copy.reserve(c.length)
        for layer in range(c.config.n_layers):
            copy.write(layer, *c.history(layer))
        copy.commit(c.length)
        out.append(copy)
    return out


def run(caches, sizes, native, q, k, v):
    step = ActiveStep(list(zip(caches, sizes)), native=native)
    position = torch.cat([torch.arange(c.length, c.length + n) for c, n in zip(caches, sizes)]).unsqueeze(1)
    scale = q.shape[-1] ** -0.5
    return [step.attend(q[layer], k[layer], v[layer], position, layer, scale, torch.float32) for layer in range(LAYERS)]


def assert_native_matches_sdpa(exact, sizes, q, k, v):
    """Attend over a clone of `exact` natively and over `exact` by SDPA; the outputs agree. -> the clone."""
    fast = clone(exact)
    want = run(exact, sizes, False, q, k, v)
    got = run(fast, sizes, True, q, k, v)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4)
    return fast


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # float16: the served q4/f16 modes' KV
@pytest.mark.parametrize("sizing", [Sizing.STATIC, Sizing.DYNAMIC])
@pytest.mark.parametrize("sizes", [[1, 1, 1], [1, 3, 1], [2, 40, 1], [2, LONG_SPAN, 1], [5]])
def test_native_matches_sdpa_and_writes_the_same_history(dtype, sizing, sizes):
    torch.manual_seed(0)
    if not CacheRegistry().native_attention():
        pytest.skip("no AVX2 CPU or compiler here")
    histories = [7, 0, 33, 12][: len(sizes)]
    exact = make_caches(histories, sizing, dtype)
    s = sum(sizes)
    # [L, 1, H, S, D] views of [L, 1, S, H, D] storage: strided, as the plain-torch model hands them over
    q, k, v = (torch.randn(LAYERS, 1, s, h, DIM).transpose(2, 3) for h in (Q_HEADS, KV_HEADS, KV_HEADS))
    fast = assert_native_matches_sdpa(exact, sizes, q, k, v)
    for a, b in zip(exact, fast):
        assert a.length == b.length
        for layer in range(LAYERS):
            for x, y in zip(a.history(layer), b.history(layer)):
                assert torch.equal(x, y)


# The kernel takes the query heads of a KV head in groups of three (2 + 1 or 3 + 1 left over), and
# has vector paths for head dims 64 and 128 and a scalar one for the rest.
@pytest.mark.parametrize("kv_heads,q_heads,dim", [(1, 4, 64), (2, 4, 128), (1, 5, 64), (2, 2, 64), (2, 6, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_native_matches_sdpa_for_other_head_layouts(kv_heads, q_heads, dim, dtype):
    torch.manual_seed(1)
    if not CacheRegistry().native_attention():
        pytest.skip("no AVX2 CPU or compiler here")
    sizes, histories = [1, 2, 1], [9, 100, 0]  # 100: across chunks of the online softmax, with a tail
    exact = make_caches(histories, Sizing.STATIC, dtype, kv_heads, dim)
    s = sum(sizes)
    q, k, v = (torch.randn(LAYERS, 1, h, s, dim) for h in (q_heads, kv_heads, kv_heads))
    assert_native_matches_sdpa(exact, sizes, q, k, v)


BOUND_LAYERS = 5


def test_bound_step_runs_every_layer_natively_matches_sdpa_and_refuses_out_of_turn():
    torch.manual_seed(2)
    if not REGISTRY.native_attention():
        pytest.skip("no AVX2 CPU or compiler here")
    sizes, histories = [1, 2], [7, 3]
    exact = make_caches(histories, Sizing.DYNAMIC, torch.float16, layers=BOUND_LAYERS)
    served = clone(exact)
    s = sum(sizes)
    q, k, v = (torch.randn(BOUND_LAYERS, 1, h, s, DIM) for h in (Q_HEADS, KV_HEADS, KV_HEADS))
    position = torch.tensor([[7], [3], [4]])
    reference = ActiveStep(list(zip(exact, sizes)), native=False)
    want = [reference.attend(q[i], k[i], v[i], position, i, DIM**-0.5, torch.float32) for i in range(BOUND_LAYERS)]
    reference.commit()
    keys = [f"bound-test-{i}" for i in range(len(served))]
    for key, cache in zip(keys, served):
        REGISTRY.install(key, cache)
    try:
        # out of turn: layer 2 straight after layer 0 is refused, and aborting leaves every cache as it was
        step = REGISTRY.set_active(list(zip(keys, sizes)))
        torch.ops.kvcache.update_and_attend(q[0], k[0], v[0], position, 0, DIM**-0.5, torch.float32)
        with pytest.raises(CacheError, match="out of turn"):
            torch.ops.kvcache.update_and_attend(q[2], k[2], v[2], position, 2, DIM**-0.5, torch.float32)
        with pytest.raises(CacheError, match="abort"):
            step.commit()
        step.abort()
        assert [c.length for c in served] == histories
        assert [len(c.table) for c in served] == [1, 1]

        step = REGISTRY.set_active(list(zip(keys, sizes)))
        with torch.profiler.profile() as prof:
            got = [torch.ops.kvcache.update_and_attend(q[i], k[i], v[i], position, i, DIM**-0.5, torch.float32)
                   for i in range(BOUND_LAYERS)]
        python_path = [e for e in prof.events() if e.name == "kvcache::attend_active_step"]
        assert python_path == []  # every layer, the first and last included, ran in C++
        assert [c.length for c in served] == histories  # nothing moves until the runner commits
        step.commit()
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4)
        assert [c.length for c in served] == [8, 5]
        for a, b in zip(exact, served):
            for layer in range(BOUND_LAYERS):
                for x, y in zip(a.history(layer), b.history(layer)):
                    assert torch.equal(x, y)
    finally:
        REGISTRY.set_active(None)
        for key in keys:
            REGISTRY.uninstall(key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [0, 20])  # 20: a sliding window the later tokens' histories pass
def test_a_tokens_attention_is_bitwise_the_same_however_its_step_is_cut(dtype, window):
    """Decoded one token a step, prefilled whole, cut into chunks, or beside another session's span: each
    token's output is the same bits (greedy replies must not depend on the load or the chunking), with a
    sliding window as without."""
    torch.manual_seed(3)
    if not CacheRegistry().native_attention():
        pytest.skip("no AVX2 CPU or compiler here")
    n, history = 90, 37
    base, other = make_caches([history, 50], Sizing.DYNAMIC, dtype)
    q, k, v = (torch.randn(LAYERS, 1, h, n, DIM) for h in (Q_HEADS, KV_HEADS, KV_HEADS))
    extra = [torch.randn(LAYERS, 1, h, 4, DIM) for h in (Q_HEADS, KV_HEADS, KV_HEADS)]

    def attend(cuts: list[int], beside: bool = False) -> torch.Tensor:
        """The span run in steps cut at `cuts` (with another session's 4 tokens first, if beside) -> [L, H_q, n, D]."""
        cache, neighbour = clone([base, other])
        outs = []
        for a, b in zip(cuts, cuts[1:]):
            spans = [(neighbour, 4), (cache, b - a)] if beside else [(cache, b - a)]
            step = ActiveStep(spans, native=True)
            position = torch.cat([torch.arange(c.length, c.length + m) for c, m in spans]).unsqueeze(1)
            got = []
            for layer in range(LAYERS):
                x = [t[layer][:, :, a:b] for t in (q, k, v)]  # [1, H, b - a, D] each
                if beside:  # the other session's tokens first, along the step's token axis
                    x = [torch.cat((e[layer], t), dim=2) for e, t in zip(extra, x)]
                got.append(step.attend(*x, position, layer, DIM**-0.5, torch.float32, window)[:, :, -(b - a):])
            step.commit()
            outs.append(torch.cat(got))
        return torch.cat(outs, dim=2)

    whole = attend([0, n])
    assert torch.equal(attend(list(range(n + 1))), whole)
    assert torch.equal(attend([0, 5, 6, 40, n]), whole)
    assert torch.equal(attend([0, 33, n], beside=True), whole)


def test_native_attention_is_whole_when_torch_runs_its_range_on_one_thread():
    """torch may hand a parallel_for's whole range to one thread: after another thread set its count
    to one (as the server's event loop does), the next region here gets a team of one. The kernel
    must attend every job it is handed; it used to do only the first thread's share."""
    if not CacheRegistry().native_attention():
        pytest.skip("no AVX2 CPU or compiler here")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: torch never starts a team, so every range runs on one thread anyway")
    script = textwrap.dedent(
        """
        import threading, torch
        from tests.kvcache.test_native_attention import CacheRegistry, Sizing, make_caches, clone, run, LAYERS, KV_HEADS, Q_HEADS, DIM
        assert CacheRegistry().native_attention()
        torch.manual_seed(4)
        exact = make_caches([9, 30], Sizing.STATIC)
        fast = clone(exact)
        q, k, v = (torch.randn(LAYERS, 1, h, 8, DIM) for h in (Q_HEADS, KV_HEADS, KV_HEADS))
        assert torch.get_num_threads() > 1, "needs two cores"
        other = threading.Thread(target=torch.set_num_threads, args=(1,))
        other.start(); other.join()
        got = run(fast, [2, 6], True, q, k, v)  # this thread's first parallel region
        want = run(exact, [2, 6], False, q, k, v)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4)
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"
