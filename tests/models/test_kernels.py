"""The AVX2 kernels of the requantizing weight modes, and the fused ops, against plain torch on the same numbers."""
import pytest
import torch

from models.block_quant import REQUANT_KINDS, dequantize, quantize, to_panels
from models.formats.panels import KINDS
from kvcache import REGISTRY, CacheConfig, SessionCache
from kvcache.errors import NoActiveCache, PositionMismatch
from models.config import ModelConfig
from models.fused import NativeLayers, NativeQKVRotary, NativeRMSNorm, NativeSwiGLU
from models.llama import Block, Layers, QKVRotary, RMSNorm, SwiGLU
from models.quant import LinearBlocks, convert_linears, model_kernels_available

pytestmark = pytest.mark.skipif(not model_kernels_available(), reason="no AVX2 CPU or compiler here")


@pytest.mark.parametrize("kind", REQUANT_KINDS)
def test_block_formats_requantize_losslessly(kind):
    torch.manual_seed(0)
    q, fields = quantize(torch.randn(64, 256), kind)
    values = dequantize(q, fields, kind)
    q2, fields2 = quantize(values, kind)  # a GGUF's own blocks come back unchanged
    assert torch.equal(q2, q) and all(torch.equal(a, b) for a, b in zip(fields2, fields))
    assert torch.equal(dequantize(q2, fields2, kind), values)


@pytest.mark.parametrize("kind", REQUANT_KINDS)
@pytest.mark.parametrize("rows", [16, 203])  # 203: the last panel, and the last group of two, padded
def test_panels_hold_the_blocks_and_nothing_more(kind, rows):
    torch.manual_seed(rows)
    w = torch.randn(rows, 96)
    panels = to_panels(w, kind)
    assert panels.shape == (-(-rows // 16) * 2, 3, KINDS[kind].bytes)  # rows padded to 16, 8 a panel
    want = dequantize(*quantize(w, kind), kind)
    assert torch.equal(torch.ops.kvserve_native.rows_blocks(panels, torch.arange(rows), KINDS[kind].id), want)
    picked = torch.tensor([202 % rows, 0, 7, 8, 7])
    assert torch.equal(torch.ops.kvserve_native.rows_blocks(panels, picked, KINDS[kind].id), want[picked])


@pytest.mark.parametrize("fmt", REQUANT_KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 40, 131])  # tiles of 1 to 3 rows; from 16, unpacked; chunks of 128
def test_block_linear_matches_its_dequantized_weights(fmt, rows):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(576, 200, bias=True)  # 200 features: the GEMM's last tile is padded
    fast = LinearBlocks.quantized(linear, fmt)
    weight = fast.weight()
    x = torch.randn(1, rows, 576)
    with torch.no_grad():
        want = x @ weight.T + linear.bias
        got = fast(x)
    assert got.shape == (1, rows, 200)
    assert float((got - want).norm() / want.norm()) < 1e-4  # int16 activations are near-exact


@pytest.mark.parametrize("fmt", REQUANT_KINDS)
@pytest.mark.parametrize("features", [584, 203])  # 203: a last group of 8 and a last GEMM tile both partial
def test_block_linear_rows_do_not_depend_on_the_batch(fmt, features):
    """A row gives bitwise what it gives alone in a batch of 2 or 3 (a wider tile), of 4 (several tiles), or
    of 8, 17, 40 and 131 (on AVX512-VNNI the wide tiles; from 16, unpacked panels; 131 in two chunks):
    greedy decoding must not change with the number of streams."""
    torch.manual_seed(1)
    fast = LinearBlocks.quantized(torch.nn.Linear(1536, features, bias=False), fmt)
    x = torch.randn(131, 1536) * torch.linspace(0.01, 30, 1536)  # wide per-block ranges, as real activations have
    with torch.no_grad():
        alone = torch.cat([fast(row) for row in x.split(1)])
        for rows in (2, 3, 4, 8, 17, 40, 131):
            batched = torch.cat([fast(part) for part in x.split(rows)])
            assert torch.equal(batched, alone), rows


def test_block_linear_rejects_mismatched_weights():
    w = to_panels(torch.randn(8, 64), "q4")
    with pytest.raises(RuntimeError, match="must be the panels of a 8-row weight for K=96"):
        torch.ops.kvserve_native.linear_blocks(torch.randn(2, 96), [w], [8], [KINDS["q4"].id])
    with pytest.raises(RuntimeError, match="must be the panels of a 40-row weight"):
        torch.ops.kvserve_native.linear_blocks(torch.randn(2, 64), [w], [40], [KINDS["q4"].id])
    with pytest.raises(RuntimeError, match="whole number of blocks"):
        torch.ops.kvserve_native.linear_blocks(torch.randn(2, 70), [w], [8], [KINDS["q4"].id])


def test_fused_modules_match_the_model_math():
    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data.normal_()
    x = torch.randn(1, 7, 576)
    torch.testing.assert_close(NativeRMSNorm(norm)(x), norm(x), atol=1e-5, rtol=1e-5)
    rotary = QKVRotary(9, 3, 64)
    qkv = torch.randn(1, 7, 15 * 64)
    angles = torch.randn(7, 32)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    for got, want in zip(NativeQKVRotary(rotary)(qkv, cos, sin), rotary(qkv, cos, sin)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    gate_up = torch.randn(1, 7, 2 * 1536) * 4
    torch.testing.assert_close(NativeSwiGLU()(gate_up), SwiGLU()(gate_up), atol=1e-5, rtol=1e-5)


def tiny_config(qkv_bias: bool = False) -> ModelConfig:
    return ModelConfig(architecture="llama", n_layers=2, dim=128, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=256,
                       vocab_size=64, rope_theta=10000.0, qkv_bias=qkv_bias, max_context=64)


def q4_layers(qkv_bias: bool = False) -> Layers:
    """Two q4 blocks of a tiny Llama, as a decoder stack."""
    return Layers(convert_linears(Block(tiny_config(qkv_bias), i), "q4").eval() for i in range(2))


@pytest.mark.parametrize("qkv_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 6])  # one tile, then two
def test_native_layers_match_the_layers_they_replace(qkv_bias, rows):
    torch.manual_seed(rows)
    layers = q4_layers(qkv_bias)
    for block in layers:
        for norm in (block.input_layernorm, block.post_attention_layernorm):
            norm.weight.data.normal_()
    assert NativeLayers.fits(layers)
    native = NativeLayers(layers)
    x = torch.randn(1, rows, 128)
    positions = torch.arange(3, 3 + rows).unsqueeze(1)  # [rows, 1], continuing a 3-token history
    angles = positions.float() * torch.rand(16)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    history = torch.randn(1, 3, 128)  # the same 3-token history in both caches
    outs, lengths = [], []
    for name, module in (("layers", layers), ("native", native)):
        key = f"native-layers-{name}"
        REGISTRY.install(key, SessionCache(CacheConfig(2, 2, 32, capacity=16)))
        with torch.no_grad():
            with REGISTRY.active(key):
                module(history, torch.arange(3).unsqueeze(1), cos[:1].expand(3, -1), sin[:1].expand(3, -1))
            with REGISTRY.active(key):
                outs.append(module(x, positions, cos, sin))
        lengths.append(REGISTRY.get(key).length)
        REGISTRY.uninstall(key)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)
    assert lengths == [3 + rows, 3 + rows]  # both forwards attended through the caches and were committed


def test_native_layers_pass_on_the_caches_typed_errors():
    native = NativeLayers(q4_layers())
    cos, sin = torch.ones(1, 32), torch.zeros(1, 32)
    REGISTRY.install("native-layers-errors", SessionCache(CacheConfig(2, 2, 32, capacity=16)))
    try:
        with torch.no_grad():
            with REGISTRY.active("native-layers-errors"):
                native(torch.randn(1, 1, 128), torch.tensor([[0]]), cos, sin)
            with pytest.raises(PositionMismatch), REGISTRY.active("native-layers-errors"):
                native(torch.randn(1, 1, 128), torch.tensor([[5]]), cos, sin)  # the history holds 1 token, not 5
            assert REGISTRY.get("native-layers-errors").length == 1  # the refused step changed nothing
        with pytest.raises(NoActiveCache):
            native(torch.randn(1, 1, 128), torch.tensor([[1]]), cos, sin)
    finally:
        REGISTRY.uninstall("native-layers-errors")


def test_native_layers_hold_the_blocks_own_weights_and_check_them():
    layers = q4_layers()
    native = NativeLayers(layers)
    held = {t.data_ptr() for t in native.buffers()}
    assert held == {t.data_ptr() for t in layers.buffers()}  # the blocks' own panels, no stacked copy
    o = layers[0].self_attn.o_proj
    with pytest.raises(RuntimeError, match="must be the panels of a 64-row weight"):
        torch.ops.kvserve_native.layer_tail(torch.randn(1, 1, 128), torch.randn(1, 4, 1, 32), o.panels(), [64], [o.kind_ids[0]],
                                            torch.ones(128), *NativeLayers._parts(layers[0].mlp.gate_up_proj),
                                            *NativeLayers._parts(layers[0].mlp.down_proj), 1e-5)


def test_native_layers_take_block_format_llama_layers_of_any_kinds():
    q4 = q4_layers()
    assert NativeLayers.fits(q4)
    mixed = Layers([q4[0], convert_linears(Block(tiny_config(), 1), "q8_0").eval()])
    assert NativeLayers.fits(mixed)  # Q4_1 and Q8_0 layers: each projection its own kind
    assert not NativeLayers.fits(Layers([q4[0], convert_linears(Block(tiny_config(), 1), "f16")]))
    assert not NativeLayers.fits(Layers([q4[0], Block(tiny_config(), 1)]))  # float32 projections
    assert not NativeLayers.fits(Layers())


def test_kernels_are_built_with_openmp():
    # at::parallel_for compiled without OpenMP quietly runs every range on one thread (a 2-core
    # machine then decodes ~25% slower); with it, the kernels import libgomp's parallel entry point.
    REGISTRY.native_attention()
    libraries = [p for p in torch.ops.loaded_libraries if "kvserve_models" in p or "kvcache_attend" in p]
    assert len(libraries) == 2, libraries
    for path in libraries:
        with open(path, "rb") as f:
            assert b"GOMP_parallel" in f.read(), f"{path} was built without -fopenmp"


@pytest.mark.parametrize("exact", [True, False])
def test_a_tied_table_is_read_from_the_heads_blocks_only_when_they_hold_it_exactly(exact):
    """The table at rest once: a tied embedding reads the lm_head's Q8_0 blocks when they dequantize to
    it bit for bit (a GGUF's Q8_0 token_embd), and keeps its own float32 copy otherwise."""
    from models.export import build_model
    from models.quant import EmbeddingBlocks

    torch.manual_seed(0)
    config = ModelConfig(architecture="llama", n_layers=1, dim=64, n_heads=2, n_kv_heads=1, head_dim=32, ffn_dim=128,
                         vocab_size=96, rope_theta=10000.0, tie_embeddings=True, max_context=64)
    with torch.device("meta"):
        from models.llama import Transformer
        shapes = {k: v.shape for k, v in Transformer(config).state_dict().items() if k != "lm_head.weight"}
    state = {k: torch.randn(s) for k, s in shapes.items()}
    table = torch.randn(96, 64)
    state["embed_tokens.weight"] = dequantize(*quantize(table, "q8"), "q8") if exact else table
    model = build_model(config, state, torch.float32, "q4")
    assert isinstance(model.embed_tokens, EmbeddingBlocks) == exact
    tokens = torch.tensor([[0, 5, 95, 5]])
    rows = model.embed_tokens(tokens)
    assert rows.shape == (1, 4, 64) and torch.equal(rows, state["embed_tokens.weight"][tokens])
    if exact:
        assert model.embed_tokens.packed is model.lm_head.packed  # one tensor, not a copy


def test_a_q4_model_holds_each_weight_once():
    """No second copy at rest: the program's integer buffers are the blocks' bytes, as panels, and no more."""
    from models.export import build_model
    from models.llama import Transformer

    config = ModelConfig(architecture="llama", n_layers=2, dim=64, n_heads=2, n_kv_heads=1, head_dim=32, ffn_dim=128,
                         vocab_size=100, rope_theta=10000.0, max_context=64)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(config).state_dict().items()}
    model = build_model(config, {k: torch.randn(s) for k, s in shapes.items()}, torch.float32, "q4")
    layer = [(128, 64), (64, 64), (256, 64), (64, 128)]  # qkv, o, gate_up, down: [N, K], Q4_1's 20 bytes a block
    blocks = 2 * sum(-(-n // 16) * 16 * k // 32 * 20 for n, k in layer) + 112 * 64 // 32 * 34  # lm_head: Q8_0, 100 rows padded
    held = sum(t.numel() for t in model.buffers() if t.dtype == torch.uint8)
    assert held == blocks
