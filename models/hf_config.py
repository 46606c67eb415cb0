"""ModelConfig from a Hugging Face config.json: its architecture's name, RoPE, and each decoder's options."""
from __future__ import annotations

from typing import Any

from .config import ModelConfig, RopeScaling, UnsupportedModel

HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
    "SmolLM3ForCausalLM": "smollm3", "Phi3ForCausalLM": "phi3", "MistralForCausalLM": "mistral",
    "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3", "Qwen3MoeForCausalLM": "qwen3moe",
    "GptOssForCausalLM": "gpt-oss",
}


def hf_rope_scaling(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta", rs.get("rope_theta", 10000.0)))
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", float(rs["factor"]))
    if kind == "yarn":
        from .yarn import hf_yarn

        return theta, hf_yarn(rs, theta)["rope_scaling"]
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3",
            float(rs["factor"]),
            float(rs.get("low_freq_factor", 1.0)),
            float(rs.get("high_freq_factor", 4.0)),
            int(rs.get("original_max_position_embeddings", 8192)),
        )
    raise UnsupportedModel(f"unsupported rope scaling type {kind!r} (config.json rope_scaling)")


def _hf_rope_dim(cfg: dict[str, Any], head_dim: int) -> int | None:
    """phi3's rotated dims per head: int(head_dim * partial_rotary_factor), as transformers' Phi3 rotary
    takes it (from rope_parameters first, then the top level); None when that is the whole head."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    rope_dim = int(head_dim * factor)
    return None if rope_dim == head_dim else rope_dim


def _hf_layers_without_rope(cfg: dict[str, Any], n_layers: int) -> tuple[int, ...]:
    """smollm3's no_rope_layers (a flag a layer, 1 = rotates) as the ids that do not rotate; a config
    without the list gets transformers' default, every no_rope_layer_interval-th layer."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(n_layers)]
    if len(flags) != n_layers:
        raise UnsupportedModel(f"no_rope_layers has {len(flags)} flags for {n_layers} layers")
    return tuple(i for i, rotates in enumerate(flags) if not rotates)


def from_hf_config(cfg: dict[str, Any], eos_ids: tuple[int, ...] = ()) -> ModelConfig:
    archs = cfg.get("architectures") or []
    arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModel(
            f"unsupported architecture {archs or cfg.get('model_type')!r}; supported: {', '.join(HF_ARCHITECTURES)}"
        )
    from .attention_config import HF_DEFAULTS, hf_attention_options  # they read this module's helpers
    from .longrope import hf_longrope
    from .moe_config import hf_moe_options

    cfg = {**HF_DEFAULTS.get(arch, {}), **cfg}
    n_heads = int(cfg["num_attention_heads"])
    dim = int(cfg["hidden_size"])
    n_layers = int(cfg["num_hidden_layers"])
    head_dim = int(cfg.get("head_dim") or dim // n_heads)
    max_context = int(cfg.get("max_position_embeddings", 2048))
    options = hf_attention_options(cfg, arch, n_layers, max_context)
    rope_dim = _hf_rope_dim(cfg, head_dim) if arch == "phi3" else None
    rope = hf_longrope(cfg, rope_dim or head_dim, max_context) if arch == "phi3" else None
    if rope is None:
        theta, scaling = hf_rope_scaling(cfg)
        rope = dict(rope_theta=theta, rope_scaling=scaling)
        if scaling is not None and scaling.kind == "yarn":  # with its attention factor
            from .yarn import hf_yarn

            rope = hf_yarn(cfg.get("rope_scaling") or cfg.get("rope_parameters"), theta)
    eos = cfg.get("eos_token_id")
    eos = tuple(eos_ids) or (tuple(eos) if isinstance(eos, list) else (eos,) if eos is not None else ())
    fields = dict(
        architecture=arch,
        n_layers=n_layers,
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        ffn_dim=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        **rope,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        max_context=max_context,
        bos_id=cfg.get("bos_token_id"),
        eos_ids=eos,
        rope_dim=rope_dim,
        layers_without_rope=_hf_layers_without_rope(cfg, n_layers) if arch == "smollm3" else (),
    )
    return ModelConfig(**{**fields, **options, **hf_moe_options(cfg, arch)})
