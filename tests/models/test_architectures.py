"""Qwen3, SmolLM3, Phi-3 (partial RoPE) and Mistral against transformers: tiny random checkpoints that
transformers itself writes, loaded and exported by kvserve, run through a real cache."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvcache import REGISTRY, CacheConfig, SessionCache
from models import ModelConfig, UnsupportedModel, load_model
from models import export as export_mod
from models.config import from_gguf_metadata, from_hf_config
from models.export import build_model
from models import fused
from models.fused import NativeQKVRotary, NativeRMSNorm
from models.hf_loader import read_hf
from models.quant import model_kernels_available

from .gguf_files import llama_cpp_source
from .test_models import NO_ROWS, PROMPT, Session, greedy, hf_greedy, run_prompt

ARCHS = ("qwen3", "smollm3", "phi3", "mistral")
# fused.py's modules that replace a whole stack of llama blocks (the q4 decoder op; two ops a layer)
WHOLE_STACK = fused.NativeLayers
OTHER_PROMPT = "def fibonacci(n):\n    return"


def write_arch_checkpoint(folder: Path, arch: str, tokenizer_source, seed: int = 0) -> Path:
    """A random transformers checkpoint of `arch`, 4 layers with GQA, plus SmolLM2's tokenizer. Norm
    weights are random too, so a norm in the wrong place shows: qwen3 with head_dim (32) independent of
    dim / heads (16); smollm3 with layers 0 and 2 NoPE (not the default every fourth); phi3 rotating 12 of
    each head's 16 dims; mistral with head_dim 32 and no sliding window."""
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
    return {arch: write_arch_checkpoint(root / arch, arch, smollm.tokenizer, seed=20 + i) for i, arch in enumerate(ARCHS)}


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


@pytest.mark.parametrize("arch", ARCHS)
def test_architecture_matches_transformers(loaded, arch):
    model, hf = loaded(arch)
    config = model.config
    assert config.architecture == arch
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


@pytest.mark.parametrize("arch", ARCHS)
def test_exported_program_attends_once_a_layer(loaded, arch):
    model, _ = loaded(arch)
    calls = [n for n in model.forward.graph.nodes if "update_and_attend" in str(n.target)]
    assert len(calls) == model.config.n_layers == 4


def test_configs_read_what_each_architecture_differs_by(arch_checkpoints):
    configs = {arch: read_hf(arch_checkpoints[arch])[0] for arch in ARCHS}
    assert configs["qwen3"].head_dim == 32 and configs["qwen3"].dim // configs["qwen3"].n_heads == 16
    assert not configs["qwen3"].qkv_bias
    assert configs["smollm3"].layers_without_rope == (0, 2)  # HF's flags [0, 1, 0, 1]: 1 rotates
    assert configs["smollm3"].tie_embeddings
    assert configs["phi3"].rope_dim == configs["phi3"].rotary_dim == 12 and configs["phi3"].head_dim == 16
    assert configs["mistral"].head_dim == 32 and configs["mistral"].rotary_dim == 32
    for config in configs.values():
        assert ModelConfig.from_json(config.to_json()) == config  # the tuples and Nones come back as they were


def _hf_config(folder: Path, **changes) -> dict:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    return cfg


def test_sliding_windows_and_longrope_are_refused(arch_checkpoints):
    # Mistral's window is honoured (tests/models/test_gemma.py); one at least as long as the context never bites
    mistral = arch_checkpoints["mistral"]
    assert from_hf_config(_hf_config(mistral, sliding_window=64)).layer_windows == (64,) * 4
    assert from_hf_config(_hf_config(mistral, sliding_window=512)).layer_windows == ()
    # elsewhere a window is refused. Qwen3 applies its window only where layer_types says so
    qwen3 = arch_checkpoints["qwen3"]
    assert from_hf_config(_hf_config(qwen3, sliding_window=64)).architecture == "qwen3"
    swa_types = ["full_attention", "sliding_attention"] * 2
    with pytest.raises(UnsupportedModel, match="sliding_window 64"):
        from_hf_config(_hf_config(qwen3, sliding_window=64, use_sliding_window=True, layer_types=swa_types))
    phi3 = arch_checkpoints["phi3"]
    with pytest.raises(UnsupportedModel, match="sliding_window 100"):
        from_hf_config(_hf_config(phi3, sliding_window=100))
    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0] * 6, "long_factor": [2.0] * 6, "original_max_position_embeddings": 256}
    with pytest.raises(UnsupportedModel, match="longrope"):
        from_hf_config(_hf_config(phi3, rope_parameters=longrope))
    # GGUF metadata: the same refusals by llama.cpp's keys
    meta = {"general.architecture": "phi3", "phi3.block_count": 4, "phi3.embedding_length": 64,
            "phi3.attention.head_count": 4, "phi3.feed_forward_length": 128, "phi3.vocab_size": 100,
            "phi3.context_length": 4096, "phi3.rope.dimension_count": 12}
    assert from_gguf_metadata(meta, True).rope_dim == 12
    assert from_gguf_metadata({**meta, "phi3.attention.sliding_window": 0}, True).head_dim == 16  # Phi-4: none
    with pytest.raises(UnsupportedModel, match="phi3.attention.sliding_window 2047"):
        from_gguf_metadata({**meta, "phi3.attention.sliding_window": 2047}, True)
    with pytest.raises(UnsupportedModel, match="longrope"):
        from_gguf_metadata({**meta, "phi3.rope.scaling.attn_factor": 1.19}, True)


def test_options_only_where_a_decoder_honours_them():
    base = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, vocab_size=100)
    with pytest.raises(UnsupportedModel, match="phi3 only"):
        ModelConfig(architecture="llama", rope_dim=8, **base)
    with pytest.raises(UnsupportedModel, match="smollm3 only"):
        ModelConfig(architecture="qwen3", layers_without_rope=(1,), **base)
    with pytest.raises(UnsupportedModel, match="layers_without_rope"):
        ModelConfig(architecture="smollm3", layers_without_rope=(2,), **base)


@pytest.mark.skipif(not model_kernels_available(), reason="the C++/AVX2 kernels are unavailable")
@pytest.mark.parametrize("arch", ARCHS)
def test_native_modules_keep_each_architectures_math(arch_checkpoints, arch, monkeypatch):
    """q4 weights: fused.py's native stand-ins replace only modules that compute the same math. The same
    q4 model without them is the reference; Mistral (Llama's blocks) shows a whole-stack native module
    does swap in where it fits."""
    config, state, _ = read_hf(arch_checkpoints[arch])
    native = build_model(config, state, torch.float32, weights="q4")
    monkeypatch.setattr(export_mod, "use_native_modules", lambda model: model)
    plain = build_model(config, state, torch.float32, weights="q4")
    kinds = {type(m) for m in native.modules()}
    assert any(isinstance(m, WHOLE_STACK) for m in native.modules()) == (arch == "mistral")
    assert NativeRMSNorm in kinds
    if arch == "phi3":
        assert NativeQKVRotary not in kinds  # it rotates whole heads
    if arch == "qwen3":  # the q/k norms run natively too, over each head's last dim
        assert all(type(b.self_attn.q_norm) is NativeRMSNorm for b in native.layers)
    ids = torch.tensor(list(range(5, 40)))
    outs = []
    for model in (native, plain):
        with Session(config) as session, torch.no_grad():
            outs.append(run_prompt(session.committing(model), config, ids.tolist(), [20, 15], all_logits=True))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "mistral"])
def test_llama_cpp_gguf_files_match_transformers(loaded, arch_checkpoints, arch, tmp_path):
    """llama.cpp's own conversion of each tiny folder loads as the folder does: its metadata reads as the HF
    config, and its logits match transformers'. SmolLM3 is left out: llama.cpp hard-codes its NoPE layers
    as every fourth, which this checkpoint's are not."""
    path = write_gguf_from_hf(arch_checkpoints[arch], tmp_path / f"{arch}.gguf")
    ours = load_model(str(path), weights="f32", use_cache=False)
    hf_config = read_hf(arch_checkpoints[arch])[0]
    assert ours.config.architecture == ("llama" if arch == "mistral" else arch)  # Mistral's files say llama
    for field in ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "rope_dim", "layers_without_rope",
                  "tie_embeddings", "qkv_bias", "max_context"):
        assert getattr(ours.config, field) == getattr(hf_config, field), field
    _, hf = loaded(arch)
    ids = ours.tokenizer.encode(PROMPT)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    with Session(ours.config) as session, torch.no_grad():
        got = run_prompt(session.committing(ours.forward), ours.config, ids, all_logits=True)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
