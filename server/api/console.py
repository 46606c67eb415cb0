"""The web console (GET / and /ui: a chat playground and a live view) and the JSON it reads, which
scripts may read too (GET /v1/status)."""
from __future__ import annotations

import time
from pathlib import Path

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import FileResponse

from ..engine.engine import Engine
from ..errors import NotFound
from . import generation
from .schemas import ERROR_RESPONSES

CONSOLE = Path(__file__).parent / "console_page"
ASSETS = {"app.js": "text/javascript", "style.css": "text/css"}
# Pages and assets anyone may load: with API keys on, the page asks for one before it reads anything.
PUBLIC_PAGES = frozenset({"/", "/ui", *(f"/ui/{name}" for name in ASSETS)})

router = APIRouter(tags=["console"], responses=ERROR_RESPONSES)


@router.get("/", include_in_schema=False)
@router.get("/ui", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(CONSOLE / "index.html", media_type="text/html", headers={"Cache-Control": "no-cache"})


@router.get("/ui/{name}", include_in_schema=False)
async def asset(name: str) -> FileResponse:
    if name not in ASSETS:
        raise NotFound(f"no console file {name!r}")
    return FileResponse(CONSOLE / name, media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})


@router.get("/v1/status")
async def status(http: HttpRequest) -> dict:
    """Sessions (the caller's own, with API keys on), the KV pool, the queue and the last minute's steps."""
    engine = generation.engine_of(http)
    with engine.lock:
        return snapshot(engine, generation.owner_of(http), http.app.state.started)


def owner_label(owner: str | None) -> str | None:
    """A key's name on the page: a prefix of its hash (Session.owner), never the key."""
    return None if owner is None else "key-" + owner[:8]


def snapshot(engine: Engine, owner: str | None, started: int) -> dict:
    blocks, sched = engine.pool.blocks, engine.scheduler
    sessions = []
    for s in engine.sessions:
        if not s.owned_by(owner):
            continue
        req = s.busy
        # evicted: its KV went back to the pool (its history stays, and is prefilled again when it is next used)
        state = ("running" if req in sched.running else "waiting") if req is not None else (
            "evicted" if s.cache is None and s.tokens else "idle")
        sessions.append({**s.info(), "state": state, "persistent": s.persistent, "owner": owner_label(s.owner),
                         "allocated": s.cache.allocated if s.cache is not None else 0})
    queries, hits = engine.metrics.prefix_totals
    return {
        "object": "status",
        "model": engine.model.name,
        "max_context": engine.max_context,
        "uptime_s": round(time.time() - started, 1),
        "pool": {
            "budget_bytes": engine.pool.budget, "block_size": blocks.block_size, "block_bytes": blocks.block_bytes,
            "blocks": blocks.n_blocks, "used_blocks": blocks.n_used(), "reserved_blocks": blocks.reserved,
            "cached_blocks": blocks.n_cached(), "free_blocks": blocks.n_free(),
            "prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
            "prefix_cache_mismatches": blocks.mismatches,
        },
        "disk": engine.pool.tier.info() if engine.pool.tier is not None else None,
        "requests": {"running": len(sched.running), "waiting": len(sched.waiting)},
        "steps": engine.recent.summary(),
        "sessions": sessions,
    }
