"""Text <-> token ids, special tokens, EOS set and the chat template, around a `tokenizers.Tokenizer`."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from . import template_env
from .config import UnsupportedModel

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# o200k's (gpt-oss, Llama 4): cased words, an apostrophe suffix kept with them, numbers by threes
GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class ChatTemplateError(ValueError):
    """The chat template could not render the given messages."""


def _byte_level(split: str | None, individual_digits: bool = False):
    steps = [pre_tokenizers.Digits(individual_digits=True)] if individual_digits else []
    if split is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    return pre_tokenizers.Sequence(steps)


# llama.cpp's `tokenizer.ggml.pre` names -> how text is split before BPE.
GGUF_PRE_TOKENIZERS = {
    "default": lambda: _byte_level(None),
    "gpt2": lambda: _byte_level(None),
    "smollm": lambda: _byte_level(None, individual_digits=True),
    "llama-bpe": lambda: _byte_level(LLAMA3_SPLIT),
    "llama3": lambda: _byte_level(LLAMA3_SPLIT),
    "qwen2": lambda: _byte_level(QWEN2_SPLIT),
    "gpt-4o": lambda: _byte_level(GPT4O_SPLIT),
}


def byte_level_bpe_from_gguf(meta: dict[str, Any]) -> Tokenizer:
    """Rebuild a byte-level BPE tokenizer from `tokenizer.ggml.*` metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModel(f"unsupported GGUF tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise UnsupportedModel(f"unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(GGUF_PRE_TOKENIZERS)}")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = GGUF_PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or []
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4]
    tok.add_special_tokens(control)
    tok.add_tokens(user)
    return tok


@dataclass(frozen=True)
class TokenizerMeta:
    """What a tokenizer needs beyond its vocabulary: specials, EOS set, BOS policy, chat template."""

    bos_token: str | None = None
    eos_token: str | None = None
    eos_ids: tuple[int, ...] = ()
    add_bos: bool = False
    chat_template: str | None = None
    extra: dict[str, str] = field(default_factory=dict)  # other special tokens the template may name


class TextTokenizer:
    """Encodes, decodes and renders chat prompts for one model."""

    def __init__(self, tokenizer: Tokenizer, meta: TokenizerMeta) -> None:
        self.tokenizer = tokenizer
        self.meta = meta
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_id = tokenizer.token_to_id(meta.bos_token) if meta.bos_token else None
        self.eos_ids = frozenset(meta.eos_ids)
        self._template = template_env.environment().from_string(meta.chat_template) if meta.chat_template else None

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special and self.meta.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    @property
    def template_has_tools(self) -> bool:
        """Whether the chat template renders a `tools` list itself."""
        return "tools" in (self.meta.chat_template or "")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, documents: list[dict[str, Any]] | None = None) -> str:
        if self._template is None:
            # A model without a template gets plain "role: content" lines, as llama.cpp does for raw models.
            body = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
            return body + ("assistant: " if add_generation_prompt else "")
        # SmolLM3's template reads its tools as `xml_tools` (its model card passes them so)
        named = {"xml_tools": tools} if tools and "xml_tools" in (self.meta.chat_template or "") else {}
        try:
            return self._template.render(
                messages=template_env.template_messages(messages),
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=documents,
                bos_token=self.meta.bos_token or "",
                eos_token=self.meta.eos_token or "",
                **{**named, **self.meta.extra},
            )
        # a template's own failure on what it was given (raise_exception, or None iterated, a key missing):
        # the request's to fix, never the server's
        except (TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None

    def save(self, folder: Path) -> None:
        self.tokenizer.save(str(folder / "tokenizer.json"))
        meta = asdict(self.meta)
        (folder / "tokenizer_meta.json").write_text(json.dumps(meta, indent=2))

    @staticmethod
    def load(folder: Path) -> TextTokenizer:
        meta = json.loads((folder / "tokenizer_meta.json").read_text())
        meta["eos_ids"] = tuple(meta["eos_ids"])
        return TextTokenizer(Tokenizer.from_file(str(folder / "tokenizer.json")), TokenizerMeta(**meta))
