"""Connections that hold the server without asking anything of it.

uvicorn times out a kept-alive connection between requests, but a connection
that never finishes its request headers (or starts the next request and stops)
is held forever: ~20k of them exhaust the process's file handles, and then
every accept fails and is logged. This module gives uvicorn an h11 protocol
that

- closes a connection whose request headers are not complete within
  `header_timeout` seconds of their first byte (or of the connection), and
  one whose request body stalls for `idle_timeout` seconds;
- caps open connections at `max_connections`: a new connection beyond the cap
  closes the oldest one still waiting for its headers (a client that sends
  its request at once is never the one closed), or itself when every open
  connection is serving a request;
- and rate-limits the event loop's log of failed accepts.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections import OrderedDict

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("infer.server")

# File handles kept free for the engine, the model's files and logging.
RESERVED_FILES = 256


def raise_open_file_limit() -> int:
    """Raise the soft limit on open files to the hard one (as vLLM does); return the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def connection_cap(requested: int) -> int:
    """`requested`, lowered to what the open-file limit leaves (each connection is a file handle)."""
    limit = raise_open_file_limit()
    fits = max(16, limit - RESERVED_FILES) if limit != resource.RLIM_INFINITY else requested
    if requested > fits:
        log.warning("--max-connections %d is above what the open-file limit (%d) allows; using %d",
                    requested, limit, fits)
    return min(requested, fits)


def guarded_protocol(header_timeout: float, idle_timeout: float, max_connections: int) -> type[H11Protocol]:
    """An H11Protocol class with the timeouts and connection cap above (one per server)."""
    waiting: OrderedDict[GuardedH11Protocol, None] = OrderedDict()  # connections waiting for headers, oldest first

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _idle_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                oldest = next(iter(waiting), None)
                if oldest is None:  # every other connection is in a request: this one goes
                    self._close("the server holds --max-connections connections")
                    return
                oldest._close("the server holds --max-connections connections; this one sent no request")
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self.conn.their_state is h11.IDLE:
                self._await_headers()  # the first bytes of the next request on a kept-alive connection
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # a whole request head arrived
                self._headers_done()
            self._body_progress()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # uvicorn's keep-alive timer covers the idle time now; a partial request
            # sent later re-arms the header timer (data_received).
            self._headers_done()

        def connection_lost(self, exc) -> None:
            self._headers_done()
            self._stop_idle()
            super().connection_lost(exc)

        def _body_progress(self) -> None:
            """While the request body comes in, each chunk restarts the idle clock."""
            self._stop_idle()
            if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
                self._idle_timer = self.loop.call_later(idle_timeout, self._close,
                                                        f"its request body stalled for {idle_timeout:g} s")

        def _stop_idle(self) -> None:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None

        def _await_headers(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout, self._header_timeout)
                waiting[self] = None

        def _headers_done(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            waiting.pop(self, None)

        def _header_timeout(self) -> None:
            self._header_timer = None
            self._close(f"no complete request headers within {header_timeout:g} s")

        def _close(self, why: str) -> None:
            self._headers_done()
            self._stop_idle()
            _log_limited("closing a connection from %s: %s", self.client, why)
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol


_last_logged: dict[str, float] = {}
LOG_EVERY_S = 10.0


def _log_limited(msg: str, *args) -> None:
    """`msg` at most once per LOG_EVERY_S (a flood would otherwise write a line per connection)."""
    now = time.monotonic()
    if now - _last_logged.get(msg, -LOG_EVERY_S) >= LOG_EVERY_S:
        _last_logged[msg] = now
        log.warning(msg + " (further such messages are held back for %g s)", *args, LOG_EVERY_S)


def install_accept_error_limiter(loop: asyncio.AbstractEventLoop) -> None:
    """The loop's errors from failed accepts (EMFILE, ENFILE, ...) logged at most once per
    LOG_EVERY_S instead of once per attempt; other errors go to the previous handler."""
    previous = loop.get_exception_handler()

    def handler(loop, context) -> None:
        if "accept" in str(context.get("message", "")):
            _log_limited("accepting a connection failed: %s", context.get("exception") or context.get("message"))
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
