"""Frozen model configuration, built from GGUF metadata or a HF config.json, with named presets."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any


class UnsupportedModel(ValueError):
    """The checkpoint asks for something this project does not implement; the message names it."""


SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: 'linear' or 'llama3'."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Everything the Llama-family decoder needs to know about a checkpoint."""

    architecture: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_freq_factors: tuple[float, ...] | None = None  # GGUF's rope_freqs tensor (llama3 files)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    max_context: int = 2048
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size", "max_context"):
            if int(getattr(self, name)) <= 0:
                raise UnsupportedModel(f"model config field {name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise UnsupportedModel(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.rope_scaling is not None and self.rope_scaling.kind not in ("linear", "llama3"):
            raise UnsupportedModel(f"unsupported rope scaling type {self.rope_scaling.kind!r}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @staticmethod
    def from_json(text: str) -> ModelConfig:
        d = json.loads(text)
        if d.get("rope_scaling"):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        for key in ("eos_ids", "rope_freq_factors"):
            if d.get(key) is not None:
                d[key] = tuple(d[key])
        return ModelConfig(**d)


HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def _hf_rope_scaling(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta", rs.get("rope_theta", 10000.0)))
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", float(rs["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3",
            float(rs["factor"]),
            float(rs.get("low_freq_factor", 1.0)),
            float(rs.get("high_freq_factor", 4.0)),
            int(rs.get("original_max_position_embeddings", 8192)),
        )
    raise UnsupportedModel(f"unsupported rope scaling type {kind!r}")


def from_hf_config(cfg: dict[str, Any], eos_ids: tuple[int, ...] = ()) -> ModelConfig:
    archs = cfg.get("architectures") or []
    arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModel(
            f"unsupported architecture {archs or cfg.get('model_type')!r}; supported: {', '.join(HF_ARCHITECTURES)}"
        )
    theta, scaling = _hf_rope_scaling(cfg)
    n_heads = int(cfg["num_attention_heads"])
    dim = int(cfg["hidden_size"])
    eos = cfg.get("eos_token_id")
    eos = tuple(eos_ids) or (tuple(eos) if isinstance(eos, list) else (eos,) if eos is not None else ())
    return ModelConfig(
        architecture=arch,
        n_layers=int(cfg["num_hidden_layers"]),
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or dim // n_heads),
        ffn_dim=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        max_context=int(cfg.get("max_position_embeddings", 2048)),
        bos_id=cfg.get("bos_token_id"),
        eos_ids=eos,
    )


def from_gguf_metadata(meta: dict[str, Any], has_output_weight: bool, rope_freqs=None) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModel(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def field(name, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise UnsupportedModel(f"GGUF file lacks metadata field {arch}.{name}")
        return value

    dim = int(field("embedding_length"))
    n_heads = int(field("attention.head_count"))
    scaling = None
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        if kind != "linear":
            raise UnsupportedModel(f"unsupported rope scaling type {kind!r}")
        scaling = RopeScaling("linear", float(field("rope.scaling.factor")))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=arch,
        n_layers=int(field("block_count")),
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=int(field("attention.head_count_kv", n_heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count") or dim // n_heads),
        ffn_dim=int(field("feed_forward_length")),
        vocab_size=int(meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])),
        rope_theta=float(field("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rope_freq_factors=tuple(float(x) for x in rope_freqs) if rope_freqs is not None else None,
        norm_eps=float(field("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings=not has_output_weight,
        qkv_bias=arch == "qwen2",
        max_context=int(field("context_length", 2048)),
        bos_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_ids=(int(eos),) if eos is not None else (),
    )


PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        architecture="llama", n_layers=30, dim=576, n_heads=9, n_kv_heads=3, head_dim=64, ffn_dim=1536,
        vocab_size=49152, rope_theta=100000.0, norm_eps=1e-5, tie_embeddings=True, max_context=8192,
        bos_id=1, eos_ids=(2,),
    ),
}
