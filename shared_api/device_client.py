"""The gateway's one client of the device socket: pooled blocking calls for the shared routes
(DeviceClient), and one multiplexed asyncio connection per process for long requests whose
replies come in several frames: chats and event streams (DeviceMux). Both read frames through the
contract's FrameReader.

Device down or silent -> ServiceError 503 with a clear code, never a hang. A timed-out mutation
may still have been admitted; the receipt answers an exact retry, so the client can retry."""
from __future__ import annotations

import asyncio
import itertools
import threading
import weakref
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
                req_id = connection.send(op, principal_id, args)
            except OSError as exc:
                connection.close()
                # nothing reached the device. A pooled connection may have gone stale across a
                # device restart: retry once on a fresh one
                if fresh or attempt:
                    raise ServiceError(503, "device_unavailable", f"the device connection failed: {exc}") from None
                with self._lock:  # the device restarted: every pooled connection is stale
                    stale, self._idle = self._idle, []
                for other in stale:
                    other.close()
                continue
            try:
                msg = connection.receive(req_id)
            except TimeoutError:
                connection.close()
                raise _timed_out(self.timeout) from None
            except (OSError, ProtocolError) as exc:
                connection.close()  # the request reached the device: it may have been admitted
                raise ServiceError(503, "device_connection_lost",
                                   f"the device connection broke after the request was sent ({exc}); it may have "
                                   "been admitted: retry it exactly") from None
            with self._lock:
                self._idle.append(connection)
            return msg
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close the pooled connections (a connection in use is closed by its caller)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


class DeviceMux:
    """The process's one asyncio connection to the device for every long request: chats and
    subscriptions (event streams) alike. Requests are told apart by their ids; a reader task
    routes each frame to its stream, and a frame without `"more": true` ends that stream. Closing
    a stream early tells the device (`subscriptions.close`: a chat stops, an operation goes on).
    When the connection fails every open stream gets 503 `device_unavailable` and the next
    request connects again."""

    _ids = itertools.count(1)

    def __init__(self, socket_path: str, timeout: float) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None
        self._connecting = asyncio.Lock()
        self._streams: dict[int, DeviceStream] = {}

    async def _connection(self) -> asyncio.StreamWriter:
        async with self._connecting:
            if self._writer is not None:
                return self._writer
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(self.socket_path),
                                                        CONNECT_TIMEOUT)
            except (OSError, asyncio.TimeoutError) as exc:
                raise _unreachable(self.socket_path, OSError(str(exc))) from None
            self._writer = writer
            self._reading = asyncio.get_running_loop().create_task(self._read(reader, writer))
            return writer

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frames = FrameReader()
        failure = ServiceError(503, "device_unavailable", "the device closed the connection")
        try:
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    break
                for msg in frames.feed(data):
                    # a frame for several subscriptions of this connection names them all in "ids"
                    for req_id in msg.get("ids") or (msg.get("id", 0),):
                        stream = self._streams.get(req_id)
                        if stream is None:
                            continue  # a stream closed early: its last frames are dropped
                        if not msg.get("more"):
                            del self._streams[stream.id]
                        stream.queue.put_nowait(msg)
        except (OSError, ProtocolError) as exc:
            failure = ServiceError(503, "device_unavailable", f"the device connection failed: {exc}")
        finally:
            if self._writer is writer:
                self._writer = None
            writer.close()
            streams, self._streams = self._streams, {}
            for stream in streams.values():
                stream.queue.put_nowait(failure)

    async def open(self, op: str, principal_id: str | None, args: dict[str, Any]) -> DeviceStream:
        """Send one request; its frames arrive on the returned stream."""
        writer = await self._connection()
        stream = DeviceStream(self, next(self._ids))
        self._streams[stream.id] = stream
        writer.write(request(stream.id, op, principal_id, args))
        try:
            await writer.drain()
        except OSError as exc:
            self._streams.pop(stream.id, None)
            raise ServiceError(503, "device_unavailable", f"the device connection failed: {exc}") from None
        return stream

    async def call(self, op: str, principal_id: str | None, args: dict[str, Any]) -> Message:
        """One request and its one reply."""
        return await (await self.open(op, principal_id, args)).next(self.timeout)

    async def _close(self, stream: DeviceStream) -> None:
        if self._streams.pop(stream.id, None) is None or self._writer is None:
            return  # already ended
        closing = DeviceStream(self, next(self._ids))  # its one reply is read and dropped
        self._streams[closing.id] = closing
        self._writer.write(request(closing.id, "subscriptions.close", None, {"id": stream.id}))
        try:
            await self._writer.drain()
        except OSError:
            pass  # the reader task ends every stream


class DeviceStream:
    """The frames of one request sent through the DeviceMux."""

    def __init__(self, mux: DeviceMux, req_id: int) -> None:
        self.mux = mux
        self.id = req_id
        self.queue: asyncio.Queue[Message | ServiceError] = asyncio.Queue()

    async def next(self, timeout: float | None = None) -> Message:
        """The next frame; asyncio.TimeoutError after `timeout` seconds without one (a stream's
        caller may then keep its client's connection alive and wait again)."""
        if self.queue.empty():  # (asyncio.timeout: no task of its own per frame, unlike wait_for)
            async with asyncio.timeout(timeout):
                msg = await self.queue.get()
        else:
            msg = self.queue.get_nowait()
        if isinstance(msg, ServiceError):
            raise msg
        return msg

    async def close(self) -> None:
        """Stop the request (its client went away); never waits for the device."""
        await self.mux._close(self)


_muxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, DeviceMux] = weakref.WeakKeyDictionary()


def mux() -> DeviceMux:
    """The running event loop's DeviceMux (daphne runs one loop per process; tests may run several)."""
    loop = asyncio.get_running_loop()
    found = _muxes.get(loop)
    if found is None:
        pooled = client()
        found = _muxes[loop] = DeviceMux(pooled.socket_path, pooled.timeout)
    return found


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
    """Close and forget the process's clients (tests that point the gateway at another device)."""
    global _client
    with _lock:
        if _client is not None:
            _client.close()
        _client = None
        for found in list(_muxes.values()):
            if found._writer is not None:
                found._writer.close()
        _muxes.clear()


def device_response(op: str, request: Any, args: dict[str, Any] | None = None) -> HttpResponse:
    """Call the device for this request's principal and pass its exact reply bytes through."""
    msg = client().call(op, request.user.principal_id, args)
    response = HttpResponse(msg["body"], status=msg["status"], content_type="application/json")
    for name, value in (msg.get("headers") or {}).items():
        response[name] = value
    return response
