"""How the app is put on a socket: the one uvicorn configuration that `kvserve serve` and the tests share.

uvicorn trusts X-Forwarded-For from 127.0.0.1 by default and rewrites the client address before any
middleware sees it, so a local client could pose as a trusted gateway. Its own proxy handling is off
here: the app's guard judges trust on the socket's peer, then applies uvicorn's proxy middleware with
--trusted-proxy as its forwarded_allow_ips (server/api/app.py).
"""
from __future__ import annotations

import uvicorn


def uvicorn_config(app, host: str, port: int, **options) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, proxy_headers=False, **options)
