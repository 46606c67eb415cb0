"""How each layer attends, read from a config.json or GGUF metadata into ModelConfig's fields: its window
(Mistral's and Phi-3's, on every layer; Gemma's, on the sliding_attention layers), and Gemma's RoPE bases,
attention scale and soft caps. Windows on any other architecture are refused.

A window w means what transformers' mask means by sliding_window (masking_utils.sliding_window_overlay:
kv > q - w), for Phi-3 as for Mistral: a token attends itself and the w - 1 before it. So Phi-3-mini-4k's 2047
attends 2047 tokens; flash-attention paths that passed window_size (w, w) attended 2048 (vLLM#4380), until
transformers#39408 made its flash path agree with the mask.

Plain data, as config.py is; hf_config.py and gguf_config.py call in here.
"""
from __future__ import annotations

from typing import Any

from .config import WINDOWED_ARCHITECTURES, UnsupportedModel
from .hf_config import hf_rope_scaling

GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
# the architectures whose window, where set, is on every layer
EVERY_LAYER_WINDOWED = ("mistral", "phi3")

# transformers' defaults for the fields older config.json files leave out (Gemma 3's, written by transformers
# 4.50, state neither tie_word_embeddings nor layer_types)
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(head_dim=256, rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=8192,
                   query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=2,
                   final_logit_softcapping=30.0, attn_logit_softcapping=50.0, hidden_activation="gelu_pytorch_tanh"),
    "gemma3": dict(head_dim=256, rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=131072,
                   query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6,
                   rope_local_base_freq=10000.0, final_logit_softcapping=None, hidden_activation="gelu_pytorch_tanh"),
}
# the RoPE base of the full-attention layers where a config.json gives none (Gemma3TextConfig.default_theta)
HF_GLOBAL_THETA = {"gemma2": 10000.0, "gemma3": 1_000_000.0}
# llama.cpp's layouts when a GGUF file states none: every layer windowed but each n-th
GGUF_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}
# llama.cpp's 27B models scale queries by (dim / heads) ** -0.5 instead of head_dim ** -0.5; GGUF files do not
# say so, llama.cpp knows them by their layer count (as gemma_pytorch's config does)
GGUF_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _positive(value) -> float | None:
    return float(value) if value else None


def refuse_sliding_window(window, max_context: int, source: str) -> None:
    """Where the decoder has no sliding window: one shorter than the context would change which positions a
    token attends to, so refuse it; one at least as long as the context never bites."""
    if window is not None and 0 < int(window) < max_context:
        raise UnsupportedModel(f"{source} {window} is shorter than the context ({max_context}): sliding-window "
                               f"attention is implemented for {', '.join(WINDOWED_ARCHITECTURES)} only")


def hf_sliding_window(cfg: dict[str, Any]):
    """The window transformers applies to some layer, or None. Qwen2/3 and SmolLM3 apply theirs only where
    layer_types says sliding_attention (or use_sliding_window, in older files); Mistral and Phi-3 wherever
    sliding_window is set."""
    if cfg.get("layer_types") is not None:
        return cfg.get("sliding_window") if "sliding_attention" in cfg["layer_types"] else None
    if "use_sliding_window" in cfg:
        return cfg.get("sliding_window") if cfg["use_sliding_window"] else None
    return cfg.get("sliding_window")


def hf_attention_options(cfg: dict[str, Any], arch: str, n_layers: int, max_context: int) -> dict[str, Any]:
    """ModelConfig's window and Gemma fields from a config.json (HF_DEFAULTS already under it)."""
    if arch in GEMMA_ARCHITECTURES:
        return hf_gemma_options(cfg, arch, n_layers)
    if arch == "gpt-oss":  # a window on the sliding_attention layers
        types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
        return {"layer_windows": _windows(types, cfg.get("sliding_window"), n_layers, "config.json")}
    return every_layer_window(hf_sliding_window(cfg), arch, n_layers, max_context, "config.json sliding_window")


def gguf_attention_options(meta: dict[str, Any], arch: str, n_layers: int, dim: int, n_heads: int,
                           max_context: int) -> dict[str, Any]:
    """ModelConfig's window and Gemma fields from GGUF metadata."""
    if arch in GEMMA_ARCHITECTURES:
        return gguf_gemma_options(meta, arch, n_layers, dim, n_heads)
    if arch == "gpt-oss":  # llama.cpp's pattern for it: every even layer windowed (load_swa_pattern(ml, 2))
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
        return {"layer_windows": _windows(types, meta.get(f"{arch}.attention.sliding_window"), n_layers, "GGUF")}
    # Mistral's files say llama, whose llama.cpp decoder reads no window. phi3's converter writes config.json's
    # sliding_window as it is (0 for none, Phi-4), which we honour as transformers does; llama.cpp itself runs
    # Phi-3 without it for now (src/models/phi3.cpp: "Phi SWA is currently disabled")
    key = f"{arch}.attention.sliding_window"
    return every_layer_window(meta.get(key), arch, n_layers, max_context, key)


def every_layer_window(window, arch: str, n_layers: int, max_context: int, source: str) -> dict[str, Any]:
    """A window shorter than the context on every layer, for the architectures that have one (EVERY_LAYER_WINDOWED),
    refused on the others; {} where it never bites."""
    if arch in EVERY_LAYER_WINDOWED and window is not None and 0 < int(window) < max_context:
        return {"layer_windows": (int(window),) * n_layers}
    refuse_sliding_window(window, max_context, source)
    return {}


def _windows(types: list[str], window, n_layers: int, source: str) -> tuple[int, ...]:
    if len(types) != n_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise UnsupportedModel(f"{source}: layer_types must name sliding_attention or full_attention for each of "
                               f"{n_layers} layers, got {types}")
    if "sliding_attention" not in types:
        return ()
    if not window or int(window) <= 0:
        raise UnsupportedModel(f"{source}: sliding_attention layers need a positive sliding_window, got {window!r}")
    return tuple(int(window) if t == "sliding_attention" else 0 for t in types)


def hf_gemma_options(cfg: dict[str, Any], arch: str, n_layers: int) -> dict[str, Any]:
    """ModelConfig's Gemma fields from a config.json (HF_DEFAULTS already under it)."""
    if cfg.get("hidden_activation") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModel(f"{arch} hidden_activation {cfg.get('hidden_activation')!r}: only the tanh-approximated "
                               "GELU (gelu_pytorch_tanh) is implemented")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModel(f"{arch} use_bidirectional_attention (EmbeddingGemma) is not supported")
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg["sliding_window_pattern"])
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    rope = cfg.get("rope_parameters") or {}
    if "full_attention" in rope:  # transformers 5 writes one RoPE per layer type
        full = rope["full_attention"]
        theta, scaling = hf_rope_scaling({"rope_parameters": full, "rope_theta": full.get("rope_theta", HF_GLOBAL_THETA[arch])})
        local = rope.get("sliding_attention") or {}
        local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModel(f"{arch} sliding_attention rope_type {local['rope_type']!r}: the windowed layers' "
                                   "RoPE must be unscaled")
    else:  # one RoPE (Gemma 2), or Gemma 3's older files: rope_theta, rope_scaling and rope_local_base_freq
        flat = cfg.get("rope_scaling") or rope
        theta, scaling = hf_rope_scaling({**cfg, "rope_theta": cfg.get("rope_theta", flat.get("rope_theta", HF_GLOBAL_THETA[arch]))})
        local_theta = float(cfg.get("rope_local_base_freq", theta))
    return dict(
        rope_theta=theta,
        rope_scaling=scaling,
        rope_theta_local=local_theta,
        layer_windows=_windows(types, cfg.get("sliding_window"), n_layers, "config.json"),
        attention_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5,
        final_logit_softcap=_positive(cfg.get("final_logit_softcapping")),
        # transformers' Gemma 3 attention never applies attn_logit_softcapping, whatever the config says
        attn_logit_softcap=_positive(cfg.get("attn_logit_softcapping")) if arch == "gemma2" else None,
    )


def gguf_gemma_options(meta: dict[str, Any], arch: str, n_layers: int, dim: int, n_heads: int) -> dict[str, Any]:
    """ModelConfig's Gemma fields from GGUF metadata, as llama.cpp reads them (src/models/gemma2.cpp, gemma3.cpp).
    Its converter wrote the norm weights with Gemma's 1 added already."""
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    window = int(meta.get(f"{arch}.attention.sliding_window") or (4096 if arch == "gemma2" else 0))
    windows: tuple[int, ...] = ()
    if window > 0:
        pattern = meta.get(f"{arch}.attention.sliding_window_pattern", GGUF_SLIDING_PATTERN[arch])
        if isinstance(pattern, (list, tuple)):  # one flag a layer, true where it is windowed
            flags = [bool(x) for x in pattern]
        else:
            flags = [int(pattern) == 0 or i % int(pattern) < int(pattern) - 1 for i in range(n_layers)]
        if len(flags) != n_layers:
            raise UnsupportedModel(f"{arch}.attention.sliding_window_pattern has {len(flags)} flags for {n_layers} layers")
        windows = tuple(window if f else 0 for f in flags)
    head_dim = int(meta.get(f"{arch}.attention.key_length") or dim // n_heads)
    scale = (dim // n_heads) ** -0.5 if n_layers == GGUF_27B_LAYERS[arch] else head_dim ** -0.5
    return dict(
        rope_theta_local=float(meta.get(f"{arch}.rope.freq_base_swa", theta if arch == "gemma2" else 10000.0)),
        layer_windows=windows,
        attention_scale=scale,
        # llama.cpp's defaults: Gemma 2 caps both at its released values, Gemma 3 only where the file says so
        final_logit_softcap=_positive(meta.get(f"{arch}.final_logit_softcapping", 30.0 if arch == "gemma2" else None)),
        attn_logit_softcap=_positive(meta.get(f"{arch}.attn_logit_softcapping", 50.0)) if arch == "gemma2" else None,
    )
