"""Runs one StepBatch through the exported program and samples the next tokens."""
from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import torch

from kvcache import CacheConfig, CacheRegistry, SessionCache
from models.export import LoadedModel

from .batch import StepBatch
from .sampling import Sampled, sample, score


WARM_UP_TOKENS = 8  # rows enough for every matmul to take its batched path once
WARM_UP_KEY = "kvserve-warm-up"


class ModelRunner:
    """Owns the exported program; called from the engine's single worker thread."""

    def __init__(self, model: LoadedModel, registry: CacheRegistry) -> None:
        self.model = model
        self.registry = registry
        # grammar masks are computed here while the model thread runs the forward
        self._masks = ThreadPoolExecutor(1, thread_name_prefix="kvserve-masks")

    def close(self) -> None:
        self._masks.shutdown(wait=True)

    def warm_up(self, layout: CacheConfig) -> None:
        """One throwaway forward before serving: fbgemm packs f16 weights on their first use, and the first
        forward at batch size faults in its buffers; no request should wait behind either."""
        n = min(WARM_UP_TOKENS, self.model.config.max_context)
        self.registry.install(WARM_UP_KEY, SessionCache(dataclasses.replace(layout, capacity=n)))
        try:
            with self.registry.active([(WARM_UP_KEY, n)]), torch.inference_mode():  # commits after the forward
                self.model.forward(  # [1, n], [n, 1], [n]; and every row's hidden state, so that path is warm too
                    torch.zeros(1, n, dtype=torch.long), torch.arange(n).unsqueeze(1), torch.arange(n), torch.arange(n)
                )
        finally:
            self.registry.uninstall(WARM_UP_KEY)

    def run(self, batch: StepBatch) -> tuple[list[Sampled], list[list[Sampled]], list[torch.Tensor]]:
        """set_active (validate, reserve) -> forward -> commit, or abort if it raised; sample the rows of
        the chunks that ask for it -> (one Sampled per sampled row, the scored rows of each scored chunk,
        the final normed hidden states [pooled, dim] of each pooling chunk), each in chunk order."""
        masks = [None if r.constraint is None else self._masks.submit(r.constraint.allowed_after, r.ahead) if r.ahead
                 else self._masks.submit(r.constraint.allowed, r.left) for r in batch.rows]
        tokens = [t for c in batch.chunks for t in c.tokens]
        positions = [c.start + i for c in batch.chunks for i in range(len(c.tokens))]
        ends, scored, pooled, at = [], [], [], 0
        for c in batch.chunks:
            scored += range(at, at + len(c.scored))  # a scored chunk's rows each predict a prompt token
            at += len(c.tokens)
            ends += range(at - c.sampled_rows, at)  # the last row predicts the token after it; so do drafts' rows
            pooled += range(at - c.pooled, at)  # an embedding's rows: their hidden states, not logits
        step = self.registry.set_active([(c.cache, len(c.tokens)) for c in batch.chunks])
        try:
            with torch.inference_mode():
                logits, hidden = self.model.forward(
                    torch.tensor([tokens], dtype=torch.long),  # [1, n]
                    torch.tensor(positions, dtype=torch.long).unsqueeze(1),  # [n, 1]
                    torch.tensor(ends + scored or [0], dtype=torch.long),  # [m]: the sampled rows, then the scored
                    torch.tensor(pooled, dtype=torch.long),  # [h]: none in a step without embeddings
                )
            step.commit()
        except BaseException:
            step.abort()
            raise
        finally:
            self.registry.set_active(None)
        sampled = sample(logits[: len(ends)], list(batch.rows), [m.result() if m is not None else None for m in masks]) if ends else []
        return sampled, self._scores(batch, logits[len(ends) :]) if scored else [], self._pooled(batch, hidden)

    @staticmethod
    def _scores(batch: StepBatch, rows: torch.Tensor) -> list[list[Sampled]]:
        """The scored rows [r, V], in chunk order -> each scored chunk's prompt logprobs."""
        out, at = [], 0
        for c in batch.chunks:
            if c.scored:
                out.append(score(rows[at : at + len(c.scored)], c.scored, c.scored_top))
                at += len(c.scored)
        return out

    @staticmethod
    def _pooled(batch: StepBatch, hidden: torch.Tensor) -> list[torch.Tensor]:
        """The hidden rows [h, dim], in chunk order -> each pooling chunk's own [pooled, dim]."""
        sizes = [c.pooled for c in batch.chunks if c.pooled]
        return list(hidden.split(sizes)) if sizes else []
