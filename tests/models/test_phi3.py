"""Phi-3's longrope and sliding window as configuration: what config.json files shaped as the released checkpoints'
(Phi-3-mini-4k, Phi-3.5-mini, Phi-4-mini) and llama.cpp's GGUF metadata for them read as, with transformers' own
RoPE functions as the reference. Their logits against transformers are in test_architectures.py (phi3-longrope,
phi3-window, from HF folders and from llama.cpp's GGUF conversions)."""
import math

import pytest
import torch

from models import ModelConfig, UnsupportedModel
from models.blocks import rope_inv_freq
from models.gguf_config import from_gguf_metadata
from models.hf_config import from_hf_config

LONG = [1.0 + 0.5 * i for i in range(48)]  # distinct from SHORT, as the released factors are
SHORT = [1.0 + 0.01 * i for i in range(48)]
ATTN_131K = math.sqrt(1 + math.log(131072 / 4096) / math.log(4096))  # 1.19: every released longrope checkpoint's


def phi_config(name: str, **changes) -> dict:
    """A config.json of the released checkpoint's shape (its fields, smaller factor lists of the right length)."""
    common = dict(architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=3072, intermediate_size=8192,
                  num_hidden_layers=32, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=32000,
                  original_max_position_embeddings=4096, tie_word_embeddings=False)
    longrope = {"type": "longrope", "long_factor": LONG, "short_factor": SHORT}
    cfg = {
        "phi-3-mini-4k": dict(num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                              sliding_window=2047, rope_scaling=None, vocab_size=32064),
        "phi-3.5-mini": dict(num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=131072,
                             sliding_window=262144, rope_scaling=longrope, vocab_size=32064),
        "phi-4-mini": dict(num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=131072,
                           sliding_window=262144, partial_rotary_factor=0.75, rope_scaling=longrope, vocab_size=200064,
                           tie_word_embeddings=True),
    }[name]
    return {**common, **cfg, **changes}


def transformers_longrope(cfg: dict, seq_len: int | None):
    """transformers' own (inv_freq, attention factor) for a Phi-3 config.json, at a sequence of `seq_len`."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS["longrope"](transformers.Phi3Config(**cfg), None, seq_len=seq_len)


@pytest.mark.parametrize("name", ["phi-3.5-mini", "phi-4-mini"])
def test_longrope_checkpoints_rotate_by_their_long_factors(name):
    """A context (131072) past the original one (4096): the long factors for every sequence, as llama.cpp
    picks them, which are transformers' frequencies for a sequence past 4096 tokens."""
    cfg = phi_config(name)
    config = from_hf_config(cfg)
    inv_freq, attn = transformers_longrope(cfg, seq_len=4097)
    assert config.rope_freq_factors == tuple(LONG) and config.rope_scaling is None
    assert config.rotary_dim == 96  # Phi-3.5: all of 3072 / 32; Phi-4-mini: 0.75 of 128
    torch.testing.assert_close(rope_inv_freq(config), inv_freq, rtol=1e-6, atol=0)
    assert config.rope_attn_factor == pytest.approx(attn) == pytest.approx(ATTN_131K)
    assert config.layer_windows == ()  # its 262144 window never bites within 131072
    assert ModelConfig.from_json(config.to_json()) == config


def test_longrope_within_the_original_context_rotates_by_the_short_factors():
    """A checkpoint whose context is its original one: the short factors and no attention factor, transformers'
    frequencies for any sequence it can hold."""
    cfg = phi_config("phi-3.5-mini", max_position_embeddings=4096)
    config = from_hf_config(cfg)
    inv_freq, attn = transformers_longrope(cfg, seq_len=4096)
    assert config.rope_freq_factors == tuple(SHORT)
    torch.testing.assert_close(rope_inv_freq(config), inv_freq, rtol=1e-6, atol=0)
    assert config.rope_attn_factor == attn == 1.0


def test_longrope_config_variants_read_as_transformers_reads_them():
    # older Phi-3 files name it "su"
    su = phi_config("phi-3.5-mini", rope_scaling={"type": "su", "long_factor": LONG, "short_factor": SHORT})
    assert from_hf_config(su) == from_hf_config(phi_config("phi-3.5-mini"))
    # a factor or attention factor given is used as given
    given = phi_config("phi-3.5-mini", rope_scaling={"rope_type": "longrope", "long_factor": LONG, "short_factor": SHORT,
                                                     "attention_factor": 1.5})
    assert from_hf_config(given).rope_attn_factor == transformers_longrope(given, 4097)[1] == 1.5
    factor = phi_config("phi-3.5-mini", rope_scaling={"rope_type": "longrope", "long_factor": LONG, "short_factor": SHORT,
                                                      "factor": 8.0})
    assert from_hf_config(factor).rope_attn_factor == pytest.approx(transformers_longrope(factor, 4097)[1])
    # Phi3Config puts the top-level original context over the rope dict's, so the long factors still apply
    inner = phi_config("phi-3.5-mini", max_position_embeddings=8192,
                       rope_parameters={"rope_type": "longrope", "long_factor": LONG, "short_factor": SHORT,
                                        "original_max_position_embeddings": 8192}, rope_scaling=None)
    config = from_hf_config(inner)
    assert config.rope_freq_factors == tuple(LONG)
    assert config.rope_attn_factor == pytest.approx(transformers_longrope(inner, 4097)[1])


def test_longrope_refusals():
    with pytest.raises(UnsupportedModel, match="48 short factors"):
        from_hf_config(phi_config("phi-3.5-mini", rope_scaling={"type": "longrope", "long_factor": LONG,
                                                                "short_factor": SHORT[:47]}))
    with pytest.raises(UnsupportedModel, match="48 long factors.*got none"):
        from_hf_config(phi_config("phi-3.5-mini", rope_scaling={"type": "longrope", "short_factor": SHORT}))
    llama = {**phi_config("phi-3.5-mini"), "architectures": ["LlamaForCausalLM"]}
    with pytest.raises(UnsupportedModel, match="rope scaling type 'longrope'"):
        from_hf_config(llama)
    base = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, vocab_size=100)
    with pytest.raises(UnsupportedModel, match="phi3 and gpt-oss only; got 1.19 for llama"):
        ModelConfig(architecture="llama", rope_attn_factor=1.19, **base)
    with pytest.raises(UnsupportedModel, match="one for each of the 6 frequencies of 12 rotated dims; got 8"):
        ModelConfig(architecture="phi3", rope_dim=12, rope_freq_factors=(1.0,) * 8, **base)
    with pytest.raises(UnsupportedModel, match="must be positive"):
        ModelConfig(architecture="phi3", rope_freq_factors=(1.0,) * 7 + (0.0,), **base)


# llama.cpp's converter for Phi-4-mini: context_length and original_context_length, rope.scaling.attn_factor, and the
# factors as the rope_factors_long and rope_factors_short tensors (read by gguf_loader, passed in here)
GGUF_PHI4_MINI = {
    "general.architecture": "phi3", "phi3.block_count": 32, "phi3.embedding_length": 3072, "phi3.attention.head_count": 24,
    "phi3.attention.head_count_kv": 8, "phi3.feed_forward_length": 8192, "phi3.vocab_size": 200064,
    "phi3.context_length": 131072, "phi3.rope.scaling.original_context_length": 4096, "phi3.rope.dimension_count": 96,
    "phi3.rope.scaling.attn_factor": ATTN_131K, "phi3.attention.sliding_window": 262144,
}
GGUF_FACTORS = {"rope_factors_long": LONG, "rope_factors_short": SHORT}


def test_gguf_longrope_reads_as_the_folder():
    config = from_gguf_metadata(GGUF_PHI4_MINI, False, rope_factors=GGUF_FACTORS)
    hf = from_hf_config(phi_config("phi-4-mini"))
    for field in ("rope_freq_factors", "rope_attn_factor", "rope_dim", "rope_scaling", "layer_windows", "max_context"):
        assert getattr(config, field) == getattr(hf, field), field
    short = from_gguf_metadata({**GGUF_PHI4_MINI, "phi3.context_length": 4096}, False, rope_factors=GGUF_FACTORS)
    assert short.rope_freq_factors == tuple(SHORT)
    with pytest.raises(UnsupportedModel, match="GGUF rope_factors: longrope needs 48 short factors"):
        from_gguf_metadata(GGUF_PHI4_MINI, False, rope_factors={"rope_factors_long": LONG})
    llama = {k.replace("phi3.", "llama."): v for k, v in GGUF_PHI4_MINI.items()} | {"general.architecture": "llama"}
    with pytest.raises(UnsupportedModel, match="phi3 only"):
        from_gguf_metadata({**llama, "llama.rope.dimension_count": 128}, False, rope_factors=GGUF_FACTORS)


def test_phi3_windows_from_folders_and_files():
    """Phi-3-mini-4k's window of 2047 on every layer (a token attends itself and the 2046 before it, as
    transformers' mask), from config.json and from its GGUF metadata; a window at least as long as the
    context (Phi-3.5, Phi-4-mini) or none (Phi-4: 0 in GGUF) windows nothing."""
    assert from_hf_config(phi_config("phi-3-mini-4k")).layer_windows == (2047,) * 32
    assert from_hf_config(phi_config("phi-3-mini-4k", sliding_window=None)).layer_windows == ()
    meta = {**GGUF_PHI4_MINI, "phi3.context_length": 4096, "phi3.attention.head_count": 32,
            "phi3.attention.head_count_kv": 32, "phi3.rope.dimension_count": 96}
    del meta["phi3.rope.scaling.attn_factor"]
    assert from_gguf_metadata({**meta, "phi3.attention.sliding_window": 2047}, False).layer_windows == (2047,) * 32
    assert from_gguf_metadata({**meta, "phi3.attention.sliding_window": 0}, False).layer_windows == ()
    assert from_gguf_metadata({**meta, "phi3.attention.sliding_window": 4096}, False).layer_windows == ()
