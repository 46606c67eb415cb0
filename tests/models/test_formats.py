"""GGUF's block formats served as stored: each decodes as llama.cpp's reference does, repacks to panels
losslessly, and multiplies by its own kernel; whole files load in their formats, and bad ones fail clearly."""
import subprocess
import sys

import numpy as np
import pytest
import torch

from models import ModelLoadError, load_model
from models.formats import FORMATS
from models.formats.panels import INT8_ACTIVATIONS
from models.quant import LinearBlocks, model_kernels_available
from models.stored import StoredTensor
from tests.models.gguf_files import random_blocks, rewritten, write_llama_gguf
from tests.models.test_models import PROMPT, Session, run_prompt

pytestmark = pytest.mark.skipif(not model_kernels_available(), reason="no AVX2 CPU or compiler here")


def reference(gguf_type: str, raw: np.ndarray, rows: int, k: int) -> torch.Tensor:
    """llama.cpp's own dequantization, as gguf-py ports it."""
    import gguf

    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[gguf_type]).reshape(rows, k).copy())


def stored_panels(gguf_type, raw):
    data = torch.from_numpy(raw.copy())
    return FORMATS[gguf_type].panels(lambda r0, r1: data[r0:r1], raw.shape[0])


@pytest.mark.parametrize("gguf_type", sorted(FORMATS))
def test_each_format_decodes_and_repacks_exactly(gguf_type):
    rng = np.random.default_rng(7)
    rows, k = 1227, 256  # in two chunks, the last panel and group padded
    raw = random_blocks(gguf_type, rows, k, rng)
    want = reference(gguf_type, raw, rows, k)
    assert torch.equal(FORMATS[gguf_type].dequantize(torch.from_numpy(raw.copy())), want)
    kind = FORMATS[gguf_type].kind
    panels = stored_panels(gguf_type, raw)
    assert panels.shape == (154, k // kind.unit, kind.bytes)
    assert torch.equal(torch.ops.kvserve_native.rows_blocks(panels, torch.arange(rows), kind.id), want)


def int8_rows(x: torch.Tensor, qk: int) -> torch.Tensor:
    """x [M, K] as the int8 path quantizes it, dequantized: per block of qk, scale amax/127, the product
    by its float32 inverse rounded to the nearest integer, ties to even (vcvtps2dq)."""
    blocks = x.reshape(x.shape[0], -1, qk)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return (torch.round(blocks * inv) * scale).reshape(x.shape)


@pytest.mark.parametrize("activations", ["int16", "int8"])
@pytest.mark.parametrize("gguf_type", sorted(FORMATS))
def test_each_format_kernel_matches_its_weights_at_every_batch(gguf_type, activations):
    """Near-exact against its own dequantized weight (int8: against the activations rounded as the path
    rounds them, so the product itself is exact), and a row's output is bitwise the same whatever shares
    its step: alone, in a tile of 2, the wide tiles unpacking in registers (3-15 rows: tiles of 8 and
    the rest) and from panels unpacked once (16+), two chunks (131)."""
    rng = np.random.default_rng(3)
    rows, k = 200, 768
    raw = random_blocks(gguf_type, rows, k, rng)
    weight = reference(gguf_type, raw, rows, k)
    kind = FORMATS[gguf_type].kind
    kind_id = kind.id | (INT8_ACTIVATIONS if activations == "int8" else 0)
    panels = stored_panels(gguf_type, raw)
    x = torch.randn(131, k) * torch.linspace(0.01, 30, k)
    full = torch.ops.kvserve_native.linear_blocks(x, [panels], [rows], [kind_id])
    want = (int8_rows(x, kind.qk) if activations == "int8" else x) @ weight.T
    assert float((full - want).norm() / want.norm()) < 1e-4
    if activations == "int8":  # int8 rounding, visibly: what the int16 path keeps
        assert float((full - x @ weight.T).norm() / want.norm()) > 1e-3
    for m in (1, 2, 3, 8, 17, 40):
        assert torch.equal(torch.cat([torch.ops.kvserve_native.linear_blocks(p, [panels], [rows], [kind_id])
                                      for p in x.split(m)]), full), m


def test_a_projection_of_mixed_formats_is_one_op(tmp_path):
    """A Q4_K_M's q and k in Q4_K, its v in Q6_K: one module, one op, the parts side by side."""
    rng = np.random.default_rng(1)
    k, parts = 256, [("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 32), ("Q5_0", 24)]
    path, tensors, weights, offset = tmp_path / "w.bin", [], [], 0
    with open(path, "wb") as f:
        for i, (t, n) in enumerate(parts):
            raw = random_blocks(t, n, k, rng)
            f.write(raw.tobytes())
            tensors.append(StoredTensor(f"w{i}", path, offset, t, (n, k)))
            weights.append(reference(t, raw, n, k))
            offset += raw.nbytes
    linear = LinearBlocks.from_stored(tensors, None)
    assert linear.kinds == ("q4_k", "q6_k", "q8") and linear.ns == (96, 32, 24)  # the two Q4_K tensors share a part
    assert linear.sources == ("Q4_K", "Q4_K", "Q6_K", "Q5_0")
    x = torch.randn(5, k)
    want = x @ torch.cat(weights).T
    assert float((linear(x) - want).norm() / want.norm()) < 1e-4
    assert torch.equal(linear.weight(), torch.cat(weights))


MIXES = {
    **{t: t for t in sorted(FORMATS)},
    "F16": "F16",
    "Q4_K_M": {"token_embd": "Q6_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "*": "Q4_K"},
}


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory, smollm_path):
    root = tmp_path_factory.mktemp("formats")
    return {name: write_llama_gguf(root / f"tiny-{name}.gguf", smollm_path, dim=256, n_layers=2, n_heads=4, n_kv_heads=2,
                                   ffn=512, types=types, seed=i)
            for i, (name, types) in enumerate(MIXES.items())}


def last_logits(model, ids):
    with Session(model.config) as session, torch.no_grad():
        return run_prompt(session.committing(model.forward), model.config, ids)[0]


@pytest.mark.parametrize("mix", list(MIXES))
def test_a_file_is_served_as_stored(tiny_files, smollm, mix):
    """Its logits match a dequantize-then-f32 reference of the same file, and it says what it holds."""
    ids = smollm.tokenizer.encode(PROMPT)
    served = load_model(str(tiny_files[mix]), use_cache=False, weights="stored", activations="int16")
    exact = load_model(str(tiny_files[mix]), use_cache=False, weights="f32")
    got, want = last_logits(served, ids), last_logits(exact, ids)
    assert float((got - want).norm() / want.norm()) < 2e-3  # the activations' int16 rounding, no more
    # int8, the default, rounds more: each format's kernels against their references above, the logits below
    held = dict(served.held)
    if mix == "F16":  # float q, k, v (and gate, up) are held fused: 4 matrices a layer, and the table
        assert held == {"F16": 2 * 4 + 1, "F32": 2 * 2 + 1}
    elif isinstance(MIXES[mix], str):  # the file's 7 matrices a layer, and the table
        assert held == {mix: 2 * 7 + 1, "F32": 2 * 2 + 1}
    else:
        assert held == {"Q4_K": 10, "Q6_K": 5, "F32": 5}


def test_int8_activations_are_asked_for_and_kept_with_the_artifact(tiny_files, smollm):
    """`--activations int8` (the default): every block product rounds its activations to int8, near the
    exact logits (int16: nearer); the artifact records it; float weights have no activations to quantize,
    and say so."""
    ids = smollm.tokenizer.encode(PROMPT)
    path = str(tiny_files["Q4_K_M"])
    int8 = load_model(path, weights="stored", activations="int8")
    int16, exact = load_model(path, weights="stored", activations="int16"), load_model(path, use_cache=False, weights="f32")
    assert (int8.activations, int16.activations) == ("int8", "int16") and int8.folder != int16.folder
    got, plain, want = last_logits(int8, ids), last_logits(int16, ids), last_logits(exact, ids)
    assert 2e-3 < float((got - want).norm() / want.norm()) < 3e-2
    assert float((plain - want).norm() / want.norm()) < 2e-3
    assert load_model(path, weights="stored").activations == "int8"  # the default, from the artifact
    assert exact.activations == "float" and load_model(path, use_cache=False, weights="f32", activations="int16").activations == "float"
    result = run_cli("export", "--model", path, "--out", "unused", "--activations", "int4")
    assert result.returncode == 2 and "--activations: invalid choice" in result.stderr


def test_a_type_without_a_kernel_names_the_tensor_unless_requantized(tmp_path, smollm_path, smollm):
    path = write_llama_gguf(tmp_path / "q2k.gguf", smollm_path, dim=256, n_layers=1, n_heads=4, n_kv_heads=2, ffn=512,
                            types={"ffn_down": "Q2_K", "*": "Q4_0"})
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_down\.weight is Q2_K.*--weights q4_0"):
        load_model(str(path), use_cache=False, weights="auto")
    model = load_model(str(path), use_cache=False, weights="q8_0")  # asked: requantized, and it says so
    # from float32: q, k, v (and gate, up) fused, so 4 matrices and the lm_head; 3 norms and the f32 table
    assert dict(model.held) == {"Q8_0": 5, "F32": 4}
    assert torch.isfinite(last_logits(model, smollm.tokenizer.encode(PROMPT))).all()


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True, timeout=300)


def test_bad_files_fail_clearly_without_a_traceback(tmp_path, tiny_files):
    good = tiny_files["Q4_K"].read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good[: len(good) - 1000])
    corrupt = tmp_path / "corrupt.gguf"
    data = bytearray(good)
    data[-144 * 3 : -144 * 3 + 2] = np.array([np.inf], dtype=np.float16).tobytes()  # a block's d
    corrupt.write_bytes(bytes(data))
    missing = rewritten(tiny_files["Q4_K"], tmp_path / "missing.gguf", drop=("blk.1.ffn_up.weight",))
    mamba = rewritten(tiny_files["Q4_K"], tmp_path / "mamba.gguf", fields={"general.architecture": "mamba"})
    for path, message in ((truncated, "truncated"), (corrupt, "not a finite number"),
                          (missing, "missing ['layers.1.mlp.gate_up_proj.weight'"), (mamba, "unsupported GGUF architecture 'mamba'")):
        result = run_cli("export", "--model", str(path), "--out", str(tmp_path / "out"))
        assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]
        assert "Traceback" not in result.stderr


def test_the_server_says_what_it_holds(tiny_files):
    """The routes a user asks what is loaded: OpenAI's model list, Ollama's tags and show."""
    import httpx

    from tests.live_server import LiveServer

    model = load_model(str(tiny_files["Q4_K_M"]), use_cache=False, weights="auto")
    with LiveServer(model, name="tiny") as server:
        listed = httpx.get(f"{server.url}/v1/models").json()["data"][0]
        assert listed["tensor_types"] == {"Q4_K": 10, "Q6_K": 5, "F32": 5}
        tags = httpx.get(f"{server.url}/api/tags").json()["models"][0]
        assert tags["details"]["quantization_level"] == "Q4_K" and tags["size"] == model.held_bytes
        shown = httpx.post(f"{server.url}/api/show", json={"model": "tiny"}).json()
        assert shown["tensor_types"] == listed["tensor_types"]
        reply = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 5}).json()
        assert reply["usage"]["completion_tokens"] == 5
