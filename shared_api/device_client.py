"""The gateway's one client of the device socket: DeviceMux, a multiplexed asyncio connection
carrying many requests told apart by their ids, so a request costs no thread and no connection
of its own. The HTTP front (shared_api/http/front.py) calls the device from the event loop through
DevicePool, a few DeviceMux connections per process; event streams and chats, whose replies come
in several frames, open a stream on the process's DeviceMux. Every request is built as its
command's declared type (gpu_worker/contract/commands.py) and every frame read through the
contract's ReplyReader, as a typed Reply.

There is one client, DeviceMux, with two faces, and they stay two. DevicePool (and `mux()`) is
for code already on an event loop: a call is an `await`, the connections belong to that loop
(one set per loop), and nothing blocks it. BlockingDevice is for synchronous callers, which all go
through shared_api/ops.py (`ops.call`, `ops.ping`): the Celery tasks in shared_api/tasks.py (the
capacity samples, hold detection, the scheduled checkpoint and audit export) and Celery beat's
wait for the device before its first run (aotx_site/celery.py), which run in processes with no
event loop at all; and Django's synchronous views, the admin's ops pages (shared_api/admin.py,
shared_api/console/: status, receipts, results, holds, and the hold banner of every admin page)
and /metrics and /healthz (shared_api/http/metrics.py), which Django's ASGI handler runs on a
worker thread, not on the event loop. No management command calls the device. Giving those
callers the async face would put an event loop in each of them (`asyncio.run` per call: a new
loop and a new connection every call, or one kept per thread) or make the pages and tasks async
where Django's admin and Celery are not; BlockingDevice instead runs one DeviceMux on one event
loop of its own thread per process, so a blocking call is the same DeviceMux call, the same
frames and the same failures, waited on through a future.

Device down or silent -> ServiceError 503 with a clear code, never a hang: `device_unavailable`
when nothing reached the device, `device_connection_lost` or `device_timeout` when the request
was sent (a mutation may have been admitted; the receipt answers an exact retry)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import threading
import weakref
from typing import Callable, Mapping, TypeVar

from django.conf import settings

from gpu_worker.contract.commands import Args, request, typed
from gpu_worker.contract.wire import ProtocolError, Reply, ReplyReader

from . import config, leader
from .errors import ServiceError

CONNECT_TIMEOUT = 2.0


def _unreachable(path: str, exc: OSError) -> ServiceError:
    return ServiceError(503, "device_unavailable", f"the device is not reachable at {path}: {exc.strerror or exc}")


def _timed_out(timeout: float) -> ServiceError:
    return ServiceError(503, "device_timeout", f"the device did not answer within {timeout:g}s; retry the exact request")


class DeviceMux:
    """One asyncio connection to the device carrying many requests at once, told apart by their
    ids: a reader task routes each frame to its stream, and a frame without `"more": true` ends
    that stream. `call` is one request and its one reply (the shared routes); `open` a stream of
    frames (chats, event streams). Closing a stream early tells the device
    (`subscriptions.close`: a chat stops, an operation goes on). When the connection fails every
    open stream gets a 503 and the next request connects again."""

    _ids = itertools.count(1)

    def __init__(self, socket_path: str, timeout: float) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None
        self._connecting = asyncio.Lock()
        self._streams: dict[int, DeviceStream | DeviceReply] = {}
        # ids whose last frames may still come and are dropped: streams closed early, calls that
        # timed out. Any other unknown id means the connection is out of step: it is closed.
        self._abandoned: set[int] = set()
        # frames written in one turn of the event loop go to the socket in one write: one system
        # call (and one wake-up of the device's socket thread) for all of them
        self._outbox: dict[asyncio.StreamWriter, list[bytes]] = {}

    async def _connection(self) -> tuple[asyncio.StreamWriter, bool]:
        """The open connection, and whether it was opened just now."""
        current = self._writer
        if current is not None and not current.is_closing():
            return current, False
        async with self._connecting:
            current = self._writer
            if current is not None and not current.is_closing():
                return current, False
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(self.socket_path),
                                                        CONNECT_TIMEOUT)
            except (OSError, asyncio.TimeoutError) as exc:
                raise _unreachable(self.socket_path, exc if isinstance(exc, OSError) else OSError(str(exc))) from None
            self._writer = writer
            self._reading = asyncio.get_running_loop().create_task(self._read(reader, writer))
            return writer, True

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frames = ReplyReader()
        failure = ServiceError(503, "device_unavailable", "the device closed the connection")
        try:
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    break
                for msg in frames.feed(data):
                    generation = msg.g
                    if generation is not None and generation < leader.newest_generation():
                        msg = _deposed(msg, generation)
                    # a frame for several subscriptions of this connection names them all in "ids"
                    for req_id in msg.ids or (msg.id or 0,):
                        stream = self._streams.get(req_id)
                        if stream is None:
                            if req_id not in self._abandoned:
                                raise ProtocolError(f"a reply to request {req_id!r}, which is not waiting")
                            if not msg.more:
                                self._abandoned.discard(req_id)
                            continue
                        if not msg.more:
                            del self._streams[stream.id]
                        stream.deliver(msg)
        except (OSError, ProtocolError) as exc:
            failure = ServiceError(503, "device_unavailable", f"the device connection failed: {exc}")
        finally:
            if self._writer is writer:
                self._writer = None
            writer.close()
            streams, self._streams = self._streams, {}
            self._abandoned.clear()
            for stream in streams.values():
                stream.fail(failure)

    async def _send(self, op: str, principal_id: str | None, args: Args | Mapping[str, object] | None,
                    retry_stale: bool, kind: type[Waiter]) -> Waiter:
        """Send one request; its frames go to a new `kind` (a DeviceStream, or a DeviceReply for a
        one-reply call). A connection that turns out to be closed when written to reached
        nothing: with retry_stale, the request goes once more on a fresh connection."""
        args = typed(op, args)  # a refusal before anything is registered or sent
        for attempt in (0, 1):
            writer, fresh = await self._connection()
            stream = kind(self, next(self._ids))
            self._streams[stream.id] = stream
            try:
                if writer.is_closing():
                    raise ConnectionResetError("the connection was closed")
                self._post(writer, request(stream.id, op, principal_id, args))
                if writer.transport.get_write_buffer_size() > 1 << 20:
                    await self._drain(writer, stream)  # the device is slow to read: wait, as a blocking send would
                return stream
            except OSError as exc:
                self._streams.pop(stream.id, None)
                if self._writer is writer:
                    self._writer = None
                if fresh or attempt or not retry_stale:
                    raise ServiceError(503, "device_unavailable", f"the device connection failed: {exc}") from None
        raise AssertionError("unreachable")

    async def _drain(self, writer: asyncio.StreamWriter, stream: Waiter) -> None:
        """Wait for room to write, bounded by the device timeout: a device that stops reading (its
        backpressure on a connection with too many requests unanswered, or a stalled device) must
        not hold a request for good. Past the bound the request may still reach the device (it is
        in the write buffer): 503 device_timeout, retry it exactly."""
        try:
            async with asyncio.timeout(self.timeout):
                await writer.drain()
        except TimeoutError:
            if self._streams.pop(stream.id, None) is not None:
                self._abandoned.add(stream.id)
            raise _timed_out(self.timeout) from None

    def _post(self, writer: asyncio.StreamWriter, frame: bytes) -> None:
        frames = self._outbox.get(writer)
        if frames is None:
            frames = self._outbox[writer] = []
            asyncio.get_running_loop().call_soon(self._flush, writer)
        frames.append(frame)

    def _flush(self, writer: asyncio.StreamWriter) -> None:
        frames = self._outbox.pop(writer, [])
        if not writer.is_closing():
            writer.write(b"".join(frames))
        # else the connection ended meanwhile: its reader task has failed every stream it carried

    async def open(self, op: str, principal_id: str | None, args: Args | Mapping[str, object]) -> DeviceStream:
        """Send one request; its frames arrive on the returned stream."""
        return await self._send(op, principal_id, args, retry_stale=False, kind=DeviceStream)

    async def call(self, op: str, principal_id: str | None, args: Args | Mapping[str, object] | None = None,
                   timeout: float | None = None) -> Reply:
        """One request and its one reply (its status, body and headers)."""
        waiter = await self._send(op, principal_id, args, retry_stale=True, kind=DeviceReply)
        limit = self.timeout if timeout is None else timeout
        timer = asyncio.get_running_loop().call_later(limit, waiter.expire)
        try:
            return await waiter.future
        except (asyncio.TimeoutError, ServiceError) as exc:
            raise self._failure(waiter, exc, limit) from None
        finally:
            timer.cancel()

    def _failure(self, waiter: DeviceReply, exc: BaseException, limit: float) -> ServiceError:
        if isinstance(exc, asyncio.TimeoutError):  # (the timer's: no reply within the limit)
            if self._streams.pop(waiter.id, None) is not None:
                self._abandoned.add(waiter.id)
            return _timed_out(limit)
        message = exc.message if isinstance(exc, ServiceError) else str(exc)  # the connection failed after the write
        return ServiceError(503, "device_connection_lost",
                            f"the device connection broke after the request was sent ({message}); it may "
                            "have been admitted: retry it exactly")

    async def _close(self, stream: DeviceStream) -> None:
        if self._streams.pop(stream.id, None) is None or self._writer is None:
            return  # already ended
        self._abandoned.add(stream.id)
        closing = DeviceStream(self, next(self._ids))  # its one reply is read and dropped
        self._abandoned.add(closing.id)
        self._post(self._writer, request(closing.id, "subscriptions.close", None, {"id": stream.id}))
        try:
            async with asyncio.timeout(self.timeout):  # bounded: a device that does not read must not hold a close
                await self._writer.drain()
        except (OSError, TimeoutError):
            pass  # the reader task ends every stream; a close that did not get out ends with the connection

    def redirect(self, socket_path: str) -> None:
        """Connect to `socket_path` from now on; the open connection (to the old primary) is closed:
        its reader task fails what it carried (on the loop's thread)."""
        self.socket_path = socket_path
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

    async def aclose(self) -> None:
        """Close the connection and wait for its reader to end (open streams get a 503)."""
        writer, reading = self._writer, self._reading
        self._writer = None
        if writer is not None:
            self._flush(writer)  # frames posted this turn of the loop (a stream's close) still go
            writer.close()
        if reading is not None:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)


KEEP_ALIVE = Reply(status=0, body=b"", more=True)  # not a device frame: DeviceStream.nudge's wake-up


class DeviceStream:
    """The frames of one request sent through the DeviceMux."""

    def __init__(self, mux: DeviceMux, req_id: int) -> None:
        self.mux = mux
        self.id = req_id
        self.queue: asyncio.Queue[Reply | ServiceError] = asyncio.Queue()
        # called by the mux's reader with each frame while the queue is empty; True: taken, not queued
        self.on_frame: Callable[[Reply], bool] | None = None
        self.backlog = 0  # body bytes of the frames queued
        # a bound on `backlog` (None: none) and what is called, once, when a frame passes it: a
        # reader slower than its frames must not hold the gateway's memory without end
        self.backlog_limit: int | None = None
        self.on_backlog: Callable[[], None] | None = None

    def deliver(self, msg: Reply) -> None:
        """A frame from the mux's reader: to `on_frame` when nothing is queued before it and it takes
        the frame at once (no wake-up of the task waiting in `next`), else queued, in order."""
        if self.on_frame is None or not self.queue.empty() or not self.on_frame(msg):
            self.queue.put_nowait(msg)
            self.backlog += len(msg.body)
            if self.backlog_limit is not None and self.backlog > self.backlog_limit and self.on_backlog is not None:
                overflow, self.on_backlog = self.on_backlog, None
                overflow()

    def fail(self, error: ServiceError) -> None:
        """The connection failed: `next` raises `error` after the frames already queued."""
        self.queue.put_nowait(error)

    async def next(self, timeout: float | None = None) -> Reply:
        """The next frame (or KEEP_ALIVE, after `nudge`); asyncio.TimeoutError after `timeout`
        seconds without one. A long-lived stream waits without a timeout: arming and cancelling a
        timer for every frame was a tenth of a gateway's work fanning events out to 1,000 streams."""
        if not self.queue.empty():
            msg = self.queue.get_nowait()
        elif timeout is None:
            msg = await self.queue.get()
        else:  # (asyncio.timeout: no task of its own per frame, unlike wait_for)
            async with asyncio.timeout(timeout):
                msg = await self.queue.get()
        if isinstance(msg, ServiceError):
            raise msg
        self.backlog -= len(msg.body)
        return msg

    def nudge(self) -> None:
        """Wake the reader with KEEP_ALIVE (its connection has been quiet: it may write a comment)."""
        self.queue.put_nowait(KEEP_ALIVE)

    async def close(self) -> None:
        """Stop the request (its client went away); never waits for the device."""
        await self.mux._close(self)


class DeviceReply:
    """The one reply of a call (DeviceMux.call), as a future with a timer handle: a queue and an
    `asyncio.timeout` per call cost a few percent of the gateway's time for a small mutation."""

    __slots__ = ("id", "future")

    def __init__(self, mux: DeviceMux, req_id: int) -> None:  # (as DeviceStream is made; it needs no mux)
        self.id = req_id
        self.future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()

    def deliver(self, msg: Reply) -> None:
        if not self.future.done():
            self.future.set_result(msg)

    def fail(self, error: ServiceError) -> None:
        if not self.future.done():
            self.future.set_exception(error)

    def expire(self) -> None:
        if not self.future.done():
            self.future.set_exception(asyncio.TimeoutError())


Waiter = TypeVar("Waiter", DeviceStream, DeviceReply)  # what a request's frames go to


class DevicePool:
    """The event loop's connections for one-reply calls: `size` DeviceMux connections used in
    turn, so that one connection's share of the device's per-connection limits (128 requests
    waiting, 4 MiB of replies) is not every request's, and a bound on the requests waiting for the
    device (beyond it: 503 `gateway_busy` at once, nothing sent)."""

    def __init__(self, socket_path: str, timeout: float, size: int, max_waiting: int) -> None:
        self.muxes = [DeviceMux(socket_path, timeout) for _ in range(max(1, size))]
        self.max_waiting = max_waiting
        self.waiting = 0
        self._turn = itertools.cycle(self.muxes)

    async def call(self, op: str, principal_id: str | None, args: Args | Mapping[str, object] | None = None) -> Reply:
        if self.waiting >= self.max_waiting:
            raise ServiceError(503, "gateway_busy", f"{self.waiting} requests of this gateway process are waiting "
                                                    "for the device; nothing was sent: retry later")
        self.waiting += 1
        try:
            return await next(self._turn).call(op, principal_id, args)
        finally:
            self.waiting -= 1

    async def aclose(self) -> None:
        for found in self.muxes:
            await found.aclose()


class BlockingDevice:
    """The blocking face of the one device client, for synchronous callers (through
    shared_api/ops.py: the admin's pages, Celery tasks and beat, /metrics and /healthz; the module
    docstring says why they do not await DevicePool): a DeviceMux on an event loop of its own
    thread ("aotx-device-client"), started on the first call in each process (a Celery worker
    forked from a parent that had one starts its own). A call is the mux's `call`,
    with its failures (503 device_unavailable, device_connection_lost, device_timeout); the caller
    waits on the call's future, which the mux's reply or its timer completes, and, as a safety net
    for a loop that could not run it, at most the call's timeout plus the connect bound."""

    def __init__(self, socket_path: str, timeout: float) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._lock = threading.Lock()
        self._running: tuple[int, asyncio.AbstractEventLoop, threading.Thread, DeviceMux] | None = None

    def _started(self) -> tuple[asyncio.AbstractEventLoop, DeviceMux]:
        with self._lock:
            running = self._running
            if running is None or running[0] != os.getpid():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="aotx-device-client", daemon=True)
                thread.start()
                running = self._running = (os.getpid(), loop, thread, DeviceMux(self.socket_path, self.timeout))
            return running[1], running[3]

    def call(self, op: str, principal_id: str | None, args: Args | Mapping[str, object] | None = None,
             timeout: float | None = None) -> Reply:
        """The device's reply (a ServiceError otherwise)."""
        args = typed(op, args)  # a refusal before anything starts
        loop, device = self._started()
        limit = self.timeout if timeout is None else timeout
        future = asyncio.run_coroutine_threadsafe(device.call(op, principal_id, args, timeout=limit), loop)
        try:
            return future.result(limit + CONNECT_TIMEOUT + 1)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise _timed_out(limit) from None

    def close(self) -> None:
        """Close the connection and end the thread (a forked child's copy is only forgotten)."""
        with self._lock:
            running, self._running = self._running, None
        if running is None or running[0] != os.getpid():
            return
        _, loop, thread, device = running
        try:
            asyncio.run_coroutine_threadsafe(device.aclose(), loop).result(CONNECT_TIMEOUT)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass  # the thread ends below whatever the connection did
        loop.call_soon_threadsafe(loop.stop)
        thread.join(CONNECT_TIMEOUT)
        if not thread.is_alive():
            loop.close()


_muxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, DeviceMux] = weakref.WeakKeyDictionary()
_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, DevicePool] = weakref.WeakKeyDictionary()


def mux() -> DeviceMux:
    """The running event loop's DeviceMux for streams (one loop per server process; tests may run several)."""
    _here()
    loop = asyncio.get_running_loop()
    found = _muxes.get(loop)
    if found is None:
        made = DeviceMux(configured_socket(), settings.AOTX_DEVICE_TIMEOUT)
        with _lock:  # (redirect lists the connections from the leader watch's thread)
            found = _muxes[loop] = made
    return found


_last_pool: tuple[weakref.ref[asyncio.AbstractEventLoop], DevicePool] | None = None


def pool() -> DevicePool:
    """The running event loop's DevicePool (the last one found is kept at hand: a lookup in the
    weak dictionary makes a weak reference each time, and every shared route asks)."""
    global _last_pool
    _here()
    loop = asyncio.get_running_loop()
    last = _last_pool
    if last is not None and last[0]() is loop:
        return last[1]
    found = _pools.get(loop)
    if found is None:
        made = DevicePool(configured_socket(), settings.AOTX_DEVICE_TIMEOUT, settings.AOTX_DEVICE_CONNECTIONS,
                          settings.AOTX_DEVICE_WAITING)
        with _lock:  # (as in mux)
            found = _pools[loop] = made
    _last_pool = (weakref.ref(loop), found)
    return found


async def aclose_loop() -> None:
    """Close the running loop's device connections (a test's event loop, before it ends)."""
    global _last_pool
    _last_pool = None
    loop = asyncio.get_running_loop()
    found_pool, found_mux = _pools.pop(loop, None), _muxes.pop(loop, None)
    if found_pool is not None:
        await found_pool.aclose()
    if found_mux is not None:
        await found_mux.aclose()


def _deposed(msg: Reply, generation: int) -> Reply:
    """A reply of a device whose leadership generation is older than the leader key's newest: it
    is answered 503 `not_primary` instead (retry exactly at the current primary), whatever it said."""
    error = ServiceError(503, "not_primary", f"the device answered as leadership generation {generation}, which a "
                                             f"newer one ({leader.newest_generation()}) replaced: retry at the primary")
    return Reply(id=msg.id, ids=msg.ids, status=503, body=error.body())


_blocking: dict[str, BlockingDevice] = {}  # by socket path
_lock = threading.Lock()


def _here() -> None:
    """503 `not_primary` while the leader key names a primary on another machine (leader.py)."""
    machine = leader.elsewhere()
    if machine is not None:
        raise ServiceError(503, "not_primary", f"the primary is on machine {machine}: send it to that machine's "
                                               "gateway")


def configured_socket() -> str:
    """The device socket of the gateway's config, read now (503 gateway_misconfigured otherwise):
    its "socket", or with "etcd" the primary's that the leader key names (shared_api/leader.py)."""
    try:
        return leader.socket_of(config.load(settings.AOTX_GATEWAY_CONFIG), redirect)
    except config.ConfigError as exc:
        raise ServiceError(503, "gateway_misconfigured", str(exc)) from None
    except leader.Elsewhere as exc:  # (docs/replication.md, "Across machines")
        raise ServiceError(503, "not_primary", f"the primary is on machine {exc}: send it to that machine's gateway") \
            from None


def _redirect(muxes: list[DeviceMux], socket_path: str) -> None:
    for found_mux in muxes:
        found_mux.redirect(socket_path)


def redirect(socket_path: str) -> None:
    """A new primary holds the leader key (shared_api/leader.py, on its watch thread): every
    device connection of this process goes to `socket_path` from now on; those open are closed,
    and what they carried gets 503 `device_connection_lost` (retry exactly)."""
    with _lock:
        found: dict[asyncio.AbstractEventLoop, list[DeviceMux]] = {loop: list(p.muxes) for loop, p in _pools.items()}
        for loop, found_mux in _muxes.items():
            found.setdefault(loop, []).append(found_mux)
        stale = [d for path, d in _blocking.items() if path != socket_path]
        for path in [path for path in _blocking if path != socket_path]:
            del _blocking[path]
    for loop, muxes in found.items():
        try:  # every connection of a loop in one callback: no request of it goes out between two
            loop.call_soon_threadsafe(_redirect, muxes, socket_path)
        except RuntimeError:  # that loop is closed: nothing of it to move
            pass
    for device in stale:
        device.close()


def blocking(socket_path: str) -> BlockingDevice:
    """The process's blocking client of the device at socket_path (one per path, made on first use)."""
    with _lock:
        found = _blocking.get(socket_path)
        if found is None:
            found = _blocking[socket_path] = BlockingDevice(socket_path, settings.AOTX_DEVICE_TIMEOUT)
    return found


def reset() -> None:
    """Close and forget the process's clients and its leader watch (tests that point the gateway at
    another device)."""
    global _last_pool
    _last_pool = None
    leader.stop()
    with _lock:
        found_blocking = list(_blocking.values())
        _blocking.clear()
        for found in [*_muxes.values(), *(m for p in _pools.values() for m in p.muxes)]:
            if found._writer is not None:
                found._writer.close()
        _muxes.clear()
        _pools.clear()
    for device in found_blocking:
        device.close()


