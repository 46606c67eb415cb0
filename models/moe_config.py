"""ModelConfig's mixture-of-experts fields, from a config.json or GGUF metadata, and their checks.

A MoE layer's feed-forward is n_experts SwiGLU experts of expert_ffn_dim each; a router (a linear map to one
logit an expert) picks n_experts_used of them for every token, and weighs their outputs by `routing`:
    softmax_norm   softmax over all the logits, the top k kept and renormalised to sum to 1 (Qwen3-MoE with
                   norm_topk_prob, and every qwen3moe GGUF: llama.cpp always renormalises them)
    softmax        softmax over all the logits, the top k kept as they are (Qwen3-MoE without norm_topk_prob)
    topk_softmax   the top k logits, softmaxed over those k (gpt-oss)
The ids are what the expert op (moe.py) takes: they are baked into an exported program.
"""
from __future__ import annotations

from typing import Any

from .config import ModelConfig, UnsupportedModel

ROUTINGS = {"softmax": 0, "softmax_norm": 1, "topk_softmax": 2}
MOE_ARCHITECTURES = ("qwen3moe", "gpt-oss")
# gpt-oss's clamped SwiGLU, which llama.cpp hard-codes (GGUF files do not state it)
GPT_OSS_SWIGLU = dict(swiglu_limit=7.0, swiglu_alpha=1.702)


def check_moe(config: ModelConfig) -> None:
    """Experts only where a decoder builds them, and sizes that make sense."""
    if config.n_experts == 0 and config.architecture not in MOE_ARCHITECTURES:
        return
    if config.architecture not in MOE_ARCHITECTURES:
        raise UnsupportedModel(f"experts are implemented for {', '.join(MOE_ARCHITECTURES)} only, "
                               f"not {config.architecture}")
    if not (0 < config.n_experts_used <= config.n_experts) or config.expert_ffn_dim <= 0:
        raise UnsupportedModel(f"a mixture-of-experts model needs 0 < experts used ({config.n_experts_used}) <= "
                               f"experts ({config.n_experts}) and a positive expert FFN width ({config.expert_ffn_dim})")
    if (config.swiglu_limit > 0) != (config.architecture == "gpt-oss"):
        raise UnsupportedModel("the clamped SwiGLU (swiglu_limit) is gpt-oss's, and gpt-oss's experts need it")
    if config.routing not in ROUTINGS:
        raise UnsupportedModel(f"unsupported expert routing {config.routing!r}; supported: {', '.join(ROUTINGS)}")


def hf_moe_options(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """The MoE fields of a config.json; {} for a dense architecture."""
    if arch == "gpt-oss":
        return dict(n_experts=int(cfg["num_local_experts"]), n_experts_used=int(cfg["num_experts_per_tok"]),
                    expert_ffn_dim=int(cfg["intermediate_size"]), routing="topk_softmax",
                    swiglu_limit=float(cfg.get("swiglu_limit", 7.0)), swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)))
    if arch != "qwen3moe":
        return {}
    n_layers = int(cfg["num_hidden_layers"])
    # transformers makes a layer dense where mlp_only_layers names it or decoder_sparse_step skips it
    dense = [i for i in range(n_layers) if i in (cfg.get("mlp_only_layers") or [])
             or (i + 1) % int(cfg.get("decoder_sparse_step") or 1) != 0]
    if dense:
        raise UnsupportedModel(f"config.json makes layers {dense[:8]} dense (mlp_only_layers, decoder_sparse_step): "
                               "a Qwen3-MoE whose layers are not all experts is not implemented")
    # Qwen's own configs say num_experts; transformers 5 writes num_local_experts
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    return dict(n_experts=int(experts), n_experts_used=int(cfg["num_experts_per_tok"]),
                expert_ffn_dim=int(cfg["moe_intermediate_size"]),
                routing="softmax_norm" if cfg.get("norm_topk_prob", False) else "softmax")


def gguf_moe_options(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """The MoE fields of a GGUF's metadata (llama.cpp's keys); {} for a dense architecture."""
    if arch not in MOE_ARCHITECTURES:
        return {}

    def field(name):
        value = meta.get(f"{arch}.{name}")
        if value is None:
            raise UnsupportedModel(f"GGUF file lacks metadata field {arch}.{name}")
        return int(value)

    if arch == "gpt-oss":
        return dict(n_experts=field("expert_count"), n_experts_used=field("expert_used_count"),
                    expert_ffn_dim=field("expert_feed_forward_length"), routing="topk_softmax", **GPT_OSS_SWIGLU)
    return dict(n_experts=field("expert_count"), n_experts_used=field("expert_used_count"),
                expert_ffn_dim=field("expert_feed_forward_length"), routing="softmax_norm")
