"""Frozen model configuration, built from GGUF metadata or a HF config.json, with named presets."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any


class UnsupportedModel(ValueError):
    """The checkpoint asks for something this project does not implement; the message names it."""


# ModelConfig.architecture: architectures.DECODERS builds each one's decoder
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "smollm3", "phi3", "mistral", "gemma2", "gemma3", "qwen3moe", "gpt-oss")
# GGUF's general.architecture names; Mistral's files say "llama"
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "smollm3", "phi3", "gemma2", "gemma3", "qwen3moe", "gpt-oss")
# the decoders that honour ModelConfig.layer_windows, and the Gemma options
WINDOWED_ARCHITECTURES = ("mistral", "phi3", "gemma2", "gemma3", "gpt-oss")
GEMMA_OPTIONS = ("rope_theta_local", "attention_scale", "final_logit_softcap", "attn_logit_softcap")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: 'linear', 'llama3' or 'yarn' (yarn.py: its betas, and whether its range is rounded)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


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
    # a divisor for each RoPE frequency: GGUF's rope_freqs tensor (llama3 files), or longrope's long or short
    # factors (phi3, longrope.py)
    rope_freq_factors: tuple[float, ...] | None = None
    rope_attn_factor: float = 1.0  # phi3's longrope: cos and sin multiplied by it (GGUF's rope.scaling.attn_factor)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    max_context: int = 2048
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    # phi3: RoPE rotates only the first rope_dim dims of each q and k head (partial_rotary_factor * head_dim);
    # None: every dim (see rotary_dim)
    rope_dim: int | None = None
    # smollm3: the ids of the layers that apply no RoPE (HF's no_rope_layers flags are 0 there)
    layers_without_rope: tuple[int, ...] = ()
    # mistral, phi3, gemma: each layer's attention window (0: the whole history; w: the token at position p attends
    # positions p - w + 1 .. p, as transformers' sliding_window), one a layer; () when no layer has one
    layer_windows: tuple[int, ...] = ()
    # gemma: the RoPE base of the windowed layers, which take no rope_scaling (Gemma 3's rope_local_base_freq)
    rope_theta_local: float | None = None
    attention_scale: float | None = None  # gemma: query_pre_attn_scalar ** -0.5; None: head_dim ** -0.5
    final_logit_softcap: float | None = None  # gemma: logits -> c tanh(logits / c)
    attn_logit_softcap: float | None = None  # gemma2: each scaled attention score -> c tanh(s / c)
    # mixture-of-experts (moe_config.py): experts a layer holds, how many a token uses, each one's FFN width,
    # and how the router weighs the chosen ones
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_dim: int = 0
    routing: str = ""
    swiglu_limit: float = 0.0  # gpt-oss's experts: gate and up clamped at it (0: plain SwiGLU)
    swiglu_alpha: float = 0.0  # gpt-oss's experts: gate * sigmoid(alpha * gate)

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
        if self.rope_scaling is not None and self.rope_scaling.kind not in ("linear", "llama3", "yarn"):
            raise UnsupportedModel(f"unsupported rope scaling type {self.rope_scaling.kind!r}")
        # each option is honoured by one decoder only: elsewhere it would be silently ignored
        if self.rope_dim is not None:
            if self.architecture != "phi3":
                raise UnsupportedModel(f"partial RoPE (rope_dim {self.rope_dim} of head_dim {self.head_dim}) "
                                       f"is implemented for phi3 only, not {self.architecture}")
            if not (0 < self.rope_dim <= self.head_dim and self.rope_dim % 2 == 0):
                raise UnsupportedModel(f"rope_dim must be even and in (0, head_dim {self.head_dim}], got {self.rope_dim}")
        if self.layers_without_rope:
            if self.architecture != "smollm3":
                raise UnsupportedModel(f"layers without RoPE are implemented for smollm3 only, not {self.architecture}")
            if not all(0 <= i < self.n_layers for i in self.layers_without_rope):
                raise UnsupportedModel(f"layers_without_rope {self.layers_without_rope} name layers past {self.n_layers}")
        if self.layer_windows:
            if self.architecture not in WINDOWED_ARCHITECTURES:
                raise UnsupportedModel(f"sliding-window attention is implemented for {', '.join(WINDOWED_ARCHITECTURES)} "
                                       f"only, not {self.architecture}")
            if len(self.layer_windows) != self.n_layers or min(self.layer_windows) < 0:
                raise UnsupportedModel(f"layer_windows must give each of {self.n_layers} layers a window of 0 or more, "
                                       f"got {self.layer_windows}")
        factors = self.rope_freq_factors
        if factors is not None and (len(factors) != self.rotary_dim // 2 or not all(f > 0 for f in factors)):
            raise UnsupportedModel(f"RoPE frequency factors must be positive, one for each of the {self.rotary_dim // 2} "
                                   f"frequencies of {self.rotary_dim} rotated dims; got {len(factors)}")
        if self.rope_attn_factor != 1.0 and (self.architecture not in ("phi3", "gpt-oss") or not self.rope_attn_factor > 0):
            raise UnsupportedModel(f"rope_attn_factor must be positive, and is implemented for phi3 and gpt-oss only; "
                                   f"got {self.rope_attn_factor} for {self.architecture}")
        for name, value in ((name, getattr(self, name)) for name in GEMMA_OPTIONS if getattr(self, name) is not None):
            if self.architecture not in ("gemma2", "gemma3") or not value > 0:
                raise UnsupportedModel(f"{name} must be positive, and is implemented for gemma2 and gemma3 only; "
                                       f"got {value} for {self.architecture}")
        from .moe_config import check_moe  # it reads this module

        check_moe(self)

    def window(self, layer_id: int) -> int:
        """Layer `layer_id`'s attention window, 0 for the whole history."""
        return self.layer_windows[layer_id] if self.layer_windows else 0

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each q and k head RoPE rotates."""
        return self.rope_dim if self.rope_dim is not None else self.head_dim

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @staticmethod
    def from_json(text: str) -> ModelConfig:
        d = json.loads(text)
        if d.get("rope_scaling"):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        for key in ("eos_ids", "rope_freq_factors", "layers_without_rope", "layer_windows"):
            if d.get(key) is not None:
                d[key] = tuple(d[key])
        return ModelConfig(**d)


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


def from_gguf_metadata(meta: dict[str, Any], has_output_weight: bool, rope_factors: dict | None = None) -> ModelConfig:
    """`rope_factors`: the file's RoPE factor tensors by name (rope_freqs, rope_factors_long, rope_factors_short)."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModel(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
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
    yarn = {}
    if kind == "yarn":
        from .yarn import gguf_yarn

        yarn = gguf_yarn(meta, arch)
    elif kind not in (None, "none"):
        if kind != "linear":
            raise UnsupportedModel(f"unsupported rope scaling type {kind!r}")
        scaling = RopeScaling("linear", float(field("rope.scaling.factor")))
    n_layers = int(field("block_count"))
    max_context = int(field("context_length", 2048))
    from .attention_config import gguf_attention_options  # they read this module's helpers
    from .longrope import gguf_longrope
    from .moe_config import gguf_moe_options

    options = gguf_attention_options(meta, arch, n_layers, dim, n_heads, max_context)
    # rope.dimension_count is the rotated dims of a head: all of it but in phi3, whose head is dim / n_heads
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    head_dim = int(meta.get(f"{arch}.attention.key_length") or (None if arch == "phi3" else rope_dims) or dim // n_heads)
    rope_dim = None
    if rope_dims is not None and int(rope_dims) != head_dim:
        if arch != "phi3":
            raise UnsupportedModel(f"{arch}.rope.dimension_count {rope_dims} is not the head dim {head_dim}: "
                                   f"partial RoPE is implemented for phi3 only")
        rope_dim = int(rope_dims)
    # llama.cpp's smollm3 has no metadata for its NoPE layers: it hard-codes every fourth (n_no_rope_layer_step)
    without_rope = tuple(i for i in range(n_layers) if (i + 1) % 4 == 0) if arch == "smollm3" else ()
    rope_factors = rope_factors or {}
    freqs = rope_factors.get("rope_freqs")
    longrope = gguf_longrope(meta, arch, rope_factors, max_context, rope_dim or head_dim)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    fields = dict(
        architecture=arch,
        n_layers=n_layers,
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=int(field("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        ffn_dim=int(field("feed_forward_length")),
        vocab_size=int(meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])),
        rope_theta=float(field("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rope_freq_factors=tuple(float(x) for x in freqs) if freqs is not None else None,
        norm_eps=float(field("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings=not has_output_weight,
        qkv_bias=arch in ("qwen2", "gpt-oss"),
        max_context=max_context,
        bos_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_ids=(int(eos),) if eos is not None else (),
        rope_dim=rope_dim,
        layers_without_rope=without_rope,
    )
    return ModelConfig(**{**fields, **options, **longrope, **yarn, **gguf_moe_options(meta, arch)})


PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        architecture="llama", n_layers=30, dim=576, n_heads=9, n_kv_heads=3, head_dim=64, ffn_dim=1536,
        vocab_size=49152, rope_theta=100000.0, norm_eps=1e-5, tie_embeddings=True, max_context=8192,
        bos_id=1, eos_ids=(2,),
    ),
}
