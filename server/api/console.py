"""The web console (GET / and /ui: a chat playground and a live view) and the JSON it reads, which
scripts may read too (GET /v1/status)."""
from __future__ import annotations

import time
from pathlib import Path

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import FileResponse

from ..engine.engine import Engine
from ..engine.session import owner_id
from ..errors import NotFound
from . import generation
from .schemas import ERROR_RESPONSES

CONSOLE = Path(__file__).parent / "console_page"
SCRIPTS = ("app.js", "api.js", "connection.js", "settings.js", "format.js", "markdown.js", "sessions.js", "chat.js",
           "completion.js", "live.js")
ASSETS = {**{name: "text/javascript" for name in SCRIPTS}, "style.css": "text/css"}
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
    """What the caller may see: with API keys (or tenants) on, its own sessions, requests and figures, and
    the pool's size; without, the whole server's too: the pool, the queue and the last minute's steps."""
    engine = generation.engine_of(http)
    with engine.lock:
        return snapshot(engine, generation.owner_of(http), http.app.state.started, http.app.state.config.model_name)


def snapshot(engine: Engine, principal: str | None, started: int, model_name: str) -> dict:
    """`model_name`: the name clients send (--served-model-name), not the folder or repo it was loaded from."""
    blocks, sched, c = engine.pool.blocks, engine.scheduler, engine.config
    owner = owner_id(principal)
    sessions = []
    for s in engine.sessions:
        if not s.owned_by(principal):
            continue
        req = s.busy
        # evicted: its KV went back to the pool (its history stays, and is prefilled again when it is next used)
        state = ("running" if req in sched.running else "waiting") if req is not None else (
            "evicted" if s.cache is None and s.tokens else "idle")
        sessions.append({**s.info(), "state": state, "persistent": s.persistent, "owner": sched.tenants.label(s.owner) if s.owner is not None else None,
                         "allocated": s.cache.allocated if s.cache is not None else 0})
    sched.tenants[owner]  # known from now on, so it has figures
    figures = engine.tenant_figures()
    mine = figures[owner]
    limits = {"sessions": c.per_key("max_sessions"), "running": c.per_key("max_running"), "queued": c.per_key("max_queued"),
              "session_ttl_s": c.session_ttl, "request_timeout_s": c.request_timeout}
    # the caller's own output tokens/s: a key holder sees its own requests' rate, never the server's
    tenant = {**mine, "throughput": engine.recent.throughput(owner), "limits": limits}
    pool = {"budget_bytes": engine.pool.budget, "block_size": blocks.block_size, "block_bytes": blocks.block_bytes,
            "blocks": blocks.n_blocks}
    out = {"object": "status", "scope": "server" if owner is None else "tenant", "model": model_name,
           "max_context": engine.max_context, "uptime_s": round(time.time() - started, 1), "tenant": tenant,
           "sessions": sessions}
    if owner is not None:  # a tenant sees its own share, never the others' load
        return {**out, "pool": {**pool, "used_blocks": -(-mine["kv_bytes"] // blocks.block_bytes)},
                "requests": {"running": mine["running"], "waiting": mine["waiting"]}, "disk": None, "steps": None}
    queries, hits = engine.metrics.prefix_totals
    return {
        **out,
        "pool": {
            **pool, "used_blocks": blocks.n_used(), "reserved_blocks": blocks.reserved,
            "cached_blocks": blocks.n_cached(), "free_blocks": blocks.n_free(),
            "prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
            "prefix_cache_mismatches": blocks.mismatches,
        },
        "disk": engine.pool.tier.info() if engine.pool.tier is not None else None,
        "requests": {"running": len(sched.running), "waiting": len(sched.waiting)},
        "steps": engine.recent.summary(),
        "speculation": {"mode": c.speculation.mode, **engine.metrics.speculation()},
        "tenants": sorted(figures.values(), key=lambda f: f["tenant"]),
    }
