"""Frozen engine and server settings, filled from CLI flags."""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from kvcache import Sizing

from .engine.drafts import SpeculationConfig

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}


def parse_bytes(text: str | int) -> int:
    """'2GiB' -> 2147483648; plain integers are bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (use e.g. 512MiB, 2GiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


KV_DTYPES = ("auto", "float32", "float16")
DENSE_STEP_TOKENS, MOE_STEP_TOKENS = 128, 256  # EngineConfig.for_model
POOLINGS = ("mean", "last")  # how an embedding pools its prompt's final hidden states (llama-server's --pooling)


@dataclass(frozen=True)
class EngineConfig:
    """Capacity and batching limits of one engine."""

    session_capacity: int = 2048  # tokens per session unless a session asks for another
    max_model_len: int | None = None  # tokens a sequence may reach, prompt and reply; None: the model's context
    session_sizing: Sizing = Sizing.DYNAMIC
    kv_budget: int = 4 * 2**30  # bytes held by every installed cache together
    # tokens a step: decodes first, then prefill chunks; None: step_tokens(the model) (docs/performance.md)
    max_batch_tokens: int | None = None
    mixed_prefill_tokens: int | None = 64  # prefill tokens a step adds beside decodes; None: what the budget leaves
    max_running: int = 64  # sessions per step
    max_queued: int = 256  # requests waiting for a running slot
    default_max_tokens: int | None = None  # a cap for requests that name none; None: the session's room
    max_stop_strings: int = 16
    max_prompt_tokens: int = 32768
    max_sessions: int = 4096  # persistent sessions, resident or evicted
    kv_dtype: str = "auto"  # float32, float16, or auto: float16 beside non-f32 weights, else the model's dtype
    retry_after_s: int = 1  # what a 429 tells the client to wait
    kv_disk: str | None = None  # a folder for the disk tier: KV blocks by content and session records
    kv_disk_budget: int = 16 * 2**30  # bytes of KV blocks the disk tier may hold
    # Per tenant (an API key, or a trusted gateway's tenant header); None: the server-wide limit
    max_sessions_per_key: int | None = None
    max_running_per_key: int | None = None
    max_queued_per_key: int | None = None
    tenant_weights: tuple[tuple[str, float], ...] = ()  # (owner id, weight): a tenant's share of served tokens
    session_ttl: float = 3600.0  # seconds an idle session stays in RAM; then it moves to disk, or is removed
    session_disk_ttl: float = 7 * 86400.0  # seconds a moved session's disk copy stays after that
    request_timeout: float | None = None  # seconds a request may take, queued and running; None: no limit
    constraint_timeout: float = 10.0  # seconds a constraint's first compile may take (grammar_worker.py)
    mask_timeout: float = 2.0  # seconds one token's grammar mask may take before its reply ends, unmet
    speculation: SpeculationConfig = SpeculationConfig()  # n-gram drafts: the default, and their limits
    kv_events: str | None = None  # tcp://HOST:PORT: publish the prefix index's changes there (ZMQ PUB) for a router
    kv_events_replay: str | None = None  # tcp://HOST:PORT: resend recent batches to a router that missed some
    # Tenants share cached prefixes (a common system prompt) instead of each hashing from its own salt; a
    # tenant can then learn, from cached_tokens or timing, which prefixes another sent
    shared_prefix_cache: bool = False
    pooling: str = "mean"  # embeddings: the mean of the prompt's final normed hidden states, or the last token's
    # The servers sharing kv_disk (their URLs, this one's too): a request for a session one of them holds is
    # sent there, and sessions on disk at start wait for a request instead of all going to the first server up
    peers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("session_capacity", "kv_budget", "max_running", "max_queued",
                     "session_ttl", "session_disk_ttl", "constraint_timeout", "mask_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_sessions_per_key", "max_running_per_key", "max_queued_per_key", "request_timeout",
                     "mixed_prefill_tokens", "max_batch_tokens"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if any(w <= 0 for _, w in self.tenant_weights):
            raise ValueError("tenant weights must be positive")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        object.__setattr__(self, "session_sizing", Sizing(self.session_sizing))
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")

    def per_key(self, name: str) -> int:
        """A tenant's limit: max_sessions_per_key and the like, or the server-wide one it defaults to."""
        own = getattr(self, f"{name}_per_key")
        return getattr(self, name) if own is None else min(own, getattr(self, name))

    def for_model(self, experts: int) -> EngineConfig:
        """These settings with what depends on the model filled in: the step's tokens, 128 (the choice in
        docs/performance.md), or 256 for a mixture-of-experts model (`experts` > 0), whose prefill chunk
        is shared out over the experts: at 256 a chunk's rows an expert are twice as many, and its
        tiles read each weight once for more of them."""
        if self.max_batch_tokens is not None:
            return self
        return replace(self, max_batch_tokens=MOE_STEP_TOKENS if experts else DENSE_STEP_TOKENS)

    def context(self, model_context: int) -> int:
        """The tokens a sequence may reach: --max-model-len, which may not exceed the model's context."""
        if self.max_model_len is not None and self.max_model_len > model_context:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's context of {model_context} tokens")
        return self.max_model_len or model_context


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-facing settings."""

    model_name: str = "model"
    # other names clients may call it by (--served-model-name's names after the first); listed in /v1/models too
    model_aliases: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 2**20
    shutdown_timeout: float = 30.0
    # seconds each request's line and headers may take to arrive, so a client trickling them cannot hold a connection
    header_timeout: float = 10.0
    # A gateway's header naming the tenant a request is for: honoured under an API key, or from these proxies
    tenant_header: str | None = None
    trusted_proxies: tuple[str, ...] = ()
    # Browser origins allowed to call the API (CORS), "*" for any; none: no CORS headers at all
    allowed_origins: tuple[str, ...] = ()
    host: str = "127.0.0.1"  # the address it listens on: on loopback, only this machine's Host names are answered
    allowed_hosts: tuple[str, ...] = ()  # Host names answered besides those ("*": any)
    admin_key: str | None = None  # opens the operator's routes (/metrics, /get_load) under API keys

    def __post_init__(self) -> None:
        if not self.header_timeout > 0:  # not 0 or NaN either: every connection would be closed at once
            raise ValueError(f"header_timeout must be positive, got {self.header_timeout}")
