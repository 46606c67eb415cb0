"""Qwen3, SmolLM3, Phi-3 (partial RoPE; longrope; a sliding window) and Mistral against transformers: tiny
random checkpoints that transformers itself writes, loaded and exported by kvserve, run through a real cache."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvcache import REGISTRY, CacheConfig, SessionCache
from models import ModelConfig, UnsupportedModel, load_model
from models import export as export_mod
from models.gguf_config import from_gguf_metadata
from models.hf_config import from_hf_config
from models.export import build_model
from models import fused
from models.fused import NativeQKVRotary, NativeRMSNorm
from models.hf_loader import read_hf
from models.quant import model_kernels_available

from .gguf_files import llama_cpp_source
from .test_models import NO_ROWS, PROMPT, Session, greedy, hf_greedy, run_prompt

ARCHS = ("qwen3", "smollm3", "phi3", "mistral")
# checkpoints of an architecture above with options of their own, named "<arch>-<option>"
VARIANTS = ("phi3-longrope", "phi3-window")
CHECKPOINTS = ARCHS + VARIANTS
# phi3-longrope's factors (exact in float32, as GGUF stores them), and its contexts: both test prompts (21 and 8
# tokens) are longer than the original 6, so transformers rotates them by the long factors, as we do for a
# model whose context (64) passes the original
LONG_FACTORS, SHORT_FACTORS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0), (1.0, 1.25, 1.5, 2.0, 2.5, 3.0)
LONGROPE_CONTEXT, LONGROPE_ORIGINAL = 64, 6
PHI3_WINDOW = 5  # shorter than both test prompts
# fused.py's modules that replace a whole stack of llama blocks (the q4 decoder op; two ops a layer)
WHOLE_STACK = fused.NativeLayers
OTHER_PROMPT = "def fibonacci(n):\n    return"


def write_arch_checkpoint(folder: Path, arch: str, tokenizer_source, seed: int = 0,
                          longrope_context: int = LONGROPE_CONTEXT) -> Path:
    """A random transformers checkpoint of `arch`, 4 layers with GQA, plus SmolLM2's tokenizer. Norm
    weights are random too, so a norm in the wrong place shows: qwen3 with head_dim (32) independent of
    dim / heads (16); smollm3 with layers 0 and 2 NoPE (not the default every fourth); phi3 rotating 12 of
    each head's 16 dims; mistral with head_dim 32 and no sliding window. phi3-longrope is phi3 with longrope
    scaling (Phi-4-mini's kind of config), phi3-window rotates whole heads and attends through a window of 5
    (Phi-3-mini-4k's kind, whose window is 2047); its context is `longrope_context`."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=tokenizer_source.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, pad_token_id=None, rope_theta=10000.0,
    )
    if arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False))
    elif arch == "smollm3":
        cfg = transformers.SmolLM3Config(**common, no_rope_layers=[0, 1, 0, 1], tie_word_embeddings=True)
        model = transformers.SmolLM3ForCausalLM(cfg)
    elif arch == "phi3":
        cfg = transformers.Phi3Config(**common, partial_rotary_factor=0.75, tie_word_embeddings=False)
        model = transformers.Phi3ForCausalLM(cfg)
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**common, head_dim=32, sliding_window=None, tie_word_embeddings=False)
        model = transformers.MistralForCausalLM(cfg)
    elif arch == "phi3-longrope":
        rope = {"rope_type": "longrope", "long_factor": list(LONG_FACTORS), "short_factor": list(SHORT_FACTORS)}
        cfg = transformers.Phi3Config(**{**common, "max_position_embeddings": longrope_context}, rope_scaling=rope,
                                      original_max_position_embeddings=LONGROPE_ORIGINAL, partial_rotary_factor=0.75,
                                      tie_word_embeddings=False)
        model = transformers.Phi3ForCausalLM(cfg)
    elif arch == "phi3-window":
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**common, sliding_window=PHI3_WINDOW,
                                                                     tie_word_embeddings=False))
    else:
        raise ValueError(arch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    return save_checkpoint(model, folder, tokenizer_source)


def save_checkpoint(model, folder: Path, tokenizer_source) -> Path:
    """A transformers model saved with SmolLM2's tokenizer beside it, as a Hugging Face folder."""
    model.save_pretrained(folder)
    tokenizer_source.tokenizer.save(str(folder / "tokenizer.json"))
    meta = tokenizer_source.meta
    # tokenizer_class as SmolLM2's own: llama.cpp's converter then reads tokenizer.json as it is (a qwen3 or
    # phi3 folder would otherwise get Qwen2's pre-tokenizer, or look for a sentencepiece model)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": meta.chat_template, "eos_token": meta.eos_token, "bos_token": meta.bos_token,
        "add_bos_token": False, "tokenizer_class": "GPT2Tokenizer",
    }))
    return folder


def write_gguf_from_hf(folder: Path, out_path: Path, outtype: str = "f32") -> Path:
    """Convert an HF folder to a GGUF file with llama.cpp's own convert_hf_to_gguf.py and the gguf-py beside
    it (the llama-cpp-python sdist's, gguf_files.llama_cpp_source), run by this venv's python."""
    tree = llama_cpp_source()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(tree / "gguf-py"), os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype,
                           "--outfile", str(out_path)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0 and out_path.is_file(), done.stderr[-3000:]
    return out_path


@pytest.fixture(scope="module")
def arch_checkpoints(tmp_path_factory, smollm):
    root = tmp_path_factory.mktemp("archs")
    return {arch: write_arch_checkpoint(root / arch, arch, smollm.tokenizer, seed=20 + i)
            for i, arch in enumerate(CHECKPOINTS)}


def model_pairs(folders: dict):
    """name -> (our LoadedModel at f32, transformers' model) of folders[name], each loaded once, on demand."""
    import transformers

    models = {}

    def get(name):
        if name not in models:
            ours = load_model(str(folders[name]), weights="f32", use_cache=False)
            hf = transformers.AutoModelForCausalLM.from_pretrained(folders[name], dtype=torch.float32).eval()
            models[name] = (ours, hf)
        return models[name]

    return get


@pytest.fixture(scope="module")
def loaded(arch_checkpoints):
    return model_pairs(arch_checkpoints)


def batched_greedy(forward, config, prompts, n):
    """Greedy decode of several prompts side by side, each step one forward over every session."""
    keys = [f"arch-batch-{i}" for i in range(len(prompts))]
    for key in keys:
        REGISTRY.install(key, SessionCache(CacheConfig(config.n_layers, config.n_kv_heads, config.head_dim, 256)))
    try:
        with REGISTRY.active([(k, len(p)) for k, p in zip(keys, prompts)]), torch.no_grad():
            tokens = torch.tensor([[t for p in prompts for t in p]])
            positions = torch.cat([torch.arange(len(p)) for p in prompts]).unsqueeze(1)
            last_rows = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
            logits, _ = forward(tokens, positions, last_rows, NO_ROWS)  # [len(prompts), vocab]
        first = logits
        out = [[] for _ in prompts]
        for i in range(n):
            step = logits.argmax(-1).tolist()
            for o, t in zip(out, step):
                o.append(t)
            with REGISTRY.active([(k, 1) for k in keys]), torch.no_grad():
                positions = torch.tensor([[len(p) + i] for p in prompts])
                logits, _ = forward(torch.tensor([step]), positions, torch.arange(len(prompts)), NO_ROWS)
        return first, out
    finally:
        for key in keys:
            REGISTRY.uninstall(key)


@pytest.mark.parametrize("arch", CHECKPOINTS)
def test_architecture_matches_transformers(loaded, arch):
    """phi3-longrope: its long factors (and attention factor) on both sides, as both prompts pass the original
    context; the short factors would give other logits."""
    model, hf = loaded(arch)
    config = model.config
    assert config.architecture == arch.split("-")[0]
    ids = model.tokenizer.encode(PROMPT)
    matches_transformers(model, hf, ids, [None, [5, 7, len(ids) - 12]])


def matches_transformers(model, hf, ids, chunkings) -> None:
    """All-position logits at 1e-4 for the prompt whole or in each chunking, 20 greedy tokens equal, and two
    prompts of different lengths in one step, each as it is alone."""
    fwd, config = model.forward, model.config
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]  # [n, vocab]
    for chunks in chunkings:
        with Session(config) as session, torch.no_grad():
            ours = run_prompt(session.committing(fwd), config, ids, chunks, all_logits=True)
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    expected = hf_greedy(hf, ids, 20)
    assert greedy(fwd, config, ids, 20) == expected
    other = model.tokenizer.encode(OTHER_PROMPT)
    with torch.no_grad():
        other_ref = hf(torch.tensor([other])).logits[0, -1]
    first, tokens = batched_greedy(fwd, config, [ids, other], 12)
    torch.testing.assert_close(first, torch.stack([ref[-1], other_ref]), atol=1e-4, rtol=0)
    assert tokens == [expected[:12], hf_greedy(hf, other, 12)]


@pytest.mark.parametrize("arch", CHECKPOINTS)
def test_exported_program_attends_once_a_layer(loaded, arch):
    model, _ = loaded(arch)
    calls = [n for n in model.forward.module.graph.nodes if "update_and_attend" in str(n.target)]
    assert len(calls) == model.config.n_layers == 4


def test_configs_read_what_each_architecture_differs_by(arch_checkpoints):
    configs = {arch: read_hf(arch_checkpoints[arch])[0] for arch in ARCHS}
    assert configs["qwen3"].head_dim == 32 and configs["qwen3"].dim // configs["qwen3"].n_heads == 16
    assert not configs["qwen3"].qkv_bias
    assert configs["smollm3"].layers_without_rope == (0, 2)  # HF's flags [0, 1, 0, 1]: 1 rotates
    assert configs["smollm3"].tie_embeddings
    assert configs["phi3"].rope_dim == configs["phi3"].rotary_dim == 12 and configs["phi3"].head_dim == 16
    assert configs["mistral"].head_dim == 32 and configs["mistral"].rotary_dim == 32
    longrope, window = (read_hf(arch_checkpoints[name])[0] for name in VARIANTS)
    assert longrope.rope_freq_factors == LONG_FACTORS and longrope.rotary_dim == 12 and longrope.rope_scaling is None
    factor = LONGROPE_CONTEXT / LONGROPE_ORIGINAL  # transformers' attention factor, from the two contexts
    assert longrope.rope_attn_factor == pytest.approx(math.sqrt(1 + math.log(factor) / math.log(LONGROPE_ORIGINAL)))
    assert window.layer_windows == (PHI3_WINDOW,) * 4 and window.rotary_dim == window.head_dim
    for config in (*configs.values(), longrope, window):
        assert ModelConfig.from_json(config.to_json()) == config  # the tuples and Nones come back as they were


def _hf_config(folder: Path, **changes) -> dict:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    return cfg


def test_sliding_windows_are_refused_where_not_implemented(arch_checkpoints):
    # Mistral's window is honoured (tests/models/test_gemma.py), Phi-3's too (tests/models/test_phi3.py); one at
    # least as long as the context never bites
    mistral = arch_checkpoints["mistral"]
    assert from_hf_config(_hf_config(mistral, sliding_window=64)).layer_windows == (64,) * 4
    assert from_hf_config(_hf_config(mistral, sliding_window=512)).layer_windows == ()
    # elsewhere a window is refused. Qwen3 applies its window only where layer_types says so
    qwen3 = arch_checkpoints["qwen3"]
    assert from_hf_config(_hf_config(qwen3, sliding_window=64)).architecture == "qwen3"
    swa_types = ["full_attention", "sliding_attention"] * 2
    with pytest.raises(UnsupportedModel, match="sliding_window 64"):
        from_hf_config(_hf_config(qwen3, sliding_window=64, use_sliding_window=True, layer_types=swa_types))
    # GGUF metadata: the same refusal by llama.cpp's keys
    meta = {"general.architecture": "qwen3", "qwen3.block_count": 4, "qwen3.embedding_length": 64,
            "qwen3.attention.head_count": 4, "qwen3.feed_forward_length": 128, "qwen3.vocab_size": 100,
            "qwen3.context_length": 4096}
    with pytest.raises(UnsupportedModel, match="qwen3.attention.sliding_window 2047"):
        from_gguf_metadata({**meta, "qwen3.attention.sliding_window": 2047}, True)


def test_options_only_where_a_decoder_honours_them():
    base = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, vocab_size=100)
    with pytest.raises(UnsupportedModel, match="phi3 only"):
        ModelConfig(architecture="llama", rope_dim=8, **base)
    with pytest.raises(UnsupportedModel, match="smollm3 only"):
        ModelConfig(architecture="qwen3", layers_without_rope=(1,), **base)
    with pytest.raises(UnsupportedModel, match="layers_without_rope"):
        ModelConfig(architecture="smollm3", layers_without_rope=(2,), **base)


@pytest.mark.skipif(not model_kernels_available(), reason="the C++/AVX2 kernels are unavailable")
@pytest.mark.parametrize("arch", CHECKPOINTS)
def test_native_modules_keep_each_architectures_math(arch_checkpoints, arch, monkeypatch):
    """q4 weights: fused.py's native stand-ins replace only modules that compute the same math. The same
    q4 model without them is the reference; Mistral and phi3-window (Llama's blocks, windowed or not) show a
    whole-stack native module does swap in where it fits."""
    config, state, _ = read_hf(arch_checkpoints[arch])
    native = build_model(config, state, torch.float32, weights="q4")
    monkeypatch.setattr(export_mod, "use_native_modules", lambda model: model)
    plain = build_model(config, state, torch.float32, weights="q4")
    kinds = {type(m) for m in native.modules()}
    assert any(isinstance(m, WHOLE_STACK) for m in native.modules()) == (arch in ("mistral", "phi3-window"))
    assert NativeRMSNorm in kinds
    if config.rotary_dim < config.head_dim:
        assert NativeQKVRotary not in kinds  # it rotates whole heads
    if arch == "qwen3":  # the q/k norms run natively too, over each head's last dim
        assert all(type(b.self_attn.q_norm) is NativeRMSNorm for b in native.layers)
    ids = torch.tensor(list(range(5, 40)))
    outs = []
    for model in (native, plain):
        with Session(config) as session, torch.no_grad():
            outs.append(run_prompt(session.committing(model), config, ids.tolist(), [20, 15], all_logits=True))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "mistral", "phi3-longrope", "phi3-window"])
def test_llama_cpp_gguf_files_match_transformers(loaded, arch_checkpoints, arch, tmp_path):
    """llama.cpp's own conversion of each tiny folder loads as the folder does: its metadata reads as the HF
    config, and its logits match transformers'. SmolLM3 is left out: llama.cpp hard-codes its NoPE layers
    as every fourth, which this checkpoint's are not. phi3-longrope: the file's rope_factors_long (chosen, as
    from the folder, since its context passes rope.scaling.original_context_length) and attn_factor, compared
    with transformers' long factors; phi3-window: the file's attention.sliding_window."""
    path = write_gguf_from_hf(arch_checkpoints[arch], tmp_path / f"{arch}.gguf")
    ours = load_model(str(path), weights="f32", use_cache=False)
    hf_config = read_hf(arch_checkpoints[arch])[0]
    assert ours.config.architecture == ("llama" if arch == "mistral" else arch.split("-")[0])  # Mistral's say llama
    for field in ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "rope_dim", "layers_without_rope",
                  "tie_embeddings", "qkv_bias", "max_context", "rope_freq_factors", "layer_windows"):
        assert getattr(ours.config, field) == getattr(hf_config, field), field
    assert ours.config.rope_attn_factor == pytest.approx(hf_config.rope_attn_factor)  # a float32 in the file
    _, hf = loaded(arch)
    ids = ours.tokenizer.encode(PROMPT)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    with Session(ours.config) as session, torch.no_grad():
        got = run_prompt(session.committing(ours.forward), ours.config, ids, all_logits=True)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
