"""The tokenizer of moe_files.py's random-weight files: SmolLM2's byte-level BPE (its tokens, types and
merges, from the default model's GGUF) padded with unused tokens to the real model's vocabulary size,
the real model's special tokens at their real ids, and its chat template from llama.cpp's
models/templates. A reply's text is SmolLM2-tokenized, but every id, count and special token the
servers see is the real model's."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5  # gguf.TokenType

# Qwen3's added tokens (tokenizer_config.json's added_tokens_decoder). The converter types a token that
# looks like <|...|> as control; <tool_call>, <think> and the like are not special: user-defined.
QWEN3_SPECIALS = tuple(
    (151643 + i, text, CONTROL if text.startswith("<|") else USER_DEFINED) for i, text in enumerate((
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
        "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
        "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
        "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
        "</tool_response>", "<think>", "</think>",
    ))
)

# o200k_harmony's specials: every id from 199998 to the end, the unnamed ones <|reserved_N|>.
_HARMONY = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
            200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>",
            200012: "<|call|>", 200018: "<|endofprompt|>"}
GPT_OSS_SPECIALS = tuple((i, _HARMONY.get(i, f"<|reserved_{i}|>"), CONTROL) for i in range(199998, 201088))


@functools.cache
def smollm_tokenizer() -> tuple[list[str], list[int], list[str]]:
    """SmolLM2's tokens, token types and merges, as its GGUF holds them."""
    import gguf

    from models import DEFAULT_MODEL, fetch

    fields = gguf.GGUFReader(str(fetch(DEFAULT_MODEL, quiet=True))).fields
    return tuple(fields[f"tokenizer.ggml.{k}"].contents() for k in ("tokens", "token_type", "merges"))


def vocabulary(specials, real_vocab: int, vocab: int, base: tuple[list[str], list[int], list[str]]):
    """(tokens, types, merges, id shift). The specials keep their distance from the end of the vocabulary,
    so a smaller `vocab` moves them down by the shift; SmolLM2's tokens fill the ids below them (as many as
    fit, with the merges among those), unused [PADn] tokens the rest. SmolLM2's own tokens that share a
    special's text become unused, so each text has one id."""
    shift = real_vocab - vocab
    first = min(i for i, _, _ in specials) - shift
    tokens, types, merges = base
    kept = min(len(tokens), first)
    if kept < 512:
        raise ValueError(f"a vocabulary of {vocab} leaves {kept} ids below the special tokens; at least 512 needed")
    special_texts = {text for _, text, _ in specials}
    out_tokens = [f"[PAD{i}]" for i in range(vocab)]
    out_types = [UNUSED] * vocab
    for i in range(kept):
        if tokens[i] not in special_texts:
            out_tokens[i], out_types[i] = tokens[i], types[i]
    for i, text, kind in specials:
        out_tokens[i - shift], out_types[i - shift] = text, kind
    if kept < len(tokens):
        known = set(out_tokens[:kept])
        merges = [m for m in merges if all(part in known for part in (*m.split(" ", 1), m.replace(" ", "", 1)))]
    return out_tokens, out_types, merges, shift


def add_vocabulary(writer, spec, real_vocab: int) -> None:
    """The tokenizer.* keys the converter writes for a gpt2-type tokenizer: model, pre-tokenizer, tokens,
    types, merges, bos/eos/padding ids, no BOS added, the chat template."""
    from tests.models.gguf_files import llama_cpp_source

    tokens, types, merges, shift = vocabulary(spec.specials, real_vocab, spec.vocab, smollm_tokenizer())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(spec.pre_tokenizer)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(spec.eos - shift)
    writer.add_pad_token_id(spec.pad - shift)
    writer.add_bos_token_id(spec.bos - shift)
    writer.add_add_bos_token(False)
    writer.add_chat_template((llama_cpp_source() / "models" / "templates" / spec.template).read_text())
