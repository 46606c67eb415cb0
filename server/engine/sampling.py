"""Token sampling outside the graph, vectorized over the rows of a step.

Every row draws its one uniform number from its own request's generator, so a seeded request samples
the same tokens whatever else shares its batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from .mirostat import MirostatState, mirostat_weights
from .typical import typical_weights

if TYPE_CHECKING:
    from .constraints import Constraint


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings; temperature 0 means greedy."""

    max_tokens: int | None = None  # None: what room the session has left (the engine decides, once)
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # The text that ends each block of a reply made of blocks (a forced tool call's): a block identical to an
    # earlier one ends the reply before it, as a stop string would, so a call is never repeated to the limit
    stop_repeats: str | None = None
    # The grammar's output is wanted whole (a forced tool call): a max_tokens too few for its shortest form is
    # refused before a token runs, where other grammars' output is cut at max_tokens as vLLM cuts it
    whole_output: bool = False
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's plus the top k
    logit_bias: tuple[tuple[int, float], ...] = ()  # added to those tokens' logits; -100 bans a token
    grammar: str | None = None  # an llguidance grammar the output must match (server/engine/constraints.py)
    prompt_logprobs: int | None = None  # None: none; k >= 0: each prompt token's logprob plus the top k (echo)
    # What the penalties count. None: vLLM's rule, repetition over the prompt and the reply, presence and
    # frequency over the reply. n > 0: llama.cpp's (Ollama's repeat_last_n), all three over the last n tokens
    # of the context, prompt and reply together; -1: the whole context; 0: no penalties.
    penalty_window: int | None = None
    typical_p: float = 1.0  # locally typical sampling (typical.py); 1: off
    mirostat: int = 0  # 1 or 2: llama.cpp's mirostat (mirostat.py), in place of the filters; 0: off
    mirostat_tau: float = 5.0  # the target surprisal, in bits
    mirostat_eta: float = 0.1  # how fast mu follows it
    # False: the reply's text keeps control tokens (vLLM's skip_special_tokens), where a tool-call format's
    # markers are ones (Mistral's [TOOL_CALLS]); the engine never reads it, the output stream does
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filters(self) -> bool:
        """Whether top-k, top-p or min-p narrow what it samples from."""
        return self.top_k != 0 or self.top_p < 1.0 or self.min_p != 0.0

    @property
    def penalized(self) -> bool:
        return self.penalty_window != 0 and (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0)

    @property
    def drawn_alone(self) -> bool:
        """Whether each of its rows is drawn by itself: mirostat and typical_p keep a set of their own per row,
        found in their own way, so they are not batched with other rows."""
        return self.mirostat != 0 or self.typical_p < 1.0


@dataclass
class SampleRow:
    """What the sampler needs from one row's request."""

    params: SamplingParams
    generator: torch.Generator
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    constraint: Constraint | None = None  # the grammar the row's output must match
    ahead: tuple[int, ...] = ()  # drafts this row follows, not yet in the constraint's state (drafts.py)
    mirostat: MirostatState | None = None  # its request's mu, moved by the token this row samples

    @property
    def left(self) -> int:
        """Tokens the row's reply may still take, this one included."""
        return self.params.max_tokens - len(self.output_ids)


@dataclass(frozen=True)
class Sampled:
    """One sampled token, with log-probabilities when asked for."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


def _last(prompt: list[int], output: list[int], n: int) -> list[int]:
    """The last n tokens of the context, prompt then output (n -1: all of it), without copying the prompt whole."""
    if n < 0 or n >= len(prompt) + len(output):
        return [*prompt, *output]
    if n <= len(output):
        return output[len(output) - n :]
    return [*prompt[len(prompt) - (n - len(output)) :], *output]


def _penalize(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    m, vocab = logits.shape
    counts = torch.zeros(m, vocab)
    seen = torch.zeros(m, vocab, dtype=torch.bool)
    for i, r in enumerate(rows):
        if r.params.penalty_window is not None:  # llama.cpp's: every penalty counts the window's tokens
            window = _last(r.prompt_ids, r.output_ids, r.params.penalty_window) if r.params.penalized else []
            if window:
                counts[i].index_add_(0, torch.tensor(window, dtype=torch.long).clamp_(0, vocab - 1), torch.ones(len(window)))
            continue
        if r.output_ids:
            out = torch.tensor(r.output_ids, dtype=torch.long).clamp_(0, vocab - 1)
            counts[i].index_add_(0, out, torch.ones(len(out)))
        if r.prompt_ids and r.params.repetition_penalty != 1.0:
            seen[i, torch.tensor(r.prompt_ids, dtype=torch.long).clamp_(0, vocab - 1)] = True
    seen |= counts > 0
    rep = torch.tensor([r.params.repetition_penalty for r in rows]).unsqueeze(1)  # [m, 1]
    pres = torch.tensor([r.params.presence_penalty for r in rows]).unsqueeze(1)
    freq = torch.tensor([r.params.frequency_penalty for r in rows]).unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    return logits - freq * counts - pres * (counts > 0).float()


def _filter_sorted(sorted_logits: torch.Tensor, log_total: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Mask (to -inf) what top-k, top-p and min-p remove, on the leading logits of each row sorted
    descending [m, C]; log_total [m, 1] is the logsumexp over the whole vocabulary."""
    vocab = sorted_logits.shape[1]
    ranks = torch.arange(vocab).unsqueeze(0)  # [1, C]
    top_k = torch.tensor([min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in rows]).unsqueeze(1)
    top_p = torch.tensor([r.params.top_p for r in rows]).unsqueeze(1)
    min_p = torch.tensor([r.params.min_p for r in rows]).unsqueeze(1)
    probs = (sorted_logits - log_total).exp()  # probabilities in the full distribution
    drop = ranks >= top_k
    drop |= (probs.cumsum(-1) - probs) > top_p  # keeps the smallest prefix reaching top_p
    drop |= probs < min_p * probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    return sorted_logits.masked_fill(drop, float("-inf"))


CANDIDATES = 256  # a top-k/top-p/min-p row is filtered among its leading candidates when they hold enough mass


def _candidates(scaled: torch.Tensor, rows: list[SampleRow]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Unnormalized sampling weights [m, C] and their token ids [m, C] (None: all V tokens, in id order).

    Sorting the whole vocabulary (49k logits) costs milliseconds a step, so plain sampling draws
    from the unsorted distribution, and a filtering row sorts only its top candidates; the full sort
    remains for top-p mass spread beyond them.
    """
    params = [r.params for r in rows]
    if not any(p.filters for p in params):
        return scaled.softmax(-1), None
    m, vocab = scaled.shape
    log_total = scaled.logsumexp(-1, keepdim=True)  # [m, 1]
    k = min(vocab, max(CANDIDATES, *(p.top_k for p in params)))
    top, order = scaled.topk(k, dim=-1)  # [m, k] each, sorted descending
    short = [i for i, (p, row, lt) in enumerate(zip(params, top, log_total)) if k < vocab and not _covered(p, row, lt, k)]
    if short:
        # Only the rows whose kept tokens reach past the candidates are sorted whole (a full sort of the
        # vocabulary dwarfs the rest of sampling; at temperature 1 and top-p 0.95 few rows need it); the others keep
        # their candidates, with -inf after them, which their filters would have masked anyway.
        wide_top = torch.full((m, vocab), float("-inf"))
        wide_order = torch.zeros((m, vocab), dtype=torch.long)
        wide_top[:, :k], wide_order[:, :k] = top, order
        which = torch.tensor(short)
        wide_top[which], wide_order[which] = scaled[which].sort(dim=-1, descending=True)
        top, order = wide_top, wide_order
    return _filter_sorted(top, log_total, rows).softmax(-1), order


def _covered(p: SamplingParams, top: torch.Tensor, log_total: torch.Tensor, k: int) -> bool:
    """Whether a row's kept tokens all lie among its k leading candidates top [k] (sorted descending)."""
    if 0 < p.top_k <= k:
        return True
    if p.top_p < 1.0 and float((top - log_total).exp().sum()) >= p.top_p:
        return True
    return p.min_p > 0.0 and float(top[-1] - top[0]) < math.log(p.min_p)


RANKED = 4  # the model's choices a reply near its end may take instead of one it could not close after
BANNED = -100.0  # OpenAI's logit_bias floor: "should result in a ban"


def _constrain(logits: torch.Tensor, rows: list[SampleRow], allowed: list[np.ndarray | None]) -> torch.Tensor:
    """Apply logit_bias and grammar masks, row by row; rows with neither are left as they are."""
    logits = logits.clone()
    for i, (r, mask) in enumerate(zip(rows, allowed)):
        if r.params.logit_bias:
            ids = torch.tensor([t for t, _ in r.params.logit_bias])
            bias = torch.tensor([float("-inf") if b <= BANNED else b for _, b in r.params.logit_bias])
            logits[i, ids] += bias
        if mask is not None:
            logits[i].masked_fill_(torch.from_numpy(~mask), float("-inf"))
    return logits


def _draw(logits: torch.Tensor, rows: list[SampleRow], u: torch.Tensor) -> torch.Tensor:
    """logits [m, V] of rows that all filter or none does, u [m] their uniform draws -> the tokens [m]."""
    scaled = logits / torch.tensor([r.params.temperature for r in rows]).unsqueeze(1)  # [m, V]
    probs, order = _candidates(scaled, rows)  # [m, C] each (order None: the whole vocabulary, unsorted)
    cdf = probs.cumsum(-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1)).clamp_(max=probs.shape[1] - 1)  # [m, 1]
    return (pick if order is None else order.gather(1, pick)).squeeze(1)


def _draw_alone(logits: torch.Tensor, r: SampleRow, u: torch.Tensor) -> int:
    """logits [V] of a mirostat or typical_p row, u its uniform draw -> its token; a mirostat row's mu moves."""
    scaled = logits / r.params.temperature
    if r.params.mirostat:
        weights = mirostat_weights(scaled, r.params, r.mirostat.mu)
    else:
        weights = typical_weights(scaled, r.params)
    cdf = weights.cumsum(0)
    token = int(torch.searchsorted(cdf, (u * cdf[-1]).reshape(1)).clamp_(max=len(cdf) - 1))
    if r.params.mirostat:
        r.mirostat.observe(r.params, float(weights[token] / cdf[-1]))
    return token


def sample(logits: torch.Tensor, rows: list[SampleRow], allowed: list[np.ndarray | None] | None = None) -> list[Sampled]:
    """logits [m, V] float32, one row per request that samples -> one token each. allowed[i], if given, is
    row i's grammar mask: bool [V], the tokens its constraint allows next."""
    raw = logits
    allowed = allowed or [None] * len(rows)
    if any(mask is not None or r.params.logit_bias for r, mask in zip(rows, allowed)):
        logits = _constrain(logits, rows, allowed)
    if any(r.params.penalized for r in rows):
        logits = _penalize(logits, rows)
    # numpy's argmax, not torch's: torch's CPU argmax over a vocabulary-wide row is an order of magnitude slower
    # (docs/performance.md); both return the first of equal maxima.
    tokens = torch.from_numpy(logits.detach().numpy().argmax(-1))  # [m]
    if not all(r.params.greedy for r in rows):
        u = torch.cat([torch.rand(1, generator=r.generator) for r in rows])  # [m], one draw per row
        # plain rows and filtering rows (top-k/p, min-p) are drawn apart, and mirostat and typical_p rows each
        # alone, so that a row's token never depends on what the other rows of its step ask for
        drawn = [i for i, r in enumerate(rows) if not r.params.greedy]
        for filters in (False, True):
            group = [i for i in drawn if rows[i].params.filters is filters and not rows[i].params.drawn_alone]
            if group:
                which = torch.tensor(group)
                tokens[which] = _draw(logits[which], [rows[i] for i in group], u[which])
        for i in drawn:
            if rows[i].params.drawn_alone:
                tokens[i] = _draw_alone(logits[i], rows[i], u[i])
    out = tokens.tolist()
    for i, r in enumerate(rows):
        if r.constraint is not None and not r.ahead:  # near its end, a reply takes only tokens it can close after (no draft comes near it)
            out[i] = r.constraint.settle(out[i], r.left, lambda i=i: logits[i].topk(RANKED).indices.tolist())
    if all(r.params.logprobs is None for r in rows):
        return [Sampled(t) for t in out]
    logp = raw.log_softmax(-1)
    result = []
    for i, (r, t) in enumerate(zip(rows, out)):
        if r.params.logprobs is None:
            result.append(Sampled(t))
            continue
        top = ()
        if r.params.logprobs > 0:
            values, ids = logp[i].topk(r.params.logprobs)
            top = tuple(zip(ids.tolist(), values.tolist()))
        result.append(Sampled(t, float(logp[i, t]), top))
    return result


def score(logits: torch.Tensor, targets: tuple[int, ...], top: int) -> list[Sampled]:
    """logits [r, V] float32, rows of a prompt, and targets [r], the prompt token after each row -> each
    target's log-probability, with the row's top `top`. Raw, before bias, penalties and grammar, as vLLM's
    prompt logprobs: they say how likely the model finds the text, not what the request would sample."""
    logp = logits.log_softmax(-1)  # [r, V]
    chosen = logp.gather(1, torch.tensor(targets, dtype=torch.long).unsqueeze(1)).squeeze(1).tolist()  # [r]
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(targets)
    if top > 0:
        values, ids = logp.topk(top, dim=-1)  # [r, top] each
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return [Sampled(t, lp, tp) for t, lp, tp in zip(targets, chosen, tops)]
