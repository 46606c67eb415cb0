"""update_and_attend's learned attention sinks (gpt-oss), in the C++ kernel and the Python path, against plain
torch: each row's scores with its head's sink logit appended, softmaxed, the sink's column dropped, times v."""
import pytest
import torch

from kvcache import REGISTRY, Sizing
from kvcache import step as steps
from kvcache.step import ActiveStep

from .test_native_attention import clone, make_caches
from .test_windowed_attention import needs_native, reference
from .tiny_attention import TinyAttention, positions

LAYERS = 2
TOLERANCE = dict(atol=3e-5, rtol=1e-4)


def sink_logits(heads: int) -> torch.Tensor:
    """Sinks around the scores' range, one above every score (the kernel rescales its sums to it), one far below."""
    sinks = torch.randn(heads) * 2
    sinks[0], sinks[-1] = 6.0, -30.0
    return sinks


def step_outputs(caches, sizes, native, q, k, v, window, sinks, softcap=0.0):
    """Every layer of one step -> [L] outputs [1, H_q, S, D_v]; the step is committed."""
    step = ActiveStep(list(zip(caches, sizes)), native=native)
    position = torch.cat([torch.arange(c.length, c.length + n) for c, n in zip(caches, sizes)]).unsqueeze(1)
    scale = q.shape[-1] ** -0.5
    outs = [step.attend(q[i], k[i], v[i], position, i, scale, torch.float32, window, softcap, sinks[i])
            for i in range(LAYERS)]
    step.commit()
    return outs


def check_against_reference(histories, sizes, window, native, softcap=0.0, dtype=torch.float32, kv_heads=2,
                            q_heads=6, dim=64):
    before = make_caches(histories, Sizing.DYNAMIC, dtype, kv_heads, dim, LAYERS)
    # [L, 1, H, S, D] views of [L, 1, S, H, D] storage: strided, as the model hands them over
    q, k, v = (torch.randn(LAYERS, 1, sum(sizes), h, dim).transpose(2, 3) for h in (q_heads, kv_heads, kv_heads))
    sinks = [sink_logits(q_heads) for _ in range(LAYERS)]
    got = step_outputs(clone(before), sizes, native, q, k, v, window, sinks, softcap)
    for layer in range(LAYERS):
        want = reference(before, sizes, q[layer], k[layer], v[layer], layer, dim**-0.5, window, softcap, sinks[layer])
        torch.testing.assert_close(got[layer], want, **TOLERANCE)


# (histories, sizes, window): a prefill from nothing, whole, without and with a window; a chunk continuing a
# history; decodes of sessions of different lengths in one step; a prefill chunk between two decodes; a long
# span beside a decode, with a window.
CASES = [
    ([0], [40], 0),
    ([0], [40], 8),
    ([30], [25], 0),
    ([100, 7, 300], [1, 1, 1], 0),
    ([100, 7, 300], [1, 1, 1], 16),
    ([50, 3, 200], [1, 37, 1], 24),
    ([5, 90], [300, 2], 40),
]


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("histories,sizes,window", CASES)
def test_sinks_match_a_plain_torch_reference(native, dtype, histories, sizes, window):
    torch.manual_seed(20)
    if native:
        needs_native()
    check_against_reference(histories, sizes, window, native, dtype=dtype)


# The vector paths (head dims 64, 128) and the scalar one (any other), MQA and GQA, with a window and a cap.
@pytest.mark.parametrize("kv_heads,q_heads,dim", [(1, 4, 64), (2, 4, 128), (2, 6, 40)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (12, 0.0), (12, 5.0)])
def test_sinks_on_every_kernel_path(kv_heads, q_heads, dim, window, softcap):
    torch.manual_seed(21)
    needs_native()
    for native in (True, False):
        check_against_reference([70, 0], [1, 33], window, native, softcap, kv_heads=kv_heads, q_heads=q_heads, dim=dim)


@pytest.mark.parametrize("window", [0, 20])
def test_sinks_prefilled_in_chunks_then_decoded_match_the_reference_and_each_other(window):
    """A history prefilled in chunks and then decoded a token a step gives each token what plain torch gives
    it over the whole sequence; natively, the same bits however the steps are cut."""
    torch.manual_seed(22)
    needs_native()
    n, (base,) = 60, make_caches([13], Sizing.DYNAMIC)
    q, k, v = (torch.randn(LAYERS, 1, h, n, 64) for h in (6, 2, 2))
    sinks = [sink_logits(6) for _ in range(LAYERS)]

    def attend(cuts: list[int], native: bool) -> list[torch.Tensor]:
        (cache,), outs = clone([base]), []
        for a, b in zip(cuts, cuts[1:]):
            outs.append(step_outputs([cache], [b - a], native, *(t[:, :, :, a:b] for t in (q, k, v)), window, sinks))
        return [torch.cat([o[layer] for o in outs], dim=2) for layer in range(LAYERS)]

    whole = attend([0, n], True)
    for native in (True, False):
        got = attend([0, 17, 40, 57, 58, 59, n], native)
        for layer in range(LAYERS):
            want = reference([base], [n], q[layer], k[layer], v[layer], layer, 0.125, window, sinks=sinks[layer])
            torch.testing.assert_close(got[layer], want, **TOLERANCE)
            if native:
                assert torch.equal(got[layer], whole[layer])


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (10, 0.0), (10, 4.0)])
def test_no_sinks_is_bitwise_what_omitting_them_computes(native, window, softcap):
    """sinks=None, by position or by name, gives the bits a call without the argument (a program saved before
    it existed) gives; natively, so does a sink that weighs nothing (e^(-1e30 - top) is 0)."""
    torch.manual_seed(23)
    if native:
        needs_native()
    before = make_caches([33, 0, 120], Sizing.DYNAMIC)
    sizes = [1, 50, 2]
    q, k, v = (torch.randn(LAYERS, 1, h, sum(sizes), 64) for h in (6, 2, 2))
    position = torch.tensor([[33], *([i] for i in range(50)), [120], [121]])
    calls = [(), (None,), {"sinks": None}] + ([(torch.full((6,), -1e30),)] if native else [])
    outputs = []
    for extra in calls:
        args, kwargs = (extra, {}) if isinstance(extra, tuple) else ((), extra)
        step = ActiveStep(list(zip(clone(before), sizes)), native=native)
        steps.bind(step)  # the op serves this thread's step: in C++ if native, else on the Python path
        try:
            outputs.append([torch.ops.kvcache.update_and_attend(q[i], k[i], v[i], position, i, 0.125, torch.float32,
                                                                window, softcap, *args, **kwargs)
                            for i in range(LAYERS)])
            step.commit()
        finally:
            steps.bind(None)
    for other in outputs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outputs[0], other))


def test_the_op_passes_sinks_to_the_bound_step():
    """Through torch.ops.kvcache.update_and_attend with a bound step, every layer runs in C++ with its sinks."""
    torch.manual_seed(24)
    needs_native()
    before = make_caches([45, 12], Sizing.DYNAMIC)
    sizes = [1, 20]
    q, k, v = (torch.randn(LAYERS, 1, h, sum(sizes), 64) for h in (6, 2, 2))
    sinks = [sink_logits(6) for _ in range(LAYERS)]
    position = torch.tensor([[45]] + [[12 + i] for i in range(20)])
    keys = [f"sinks-op-{i}" for i in range(len(before))]
    for key, cache in zip(keys, clone(before)):
        REGISTRY.install(key, cache)
    try:
        with REGISTRY.active(list(zip(keys, sizes))), torch.profiler.profile() as prof:
            got = [torch.ops.kvcache.update_and_attend(q[i], k[i], v[i], position, i, 0.125, torch.float32, 6, 0.0,
                                                       sinks[i]) for i in range(LAYERS)]
    finally:
        for key in keys:
            REGISTRY.uninstall(key)
    assert [e for e in prof.events() if e.name == "kvcache::attend_active_step"] == []
    for layer in range(LAYERS):
        want = reference(before, sizes, q[layer], k[layer], v[layer], layer, 0.125, 6, sinks=sinks[layer])
        torch.testing.assert_close(got[layer], want, **TOLERANCE)


@pytest.mark.parametrize("sinks,message", [
    (torch.zeros(5), r"float32 \[H_q\] = \[6\]"),
    (torch.zeros(6, 1), r"float32 \[H_q\] = \[6\]"),
    (torch.zeros(6, dtype=torch.bfloat16), r"float32 \[H_q\] = \[6\]"),
    (torch.tensor([0.0, 1.0, float("inf"), 0.0, 0.0, 0.0]), "finite"),
    (torch.tensor([0.0, float("nan"), 0.0, 0.0, 0.0, 0.0]), "finite"),
])
def test_sinks_of_the_wrong_shape_type_or_not_finite_are_refused(sinks, message):
    cache = make_caches([3], Sizing.DYNAMIC)[0]
    q, k, v = (torch.randn(1, h, 1, 64) for h in (6, 2, 2))
    REGISTRY.install("sinks-refused", cache)
    try:
        with pytest.raises(ValueError, match=message), REGISTRY.active([("sinks-refused", 1)]):
            torch.ops.kvcache.update_and_attend(q, k, v, torch.tensor([[3]]), 0, 0.125, torch.float32, 0, 0.0, sinks)
        assert cache.length == 3  # the refused step changed nothing
    finally:
        REGISTRY.uninstall("sinks-refused")


class SinkAttention(TinyAttention):
    """TinyAttention whose layers each hold a sink logit per query head, as a buffer, and a sliding window."""

    WINDOW = 5

    def __init__(self):
        super().__init__(n_layers=2, n_heads=4, n_kv_heads=2)
        for i in range(len(self.wq)):
            self.register_buffer(f"sinks_{i}", torch.randn(self.n_heads) + 1.0)

    def forward(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        for i in range(len(self.wq)):
            q, k, v = self._qkv(i, x, position)
            a = torch.ops.kvcache.update_and_attend(q, k, v, position, i, self.scale, x.dtype, self.WINDOW, 0.0,
                                                    getattr(self, f"sinks_{i}"))
            x = x + a.transpose(1, 2).reshape(1, x.shape[1], -1) @ self.wo[i].T
        return x

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Cacheless forward over a whole history x [1, T, dim], as transformers' gpt-oss eager attention."""
        t = x.shape[1]
        pos = torch.arange(t).unsqueeze(1)
        seen = (pos.T <= pos) & (pos.T > pos - self.WINDOW)  # [T, T]
        for i in range(len(self.wq)):
            q, k, v = self._qkv(i, x, pos)
            rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            scores = (q @ k.transpose(2, 3) * self.scale).masked_fill(~seen, float("-inf"))  # [1, H, T, T]
            sink = getattr(self, f"sinks_{i}").view(1, -1, 1, 1).expand(1, -1, t, 1)
            a = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1] @ v
            x = x + a.transpose(1, 2).reshape(1, t, -1) @ self.wo[i].T
        return x


def test_a_model_with_sinks_exports_them_as_the_ops_argument_and_serves():
    torch.manual_seed(25)
    model = SinkAttention()
    s = torch.export.Dim("s", min=1, max=64)
    ep = torch.export.export(model, (torch.randn(1, 4, 32), positions(0, 4)), dynamic_shapes=({1: s}, {0: s}))
    ep = ep.run_decompositions({})
    buffers = ep.graph_signature.inputs_to_buffers
    calls = [n for n in ep.graph.nodes if n.op == "call_function" and "update_and_attend" in str(n.target)]
    assert len(calls) == 2
    for i, call in enumerate(calls):
        sinks = call.kwargs.get("sinks", call.args[9] if len(call.args) > 9 else None)
        assert isinstance(sinks, torch.fx.Node) and buffers[sinks.name] == f"sinks_{i}"  # the buffer itself
        assert call.args[7] == SinkAttention.WINDOW
    x = torch.randn(1, 14, 32)
    program = ep.module()
    cache = REGISTRY.install("sinks-export", make_caches([0], Sizing.DYNAMIC, kv_heads=2, dim=8)[0])
    try:
        outs, at = [], 0
        for n in (9, 1, 1, 3):  # a prefill in one piece, two decodes, a chunk: past the window each time
            with REGISTRY.active("sinks-export"):
                outs.append(program(x[:, at : at + n], positions(at, n)))
            at += n
        assert cache.length == 14
    finally:
        REGISTRY.uninstall("sinks-export")
    torch.testing.assert_close(torch.cat(outs, dim=1), model.reference(x), atol=1e-5, rtol=1e-4)
