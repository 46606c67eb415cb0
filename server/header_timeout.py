"""A deadline for each request's head: its request line and headers must all arrive within --header-timeout
of the connection opening or, on a kept-alive connection, of the next request's first byte (uvicorn's
keep-alive timeout bounds the idle wait before that byte), or the connection is closed.

uvicorn has no such limit: its keep-alive timer stops at the first byte of a request, so a client that
sends a header byte every few seconds (slowloris) holds a connection, and what it costs, for as long as
it likes; enough of them hold every connection the process can take. The body is not covered: it is
read by the app as it arrives, and a request that is being served is never cut by this.

These are uvicorn's own protocol classes with a timer added, passed to uvicorn.Config as `http=`
(server/listener.py); httptools when it is installed, else h11, as uvicorn's "auto" picks.
"""
from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import TimedOut

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is not installed: h11 serves
    HttpToolsProtocol = None


def _timed_out_response(seconds: float) -> bytes:
    body = json.dumps(TimedOut(f"the request's headers did not arrive within {seconds:g}s").body()).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))


class _HeadDeadline:
    """The timer, for a uvicorn protocol class it is mixed into (before it, so these run first)."""

    header_timeout: float = 10.0
    _head_timer: asyncio.TimerHandle | None = None
    _head_due = False  # a response ended and the next head has not begun: its clock starts at its first byte
    _head_begun = False  # a byte of the awaited head has come: the client is told why it is cut off

    def _start_head_clock(self, begun: bool) -> None:
        self._stop_head_timer()
        self._head_begun = begun
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        self._head_due = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _serving(self) -> bool:
        """Whether a request whose head has arrived is still being answered."""
        return self.cycle is not None and not self.cycle.response_complete

    def _head_timed_out(self) -> None:
        self._head_timer = None
        # an upgraded connection (a WebSocket) belongs to another protocol now; one being answered is not waiting
        if self.transport.is_closing() or self.transport.get_protocol() is not self or self._serving():
            return
        if self._head_begun:
            self.transport.write(_timed_out_response(self.header_timeout))
        self.transport.close()

    # ---- where uvicorn's protocol starts and stops waiting for a head -------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._start_head_clock(begun=False)  # uvicorn has no timer for a new connection that sends nothing

    def data_received(self, data: bytes) -> None:
        if data and self._head_due:
            self._start_head_clock(begun=True)
        elif data and self._head_timer is not None:
            self._head_begun = True
        super().data_received(data)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # a pipelined request already read is being served: the wait begins when it is answered
        if not self.transport.is_closing() and not self._serving():
            self._head_due = True

    def connection_lost(self, exc) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)


class H11HeadDeadline(_HeadDeadline, H11Protocol):
    def handle_events(self) -> None:
        super().handle_events()
        if self._serving():  # a whole head was read (h11 has no callback of its own for it)
            self._stop_head_timer()


if HttpToolsProtocol is not None:
    class HttpToolsHeadDeadline(_HeadDeadline, HttpToolsProtocol):
        def on_headers_complete(self) -> None:
            self._stop_head_timer()
            super().on_headers_complete()


def protocol_class(header_timeout: float) -> type[asyncio.Protocol]:
    """The HTTP protocol class for uvicorn.Config(http=...), closing a connection whose request head takes
    longer than `header_timeout` seconds."""
    base = HttpToolsHeadDeadline if HttpToolsProtocol is not None else H11HeadDeadline
    return type(base.__name__, (base,), {"header_timeout": header_timeout})
