"""The gateway's one client of the device socket: pooled blocking calls for the shared routes,
and asyncio streams for long requests whose replies come in several frames (chat). Both read
frames through the contract's FrameReader.

Device down or silent -> ServiceError 503 with a clear code, never a hang. A timed-out mutation
may still have been admitted; the receipt answers an exact retry, so the client can retry."""
from __future__ import annotations

import asyncio
import itertools
import threading
from collections import deque
from typing import Any

from django.conf import settings
from django.http import HttpResponse

from gpu_worker.contract.client import Connection
from gpu_worker.contract.wire import FrameReader, Message, ProtocolError, request

from . import config
from .errors import ServiceError

CONNECT_TIMEOUT = 2.0


def _unreachable(path: str, exc: OSError) -> ServiceError:
    return ServiceError(503, "device_unavailable", f"the device is not reachable at {path}: {exc.strerror or exc}")


def _timed_out(timeout: float) -> ServiceError:
    return ServiceError(503, "device_timeout", f"the device did not answer within {timeout:g}s; retry the exact request")


class DeviceClient:
    """A pool of device connections: a request borrows one and returns it when its reply has
    arrived (daphne may run each request on a new thread, so per-thread sockets would mean a
    new connection per request)."""

    def __init__(self, socket_path: str, timeout: float) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._idle: list[Connection] = []
        self._lock = threading.Lock()

    def _connect(self) -> Connection:
        try:
            return Connection(self.socket_path, connect_timeout=CONNECT_TIMEOUT, timeout=self.timeout)
        except OSError as exc:
            raise _unreachable(self.socket_path, exc) from None

    def call(self, op: str, principal_id: str | None, args: dict[str, Any] | None = None) -> Message:
        """The device's reply map {"status", "body", "headers"?}."""
        for attempt in (0, 1):
            with self._lock:
                connection = self._idle.pop() if self._idle else None
            fresh = connection is None
            if connection is None:
                connection = self._connect()
            try:
                msg = connection.call(op, principal_id, args)
            except TimeoutError:
                connection.close()
                raise _timed_out(self.timeout) from None
            except (OSError, ProtocolError) as exc:
                connection.close()
                # a pooled connection may have gone stale across a device restart: retry once on a
                # fresh one (safe: an exact retry of a mutation answers its existing receipt)
                if fresh or attempt:
                    raise ServiceError(503, "device_unavailable", f"the device connection failed: {exc}") from None
                with self._lock:  # the device restarted: every pooled connection is stale
                    stale, self._idle = self._idle, []
                for other in stale:
                    other.close()
                continue
            with self._lock:
                self._idle.append(connection)
            return msg
        raise AssertionError("unreachable")

    def stream(self) -> DeviceStream:
        return DeviceStream(self.socket_path, self.timeout)

    def close(self) -> None:
        """Close the pooled connections (a connection in use is closed by its caller)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


class DeviceStream:
    """One asyncio connection for one long request: `send` it, then take its reply frames with
    `frame` (a frame with `"more": true` is followed by another). Closing the connection tells
    the device the client went away (it cancels a chat and frees its pages)."""

    _ids = itertools.count(1)

    def __init__(self, socket_path: str, timeout: float) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._frames = FrameReader()
        self._ready: deque[Message] = deque()

    async def open(self) -> DeviceStream:
        try:
            self._reader, self._writer = await asyncio.open_unix_connection(self.socket_path)
        except OSError as exc:
            raise _unreachable(self.socket_path, exc) from None
        return self

    async def __aenter__(self) -> DeviceStream:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    async def send(self, op: str, principal_id: str | None, args: dict[str, Any]) -> None:
        assert self._writer is not None
        self._writer.write(request(next(self._ids), op, principal_id, args))
        await self._writer.drain()

    async def frame(self) -> Message:
        assert self._reader is not None
        while not self._ready:
            try:
                data = await asyncio.wait_for(self._reader.read(1 << 16), self.timeout)
            except asyncio.TimeoutError:
                raise _timed_out(self.timeout) from None
            except OSError as exc:
                raise ServiceError(503, "device_unavailable", f"the device connection failed: {exc}") from None
            if not data:
                raise ServiceError(503, "device_unavailable", "the device closed the connection")
            try:
                self._ready.extend(self._frames.feed(data))
            except ProtocolError as exc:
                raise ServiceError(503, "device_unavailable", f"the device connection failed: {exc}") from None
        return self._ready.popleft()


_client: DeviceClient | None = None
_lock = threading.Lock()


def client() -> DeviceClient:
    """Opened lazily per process: daphne runs no ASGI lifespan."""
    global _client
    if _client is None:
        with _lock:
            if _client is None:
                try:
                    cfg = config.load(settings.AOTX_GATEWAY_CONFIG)
                except config.ConfigError as exc:
                    raise ServiceError(503, "gateway_misconfigured", str(exc)) from None
                _client = DeviceClient(cfg["socket"], settings.AOTX_DEVICE_TIMEOUT)
    return _client


def reset() -> None:
    """Close and forget the process's client (tests that point the gateway at another device)."""
    global _client
    with _lock:
        if _client is not None:
            _client.close()
        _client = None


def device_response(op: str, request: Any, args: dict[str, Any] | None = None) -> HttpResponse:
    """Call the device for this request's principal and pass its exact reply bytes through."""
    msg = client().call(op, request.user.principal_id, args)
    response = HttpResponse(msg["body"], status=msg["status"], content_type="application/json")
    for name, value in (msg.get("headers") or {}).items():
        response[name] = value
    return response
