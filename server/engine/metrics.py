"""Prometheus metrics, named after vLLM's (prefix kvserve: instead of vllm:)."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_IO = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
_SESSIONS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class StepCounts:
    """What steps did, counted by the scheduler until the metrics take them."""

    preemptions: int = 0
    evictions: int = 0
    prefix_queries: int = 0  # prompt tokens admitted
    prefix_hits: int = 0  # of those, found in the KV
    drafts: int = 0  # drafted steps of a request (vLLM's spec_decode_num_drafts)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted: int = 0  # tokens the steps gave their requests
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted drafts by their position in the draft

    def drafted(self, drafts: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += drafts
        self.accepted_tokens += accepted
        self.accepted_per_pos += [0] * (accepted - len(self.accepted_per_pos))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1


class Metrics:
    """One engine's metrics, in a registry of its own (no process-global state)."""

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self.model_name = model_name

        def hist(name, doc, buckets=_LATENCY):
            return Histogram(name, doc, ["model_name"], registry=r, buckets=buckets).labels(model_name)

        def gauge(name, doc):
            return Gauge(name, doc, ["model_name"], registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, ["model_name"], registry=r).labels(model_name)

        self.ttft = hist("kvserve:time_to_first_token_seconds", "Time to first token")
        self.tpot = hist("kvserve:time_per_output_token_seconds", "Time per output token")
        self.e2e = hist("kvserve:e2e_request_latency_seconds", "End-to-end request latency")
        self.queue = hist("kvserve:request_queue_time_seconds", "Time spent waiting for admission")
        self.step_sessions = hist("kvserve:step_num_sessions", "Sessions per model step", _SESSIONS)
        self.running = gauge("kvserve:num_requests_running", "Requests in the running set")
        self.waiting = gauge("kvserve:num_requests_waiting", "Requests waiting for admission")
        self.kv_usage = gauge("kvserve:kv_cache_usage_perc", "Fraction of the KV budget held by caches")
        self.kv_bytes = gauge("kvserve:kv_cache_usage_bytes", "Bytes of the KV pool held by sessions (static reservations included)")
        self.kv_cached_bytes = gauge("kvserve:kv_cache_cached_bytes", "Bytes of the KV pool kept as reusable prefixes, held by no session")
        self.sessions = gauge("kvserve:num_sessions", "Sessions alive (persistent and temporary)")
        self.prompt_tokens = counter("kvserve:prompt_tokens", "Prompt tokens prefilled (reused KV excluded)")
        self.generation_tokens = counter("kvserve:generation_tokens", "Generated tokens")
        self.preemptions = counter("kvserve:num_preemptions", "Running requests preempted for KV memory")
        self.evictions = counter("kvserve:num_session_evictions", "Idle sessions whose KV was evicted")
        self.prefix_queries = counter("kvserve:prefix_cache_queries", "Prompt tokens looked up in the KV (sessions and prefix cache)")
        self.prefix_hits = counter("kvserve:prefix_cache_hits", "Prompt tokens found in the KV, not prefilled")
        self.prefix_mismatches = counter("kvserve:prefix_cache_mismatches", "Prefix hits refused: a cached block's token ids were not the request's (a bug; the block was recomputed)")
        self._seen: dict[str, int] = {}  # a running total's value when its counter last moved
        self.disk_blocks = gauge("kvserve:kv_disk_blocks", "KV blocks in the disk tier")
        self.disk_bytes = gauge("kvserve:kv_disk_bytes", "Bytes of KV blocks in the disk tier")
        self.disk_healthy = gauge("kvserve:kv_disk_healthy", "1 while the disk tier works; 0 once it failed (RAM only)")
        self.disk_full = gauge("kvserve:kv_disk_writes_paused",
                               "1 while the disk tier's disk is full: writes pause, reads go on, writing is retried")
        self.disk_hits = counter("kvserve:kv_disk_hits", "KV blocks read back from disk instead of recomputed")
        self.disk_misses = counter("kvserve:kv_disk_misses", "Read-backs that stopped at a block not on disk")
        self.disk_errors = counter("kvserve:kv_disk_errors", "Disk tier I/O failures and blocks or records that failed their checks")
        self.disk_read = hist("kvserve:kv_disk_read_seconds", "Time to read back one request's blocks from disk", _IO)
        self.disk_write = hist("kvserve:kv_disk_write_seconds", "Time to write one KV block behind", _IO)
        self.prefix_totals = [0, 0]  # queries, hits: the console's hit rate, without reading counters back
        # speculation, as vLLM's spec_decode_* counters
        self.spec_drafts = counter("kvserve:spec_decode_num_drafts", "Decode steps of a request that checked drafted tokens")
        self.spec_draft_tokens = counter("kvserve:spec_decode_num_draft_tokens", "Draft tokens checked")
        self.spec_accepted = counter("kvserve:spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.spec_emitted = counter("kvserve:spec_decode_num_emitted_tokens", "Tokens emitted by drafted steps: the drafts accepted and the token after them")
        self._spec_per_pos = Counter("kvserve:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by their position in the draft",
                                     ["model_name", "position"], registry=r)
        self.spec_totals = [0, 0]  # draft tokens, accepted: the status page's rate
        self._finished = Counter("kvserve:request_success", "Finished requests", ["model_name", "finished_reason"], registry=r)
        # per tenant: labelled by a short hash of its key, the tenants past the first few as "other"
        by_tenant = ["model_name", "tenant"]
        self._tenant_gauges = {
            "running": Gauge("kvserve:tenant_requests_running", "A tenant's requests in the running set", by_tenant, registry=r),
            "waiting": Gauge("kvserve:tenant_requests_waiting", "A tenant's requests waiting for admission", by_tenant, registry=r),
            "sessions": Gauge("kvserve:tenant_sessions", "A tenant's persistent sessions in RAM", by_tenant, registry=r),
            "kv_bytes": Gauge("kvserve:tenant_kv_usage_bytes", "Bytes of the KV pool a tenant's sessions hold", by_tenant, registry=r),
        }
        self._tenant_counters = {
            "tokens_served": Counter("kvserve:tenant_tokens_served", "Tokens served to a tenant: prompt tokens prefilled and tokens decoded", by_tenant, registry=r),
            "rejected": Counter("kvserve:tenant_requests_rejected", "A tenant's requests and sessions refused with 429", by_tenant, registry=r),
        }

    def observe(self, retired, counts: StepCounts) -> None:
        """What the steps since the last call finished and counted."""
        now = time.monotonic()
        for req in retired:
            f = req.finished
            self._finished.labels(self.model_name, f.reason).inc()
            self.e2e.observe(now - req.arrival)
            if req.admitted_at is not None:
                self.queue.observe(req.admitted_at - req.arrival)
            if req.first_token_at is not None:
                self.ttft.observe(req.first_token_at - req.arrival)
                if f.completion_tokens > 1:
                    self.tpot.observe((req.last_token_at - req.first_token_at) / (f.completion_tokens - 1))
        c = counts
        self.preemptions.inc(c.preemptions)
        self.evictions.inc(c.evictions)
        self.prefix_queries.inc(c.prefix_queries)
        self.prefix_hits.inc(c.prefix_hits)
        self.prefix_totals[0] += c.prefix_queries
        self.prefix_totals[1] += c.prefix_hits
        self.prompt_tokens.inc(c.prefix_queries - c.prefix_hits)
        self.generation_tokens.inc(c.emitted)
        self.spec_drafts.inc(c.drafts)
        self.spec_draft_tokens.inc(c.draft_tokens)
        self.spec_accepted.inc(c.accepted_tokens)
        self.spec_emitted.inc(c.accepted_tokens + c.drafts)  # each drafted step emits its kept drafts and one more
        for pos, n in enumerate(c.accepted_per_pos):
            self._spec_per_pos.labels(self.model_name, str(pos)).inc(n)
        self.spec_totals[0] += c.draft_tokens
        self.spec_totals[1] += c.accepted_tokens

    def speculation(self) -> dict:
        """Drafted and accepted tokens so far, and the share accepted (None before any draft)."""
        drafted, accepted = self.spec_totals
        return {"draft_tokens": drafted, "accepted_tokens": accepted,
                "acceptance_rate": round(accepted / drafted, 4) if drafted else None}

    def _advance(self, name: str, counter, total: int) -> None:
        """Move a counter up to a running total kept elsewhere (the pool's, the disk tier's)."""
        counter.inc(total - self._seen.get(name, 0))
        self._seen[name] = total

    def pool_mismatches(self, total: int) -> None:
        """The pool's running count of refused prefix hits."""
        self._advance("mismatches", self.prefix_mismatches, total)

    def disk(self, tier) -> None:
        """The disk tier's counts since the last call."""
        st = tier.stats
        self._advance("disk_hits", self.disk_hits, st.hits)
        self._advance("disk_misses", self.disk_misses, st.misses)
        self._advance("disk_errors", self.disk_errors, st.errors)
        while st.read_s:
            self.disk_read.observe(st.read_s.pop())
        while st.write_s:
            self.disk_write.observe(st.write_s.pop())
        info = tier.info()
        self.disk_blocks.set(info["blocks"])
        self.disk_bytes.set(info["bytes"])
        self.disk_healthy.set(1 if tier.healthy else 0)
        self.disk_full.set(1 if info["writes_paused"] else 0)

    def tenants(self, figures) -> None:
        """Per-tenant figures, as (metric label, Tenants.figures entry) pairs, summed by label."""
        by_label: dict[str, dict] = {}
        for label, fig in figures:
            total = by_label.setdefault(label, dict.fromkeys([*self._tenant_gauges, *self._tenant_counters], 0))
            for name in total:
                total[name] += fig[name]
        for label, total in by_label.items():
            for name, gauge in self._tenant_gauges.items():
                gauge.labels(self.model_name, label).set(total[name])
            for name, counter in self._tenant_counters.items():
                self._advance(f"{name}:{label}", counter.labels(self.model_name, label), total[name])

    def gauges(self, kv_used: int, kv_budget: int, kv_cached: int, running: int, waiting: int, sessions: int) -> None:
        self.kv_bytes.set(kv_used)
        self.kv_usage.set(kv_used / kv_budget)
        self.kv_cached_bytes.set(kv_cached)
        self.running.set(running)
        self.waiting.set(waiting)
        self.sessions.set(sessions)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def generated_by_owner(outputs) -> dict[str | None, int]:
    """Tokens a step gave each tenant's requests: outputs holds (request, its output length before the step)."""
    by_owner: dict[str | None, int] = {}
    for req, had in outputs:
        by_owner[req.session.owner] = by_owner.get(req.session.owner, 0) + max(0, len(req.output_ids) - had)
    return by_owner


class RecentSteps:
    """The last minute of steps, for the console: batch sizes, and output tokens a second, the server's and
    each tenant's own (a tenant is shown its own figures only)."""

    WINDOW_S = 60
    NOW_S = 5  # "now": short enough to follow a burst, long enough to even out steps

    def __init__(self) -> None:
        # (time, sessions, tokens, generated, generated by owner id)
        self._steps: deque[tuple[float, int, int, int, dict[str | None, int]]] = deque()

    def record(self, sessions: int, tokens: int, generated: int, by_owner: dict[str | None, int] | None = None) -> None:
        now = time.monotonic()
        self._steps.append((now, sessions, tokens, generated, by_owner or {}))
        while self._steps and self._steps[0][0] < now - self.WINDOW_S:
            self._steps.popleft()

    def summary(self) -> dict:
        last = self._steps[-1] if self._steps else (0.0, 0, 0, 0, {})
        return {"last_step_sessions": last[1], "last_step_tokens": last[2],
                **self._rates(self._per_second(lambda step: step[3]))}

    def throughput(self, owner: str | None) -> dict:
        """One tenant's output tokens a second (owner: an owner id): what its own requests generated."""
        return self._rates(self._per_second(lambda step: step[4].get(owner, 0)))

    def _per_second(self, generated) -> list[int]:
        """Tokens by the second they were generated in, oldest first; the last holds the latest second."""
        now = time.monotonic()
        per_second = [0] * self.WINDOW_S
        for step in self._steps:
            age = int(now - step[0])
            if 0 <= age < self.WINDOW_S:
                per_second[self.WINDOW_S - 1 - age] += generated(step)
        return per_second

    def _rates(self, per_second: list[int]) -> dict:
        return {"tokens_per_s_now": round(sum(per_second[-self.NOW_S :]) / self.NOW_S, 2), "now_window_s": self.NOW_S,
                "tokens_per_s_last_minute": round(sum(per_second) / self.WINDOW_S, 2),
                "tokens_per_s_by_second": per_second}
