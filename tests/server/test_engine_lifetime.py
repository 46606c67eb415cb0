"""What a weight mode derives from a weight belongs to the loaded model: two engines in one process each
hold their own, and dropping one frees it."""
import gc
import weakref

import httpx
import pytest

from models import load_model
from models.quant import model_kernels_available

from ..live_server import LiveServer


def _derived(forward) -> list[weakref.ref]:
    """Weak references to what the program's weights carry besides themselves: the f16 weights that
    fbgemm's packing rides on (q4 derives nothing: tests/models/test_kernels.py holds it to one copy)."""
    return [weakref.ref(t) for t in forward.buffers() if hasattr(t, "_fbgemm_fp16")]


def _reply(url: str) -> list[int]:
    body = {"inputs": "one two three four five six", "parameters": {"max_new_tokens": 6, "details": True}}
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


def test_dropping_one_of_two_engines_frees_its_packed_weights(tiny_checkpoints):
    if not model_kernels_available():
        pytest.skip("the native kernels do not build here")
    path = tiny_checkpoints["llama"]
    servers = [LiveServer(load_model(str(path), weights="f16")) for _ in range(2)]
    with servers[0] as first:
        with servers[1] as second:
            replies = [_reply(first.url), _reply(second.url)]  # a 6-token prefill takes the batched kernels
        kept, dropped = (_derived(s.engine.model.forward.module) for s in servers)
        assert replies[0] == replies[1]
        assert dropped and kept, "the program holds no derived weights to watch"
        assert {id(r()) for r in dropped}.isdisjoint({id(r()) for r in kept}), "the two engines share packed weights"

        del second, servers[1]
        gc.collect()
        assert all(r() is None for r in dropped), "a dropped engine's packed weights are still alive"
        assert all(r() is not None for r in kept)
        assert _reply(first.url) == replies[0]  # the other engine still serves, with its own
