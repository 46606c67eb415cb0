"""How the app is put on a socket: the one uvicorn configuration that `kvserve serve` and the tests share,
and the Host names a server on that address answers.

uvicorn trusts X-Forwarded-For from 127.0.0.1 by default and rewrites the client address before any
middleware sees it, so a local client could pose as a trusted gateway. Its own proxy handling is off
here: the app's guard judges trust on the socket's peer, then applies uvicorn's proxy middleware with
--trusted-proxy as its forwarded_allow_ips (server/api/guard.py).
"""
from __future__ import annotations

import ipaddress

import uvicorn

from .header_timeout import protocol_class

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def uvicorn_config(app, host: str, port: int, header_timeout: float = 10.0, **options) -> uvicorn.Config:
    """`header_timeout`: seconds each request's line and headers may take to arrive (server/header_timeout.py)."""
    return uvicorn.Config(app, host=host, port=port, proxy_headers=False, http=protocol_class(header_timeout),
                          **options)


def allowed_hosts(bind: str, extra: tuple[str, ...]) -> frozenset[str] | None:
    """The Host names a server bound to `bind` answers: on loopback, this machine's and `extra`; elsewhere
    `extra`, or any when none are given. '*' in `extra`: any."""
    if "*" in extra:
        return None
    try:
        loopback = bind == "localhost" or ipaddress.ip_address(bind).is_loopback
    except ValueError:
        loopback = False
    names = {h.lower().strip("[]") for h in extra}
    return frozenset(names | set(LOOPBACK_NAMES)) if loopback else frozenset(names) or None


def origin_list(values: list[str]) -> tuple[str, ...]:
    """--allowed-origins (or --allowed-hosts), repeated or comma-separated: 'https://a.example,https://b.example'
    or '*'."""
    return tuple(dict.fromkeys(o.strip().rstrip("/") for v in values for o in v.split(",") if o.strip()))


def host_name(value: str) -> str:
    """'example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value
