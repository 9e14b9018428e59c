"""An in-process RSGI client for tests: one request through the gateway's application
(aotx_site.gateway:application) as granian hands it over — a request scope, and a protocol object
the application reads the body from and answers through — without a socket. What the server
itself does (parsing, the header read timeout, Content-Length, keep-alive) is tested through the
real server (tests/e2e/test_refuse_before_reading.py)."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable
from urllib.parse import unquote

from shared_api.http.server import first


class Headers:
    """RSGI's request headers: names lowercased, as the server gives them."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        self.pairs = [(name.lower(), value) for name, value in pairs]

    def __contains__(self, key: str) -> bool:
        return any(name == key for name, _ in self.pairs)

    def keys(self) -> list[str]:
        return [name for name, _ in self.pairs]

    def values(self) -> list[str]:
        return [value for _, value in self.pairs]

    def items(self) -> list[tuple[str, str]]:
        return list(self.pairs)

    def get(self, key: str, default: Any = None) -> Any:
        return next((value for name, value in self.pairs if name == key), default)


class Scope:
    """RSGI's HTTP request scope."""
    proto = "http"
    http_version = "1.1"
    rsgi_version = "1.5"
    scheme = "http"
    server = "127.0.0.1:80"
    client = "127.0.0.1:50000"
    authority = None

    def __init__(self, method: str, path: str, headers: list[tuple[bytes, bytes]]) -> None:
        raw_path, _, query = path.partition("?")
        self.method = method
        self.path = unquote(raw_path)
        self.query_string = query
        self.headers = Headers([(name.decode("latin-1"), value.decode("latin-1")) for name, value in headers])


class Stream:
    def __init__(self, proto: Protocol) -> None:
        self.proto = proto

    async def send_bytes(self, data: bytes) -> None:
        if self.proto.gone.is_set():
            raise ConnectionResetError("the client went away")
        self.proto.body += data
        self.proto.chunks.append(data)
        if self.proto.on_write is not None:
            self.proto.on_write(data)

    async def send_str(self, data: str) -> None:
        await self.send_bytes(data.encode())


class Protocol:
    """RSGI's HTTP protocol object: the body in `pieces` (as they would arrive), the answer
    recorded. The client goes away (`client_disconnect` returns) once it has its whole answer, or
    when `leave()` is called."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = list(pieces)
        self.status: int | None = None
        self.headers: list[tuple[str, str]] = []
        self.body = bytearray()
        self.chunks: list[bytes] = []  # a streamed answer's writes
        self.answered = asyncio.Event()
        self.gone = asyncio.Event()
        self.streamed = False
        self.reads = 0  # how many times the application started reading the body
        self.on_write: Callable[[bytes], None] | None = None  # called with each streamed chunk

    async def __call__(self) -> bytes:
        self.reads += 1
        whole, self.pieces = b"".join(self.pieces), []
        return whole

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[bytes]:
        self.reads += 1
        while self.pieces:
            yield self.pieces.pop(0)

    async def client_disconnect(self) -> None:
        await first(self.answered.wait(), self.gone.wait())

    def leave(self) -> None:
        self.gone.set()

    def _start(self, status: int, headers: list[tuple[str, str]]) -> None:
        assert self.status is None, "a second answer to one request"
        self.status, self.headers = status, list(headers)

    def response_empty(self, status: int, headers: list[tuple[str, str]]) -> None:
        self._start(status, headers)
        self.answered.set()

    def response_bytes(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self._start(status, headers)
        self.body += body
        self.answered.set()

    def response_str(self, status: int, headers: list[tuple[str, str]], body: str) -> None:
        self.response_bytes(status, headers, body.encode())

    def response_stream(self, status: int, headers: list[tuple[str, str]]) -> Stream:
        self._start(status, headers)
        self.streamed = True
        return Stream(self)


async def request(app: Any, method: str, path: str, headers: list[tuple[bytes, bytes]],
                  pieces: list[bytes]) -> Protocol:
    """Run one request through `app` (an RSGI application) to its end; the protocol holds the answer."""
    proto = Protocol(pieces)
    await app.__rsgi__(Scope(method, path, headers), proto)
    proto.answered.set()  # (a streamed answer ends when the application returns)
    return proto
