"""Locally typical sampling (typical_p), as llama.cpp's `llama_sampler_typical` defines it (Meister et al.,
"Locally Typical Sampling"): keep the tokens whose surprisal -log p lies closest to the distribution's
entropy, nearest first, until their mass exceeds p; at least one.

A typical_p row runs its filters in llama.cpp's chain, each on what the one before it kept, renormalized:
top-k, then typical_p, then top-p and min-p. (A row without typical_p filters as vLLM does, every filter on
the whole distribution; llama.cpp's order matters here, since typical sampling may drop the most likely
token, which top-p and min-p always keep.) Temperature comes first, as for every other row.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .sampling import SamplingParams


def typical_keep(logp: torch.Tensor, p: float) -> torch.Tensor:
    """logp [n], log-probabilities that sum to one (-inf: already dropped) -> bool [n], the tokens typical_p
    keeps: by |surprisal - entropy| ascending, up to and including the first whose running mass exceeds p."""
    probs = logp.exp()
    entropy = -torch.where(probs > 0, probs * logp, torch.zeros(())).sum()
    shifted = (-logp - entropy).abs()  # +inf where dropped: those sort last
    order = shifted.argsort(stable=True)
    mass = probs[order].cumsum(0)
    before = torch.cat([torch.zeros(1), mass[:-1]])  # the mass ahead of each token in that order
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order] = before <= p  # the first always (min_keep 1): nothing is ahead of it
    return keep & (probs > 0)


def typical_weights(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """scaled [V], one row's logits over its temperature -> its sampling weights [V] (0: dropped), in id
    order: top-k, typical_p, then top-p and min-p, each renormalized over what the one before it kept."""
    vocab = scaled.shape[0]
    k = min(params.top_k, vocab) if params.top_k > 0 else vocab
    top, ids = scaled.topk(k) if k < vocab else scaled.sort(descending=True)  # sorted descending
    logp = top.log_softmax(0)
    keep = typical_keep(logp, params.typical_p)
    logp = logp.masked_fill(~keep, float("-inf")).log_softmax(0)  # what typical kept, renormalized
    probs = logp.exp()
    if params.top_p < 1.0:
        keep &= ~((probs.cumsum(0) - probs) > params.top_p)  # the smallest prefix reaching top_p
    if params.min_p > 0.0:
        keep &= ~(probs < params.min_p * probs.max())
    weights = torch.zeros(vocab)
    weights[ids[keep]] = probs[keep]
    return weights
