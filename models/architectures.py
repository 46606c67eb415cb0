"""Which decoder each architecture builds, and how GGUF files name what the architectures hold.

A checkpoint names its architecture in HF's config.json `architectures` or GGUF's `general.architecture`;
hf_config.py and gguf_config.py turn either into ModelConfig.architecture (HF_ARCHITECTURES there,
config.GGUF_ARCHITECTURES: plain data, so reading a config needs no model code), and DECODERS below turns
that into the decoder class.
Mistral's GGUF files say "llama" (its math), so only its HF folders come out as "mistral".
"""
from __future__ import annotations

from .blocks import Transformer
from .config import SUPPORTED_ARCHITECTURES, ModelConfig
from .gemma3 import Gemma2Transformer, Gemma3Transformer
from .gpt_oss import GptOssTransformer
from .phi3 import Phi3Transformer
from .qwen3 import Qwen3Transformer
from .qwen3_moe import Qwen3MoeTransformer
from .smollm3 import SmolLM3Transformer

DECODERS: dict[str, type[Transformer]] = {
    "llama": Transformer,
    "qwen2": Transformer,  # Llama's math with config.qkv_bias
    "mistral": Transformer,  # Llama's math, each layer attending through the config's window
    "qwen3": Qwen3Transformer,  # q and k RMS-normed per head before RoPE
    "smollm3": SmolLM3Transformer,  # some layers without RoPE
    "phi3": Phi3Transformer,  # RoPE on part of each head (Phi-4-mini)
    "gemma3": Gemma3Transformer,  # Gemma's block, sliding and full layers, q/k norms
    "gemma2": Gemma2Transformer,  # Gemma 3's without q/k norms, attention scores capped
    "qwen3moe": Qwen3MoeTransformer,  # Qwen3's attention, a mixture of experts for the MLP
    "gpt-oss": GptOssTransformer,  # attention sinks, sliding and full layers, experts with biases
}
assert set(DECODERS) == set(SUPPORTED_ARCHITECTURES), "every architecture a config may name builds a decoder"


def build_decoder(config: ModelConfig) -> Transformer:
    """The decoder for `config`, its weights uninitialised (build it on the meta device)."""
    return DECODERS[config.architecture](config)


# GGUF tensor names after `blk.N.` -> ours after `layers.N.`, as llama.cpp's gguf-py (constants.py) names
# them. The q, k, v and gate, up parts are fused later (export.fuse_projections); a file that fused them
# already (phi3's attn_qkv) is taken as it is: same rows, same order as ours.
GGUF_TENSOR_NAMES: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # phi3: [(H_q + 2 H_kv) * D, dim], q rows, then k, then v
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # qwen3: [D], one for all heads
    "attn_k_norm.weight": "self_attn.k_norm.weight",  # qwen3: [D]
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # MoE: the router [E, dim], and each projection of every expert as one [E, rows, cols] tensor
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
# Where an architecture's files mean something else by a name. phi3 writes HF's fused gate_up_proj as
# ffn_up [2 * ffn, dim], gate rows first (llama.cpp's fused swiglu activates the first half), and no ffn_gate.
# Gemma's four norms a block: its ffn_norm is the norm before the feed-forward, which HF names
# pre_feedforward_layernorm (its post_attention_layernorm follows the attention's output).
_GEMMA_NORMS = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
GGUF_TENSOR_NAMES_BY_ARCH: dict[str, dict[str, str]] = {
    # gpt-oss: the norm before the experts, the sinks, and the biases of the output, the router and the experts
    "gpt-oss": {"post_attention_norm.weight": "post_attention_layernorm.weight", "attn_sinks.weight": "self_attn.sinks",
                "attn_output.bias": "self_attn.o_proj.bias", "ffn_gate_inp.bias": "mlp.router.bias",
                "ffn_gate_exps.bias": "mlp.experts.gate_bias", "ffn_up_exps.bias": "mlp.experts.up_bias",
                "ffn_down_exps.bias": "mlp.experts.down_bias"},
    "phi3": {"ffn_up.weight": "mlp.gate_up_proj.weight"},
    "gemma2": _GEMMA_NORMS,
    "gemma3": _GEMMA_NORMS,
}
# Architectures whose q and k rows llama.cpp's converter permuted for its interleaved ("normal") RoPE, to
# be undone on load (stored.unpermute_qk): LlamaModel and its subclasses with undo_permute = True,
# SmolLM3Model among them. qwen2, qwen3 and phi3 use llama.cpp's NeoX RoPE, which is ours: not permuted.
GGUF_PERMUTED_QK = frozenset({"llama", "smollm3"})
# Architectures whose RMSNorm scales by 1 + weight: an HF folder's norm weights get the 1 added on load
# (hf_loader), so the shared RMSNorm computes it. llama.cpp's converter adds it itself, so GGUF files hold 1 + w.
HF_NORMS_OFFSET_BY_ONE = frozenset({"gemma2", "gemma3"})
# Tensors a file may hold for math this project does not implement: loading one refuses the file. (phi3's
# longrope factor tensors are read as config, by gguf_loader.)
GGUF_REFUSED_TENSORS: dict[str, str] = {}


def gguf_layer_names(arch: str) -> dict[str, str]:
    """The GGUF -> our layer tensor names for an architecture's files (after `blk.N.` / `layers.N.`)."""
    return {**GGUF_TENSOR_NAMES, **GGUF_TENSOR_NAMES_BY_ARCH.get(arch, {})}
