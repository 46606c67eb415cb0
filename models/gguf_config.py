"""ModelConfig from a GGUF file's metadata, as llama.cpp's converter writes it."""
from __future__ import annotations

from typing import Any

from .config import GGUF_ARCHITECTURES, ModelConfig, RopeScaling, UnsupportedModel

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
