"""Read a GGUF file: metadata, dequantized weights (in our names), tokenizer and chat template."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from .config import UnsupportedModel, from_gguf_metadata
from .errors import ModelLoadError
from .tokenizer import TextTokenizer, TokenizerMeta, byte_level_bpe_from_gguf

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight", "output.weight": "lm_head.weight"}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def _reader(path: Path):
    import gguf

    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises many kinds of errors on a damaged file
        raise ModelLoadError(f"{path}: not a valid GGUF file ({type(e).__name__}: {e})") from None


def _metadata(reader) -> dict[str, Any]:
    meta = {}
    for name, f in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        try:
            meta[name] = f.contents()
        except Exception as e:
            raise ModelLoadError(f"GGUF metadata field {name} is unreadable: {e}") from None
    return meta


def our_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise UnsupportedModel(f"unsupported GGUF tensor {gguf_name!r}")


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaved-rope permutation of a q/k weight [n_heads * D, dim] (or bias)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)  # [H, 2, D/2, ...] -> [H*D, ...]


def read_gguf(path: Path, dtype: torch.dtype = torch.float32, progress: bool = False):
    """-> (ModelConfig, state dict in our names, TextTokenizer)."""
    import gguf

    path = Path(path)
    reader = _reader(path)
    meta = _metadata(reader)
    names = {t.name for t in reader.tensors}
    rope_freqs = None
    if "rope_freqs.weight" in names:
        rope_freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight").data.tolist()
    config = from_gguf_metadata(meta, has_output_weight="output.weight" in names, rope_freqs=rope_freqs)
    size = path.stat().st_size
    state: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="dequantizing", unit="tensor", disable=not progress):
        if t.name == "rope_freqs.weight":
            continue
        if t.data_offset + t.n_bytes > size:
            raise ModelLoadError(f"{path}: truncated (tensor {t.name} ends past the end of the file)")
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise UnsupportedModel(f"{path}: tensor {t.name} has unsupported type {t.tensor_type.name}") from None
        w = torch.from_numpy(np.array(arr, dtype=np.float32))  # a writable copy
        name = our_name(t.name)
        if config.architecture == "llama" and t.name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = config.n_heads if ".attn_q." in t.name else config.n_kv_heads
            w = unpermute_qk(w, heads)
        state[name] = w.to(dtype) if w.dim() > 1 else w
    tokenizer = TextTokenizer(byte_level_bpe_from_gguf(meta), _tokenizer_meta(meta))
    return config, state, tokenizer


def _tokenizer_meta(meta: dict[str, Any]) -> TokenizerMeta:
    tokens = meta["tokenizer.ggml.tokens"]

    def tok(key):
        i = meta.get(key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    eos = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = {int(eos)} if eos is not None else set()
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None:
        eos_ids.add(int(eot))
    template = meta.get("tokenizer.chat_template")
    # Chat models end a turn with their template's end-of-turn token, which may differ from EOS.
    for candidate in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
        if template and candidate in template and candidate in tokens:
            eos_ids.add(tokens.index(candidate))
    return TokenizerMeta(
        bos_token=tok("tokenizer.ggml.bos_token_id"),
        eos_token=tok("tokenizer.ggml.eos_token_id"),
        eos_ids=tuple(sorted(eos_ids)),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=template,
    )

