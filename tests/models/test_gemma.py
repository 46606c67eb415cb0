"""Gemma 3 and Gemma 2 (sliding and full layers), and Mistral with a sliding window, against transformers: tiny
random checkpoints with windows of 8, so that every prompt here crosses them."""
import dataclasses
import json

import pytest
import torch

from models import UnsupportedModel, load_model
from models import export as export_mod
from models.gguf_config import from_gguf_metadata
from models.hf_config import from_hf_config
from models.export import build_model
from models.fused import NativeLayers, NativeRMSNorm
from models.hf_loader import read_hf
from models.quant import model_kernels_available

from .test_architectures import matches_transformers, model_pairs, save_checkpoint, write_gguf_from_hf
from .test_models import PROMPT, Session, run_prompt

WINDOW = 8
LONG_PROMPT = PROMPT + " there lived a small fox who counted the stars every night and never slept."
S, F = "sliding_attention", "full_attention"
KINDS = ("gemma3", "gemma2", "mistral")


def write_checkpoint(folder, kind, tokenizer_source, seed=0, **changes):
    """A random transformers checkpoint of `kind` (4 layers, GQA, head_dim 16) plus SmolLM2's tokenizer.
    Gemma 3: layers sliding, full, sliding, sliding; its full layers' RoPE linearly scaled, the sliding ones on
    another base; query_pre_attn_scalar not head_dim; capped logits. Gemma 2: its default alternation, capped
    attention scores and logits. Mistral: every layer windowed. Norms and q/k projections are scaled up from
    transformers' init, so a misplaced norm shows and attention is peaked enough that a window's edge does."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=tokenizer_source.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=None, sliding_window=WINDOW)
    if kind == "gemma3":
        rope = {F: {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0}, S: {"rope_type": "default", "rope_theta": 1000.0}}
        settings = dict(layer_types=[S, F, S, S], query_pre_attn_scalar=24, rope_parameters=rope,
                        final_logit_softcapping=3.0, tie_word_embeddings=True)
        cfg = transformers.Gemma3TextConfig(**{**common, **settings, **changes})
        model = transformers.Gemma3ForCausalLM(cfg)
    elif kind == "gemma2":
        settings = dict(query_pre_attn_scalar=16, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**{**common, **settings, **changes}))
    else:
        cfg = transformers.MistralConfig(**{**common, "rope_theta": 10000.0, "tie_word_embeddings": False, **changes})
        model = transformers.MistralForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma's norms scale by 1 + w, Mistral's by w
                p.normal_(0.0 if kind.startswith("gemma") else 1.0, 0.3)
            elif "q_proj" in name or "k_proj" in name:
                p.normal_(0.0, 0.2)
    return save_checkpoint(model, folder, tokenizer_source)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smollm):
    root = tmp_path_factory.mktemp("windowed")
    return {kind: write_checkpoint(root / kind, kind, smollm.tokenizer, seed=40 + i) for i, kind in enumerate(KINDS)}


@pytest.fixture(scope="module")
def loaded(checkpoints):
    return model_pairs(checkpoints)


@pytest.mark.parametrize("kind", KINDS)
def test_windowed_models_match_transformers(loaded, kind):
    model, hf = loaded(kind)
    config = model.config
    assert config.architecture == kind
    ids = model.tokenizer.encode(LONG_PROMPT)
    assert len(ids) > 3 * WINDOW
    matches_transformers(model, hf, ids, [None, [5, 7, len(ids) - 12], [WINDOW + 3, 1, len(ids) - WINDOW - 4]])


def test_the_window_bites(loaded, checkpoints):
    """The same Gemma 3 with windows past any history gives the same logits for the first WINDOW tokens and
    others after them: the tests above see the window, not only what precedes its edge."""
    model, _ = loaded("gemma3")
    config, state, _ = read_hf(checkpoints["gemma3"])
    wide = dataclasses.replace(config, layer_windows=tuple(10**6 if w else 0 for w in config.layer_windows))
    unwindowed = build_model(wide, state, torch.float32)
    ids = model.tokenizer.encode(LONG_PROMPT)
    outs = []
    for forward in (model.forward, unwindowed):
        with Session(config) as session, torch.no_grad():
            outs.append(run_prompt(session.committing(forward), config, ids, all_logits=True))
    torch.testing.assert_close(outs[0][:WINDOW], outs[1][:WINDOW], atol=1e-5, rtol=0)
    assert (outs[0][WINDOW:] - outs[1][WINDOW:]).abs().max() > 1e-2


def _hf_config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("kind", KINDS)
def test_exported_program_attends_once_a_layer_with_its_window(loaded, kind):
    model, _ = loaded(kind)
    calls = [n for n in model.forward.module.graph.nodes if "update_and_attend" in str(n.target)]
    assert len(calls) == model.config.n_layers == 4
    windows = {"gemma3": (WINDOW, 0, WINDOW, WINDOW), "gemma2": (WINDOW, 0, WINDOW, 0), "mistral": (WINDOW,) * 4}[kind]
    assert model.config.layer_windows == windows

    def arg(node, at, name, default):  # the program leaves out arguments at their schema default
        return node.args[at] if len(node.args) > at else node.kwargs.get(name, default)

    assert tuple(arg(n, 7, "window", 0) for n in calls) == windows
    assert tuple(arg(n, 8, "softcap", 0.0) for n in calls) == ((2.0,) * 4 if kind == "gemma2" else (0.0,) * 4)


def test_gemma3_gguf_from_llama_cpp_matches_transformers(smollm, tmp_path):
    """llama.cpp's own conversion: its norms hold 1 + w already, its layers follow llama.cpp's fixed layout
    (every sixth full), and its metadata carries no query_pre_attn_scalar (llama.cpp scales by head_dim), so
    this checkpoint is six layers in that layout with query_pre_attn_scalar = head_dim."""
    import transformers

    folder = write_checkpoint(tmp_path / "gemma3-six", "gemma3", smollm.tokenizer, seed=50, num_hidden_layers=6,
                              layer_types=[S] * 5 + [F], query_pre_attn_scalar=16, final_logit_softcapping=5.0)
    path = write_gguf_from_hf(folder, tmp_path / "gemma3.gguf")
    ours = load_model(str(path), weights="f32", use_cache=False)
    hf_config = read_hf(folder)[0]
    assert ours.config.architecture == "gemma3"
    for field in ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "tie_embeddings", "max_context", "layer_windows",
                  "rope_theta", "rope_scaling", "rope_theta_local", "attention_scale", "final_logit_softcap"):
        assert getattr(ours.config, field) == getattr(hf_config, field), field
    assert ours.config.norm_eps == pytest.approx(hf_config.norm_eps)  # a float32 in the file
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = ours.tokenizer.encode(LONG_PROMPT)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    with Session(ours.config) as session, torch.no_grad():
        got = run_prompt(session.committing(ours.forward), ours.config, ids, [13, len(ids) - 13], all_logits=True)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_configs_read_gemmas_older_files_and_gguf_metadata():
    # Gemma 3 1B's config.json as transformers 4.50 wrote it: no layer_types, no tie_word_embeddings
    old = {"architectures": ["Gemma3ForCausalLM"], "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
           "hidden_size": 1152, "intermediate_size": 6912, "max_position_embeddings": 32768, "num_attention_heads": 4,
           "num_hidden_layers": 26, "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
           "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
           "sliding_window_pattern": 6, "vocab_size": 262144}
    config = from_hf_config(old)
    assert config.tie_embeddings and config.attention_scale == 256**-0.5
    assert config.layer_windows == tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(26))
    assert (config.rope_theta, config.rope_theta_local, config.rope_scaling) == (1e6, 1e4, None)
    scaled = from_hf_config({**old, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})  # Gemma 3 4B's text
    assert scaled.rope_scaling.kind == "linear" and scaled.rope_scaling.factor == 8.0
    with pytest.raises(UnsupportedModel, match="bidirectional"):
        from_hf_config({**old, "use_bidirectional_attention": True})
    with pytest.raises(UnsupportedModel, match="hidden_activation"):
        from_hf_config({**old, "hidden_activation": "silu"})
    gemma2 = from_hf_config({**old, "architectures": ["Gemma2ForCausalLM"], "sliding_window_pattern": 2})
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (50.0, 30.0)  # transformers' defaults
    assert gemma2.layer_windows[:4] == (512, 0, 512, 0)

    # GGUF: llama.cpp's keys and its defaults (every sixth layer full in Gemma 3, every second in Gemma 2)
    meta = {"general.architecture": "gemma3", "gemma3.block_count": 12, "gemma3.embedding_length": 64,
            "gemma3.attention.head_count": 4, "gemma3.attention.key_length": 32, "gemma3.feed_forward_length": 128,
            "gemma3.vocab_size": 100, "gemma3.context_length": 4096, "gemma3.rope.freq_base": 1e6,
            "gemma3.attention.sliding_window": 512}
    config = from_gguf_metadata(meta, False)
    assert config.layer_windows == (512,) * 5 + (0,) + (512,) * 5 + (0,)
    assert (config.rope_theta_local, config.attention_scale, config.final_logit_softcap) == (1e4, 32**-0.5, None)
    flags = [True, False] * 6
    assert from_gguf_metadata({**meta, "gemma3.attention.sliding_window_pattern": flags}, False).layer_windows == (512, 0) * 6
    assert from_gguf_metadata({**meta, "gemma3.attention.sliding_window": 0}, False).layer_windows == ()
    g2 = {k.replace("gemma3", "gemma2"): v for k, v in meta.items() if "sliding" not in k} | {"general.architecture": "gemma2"}
    config = from_gguf_metadata({**g2, "gemma2.block_count": 46}, False)  # 27B: scaled by (dim / heads) ** -0.5
    assert config.layer_windows == (4096, 0) * 23 and config.attention_scale == 16**-0.5
    assert (config.attn_logit_softcap, config.final_logit_softcap, config.rope_theta_local) == (50.0, 30.0, 1e6)
    # the windows are refused where the decoder has none, as before
    with pytest.raises(UnsupportedModel, match="llama.attention.sliding_window 64"):
        from_gguf_metadata({k.replace("gemma3", "llama"): v for k, v in meta.items()} | {
            "general.architecture": "llama", "llama.attention.sliding_window": 64}, True)


def test_a_mistral_window_loads_and_others_still_refuse(checkpoints):
    assert read_hf(checkpoints["mistral"])[0].layer_windows == (WINDOW,) * 4
    wide = {**_hf_config(checkpoints["mistral"]), "sliding_window": 512}  # as long as the context: never bites
    assert from_hf_config(wide).layer_windows == ()
    cfg = {**_hf_config(checkpoints["mistral"]), "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True}
    with pytest.raises(UnsupportedModel, match="sliding_window 8 .* implemented for mistral, phi3, .*gpt-oss only"):
        from_hf_config(cfg)


@pytest.mark.skipif(not model_kernels_available(), reason="the C++/AVX2 kernels are unavailable")
@pytest.mark.parametrize("kind", ["gemma3", "mistral"])
def test_native_modules_keep_the_windowed_math(checkpoints, kind, monkeypatch):
    """q4 weights: Gemma's folded norms run as the native RMSNorm, its blocks stay its own; Mistral's whole stack
    runs natively with each layer's window. The same q4 model without native modules is the reference."""
    config, state, _ = read_hf(checkpoints[kind])
    native = build_model(config, state, torch.float32, weights="q4")
    monkeypatch.setattr(export_mod, "use_native_modules", lambda model: model)
    plain = build_model(config, state, torch.float32, weights="q4")
    stacks = [m for m in native.modules() if isinstance(m, NativeLayers)]
    assert len(stacks) == (kind == "mistral")
    if kind == "gemma3":
        assert all(type(b.pre_feedforward_layernorm) is NativeRMSNorm for b in native.layers)
    else:
        assert stacks[0].windows == [WINDOW] * 4
    ids = list(range(5, 45))
    outs = []
    for model in (native, plain):
        with Session(config) as session, torch.no_grad():
            outs.append(run_prompt(session.committing(model), config, ids, [20, 20], all_logits=True))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
