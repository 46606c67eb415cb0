"""Read a GGUF file: metadata, its weights as stored (in our names), tokenizer and chat template."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from .architectures import GGUF_PERMUTED_QK, GGUF_REFUSED_TENSORS, gguf_layer_names
from .config import UnsupportedModel
from .gguf_config import from_gguf_metadata
from .gguf_file import read_header
from .errors import ModelLoadError
from .spm_tokenizer import sentencepiece_from_gguf
from .stored import StoredTensor, unpermute_qk
from .tokenizer import TextTokenizer, TokenizerMeta, byte_level_bpe_from_gguf

_GLOBAL_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight", "output.weight": "lm_head.weight"}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
# tokenizer.ggml.model -> (how its vocabulary is rebuilt, whether llama.cpp adds BOS when the file does not say)
_TOKENIZERS = {"gpt2": (byte_level_bpe_from_gguf, False), "llama": (sentencepiece_from_gguf, True)}
# Chat models end a turn with their template's end-of-turn token, which may differ from EOS.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def our_name(gguf_name: str, arch: str) -> str:
    if gguf_name in GGUF_REFUSED_TENSORS:
        raise UnsupportedModel(f"GGUF tensor {gguf_name}: {GGUF_REFUSED_TENSORS[gguf_name]}")
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m, names = _BLOCK.fullmatch(gguf_name), gguf_layer_names(arch)
    if m and m.group(2) in names:
        return f"layers.{m.group(1)}.{names[m.group(2)]}"
    raise UnsupportedModel(f"unsupported GGUF tensor {gguf_name!r} for the {arch} architecture")


def read_gguf(path: Path, dtype: torch.dtype = torch.float32, progress: bool = False):
    """-> (ModelConfig, state in our names, TextTokenizer). Matrices stay in the file, as StoredTensors;
    vectors (norms, biases) are read as float32."""
    path = Path(path)
    meta, infos = read_header(path)
    tensors = {t.name: t for t in infos}
    size = path.stat().st_size
    for t in infos:
        if t.data_offset + t.n_bytes > size:
            raise ModelLoadError(f"{path}: truncated (tensor {t.name} ends past the end of the file)")

    def stored(t, heads: int = 0) -> StoredTensor:
        shape = tuple(reversed(t.shape))  # GGUF lists the row length first
        return StoredTensor(t.name, path, t.data_offset, t.type_name, shape, heads)

    # RoPE's frequency factors, config rather than weights: llama3's rope_freqs, phi3's longrope long and short sets
    rope_factors = {name: stored(tensors.pop(f"{name}.weight")).floats().tolist()
                    for name in ("rope_freqs", "rope_factors_long", "rope_factors_short") if f"{name}.weight" in tensors}
    config = from_gguf_metadata(meta, has_output_weight="output.weight" in tensors, rope_factors=rope_factors)
    state: dict[str, torch.Tensor | StoredTensor] = {}
    for t in tqdm(tensors.values(), desc="reading", unit="tensor", disable=not progress):
        name = our_name(t.name, config.architecture)
        kind = t.name.split(".")[-2]
        heads = 0
        if config.architecture in GGUF_PERMUTED_QK and kind in ("attn_q", "attn_k"):
            heads = config.n_heads if kind == "attn_q" else config.n_kv_heads
        w = stored(t, heads if len(t.shape) > 1 else 0)
        if len(w.shape) == 1:  # a norm or a bias: small, read now
            v = w.dequantize()
            state[name] = unpermute_qk(v, heads) if heads else v
        else:
            state[name] = w
    return config, state, _tokenizer(meta, path)


def _tokenizer(meta: dict[str, Any], path: Path) -> TextTokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind not in _TOKENIZERS:
        raise UnsupportedModel(f"{path}: GGUF tokenizer.ggml.model {kind!r} is not supported; supported: 'gpt2' (byte-level "
                               "BPE: Llama 3, Qwen, SmolLM) and 'llama' (SentencePiece: Llama 2, Mistral, Gemma, Phi-3)")
    if not meta.get("tokenizer.ggml.tokens"):
        raise ModelLoadError(f"{path}: no tokenizer.ggml.tokens; the file holds no vocabulary")
    build, bos_by_default = _TOKENIZERS[kind]
    try:
        return TextTokenizer(build(meta), _tokenizer_meta(meta, bos_by_default))
    except (ModelLoadError, UnsupportedModel) as e:
        raise type(e)(f"{path}: {e}") from None


def _tokenizer_meta(meta: dict[str, Any], bos_by_default: bool) -> TokenizerMeta:
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
    for candidate in _END_OF_TURN:
        if template and candidate in template and candidate in tokens:
            eos_ids.add(tokens.index(candidate))
    return TokenizerMeta(
        bos_token=tok("tokenizer.ggml.bos_token_id"),
        eos_token=tok("tokenizer.ggml.eos_token_id"),
        eos_ids=tuple(sorted(eos_ids)),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", bos_by_default)),
        chat_template=template,
    )

