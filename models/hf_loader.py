"""Read a Hugging Face checkpoint folder: config, (sharded) safetensors, tokenizer files."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from .architectures import HF_NORMS_OFFSET_BY_ONE
from .config import ModelConfig
from .hf_config import from_hf_config
from .errors import ModelLoadError
from .tokenizer import TextTokenizer, TokenizerMeta


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from None


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def read_hf_config(folder: Path) -> ModelConfig:
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder}: no config.json; a Hugging Face model folder needs one")
    gen = _json(folder / "generation_config.json")
    eos = gen.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (eos,) if eos is not None else ()
    return from_hf_config(_json(folder / "config.json"), eos_ids)


def read_hf(folder: Path, dtype: torch.dtype = torch.float32, progress: bool = False):
    """-> (ModelConfig, state dict in our names, TextTokenizer)."""
    folder = Path(folder)
    config = read_hf_config(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(_json(index)["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        for key, w in load_file(str(folder / name)).items():
            if key.endswith("rotary_emb.inv_freq"):
                continue
            key = key.removeprefix("model.")
            state[key] = w.to(dtype) if w.dim() > 1 else w.float()
    if config.architecture in HF_NORMS_OFFSET_BY_ONE:  # Gemma's norms scale by 1 + w: store 1 + w, in float32
        state = {k: w + 1 if k.endswith("norm.weight") else w for k, w in state.items()}
    return config, state, read_hf_tokenizer(folder, config)


def read_hf_tokenizer(folder: Path, config: ModelConfig) -> TextTokenizer:
    if not (folder / "tokenizer.json").is_file():
        raise ModelLoadError(f"{folder}: no tokenizer.json")
    tc = _json(folder / "tokenizer_config.json")
    template = tc.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos_ids = set(config.eos_ids)
    eos_token = _token_text(tc.get("eos_token"))
    if eos_token is not None and tok.token_to_id(eos_token) is not None:
        eos_ids.add(tok.token_to_id(eos_token))
    bos_token = _token_text(tc.get("bos_token"))
    meta = TokenizerMeta(
        bos_token=bos_token,
        eos_token=eos_token,
        eos_ids=tuple(sorted(eos_ids)),
        add_bos=bool(tc.get("add_bos_token", False)) and bos_token is not None,
        chat_template=template if isinstance(template, str) else None,
    )
    return TextTokenizer(tok, meta)
