"""Mirostat (Basu et al., "Mirostat: a neural text decoding algorithm that directly controls perplexity"),
versions 1 and 2 as llama.cpp's `llama_sampler_mirostat` (m = 100) and `llama_sampler_mirostat_v2` define them.

Both keep the tokens whose surprisal (-log2 p) a per-request target `mu` allows, draw among them, and move
`mu` by eta times the drawn token's surprisal past tau, so the reply's surprisal settles near tau. `mu`
starts at 2 tau and lives with the request (`Sequence.mirostat`), as its generator does. llama.cpp runs
temperature then mirostat and no other filter (top-k, top-p, typical_p and min-p are ignored); penalties,
logit_bias and grammars still shape the logits first, as they do for every row.

A mirostat request does not draft: speculation samples several rows of one request in one step, and
each row's set depends on the `mu` the rows before it leave.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .sampling import SamplingParams

VERSIONS = (1, 2)
M = 100  # v1 estimates the distribution's Zipf exponent from its m most likely tokens (llama.cpp's m)
LN2 = math.log(2.0)


@dataclass
class MirostatState:
    """One request's target surprisal, in bits; moved after each token it samples."""

    mu: float

    @classmethod
    def start(cls, params: SamplingParams) -> MirostatState:
        return cls(2.0 * params.mirostat_tau)

    def observe(self, params: SamplingParams, p: float) -> None:
        """The drawn token had probability p among the tokens kept: mu moves against the error in surprisal."""
        surprise = -math.log2(p) if p > 0.0 else math.inf
        self.mu -= params.mirostat_eta * (surprise - params.mirostat_tau)


def zipf_exponent(logp: torch.Tensor) -> float | None:
    """v1's s_hat: the least-squares Zipf exponent over the leading log-probabilities logp [n] (sorted
    descending, finite); None with fewer than two."""
    n = logp.shape[0]
    if n < 2:
        return None
    i = torch.arange(n - 1, dtype=torch.float64)
    t = torch.log((i + 2) / (i + 1))  # log of the rank ratio
    b = (logp[:-1] - logp[1:]).double()  # log of the probability ratio
    return float((t * b).sum() / (t * t).sum())


def v1_k(s_hat: float, mu: float, vocab: int) -> int:
    """How many of the most likely tokens v1 keeps: k = (eps 2^mu / (1 - V^-eps))^(1 / s_hat), eps = s_hat - 1,
    worked in logs (2^mu overflows as mu climbs), truncated as llama.cpp's int(k), within 1..vocab."""
    eps = s_hat - 1.0
    ratio = eps / (1.0 - vocab ** -eps) if abs(eps) > 1e-9 else 1.0 / math.log(vocab)  # its limit at eps 0
    numerator = math.log(ratio) + mu * LN2
    if s_hat <= 0.0:  # a flat head: k is 0 or unbounded
        return vocab if numerator > 0 else 1
    log_k = numerator / s_hat
    if log_k >= math.log(vocab):
        return vocab
    return max(int(math.exp(log_k)), 1)


def mirostat_weights(scaled: torch.Tensor, params: SamplingParams, mu: float) -> torch.Tensor:
    """scaled [V], one row's logits over its temperature -> its sampling weights [V] (0: dropped), in id
    order, as plain sampling's are: with every token kept they are its softmax, and it draws the same."""
    probs = scaled.softmax(0)
    vocab = probs.shape[0]
    if params.mirostat == 1:
        logp = scaled.log_softmax(0)
        head = logp.topk(min(M, vocab)).values
        s_hat = zipf_exponent(head[torch.isfinite(head)])
        k = 1 if s_hat is None else v1_k(s_hat, mu, vocab)
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[logp.topk(k).indices] = True
    else:
        keep = probs.log2().neg() <= mu  # v2: every token whose surprisal is at most mu
        if not keep.any():
            keep[probs.argmax()] = True
    return torch.where(keep, probs, torch.zeros(()))
