"""Tenants: who a request belongs to, and the virtual token counters that share the steps between them.

A tenant is the owner of a request's session: a hash of its API key (or of a trusted gateway's tenant
header under that key); without keys every client is one tenant, None. Each tenant's counter grows by
the tokens the steps serve it (prompt tokens prefilled, and one a step for each decode) divided by its
weight, and the scheduler admits the waiting request of the tenant whose counter is smallest. One
tenant's burst then waits behind another's few, instead of in front of them (the virtual token
counter of Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024). A tenant that comes
back after a pause starts from the smallest counter among the busy ones, so idling banks no credit.
"""
from __future__ import annotations

import hmac
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from kvcache.disk_files import FILE_MODE, make_folders, read_regular

MAX_LABELS = 32  # tenants past the first this many share the metrics label "other"
SECRET_FILE = "tenant-labels.key"

log = logging.getLogger("kvserve.engine")


@dataclass
class Tenant:
    """One tenant's counter and running totals."""

    label: str  # its name on the console, in /v1/status and in metrics: an HMAC of its owner id, never the key
    metric_label: str  # its label in metrics: its own for the first tenants seen, else "other"
    weight: float
    counter: float = 0.0  # virtual tokens: tokens served / weight
    tokens: int = 0  # tokens served
    rejected: int = 0  # requests and sessions refused for want of room (429)


def label_secret(folder: str | None) -> bytes:
    """The deployment's secret for tenant labels: one file in the --kv-disk folder, so every server on it
    (a cluster's replicas, a restarted server) names a tenant alike; without a folder, this process's own."""
    if folder is None:
        return secrets.token_bytes(32)
    path = Path(folder) / SECRET_FILE
    try:
        make_folders(path.parent, path.parent)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
        except FileExistsError:
            pass
        else:  # a server beside this one reads it only once it is whole: it waits below for 32 bytes
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
        for _ in range(100):
            secret = read_regular(path)  # the disk tier's rule: no symlink, no FIFO to hang on
            if len(secret) >= 32:
                return secret
            time.sleep(0.01)
        raise OSError(f"{path} holds no secret")
    except OSError as e:
        log.warning("tenant labels: %s (%s); this process labels tenants with a secret of its own", path, e)
        return secrets.token_bytes(32)


class Tenants:
    """Every tenant seen, by owner id."""

    def __init__(self, weights: tuple[tuple[str, float], ...] = (), secret: bytes | None = None) -> None:
        self._weights = dict(weights)
        self._known: dict[str | None, Tenant] = {}
        # A label is an HMAC, so no one who knows (or guesses) a key can find its tenant's figures
        self._secret = secret if secret is not None else secrets.token_bytes(32)

    def label(self, owner: str | None) -> str:
        if owner is None:
            return "default"
        return "t-" + hmac.new(self._secret, owner.encode(), "sha256").hexdigest()[:12]

    def __getitem__(self, owner: str | None) -> Tenant:
        tenant = self._known.get(owner)
        if tenant is None:
            label = self.label(owner)
            tenant = Tenant(label, label if len(self._known) < MAX_LABELS else "other", self._weights.get(owner, 1.0))
            self._known[owner] = tenant
        return tenant

    def charge(self, owner: str | None, tokens: int) -> None:
        tenant = self[owner]
        tenant.tokens += tokens
        tenant.counter += tokens / tenant.weight

    def wake(self, owner: str | None, busy: set[str | None]) -> None:
        """A tenant with nothing queued or running sends a request: catch its counter up with the busy ones."""
        others = [self[o].counter for o in busy if o != owner]
        if others:
            tenant = self[owner]
            tenant.counter = max(tenant.counter, min(others))

    def figures(self, running, waiting, sessions) -> dict[str | None, dict]:
        """Each tenant's running and waiting requests, persistent sessions and their KV bytes, tokens served
        and refusals, by owner id."""
        out: dict[str | None, dict] = {}

        def of(owner):
            if owner not in out:
                t = self[owner]
                out[owner] = {"tenant": t.label, "weight": t.weight, "running": 0, "waiting": 0, "sessions": 0,
                              "kv_bytes": 0, "tokens_served": t.tokens, "rejected": t.rejected}
            return out[owner]

        for owner in list(self._known):
            of(owner)
        for req in running:
            of(req.session.owner)["running"] += 1
        for req in waiting:
            of(req.session.owner)["waiting"] += 1
        for session in sessions:
            fig = of(session.owner)
            fig["sessions"] += session.persistent
            fig["kv_bytes"] += session.cache.nbytes if session.cache is not None else 0
        return out
