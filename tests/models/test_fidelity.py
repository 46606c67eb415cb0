"""Each faster weights mode against the exact f32 path, on the real SmolLM2 model."""
import math

import pytest
import torch

from kvcache import REGISTRY, SessionCache
from models import DEFAULT_MODEL, load_model
from server.config import EngineConfig
from server.engine.kv_pool import kv_layout

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics state that",
    "My favourite recipe for pancakes is",
    "In 1969, the first humans",
    "Photosynthesis is the process by which",
    "The best way to learn a new language is",
]
NO_ROWS = torch.zeros(0, dtype=torch.long)  # no hidden rows: the program's embedding output stays empty
TEXT = (
    "The Industrial Revolution began in Great Britain in the late eighteenth century. New machines, "
    "powered first by water and then by steam, changed how goods were made. Factories grew in towns, "
    "and many people moved from the countryside to work in them. Railways and canals carried coal, "
    "iron and cotton across the country, and trade with other nations increased quickly."
)


def greedy_batch(model, prompts, n_tokens):
    """Greedy continuations of all prompts, decoded together in one step per token, with the KV dtype
    the server gives this model (float16 beside approximate weights)."""
    tok = model.tokenizer
    keys = [f"fidelity-{model.weights}-{i}" for i in range(len(prompts))]
    ids = [tok.encode(p) for p in prompts]
    last = []
    with torch.inference_mode():
        for key, p in zip(keys, ids):
            REGISTRY.install(key, SessionCache(kv_layout(model, EngineConfig().kv_dtype, 256)))
            with REGISTRY.active(key):
                logits, _ = model.forward(torch.tensor([p]), torch.arange(len(p)).unsqueeze(1), torch.tensor([len(p) - 1]), NO_ROWS)
                last.append(int(logits[0].argmax()))
        outs = [[t] for t in last]
        step = REGISTRY.set_active([(k, 1) for k in keys])
        for i in range(n_tokens - 1):
            pos = torch.tensor([[len(p) + i] for p in ids])
            logits, _ = model.forward(torch.tensor([[o[-1] for o in outs]]), pos, torch.arange(len(keys)), NO_ROWS)
            step.commit()
            for o, t in zip(outs, logits.argmax(-1).tolist()):
                o.append(t)
        REGISTRY.set_active(None)
    for k in keys:
        REGISTRY.uninstall(k)
    return outs


def perplexity(model, text):
    ids = model.tokenizer.encode(text)
    key = f"ppl-{model.weights}"
    REGISTRY.install(key, SessionCache(kv_layout(model, EngineConfig().kv_dtype, len(ids))))
    with REGISTRY.active(key), torch.inference_mode():
        logits, _ = model.forward(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(1), torch.arange(len(ids) - 1), NO_ROWS)
    REGISTRY.uninstall(key)
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))
    return math.exp(float(nll))


def greedy_alone(model, prompt, n_tokens):
    """Greedy continuation of one prompt decoded by itself: one row a step, the path a lone stream takes."""
    return greedy_batch(model, [prompt], n_tokens)[0]


def agreement(exact, approx):
    return sum(a == b for x, y in zip(exact, approx) for a, b in zip(x, y)) / sum(len(x) for x in exact)


@pytest.fixture(scope="module")
def exact_greedy(smollm):
    return greedy_batch(smollm, PROMPTS, 64)


@pytest.mark.parametrize("weights", ["f16", "q4"])
def test_weights_mode_fidelity(smollm, exact_greedy, weights):
    """int16 activations keep greedy tokens the float model's."""
    fast = load_model(DEFAULT_MODEL, weights=weights, activations="int16")
    assert fast.weights == weights
    agree = agreement(exact_greedy, greedy_batch(fast, PROMPTS, 64))
    assert agree >= 0.9, f"{weights} agrees with f32 on {agree:.1%} of greedy tokens"
    p_exact, p_fast = perplexity(smollm, TEXT), perplexity(fast, TEXT)
    assert abs(p_fast - p_exact) / p_exact <= 0.05, (p_exact, p_fast)


def test_q4_single_stream_fidelity(exact_greedy):
    """Below 4 rows q4 runs its dot products straight off the blocks, not the GEMM of the batched test."""
    fast = load_model(DEFAULT_MODEL, weights="q4", activations="int16")
    agree = agreement(exact_greedy, [greedy_alone(fast, p, 64) for p in PROMPTS])
    assert agree >= 0.9, f"q4 decoding one stream agrees with f32 on {agree:.1%} of greedy tokens"


def test_int8_activations_keep_the_perplexity(smollm, exact_greedy):
    """The default, int8 activations (llama.cpp's precision): greedy replies part from the float model's
    where logits are near-tied, as llama-server's do, but the perplexity stays the exact product's, and
    the first token of each prompt (no earlier parting) mostly agrees."""
    served = load_model(DEFAULT_MODEL, weights="auto")
    assert served.activations == "int8"
    p_exact, p_served = perplexity(smollm, TEXT), perplexity(served, TEXT)
    assert abs(p_served - p_exact) / p_exact <= 0.05, (p_exact, p_served)
    firsts = [o[0] for o in greedy_batch(served, PROMPTS, 1)]
    assert sum(a == b[0] for a, b in zip(firsts, exact_greedy)) >= 6, (firsts, [b[0] for b in exact_greedy])
