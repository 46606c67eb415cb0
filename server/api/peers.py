"""A request for a session that another server on the shared --kv-disk holds, sent on to that server.

A session is one live server's at a time (its claim, kvcache/disk_records.py), and the claim names its
holder by boot id. A request can still land elsewhere: a Responses request's `previous_response_id` is in
its body, which neither nginx nor the router routes on, and a session made through the router hashes to
another replica in nginx. Answering 409 there would strand the conversation. With --peers, the server
asks its peers' `/get_server_info` which one has that boot id, relays the request to it and streams the
answer back, status and headers as they are; the session stays where its KV is.

Only a URL from --peers is ever sent to: the lock file sits in a folder others may write in, so what it
says picks among the peers, never an address. A relayed request carries FORWARDED and is never relayed
again, so two servers cannot pass one request back and forth. The client's own headers go along (its
key, its tenant), so the holder checks the request as if it had come straight to it.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from fastapi import Request as HttpRequest
from starlette.responses import Response, StreamingResponse

from ..errors import HeldElsewhere, ShuttingDown
from .guard import error_response

log = logging.getLogger("kvserve.peers")

FORWARDED = "kvserve-forwarded"  # set on a relayed request: its receiver answers it itself
LOOKUP_TIMEOUT_S = 2  # a peer that does not say its boot id in this long is skipped for this look-up
CONNECT_TIMEOUT_S = 5
# headers of one connection, not of the request: the relay's own connection has its own
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
                        "host", "content-length"})
CREDENTIALS = ("authorization", "x-api-key")  # what a peer's /get_server_info asks for under --api-key


class Peers:
    """The other servers on the folder, by boot id, found when first needed and again when one is unknown."""

    def __init__(self, urls: tuple[str, ...], own_id: str) -> None:
        self.urls, self.own_id = tuple(u.rstrip("/") for u in urls), own_id
        self.known: dict[str, str] = {}  # boot id -> URL
        self._client = None

    def client(self):
        if self._client is None:
            import httpx  # here, not at the top: most servers never relay, and httpx lengthens every start-up
            logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per relay: the access log has it already
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
                                             limits=httpx.Limits(max_connections=None))
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def find(self, holder: str, http: HttpRequest) -> str | None:
        """The URL of the peer whose boot id is `holder` -> None if none says so (it died, or never was one)."""
        if holder not in self.known:
            headers = {h: http.headers[h] for h in CREDENTIALS if h in http.headers}
            ids = await asyncio.gather(*(self._boot_id(url, headers) for url in self.urls))
            self.known = {boot: url for url, boot in zip(self.urls, ids) if boot is not None and boot != self.own_id}
        return self.known.get(holder)

    async def _boot_id(self, url: str, headers: dict) -> str | None:
        try:
            r = await self.client().get(url + "/get_server_info", headers={**headers, FORWARDED: "1"},
                                        timeout=LOOKUP_TIMEOUT_S)
            return r.json().get("instance_id") if r.status_code == 200 else None
        except Exception:  # a peer down, slow or not a kvserve: not the holder
            return None

    async def forward(self, http: HttpRequest, error: HeldElsewhere) -> Response:
        """The holder's answer to `http`, relayed; the 409 itself if there is no peer to send it to."""
        path = http.url.path
        if http.headers.get(FORWARDED) or error.holder is None:
            return error_response(error, path)
        url = await self.find(error.holder, http)
        if url is None:
            return error_response(error, path)
        import httpx
        headers = [(k, v) for k, v in http.headers.items() if k not in HOP_BY_HOP] + [(FORWARDED, "1")]
        target = url + path + (f"?{http.url.query}" if http.url.query else "")
        client = self.client()
        request = client.build_request(http.method, target, headers=headers, content=await http.body())
        try:
            upstream = await client.send(request, stream=True)
        except httpx.TransportError as e:
            log.warning("relay to %s for a session it holds failed: %s", url, e)
            return error_response(ShuttingDown("the server that holds this session did not answer; try again",
                                               headers={"Retry-After": "1"}), path)

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:  # the client went away, or the answer ended: the holder's connection closes with it
                await upstream.aclose()

        kept = {k: v for k, v in upstream.headers.items() if k not in HOP_BY_HOP}
        return StreamingResponse(body(), status_code=upstream.status_code, headers=kept)
