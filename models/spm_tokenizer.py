"""SentencePiece vocabularies in GGUF files (`tokenizer.ggml.model == "llama"`: Llama 2, Mistral 7B v0.1-v0.3,
Gemma 1-3, Phi-3), rebuilt as a `tokenizers.Tokenizer` that splits text as llama.cpp's `llm_tokenizer_spm` does.

llama.cpp starts from one symbol per UTF-8 character and, over and over, joins the adjacent pair whose
concatenation is a token of the highest score (the leftmost on a tie); a symbol that never became a token is
written as its <0xNN> byte tokens. A `tokenizers` BPE does the same when its merges are every pair of tokens whose
concatenation is a token, ranked by that token's score, and it falls back to bytes. The one place they can part:
BPE ranks are all distinct, so two different tokens of equal score are ordered by id, not by position. The normal
pieces of a trained SentencePiece vocabulary have distinct scores.

Around the merges, as llama.cpp: spaces are written "▁"; when `tokenizer.ggml.add_space_prefix` (default true;
Gemma's files say false) every run of text that starts the input or follows a special token gets a leading "▁"
(a normalizer runs on each piece between added tokens, so Prepend does exactly that); and control, unknown and
user-defined tokens are matched whole in the text before any of this, as llama.cpp's special-token partition does.
"""
from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

from .errors import ModelLoadError

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space
# llama.cpp strips the whitespace after Phi-3's special tokens (its tokenizer.json says rstrip), except these;
# it knows a Phi-3 file by its general.name alone
PHI3_NAMES = ("phi-3", "phi3")
PHI3_NO_RSTRIP = ("<unk>", "<s>", "<|endoftext|>")


def score_ranked_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every (left, right) pair of tokens whose concatenation is a token, that token's best score first."""
    ids = {t: i for i, t in enumerate(tokens)}  # a repeated string means its last id, as llama.cpp's map
    ranked = []
    for i, token in enumerate(tokens):
        if ids[token] != i:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _array(meta: dict[str, Any], key: str, n: int, default) -> list:
    values = meta.get(key)
    if values is None:  # llama.cpp reads a missing array as all default
        return [default] * n
    values = list(values)
    if len(values) != n:
        raise ModelLoadError(f"GGUF {key} has {len(values)} entries for {n} tokens")
    return values


def sentencepiece_from_gguf(meta: dict[str, Any]) -> Tokenizer:
    """Rebuild a SentencePiece (`tokenizer.ggml.model == "llama"`) vocabulary from `tokenizer.ggml.*` metadata."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    scores = [float(s) for s in _array(meta, "tokenizer.ggml.scores", len(tokens), 0.0)]
    types = [int(t) for t in _array(meta, "tokenizer.ggml.token_type", len(tokens), NORMAL)]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    if unk_id is None or not 0 <= unk_id < len(tokens):  # older files leave it out; their <unk> has its type
        unk_id = next((i for i, ty in enumerate(types) if ty == UNKNOWN), None)
    unk = tokens[unk_id] if unk_id is not None else None
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=score_ranked_merges(tokens, scores), unk_token=unk, byte_fallback=True,
                     fuse_unk=False)
    tok = Tokenizer(bpe)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    prepend = [normalizers.Prepend(SPACE)] if prefix else []
    tok.normalizer = normalizers.Sequence([*prepend, normalizers.Replace(" ", SPACE)])
    # llama.cpp drops the space it prepended from the first token it prints
    unprepend = [decoders.Strip(" ", 1, 0)] if prefix else []
    decode = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *unprepend]
    tok.decoder = decoders.Sequence(decode)

    name = str(meta.get("general.name", "")).lower()
    phi3 = any(n in name for n in PHI3_NAMES)

    def added(token: str, special: bool) -> AddedToken:
        return AddedToken(token, special=special, normalized=False, rstrip=phi3 and token not in PHI3_NO_RSTRIP)

    # Control and unknown tokens are special (hidden when decoding without specials); user-defined ones print.
    tok.add_special_tokens([added(t, True) for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN)])
    tok.add_tokens([added(t, False) for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    return tok
