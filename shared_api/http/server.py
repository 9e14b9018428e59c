"""The gateway's HTTP server: granian (Rust: hyper on tokio, the application on a uvloop event loop)
serving aotx_site/gateway.py's application through RSGI, granian's own interface, in `workers`
processes that share the listening socket (`manage.py serve --config gateway.json`).

RSGI hands the application a request's head and a protocol object to read the body from and to
answer with (`response_bytes`, `response_stream`); each request runs as an asyncio task on the
worker's loop. It replaced uvicorn, which the gateway could only make fast by subclassing its
protocol (private internals, a pinned version, a second path for the shared routes); beside that,
granian answers 1.31x the reads, 0.99x the mutations and spends 0.64x the CPU per streamed event
(docs/performance.md, "The server: granian's RSGI"). It is used through its public settings only: HTTP/1.1 with a header read timeout (`header_timeout`: a connection that does not
send a whole request head within it, the first or the next on a keep-alive connection, is closed),
a read buffer that bounds a request head (hyper answers 431 past it). The access log is the
application's (`AccessLog`: granian's own, a logging call a request, cost a third of the
gateway's mutations a second). The application bounds a head
to `max_header_bytes` itself, to answer 431 in the one error body; bodies, their limits and their
timeout are the application's (shared_api/http/front.py).

Everything else that speaks ASGI — Django (the admin, the schema, /metrics) and the event streams'
Channels consumers — runs behind `asgi`, the one bridge from an RSGI request to an ASGI
application."""
from __future__ import annotations

import asyncio
import atexit
import os
import sys
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Generator, Iterator, Mapping, Protocol

if TYPE_CHECKING:
    from ..config import GatewayConfig

APPLICATION = "aotx_site.gateway:application"
# hyper's read buffer for a request head: past it hyper itself answers 431 (with no body); below it
# and past max_header_bytes, the application answers 431 in the one error body
HEAD_BUFFER_FLOOR = 64 * 1024

# every response's caching and sniffing headers (SPEC: all responses disable caching), written
# here once: the front's answers, the streams' (shared_api/streams/events.py) and Django's
# (shared_api/http/middleware.py) take them from here
PRIVATE_HEADERS = [("cache-control", "no-store"), ("x-content-type-options", "nosniff")]
# SIGTERM: a worker still serving (an event stream's client never leaves by itself) is killed after
# this many seconds; the streams' clients resume with Last-Event-ID
STOP_SECONDS = 10
# scope["extensions"][WRITE_NOWAIT](chunk) -> bool: a streamed response's next chunk sent now (`asgi`)
WRITE_NOWAIT = "aotx.write_nowait"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]  # (Django's handler: see aotx_site/gateway.py)


class AccessLog:
    """The access log: a line a request (client address, method, path without its query string —
    a token sent in a URL is refused and never written down —, protocol, status, milliseconds),
    written to standard output in one write per `FLUSH_SECONDS` or `FLUSH_LINES` lines, whichever
    comes first; what is pending is written at exit."""
    FLUSH_SECONDS = 0.1
    FLUSH_LINES = 512

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.timer: asyncio.TimerHandle | None = None
        atexit.register(self.flush)

    def add(self, request: RequestHead, status: int, started: float) -> None:
        self.lines.append(f'{request.client} - "{request.method} {request.path} HTTP/{request.http_version}" '
                          f'{status} {(time.perf_counter() - started) * 1000:.3f}\n')
        if len(self.lines) >= self.FLUSH_LINES:
            self.flush()
        elif self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.FLUSH_SECONDS, self.flush)

    def flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        lines, self.lines = self.lines, []
        if lines:
            try:
                sys.stdout.write("".join(lines))
                sys.stdout.flush()
            except (OSError, ValueError):
                pass  # (standard output closed: the lines have nowhere to go)


class Logged:
    """An RSGI protocol object that remembers the status it answered with (for the access log)."""
    __slots__ = ("proto", "status")

    def __init__(self, proto: Proto) -> None:
        self.proto = proto
        self.status = 0

    def __call__(self) -> Awaitable[bytes]:
        return self.proto()

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self.proto.__aiter__()

    def client_disconnect(self) -> Awaitable[None]:
        return self.proto.client_disconnect()

    def response_bytes(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.status = status
        self.proto.response_bytes(status, headers, body)

    def response_stream(self, status: int, headers: list[tuple[str, str]]) -> Stream:
        self.status = status
        return self.proto.response_stream(status, headers)


class Stream(Protocol):
    """A started streamed response (RSGI's HTTP stream transport)."""

    async def send_bytes(self, data: bytes) -> None: ...


class RequestHead(Protocol):
    """What the application reads of an RSGI HTTP request head (granian's scope)."""
    proto: str
    http_version: str
    method: str
    scheme: str
    path: str
    query_string: str
    client: str
    server: str

    @property
    def headers(self) -> Mapping[str, str]: ...


class Proto(Protocol):
    """What the application uses of an RSGI HTTP protocol object."""

    def __call__(self) -> Awaitable[bytes]: ...

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    def client_disconnect(self) -> Awaitable[None]: ...

    def response_bytes(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None: ...

    def response_stream(self, status: int, headers: list[tuple[str, str]]) -> Stream: ...


HEADERS = "aotx.headers"  # a scope's headers by lowercase name (a repeated one: its last value)
HEAD_BYTES = "aotx.head_bytes"  # the request line's path and query and the headers, in bytes
REPEATED = "aotx.repeated"  # the lowercase names of the headers the request sent more than once


class BodyIncomplete(Exception):
    """The request body did not arrive whole: its chunked framing broke, or the connection ended
    before the last chunk or before Content-Length bytes."""


async def body_chunks(proto: Proto) -> AsyncIterator[bytes]:
    """A request body's chunks as they arrive, ending only when the body ended as its framing
    says; BodyIncomplete otherwise. granian's body iterator does not raise: it yields an empty
    chunk for a frame it could not read (a broken chunk size, a cut connection) and then one more
    empty chunk as the end, so a body is whole only when its first empty chunk is its last. A
    chunked body's trailers also come as an empty chunk and are refused with it (no route reads
    trailers). tests/e2e/test_http_edges.py holds granian to this, over raw sockets."""
    chunks = proto.__aiter__()
    while True:
        try:
            chunk = await chunks.__anext__()
        except StopAsyncIteration:
            return  # (before the closing empty chunk: a body already taken)
        except Exception:  # (the server's: the connection broke while the body was arriving)
            raise BodyIncomplete from None
        if chunk:
            yield chunk
            continue
        try:
            await chunks.__anext__()
        except StopAsyncIteration:
            return
        except Exception:
            pass
        raise BodyIncomplete


def asgi_scope(scope: RequestHead) -> Scope:
    """An RSGI request head as an ASGI HTTP scope (the application's routing and checks read it
    this way; Django and Channels need it), with the headers also by name and the head's size,
    from one walk over them."""
    pairs: list[tuple[bytes, bytes]] = []
    by_name: dict[bytes, bytes] = {}
    repeated: list[bytes] = []
    size = len(scope.path) + len(scope.query_string)
    for name, value in scope.headers.items():
        raw = name.encode("latin-1")
        pair = (raw, value.encode("latin-1"))
        pairs.append(pair)
        lower = raw.lower()
        if lower in by_name:
            repeated.append(lower)
        by_name[lower] = pair[1]
        size += len(name) + len(value) + 4
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": scope.http_version,
            "method": scope.method, "scheme": scope.scheme, "path": scope.path,
            "raw_path": scope.path.encode("utf-8"), "query_string": scope.query_string.encode("latin-1"),
            "root_path": "", "headers": pairs, HEADERS: by_name, HEAD_BYTES: size, REPEATED: repeated,
            "client": _address(scope.client), "server": _address(scope.server)}


def _address(text: str) -> tuple[str, int] | None:
    host, sep, port = text.rpartition(":")
    return (host.strip("[]"), int(port)) if sep and port.isdigit() else None


def str_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    return [(name.decode("latin-1"), value.decode("latin-1")) for name, value in headers]


class Resume:
    """The rest of an awaitable driven one step outside any task (`start`): awaiting it yields the
    object the awaitable was waiting on, as the awaitable itself would have, then runs it to its
    end, so a task can finish a wait that began in a plain function."""

    def __init__(self, steps: Iterator[object], waiting_on: object) -> None:
        self.steps = steps
        self.waiting_on = waiting_on

    @classmethod
    def start(cls, awaitable: Awaitable[object]) -> Resume | None:
        """None when the awaitable completed at its first step (nothing to wait for)."""
        steps = awaitable.__await__()
        try:
            waiting_on = _step(steps, None)
        except StopIteration:
            return None
        return cls(steps, waiting_on)

    def __await__(self) -> Generator[object, object, None]:
        value = yield self.waiting_on
        while True:
            try:
                waiting_on = _step(self.steps, value)
            except StopIteration:
                return
            value = yield waiting_on


def _step(steps: Iterator[object], value: object) -> object:
    """The awaitable's next step (granian's awaitables are plain iterators: no `send`)."""
    send = getattr(steps, "send", None)
    return send(value) if send is not None else next(steps)


async def first(*waits: Awaitable[object]) -> None:
    """Return when the first of `waits` is done; the others are cancelled."""
    tasks = [asyncio.ensure_future(wait) for wait in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


class Receiver:
    """An ASGI `receive` over an RSGI request: the body's chunks as they arrive; after the last,
    `http.disconnect` once the client disconnects or the response has been sent (`finished`), as
    an ASGI server says it (a Channels consumer waits for it to stop). A body that does not
    arrive whole ends in `http.disconnect` (`incomplete` says so): the application never sees a
    cut body as a complete one."""

    def __init__(self, proto: Proto) -> None:
        self.proto = proto
        self.chunks = body_chunks(proto)
        self.body_done = False
        self.incomplete = False
        self.finished = asyncio.Event()

    async def __call__(self) -> dict[str, Any]:
        if not self.body_done:
            try:
                chunk = await self.chunks.__anext__()
            except StopAsyncIteration:
                self.body_done = True
                return {"type": "http.request", "body": b"", "more_body": False}
            except BodyIncomplete:
                self.body_done = self.incomplete = True
                return {"type": "http.disconnect"}
            return {"type": "http.request", "body": chunk, "more_body": True}
        if not self.finished.is_set():
            await first(self.proto.client_disconnect(), self.finished.wait())
        return {"type": "http.disconnect"}


async def asgi(app: ASGIApp, scope: Scope, proto: Proto, bound: Callable[[Receiver], Receive] | None = None) -> bool:
    """Run an ASGI application on one RSGI request (`bound`: wraps the request's `receive` in a
    caller's limits); its `send` answers with the response's bytes, or streams them when the
    application says more body follows. Returns whether the application started a response."""
    response: dict[str, Any] = {}
    stream: Stream | None = None
    receive = Receiver(proto)
    pending: list[Resume] = []  # a write_nowait's send that the connection did not take at once
    head_only = scope.get("method") == "HEAD"  # (a HEAD's answer is its head: a body would not be sent)

    def write_nowait(chunk: bytes) -> bool:
        """Send the next chunk of a started streamed response now (granian's `send_bytes` sends
        at once, and its awaitable is already complete when the connection took the bytes): an
        event stream's fan-out writes an event to every stream from the device reader's turn of
        the loop, without waking each stream's task. A send the connection did not take at once
        is left pending: `send` finishes it before anything else is written, and until then this
        answers False (the caller then queues, in order)."""
        if stream is None or pending or not chunk or receive.finished.is_set():
            return False
        try:
            waiting = Resume.start(stream.send_bytes(chunk))
        except Exception:  # (the client went away: the stream's task meets it when it writes)
            return False
        if waiting is not None:
            pending.append(waiting)
        return True
    scope.setdefault("extensions", {})[WRITE_NOWAIT] = write_nowait

    async def send(message: dict[str, Any]) -> None:
        nonlocal stream
        kind = message["type"]
        if kind == "http.response.start":
            response["status"] = message["status"]
            response["headers"] = str_headers(list(message.get("headers", [])))
            return
        if kind != "http.response.body" or "status" not in response or receive.finished.is_set():
            return
        body = message.get("body", b"")
        if stream is None:
            if not message.get("more_body") or head_only:
                receive.finished.set()
                proto.response_bytes(response["status"], response["headers"], b"" if head_only else body)
                return
            stream = proto.response_stream(response["status"], response["headers"])
            response["streamed"] = True
        try:
            while pending:
                await pending.pop()
            if body:
                await stream.send_bytes(body)
        except Exception:  # (the server's: the client went away; the application hears it from `receive`)
            receive.finished.set()
            stream = None
        finally:
            if not message.get("more_body"):
                receive.finished.set()
                stream = None  # the response ends here (see below)

    try:
        await app(scope, receive if bound is None else bound(receive), send)
    finally:
        # granian ends a streamed response when its transport object is released, not when the
        # handler returns: the application (a Channels consumer) may outlive its response
        stream = None
    if "status" in response and not receive.finished.is_set():
        receive.finished.set()
        if "streamed" not in response:
            proto.response_bytes(response["status"], response["headers"], b"")  # started, never finished
    return "status" in response


def serve(cfg: GatewayConfig) -> None:
    """Run the gateway until SIGTERM or SIGINT (granian's supervisor, and its workers)."""
    from granian.constants import HTTPModes, Interfaces, Loops
    from granian.http import HTTP1Settings
    from granian.server import Server

    os.environ["AOTX_MAX_HEADER_BYTES"] = str(cfg["max_header_bytes"])
    os.environ["AOTX_BODY_TIMEOUT"] = str(cfg["body_timeout"])
    os.environ["AOTX_GATEWAY_WORKERS"] = str(cfg["workers"])  # (each process allows its share of a rate)
    os.environ["AOTX_LISTEN_HOST"] = cfg["host"]  # (a host the gateway answers to: aotx_site/settings.py)
    Server(APPLICATION, address=cfg["host"], port=cfg["port"], interface=Interfaces.RSGI,
           workers=cfg["workers"], loop=Loops.uvloop, http=HTTPModes.http1, websockets=False,
           http1_settings=HTTP1Settings(header_read_timeout=int(cfg["header_timeout"] * 1000),
                                        max_buffer_size=max(HEAD_BUFFER_FLOOR, 4 * cfg["max_header_bytes"])),
           log_access=False, respawn_failed_workers=True,
           workers_kill_timeout=STOP_SECONDS).serve()
