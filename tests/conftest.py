"""Shared fixtures: the real SmolLM2 model, tiny random HF checkpoints, and live servers."""
from __future__ import annotations

import os

# Before torch loads libgomp, which reads it once: an OpenMP thread waiting at a barrier spins this many
# rounds, then sleeps. `make test` runs two workers, each with a server whose two threads spin, on a
# 2-core machine; at libgomp's default a thread spins out its whole time slice while the thread it waits
# for is off the CPU, and a one-token step took a second.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import json
from pathlib import Path

import pytest
import torch

from models import DEFAULT_MODEL, fetch, load_model

from .live_server import LiveServer

torch.manual_seed(0)


def pytest_collection_modifyitems(items):
    """Files with a long drill (marked slow) go first: `make test`'s workers take whole files in this
    order, and a long file started last would leave one worker idle while it runs."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: each file keeps its own order


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    return fetch(DEFAULT_MODEL, quiet=True)


@pytest.fixture(scope="session")
def smollm(smollm_path):
    return load_model(DEFAULT_MODEL)


def write_tiny_checkpoint(folder: Path, arch: str, tokenizer_source, tie: bool = False, seed: int = 0) -> Path:
    """A random transformers checkpoint (Llama with GQA, or Qwen2 with qkv bias) plus a real tokenizer."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=tokenizer_source.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, rope_theta=10000.0,
    )
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # make the biases matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(folder)
    tokenizer_source.tokenizer.save(str(folder / "tokenizer.json"))
    meta = tokenizer_source.meta
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": meta.chat_template, "eos_token": meta.eos_token, "bos_token": meta.bos_token,
        "add_bos_token": False,
    }))
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, smollm):
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama": write_tiny_checkpoint(root / "llama", "llama", smollm.tokenizer, seed=1),
        "qwen2": write_tiny_checkpoint(root / "qwen2", "qwen2", smollm.tokenizer, seed=2),
        "tied": write_tiny_checkpoint(root / "tied", "llama", smollm.tokenizer, tie=True, seed=3),
    }


@pytest.fixture(scope="session")
def served_model(smollm_path):
    """SmolLM2 on the weights `kvserve serve` picks by default (q4 where the kernels build)."""
    from models.catalog import DEFAULT_WEIGHTS
    from models.loader import resolve_weights

    return load_model(DEFAULT_MODEL, weights=resolve_weights(DEFAULT_WEIGHTS))


@pytest.fixture(scope="session")
def fast_server(served_model):
    """One shared server on the served model, for tests that only read from it or clean up after them."""
    with LiveServer(served_model) as server:
        yield server


@pytest.fixture(scope="session")
def smollm_server(smollm):
    """One shared server on the real model, for tests that only read from it."""
    with LiveServer(smollm) as server:
        yield server
