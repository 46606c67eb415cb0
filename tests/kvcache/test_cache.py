import subprocess
import sys
import textwrap

import pytest
import torch
from torch.export import Dim

import kvcache
from kvcache import REGISTRY, CacheConfig, CacheFull, SessionCache, Sizing

from .tiny_attention import TinyAttention, positions

SIZINGS = [Sizing.STATIC, Sizing.DYNAMIC]


@pytest.fixture
def model():
    return TinyAttention().eval()


@pytest.fixture
def install():
    keys = []

    def _install(key, config):
        keys.append(key)
        return REGISTRY.install(key, SessionCache(config))

    yield _install
    REGISTRY.set_active(None)
    for key in keys:
        if key in REGISTRY:
            REGISTRY.uninstall(key)


def export(model, tokens=4):
    x = torch.randn(1, tokens, 32)
    s = Dim("s", min=1, max=4096)
    return torch.export.export(
        model, (x, positions(0, tokens)), dynamic_shapes=({1: s}, {0: s}), strict=True
    )


def run_chunks(fwd, key, x, chunks):
    """Feed x [1, T, dim] through fwd in chunks of the given sizes; return [1, T, dim]."""
    outs, at = [], 0
    step = REGISTRY.set_active(key)
    for n in chunks:
        outs.append(fwd(x[:, at : at + n], positions(at, n)))
        step.commit()
        at += n
    return torch.cat(outs, dim=1)


def test_exported_graph_is_functional():
    ep = export(TinyAttention()).run_decompositions({})
    kinds = [s.kind.name for s in ep.graph_signature.input_specs]
    assert "BUFFER" not in kinds
    assert not [s for s in ep.graph_signature.output_specs if s.kind.name == "BUFFER_MUTATION"]
    calls = [n for n in ep.graph.nodes if n.op == "call_function" and "update_and_attend" in str(n.target)]
    assert len(calls) == 3
    assert sorted(n.args[4] for n in calls) == [0, 1, 2]


@pytest.mark.parametrize("sizing", SIZINGS)
def test_one_program_serves_prefill_chunks_and_decode(model, install, sizing):
    fwd = export(model).module()
    x = torch.randn(1, 6 + 3 + 3 + 1 + 1, 32)
    install("a", model.cache_config(64, sizing))
    got = run_chunks(fwd, "a", x, [6, 3, 3, 1, 1])
    torch.testing.assert_close(got, model.reference(x), atol=1e-4, rtol=0)
    assert REGISTRY.get("a").length == 14


@pytest.mark.parametrize("sizing", SIZINGS)
@pytest.mark.parametrize("chunks", [[10], [1] * 10, [4, 4, 2], [7, 1, 1, 1]])
def test_parity_with_cacheless_reference(model, install, sizing, chunks):
    x = torch.randn(1, sum(chunks), 32)
    install("a", model.cache_config(16, sizing))
    got = run_chunks(model, "a", x, chunks)
    torch.testing.assert_close(got, model.reference(x), atol=1e-4, rtol=0)


@pytest.mark.parametrize("sizing", SIZINGS)
def test_three_sessions_in_one_forward_match_solo_runs(model, install, sizing):
    fwd = export(model).module()
    hist = {"a": torch.randn(1, 9, 32), "b": torch.randn(1, 5, 32), "c": torch.randn(1, 2, 32)}
    # a: history 5 then a 4-token chunk; b: history 4 then one decode token; c: a fresh 2-token prefill
    before = {"a": 5, "b": 4, "c": 0}
    for key, x in hist.items():
        install(key, model.cache_config(32, sizing))
        if before[key]:
            run_chunks(fwd, key, x, [before[key]])
    spans = [("a", 4), ("b", 1), ("c", 2)]
    xs = torch.cat([hist[k][:, before[k] :] for k, _ in spans], dim=1)
    pos = torch.cat([positions(before[k], n) for k, n in spans])
    step = REGISTRY.set_active(spans)
    out = fwd(xs, pos)
    step.commit()
    at = 0
    for key, n in spans:
        solo = model.reference(hist[key])[:, before[key] :]
        torch.testing.assert_close(out[:, at : at + n], solo, atol=1e-4, rtol=0)
        assert REGISTRY.get(key).length == before[key] + n
        at += n


def snapshot(cache):
    return cache.length, [t.clone() for layer in range(cache.config.n_layers) for t in cache.history(layer)]


def assert_unchanged(cache, snap):
    length, tensors = snap
    assert cache.length == length
    now = [t for layer in range(cache.config.n_layers) for t in cache.history(layer)]
    for a, b in zip(now, tensors):
        assert torch.equal(a, b)


@pytest.mark.parametrize("sizing", SIZINGS)
def test_overflow_raises_and_changes_nothing(model, install, sizing):
    cache = install("a", model.cache_config(8, sizing))
    x = torch.randn(1, 10, 32)
    run_chunks(model, "a", x, [6])
    snap, nbytes = snapshot(cache), cache.nbytes
    with pytest.raises(CacheFull) as err:
        model(x[:, 6:9], positions(6, 3))
    assert (err.value.length, err.value.requested, err.value.capacity) == (6, 3, 8)
    assert_unchanged(cache, snap)
    assert cache.nbytes == nbytes
    # the cache is still usable up to its capacity
    out = model(x[:, 6:8], positions(6, 2))
    torch.testing.assert_close(out, model.reference(x[:, :8])[:, 6:], atol=1e-4, rtol=0)


@pytest.mark.parametrize("sizing", SIZINGS)
def test_multi_session_overflow_changes_no_session(model, install, sizing):
    a = install("a", model.cache_config(32, sizing))
    b = install("b", model.cache_config(4, sizing))
    x = torch.randn(1, 8, 32)
    run_chunks(model, "a", x, [3])
    run_chunks(model, "b", x, [3])
    snaps = {"a": snapshot(a), "b": snapshot(b)}
    with pytest.raises(CacheFull):  # refused when activated, before any forward
        REGISTRY.set_active([("a", 1), ("b", 2)])
    assert_unchanged(a, snaps["a"])
    assert_unchanged(b, snaps["b"])


def test_wrong_positions_raise_and_change_nothing(model, install):
    a = install("a", model.cache_config(32))
    b = install("b", model.cache_config(32))
    x = torch.randn(1, 8, 32)
    run_chunks(model, "a", x, [3])
    snaps = snapshot(a), snapshot(b)
    REGISTRY.set_active([("a", 1), ("b", 2)])
    with pytest.raises(kvcache.PositionMismatch, match="'b'"):
        model(x[:, :3], torch.tensor([[3], [1], [2]]))
    assert_unchanged(a, snaps[0])
    assert_unchanged(b, snaps[1])
    with pytest.raises(kvcache.CacheError, match="cover 3 tokens"):
        model(x[:, :4], positions(0, 4))


def test_fake_kernel_takes_value_head_dim():
    m = TinyAttention(head_dim=8, v_head_dim=12)
    ep = export(m)
    calls = [n for n in ep.graph.nodes if n.op == "call_function" and "update_and_attend" in str(n.target)]
    shapes = [tuple(n.meta["val"].shape) for n in calls]
    assert all(s[1] == 4 and s[3] == 12 for s in shapes), shapes
    with torch._subclasses.fake_tensor.FakeTensorMode():
        q, k, v = torch.empty(1, 4, 5, 8), torch.empty(1, 2, 5, 8), torch.empty(1, 2, 5, 12)
        out = torch.ops.kvcache.update_and_attend(q, k, v, torch.zeros(5, 1, dtype=torch.long), 0, 1.0, torch.bfloat16)
        assert out.shape == (1, 4, 5, 12) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("sizing", SIZINGS)
def test_rewind_then_continue_equals_fresh_run(model, install, sizing):
    x = torch.randn(1, 10, 32)
    y = torch.randn(1, 3, 32)
    cache = install("a", model.cache_config(16, sizing))
    run_chunks(model, "a", x, [10])
    cache.rewind(4)
    assert cache.length == 6
    out = model(y, positions(6, 3))
    ref = model.reference(torch.cat([x[:, :6], y], dim=1))[:, 6:]
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    with pytest.raises(ValueError):
        cache.rewind(10)


def test_registry_contract(model, install):
    install("a", model.cache_config(8))
    install("b", model.cache_config(8))
    with pytest.raises(kvcache.CacheError, match="already installed"):
        REGISTRY.install("a", SessionCache(model.cache_config(8)))
    REGISTRY.set_active("a")
    with REGISTRY.active("b"):
        assert REGISTRY.active_keys() == ("b",)
    assert REGISTRY.active_keys() == ("a",)
    REGISTRY.uninstall("a")
    assert REGISTRY.active_keys() == ()
    with pytest.raises(kvcache.NoActiveCache, match="no active cache"):
        model(torch.randn(1, 2, 32), positions(0, 2))
    with pytest.raises(kvcache.UnknownCache):
        REGISTRY.set_active("nope")


def test_dynamic_grows_block_by_block_within_capacity(model, install):
    cache = install("d", model.cache_config(100, Sizing.DYNAMIC))
    per_token, block = cache.config.bytes_per_token(), cache.block_size
    assert cache.nbytes == 0
    step = REGISTRY.set_active("d")
    x = torch.randn(1, 100, 32)
    allocations = []
    for i in range(100):
        model(x[:, i : i + 1], positions(i, 1))
        step.commit()
        if not allocations or allocations[-1] != cache.allocated:
            allocations.append(cache.allocated)
        assert cache.nbytes == cache.allocated * per_token
        assert cache.allocated == -(-(i + 1) // block) * block
    assert allocations == list(range(block, 100 + block, block))
    static = install("s", model.cache_config(100, Sizing.STATIC))
    assert static.nbytes == 112 * per_token and static.length == 0  # its capacity, in whole blocks, held back


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="capacity"):
        CacheConfig(n_layers=1, n_kv_heads=1, head_dim=8, capacity=0)
    with pytest.raises(ValueError, match="n_kv_heads"):
        CacheConfig(n_layers=1, n_kv_heads=-1, head_dim=8, capacity=4)
    with pytest.raises(ValueError, match="sizing"):
        CacheConfig(n_layers=1, n_kv_heads=1, head_dim=8, capacity=4, sizing="huge")
    with pytest.raises(ValueError, match="dtype"):
        CacheConfig(n_layers=1, n_kv_heads=1, head_dim=8, capacity=4, dtype=torch.int8)
    cfg = CacheConfig(n_layers=1, n_kv_heads=1, head_dim=8, capacity=4, sizing="static")
    assert cfg.sizing is Sizing.STATIC
    with pytest.raises(Exception):
        cfg.capacity = 9  # frozen


def test_saved_program_runs_in_fresh_process_with_any_cache(tmp_path):
    model = TinyAttention()
    path = tmp_path / "tiny.pt2"
    torch.export.save(export(model), str(path))
    x = torch.randn(1, 7, 32)
    torch.save({"x": x, "ref": model.reference(x)}, tmp_path / "data.pt")
    script = textwrap.dedent(
        f"""
        import torch, kvcache
        from kvcache import REGISTRY, CacheConfig, SessionCache, Sizing
        fwd = torch.export.load({str(path)!r}).module()
        data = torch.load({str(tmp_path / "data.pt")!r})
        for cap in (7, 50):
            for sizing in Sizing:
                key = f"{{cap}}-{{sizing.value}}"
                REGISTRY.install(key, SessionCache(CacheConfig(3, 2, 8, cap, sizing=sizing)))
                step = REGISTRY.set_active(key)
                a = fwd(data["x"][:, :5], torch.arange(5).unsqueeze(1))
                step.commit()
                b = fwd(data["x"][:, 5:], torch.arange(5, 7).unsqueeze(1))
                step.commit()
                torch.testing.assert_close(torch.cat([a, b], 1), data["ref"], atol=1e-4, rtol=0)
                assert REGISTRY.get(key).length == 7
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
