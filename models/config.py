"""Frozen model configuration, with named presets; hf_config.py and gguf_config.py build it from a checkpoint."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass


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


PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        architecture="llama", n_layers=30, dim=576, n_heads=9, n_kv_heads=3, head_dim=64, ffn_dim=1536,
        vocab_size=49152, rope_theta=100000.0, norm_eps=1e-5, tie_embeddings=True, max_context=8192,
        bos_id=1, eos_ids=(2,),
    ),
}
