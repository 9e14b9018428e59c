"""The gateway's HTTP server: uvicorn (httptools parser, uvloop event loop) running
aotx_site.asgi:application in `workers` processes that share the listening socket
(`manage.py serve --config gateway.json`).

GatewayProtocol is uvicorn's httptools protocol with what a public listener needs before any
application code runs: a bound on a request's header bytes (431 with the one error body, not a
dropped connection), a header timeout (a connection that does not finish its headers in
`header_timeout` seconds gets 408 and is closed: slow clients cannot hold connections), and the
one error body for requests the parser refuses. The keep-alive idle timeout is uvicorn's
(`idle_timeout`); the body timeout and limits are the application's (shared_api/http/front.py).
RedactQuery keeps query values out of the access log (a token sent in a URL is refused and never
written down). Each request's scope carries `extensions["aotx.write_nowait"]`: the event streams
write an event's bytes through it from the device reader's turn of the loop when the connection
takes them at once (shared_api/streams/events.py); `extensions["aotx.body_ready"]` hands a request's
body over without a wait when all of it has arrived (shared_api/http/front.py's read_body).

The native path: a request whose body arrives with its headers (nearly every API request) is
offered to the application's `native(scope, body, answer)` (shared_api/http/front.py: the shared
routes) before any ASGI task exists; the application answers it through `answer(status, body,
headers)`, now or when the device replies, or declines it, and a declined request runs as an ASGI
task exactly as it would have. Pipelined requests, bodies still arriving and the access log keep
uvicorn's behaviour."""
from __future__ import annotations

import asyncio
import copy
import functools
import logging
import os
from typing import Any, Callable, cast

import httptools
import uvicorn
from uvicorn.config import LOGGING_CONFIG
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from gpu_worker.contract.errors import ServiceError

APPLICATION = "aotx_site.asgi:application"
# scope["extensions"][WRITE_NOWAIT](chunk) -> bool: a streamed response's next body chunk written now
WRITE_NOWAIT = "aotx.write_nowait"
# scope["extensions"][BODY_READY]() -> bytes | None: the whole request body when it has all arrived
BODY_READY = "aotx.body_ready"
Answer = Callable[[int, bytes, list[tuple[bytes, bytes]]], None]  # a native answer: status, body, headers


def _settings() -> tuple[int, float]:
    """(max header bytes, header timeout) of this process: serve() passes them to its workers."""
    return (int(os.environ.get("AOTX_MAX_HEADER_BYTES", "16384")),
            float(os.environ.get("AOTX_HEADER_TIMEOUT", "10")))


class GatewayProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header size bound, a header timeout, and the native path."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_header_bytes, self.header_timeout = _settings()
        self.header_bytes = 0
        self.header_timer: asyncio.TimerHandle | None = None
        self.refusal: ServiceError | None = None
        # the application's native(scope, body, answer) -> bool (shared_api/http/front.py), when it has one
        self.native: Callable[[dict[str, Any], bytes, Answer], bool] | None = getattr(self.app, "native", None)
        self.deferred: tuple[RequestResponseCycle, Any] | None = None  # a request held for the native path
        self.in_headers = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self.header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _header_timed_out(self) -> None:
        self.header_timer = None
        if self.cycle is None or self.cycle.response_complete:  # between requests: headers are due
            self.refuse(ServiceError(408, "header_timeout", f"the request's headers did not arrive within "
                                                            f"{self.header_timeout:g}s"))

    def refuse(self, err: ServiceError) -> None:
        """Answer with the one error body and close, whatever the parser was doing."""
        if self.transport.is_closing():
            return
        body = err.body()
        self.transport.write(b"".join([
            STATUS_LINE[err.status], b"content-type: application/json\r\ncache-control: no-store\r\n",
            b"content-length: ", str(len(body)).encode(), b"\r\nconnection: close\r\n\r\n", body]))
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError as exc:
            refusal, self.refusal = self.refusal, None
            self.refuse(refusal or ServiceError(400, "bad_request", f"invalid HTTP request: {exc}"))
        finally:
            deferred, self.deferred = self.deferred, None
            if deferred is not None and not self.transport.is_closing():  # its body is still coming: ASGI
                super()._start_asgi_task(*deferred)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.header_bytes = 0
        if self.header_timer is None:
            self._arm_header_timer()

    def _count(self, size: int) -> None:
        self.header_bytes += size
        if self.header_bytes > self.max_header_bytes:
            self.refusal = ServiceError(431, "headers_too_large", f"the request line and headers exceed "
                                                                  f"{self.max_header_bytes} bytes")
            raise ValueError("headers too large")  # stops the parser: data_received answers

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        self.in_headers = True
        try:
            super().on_headers_complete()
        finally:
            self.in_headers = False

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # the next request's headers are due within the idle (keep-alive) timeout, then the header timeout

    # ---- the native path ------------------------------------------------------------------------
    # A request on a shared route whose body arrives with its headers (nearly all of them) is
    # answered without an ASGI task, its receive/send callables, the application's coroutines and
    # a response formatted from ASGI messages (docs/performance.md, "The shared routes' native
    # path"). The request is held when its headers are complete (not started as a task); when its
    # body is complete in the same read, the application's `native` answers it or declines, and a
    # declined request, or one whose body is still coming at the end of the read, starts as an
    # ASGI task as it would have.

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        if self.in_headers and self.native is not None and app is self.app:
            self.deferred = (cycle, app)  # (the standard case: not pipelined, not over a limit)
            return
        self._run_asgi(cycle, app)

    def _run_asgi(self, cycle: RequestResponseCycle, app: Any) -> None:
        """Start the request's ASGI task, its scope given this server's extensions (made here, not
        for every request: a natively answered one never reads them)."""
        extensions = cast("dict[str, Any]", cycle.scope.setdefault("extensions", {}))
        extensions[WRITE_NOWAIT] = functools.partial(_write_nowait, cycle)
        extensions[BODY_READY] = functools.partial(_body_ready, cycle)
        super()._start_asgi_task(cycle, app)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        deferred = self.deferred
        if deferred is None or deferred[0] is not self.cycle:
            return
        self.deferred = None
        cycle = deferred[0]
        assert self.native is not None
        try:
            taken = self.native(cast("dict[str, Any]", cycle.scope), bytes(cycle.body),
                                functools.partial(self._answer, cycle))
        except Exception:  # (the ASGI path runs it again and answers, 500 and a log line included)
            taken = False
        if taken:
            cycle.body = bytearray()
        else:
            self._run_asgi(*deferred)

    def _answer(self, cycle: RequestResponseCycle, status: int, body: bytes,
                headers: list[tuple[bytes, bytes]]) -> None:
        """Write a natively answered request's response (its headers as the application gives
        them, Content-Length included), as uvicorn's `send` would for the two ASGI messages."""
        if cycle.disconnected or cycle.response_complete or self.transport.is_closing():
            return  # (the client went away: a pipelined request's cycle is not told, the transport is)
        keep_alive = cycle.keep_alive
        parts = [STATUS_LINE[status]]
        for name, value in (*self.server_state.default_headers, *headers):
            parts += (name, b": ", value, b"\r\n")
        if not keep_alive:
            parts.append(b"connection: close\r\n")
        parts += (b"\r\n", body)
        self.transport.write(b"".join(parts))
        cycle.response_started = cycle.response_complete = True
        if self.access_log:
            scope = cycle.scope
            self.access_logger.info('%s - "%s %s HTTP/%s" %d', get_client_addr(scope), scope["method"],
                                    get_path_with_query_string(scope), scope["http_version"], status)
        if not keep_alive:
            self.transport.close()
        cycle.on_response()


def _write_nowait(cycle: Any, chunk: bytes) -> bool:
    """Write one body chunk of a started chunked response now, as the cycle's `send` would, when
    the connection takes it without waiting; False (nothing written) when it would wait, or the
    response is not one such (the caller then awaits `send`). An event stream's fan-out writes a
    thousand streams' events this way in one turn of the loop, not a task wake-up per stream."""
    if (cycle.disconnected or cycle.response_complete or not cycle.response_started or not cycle.chunked_encoding
            or cycle.flow.write_paused or not chunk):
        return False
    cycle.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
    return True


def _body_ready(cycle: Any) -> bytes | None:
    """The request's whole body, taken as `receive` would take it, when the parser has seen its
    end (the common case: a small request arrives in one read, and the application's task starts
    after it); None when more is to come (the caller then reads it through `receive`, with its
    timeout). Taking it this way costs no timer and no task switch (the body's `receive` under
    `asyncio.timeout` was some 5% of a small mutation's time in the gateway)."""
    if cycle.more_body or cycle.disconnected or cycle.response_complete:
        return None
    body = bytes(cycle.body)
    cycle.body = bytearray()
    cycle.message_event.clear()  # (a later receive waits for the disconnect, as after the last chunk)
    cycle.flow.resume_reading()
    return body


class RedactQuery(logging.Filter):
    """uvicorn's access log line with every query value replaced by `…`: tokens sent in a URL
    (refused anyway) and any other secret a client put there stay out of the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            path, _, query = args[2].partition("?")
            names = [part.partition("=")[0] for part in query.split("&")]
            record.args = (*args[:2], path + "?" + "&".join(f"{name}=…" for name in names), *args[3:])
        return True


def log_config() -> dict[str, Any]:
    doc = copy.deepcopy(LOGGING_CONFIG)
    doc["filters"] = {"redact_query": {"()": "shared_api.http.server.RedactQuery"}}
    doc["handlers"]["access"]["filters"] = ["redact_query"]
    return doc


def serve(cfg: dict[str, Any]) -> None:
    """Run the gateway until SIGTERM or SIGINT (uvicorn's supervisor when workers > 1)."""
    os.environ["AOTX_MAX_HEADER_BYTES"] = str(cfg["max_header_bytes"])
    os.environ["AOTX_HEADER_TIMEOUT"] = str(cfg["header_timeout"])
    os.environ["AOTX_BODY_TIMEOUT"] = str(cfg["body_timeout"])
    os.environ["AOTX_GATEWAY_WORKERS"] = str(cfg["workers"])  # (each process allows its share of a rate)
    uvicorn.run(APPLICATION, **options(cfg))


def options(cfg: dict[str, Any]) -> dict[str, Any]:
    """uvicorn's settings for the gateway. proxy_headers stays off: it would wrap the application
    in a middleware, and the protocol's native path needs the application itself."""
    return dict(host=cfg["host"], port=cfg["port"], workers=cfg["workers"], http="shared_api.http.server:GatewayProtocol",
                loop="uvloop", lifespan="off", timeout_keep_alive=cfg["idle_timeout"], log_config=log_config(),
                access_log=True, proxy_headers=False, server_header=False)
