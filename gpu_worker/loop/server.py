"""The device's transport: the socket server on DIR/service.sock and the loop that drives the
tick pipeline (storage/committer.py). No domain rule lives here.

One thread owns the shared state (the engine computes on its own thread, loop/runner.py, and
hands its events back to this loop). The sockets belong to a native thread (native/sockio.cpp):
it accepts, reads, splits frames and sends, holding no interpreter lock, and hands this loop
whole frame payloads through one eventfd. This loop decodes each payload, checks the protocol
version, queues it in the inbox, lets the committer gather and commit ticks, and answers through
`io.send`, one call per round of replies. The committer's tick I/O thread reports through a
second eventfd; other threads reach the loop only through `deliver` and `stop`, which queue work
and write to a third.
"""
from __future__ import annotations

import collections
import logging
import os
import select
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol, cast

from .. import native
from .watchdog import STALL_SECONDS, Watchdog
from ..contract.wire import (MAX_FRAME, PROTOCOL_VERSION, VERSION_REFUSED, Answer, Message, ProtocolError, Reply,
                             decode_request, encode_reply, reply)

if TYPE_CHECKING:
    from ..replication.lease import Leadership
    from ..replication.primary import Shipper
    from ..storage.committer import Committer
    from .runner import Event

log = logging.getLogger("gpu_worker.server")
IDLE_SECONDS = 0.1
# A connection whose unsent replies pass this many bytes is not read until they drain below it,
# nor one with this many requests not yet answered: a client that sends without reading gets
# backpressure, not a device that grows without bound.
HIGH_WATER = 4 << 20
MAX_IN_FLIGHT = 128
ACCEPT_PAUSE = 1.0  # seconds without accepting after accept() fails (out of descriptors)
_IN = select.EPOLLIN


class Connection:
    """One gateway connection as the device sees it: the native loop's id for it. Replies and
    the device's per-connection state (chat streams) are keyed by this object."""
    __slots__ = ("id", "closed")

    def __init__(self, conn_id: int) -> None:
        self.id = conn_id
        self.closed = False


class Served(Protocol):
    """What the loop needs of the device (gpu_worker/device.py's Device)."""
    committer: Committer
    leadership: Leadership | None
    pipeline_state: Callable[[], dict[str, object]] | None  # the loop's own, set by the loop

    @property
    def internal_work(self) -> bool: ...

    def read(self, msg: Message) -> Reply: ...

    def take_outbox(self) -> list[Answer]: ...

    def engine_events(self, events: list[Event]) -> None: ...

    def connection_closed(self, conn: object) -> None: ...

    def idle(self) -> None: ...


class Server:
    """The socket is the device's trust boundary: every frame names its principal, so only the
    gateway may connect. The socket file is mode 0600 (the device's user only), or 0660 with its
    group set to `socket_group`; and every accepted peer's credentials (SO_PEERCRED, checked by the
    native loop) must have the device's own uid, one of `allow_uids` or its primary gid among
    `allow_gids` (and `socket_group`), else it is closed at once and the refusal logged."""

    def __init__(self, device: Served, socket_path: str, *, allow_uids: tuple[int, ...] = (),
                 allow_gids: tuple[int, ...] = (), socket_group: int | None = None,
                 stall_seconds: float = STALL_SECONDS, replica: Shipper | None = None) -> None:
        self.device = device                 # gpu_worker.device.Device
        self.committer = device.committer
        self.replica = replica               # journal shipping to a standby (replication/primary.py Shipper)
        self.socket_path = socket_path
        self.socket_group = socket_group
        self.allow_uids = tuple(sorted({os.geteuid(), *allow_uids}))
        self.allow_gids = tuple(sorted(set(allow_gids) | ({socket_group} if socket_group is not None else set())))
        self.inbox: collections.deque[tuple[Connection, Message]] = collections.deque()
        self.failure: BaseException | None = None
        self._want_tick = False
        self._running = False
        self.io: Any = None                  # the native socket loop (sockio), while run() runs
        self._conns: dict[int, Connection] = {}  # conn id -> Connection, from its first frame
        self._wake: int | None = None        # run()'s eventfd: other threads wake the loop through it
        self._wake_lock = threading.RLock()  # re-entrant: stop() may run in a signal handler
        self._from_threads: collections.deque[list[Event]] = collections.deque()  # engine events from deliver()
        self._stop_asked = False
        self.sent = 0                        # replies handed to the socket thread (the watchdog's progress)
        self.watchdog = Watchdog(self, stall_seconds)
        device.pipeline_state = self.pipeline_state

    # ---- driving the pipeline -----------------------------------------------------------

    @property
    def progress(self) -> int:
        """Grows whenever the pipeline moves: a batch gathered, a tick finished, a reply sent."""
        return self.committer.gathered + self.committer.finished + self.sent

    @property
    def want_tick(self) -> bool:
        return self._want_tick

    @property
    def pending_deliveries(self) -> int:
        """Other threads' results queued for this loop and not yet taken."""
        return len(self._from_threads)

    def submit(self, conn: Connection, msg: Message) -> None:
        self.inbox.append((conn, msg))
        self._want_tick = True

    def _tick(self) -> None:
        self._want_tick = False
        self._step(self.committer.tick, self.inbox)

    def _synced(self) -> None:
        self._step(self.committer.synced)

    def _step(self, step: Callable[..., list[Answer]], *args: object) -> None:
        try:
            self._send(step(*args) + self.device.take_outbox())
        except BaseException as exc:  # a journal I/O error stops the device so a restart recovers
            self._fail(exc)
            return
        self._schedule_if_work()

    def _fail(self, exc: BaseException) -> None:
        self.failure = exc
        self._running = False

    def _idle(self) -> None:
        """Ten times a second: grants, holds, deadlines, stale output to journal, automatic checkpoint."""
        try:
            self.device.idle()
        except BaseException as exc:
            self._fail(exc)
            return
        self._send(self.device.take_outbox())
        self._step(self.committer.fence)  # (a fenced primary's replies held for its standby)

    def _schedule_if_work(self) -> None:
        """After every step: tick again when there is something to gather, or records that only a
        tick will send to the disk (committer.io_waits: else nothing would ever wake the loop for
        them, and every command behind them would wait for good)."""
        if self._want_tick:
            return
        committer = self.committer
        if committer.io_waits() or (not committer.gather_waits(len(self.inbox))
                                    and (self.inbox or self.device.internal_work)):
            self._want_tick = True

    def engine_events(self, events: list[Event]) -> None:
        """The engine thread's events, on this loop's thread."""
        try:
            self.device.engine_events(events)
        except BaseException as exc:
            self._fail(exc)
            return
        self._send(self.device.take_outbox())
        self._schedule_if_work()

    # ---- sockets -----------------------------------------------------------------------

    def _send(self, replies: list[Answer]) -> None:
        """Hand replies to the socket thread: one (conn id, frames, count) per connection (each reply's
        connection one of this server's: the device keeps them as they came, typed `object`). Under an
        etcd leadership every reply carries its generation ("g"): a gateway that saw a newer one
        takes it for a deposed primary's (shared_api/device_client.py)."""
        if not replies:
            return
        self.sent += len(replies)
        leadership = self.device.leadership
        if leadership is not None:
            generation = leadership.generation
            for _, msg in replies:
                msg.g = generation
        by_conn: dict[Connection, list[bytes]] = {}
        for peer, msg in replies:
            conn = cast(Connection, peer)
            frames = by_conn.get(conn)
            if frames is None:
                by_conn[conn] = [encode_reply(msg)]
            else:
                frames.append(encode_reply(msg))
        self.io.send([(conn.id, frames[0] if len(frames) == 1 else b"".join(frames), len(frames))
                      for conn, frames in by_conn.items() if not conn.closed])

    def _arrived(self, events: list[tuple[int, bytes | str | None]]) -> None:
        """What the socket thread read: frame payloads, connections gone, warnings."""
        conns = self._conns
        for conn_id, data in events:
            conn = conns.get(conn_id)
            if type(data) is bytes:
                if conn is None:
                    conn = conns[conn_id] = Connection(conn_id)
                elif conn.closed:
                    continue
                try:
                    msg = decode_request(data)
                except ProtocolError as exc:
                    log.warning("closing connection: %s", exc)
                    self.io.close(conn_id)
                    self._closed(conn)
                    continue
                if msg.get("v") != PROTOCOL_VERSION:
                    self._send([(conn, reply(msg.get("id"), 400, VERSION_REFUSED))])
                    continue
                if msg.get("op") == "ping":  # liveness and the watchdog's view: never behind a stalled tick
                    self._send([(conn, self.device.read(msg))])
                    continue
                self.submit(conn, msg)
            elif data is None:  # the peer closed, the connection failed, or its frame was too large
                if conn is not None:
                    self._closed(conn)
            else:
                log.warning("%s", data)

    def pipeline_state(self) -> dict[str, object]:
        """What `ping` reports of this loop: the stall watchdog's reading and the queues."""
        stalled = self.watchdog.stalled_seconds()
        return {"stalled_seconds": round(stalled, 3), "stall_seconds": self.watchdog.stall_seconds,
                "stalled": stalled >= self.watchdog.stall_seconds, "inbox": len(self.inbox),
                "batches": len(self.committer.batches), "ticks_in_flight": self.committer.writer.ticks_in_flight,
                "replication": self.replica.state() if self.replica is not None else None,
                "leadership": self.device.leadership.state() if self.device.leadership is not None else None}

    def _closed(self, conn: Connection) -> None:
        if conn.closed:
            return
        conn.closed = True
        del self._conns[conn.id]
        try:
            self.device.connection_closed(conn)
        except BaseException as exc:
            self._fail(exc)

    # ---- other threads -----------------------------------------------------------------

    def deliver(self, events: list[Event]) -> None:
        """From the engine thread: hand events to the loop (dropped while no loop runs)."""
        with self._wake_lock:
            if self._wake is not None:
                self._from_threads.append(events)
                os.eventfd_write(self._wake, 1)

    def stop(self) -> None:
        """From any thread or a signal handler: the loop ends after its current step."""
        with self._wake_lock:
            self._stop_asked = True
            if self._wake is not None:
                os.eventfd_write(self._wake, 1)

    def _woken(self) -> None:
        assert self._wake is not None
        try:
            os.eventfd_read(self._wake)
        except BlockingIOError:
            pass
        if self._stop_asked:
            self._running = False
        # only what was queued when woken: what these events deliver (a continuation's next slice:
        # Checkpoints._mark_folded) waits for the next wake, after the ticks and reads queued meanwhile
        for _ in range(len(self._from_threads)):
            if not self._running:
                break
            self.engine_events(self._from_threads.popleft())

    # ---- the loop ----------------------------------------------------------------------

    def _listen(self) -> socket.socket:
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)  # we hold the journal lock, so no live device owns it
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.socket_path)
        if self.socket_group is not None:
            os.chown(self.socket_path, -1, self.socket_group)
            os.chmod(self.socket_path, 0o660)
        else:
            os.chmod(self.socket_path, 0o600)
        listener.listen(1024)
        listener.setblocking(False)
        return listener

    def run(self, on_ready: Callable[[], None] | None = None) -> None:
        listener = self._listen()
        self.io = io = native.load("sockio").Loop(listener.fileno(), HIGH_WATER, MAX_IN_FLIGHT, MAX_FRAME, ACCEPT_PAUSE,
                                                  self.allow_uids, self.allow_gids)
        with self._wake_lock:
            self._wake = os.eventfd(1 if self._stop_asked else 0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        epoll = select.epoll()
        syncer = native.load("sockio").Syncer()
        self.committer.attach(syncer, self.replica)
        io_fd, sync_fd, wake_fd = io.fileno(), syncer.fileno(), self._wake
        replica_fd = self.replica.fileno() if self.replica is not None else -1
        for fd in (io_fd, sync_fd, wake_fd):
            epoll.register(fd, _IN)
        if self.replica is not None:
            epoll.register(replica_fd, _IN)  # its waker: an acknowledgement, a standby joining or leaving
        on_main = threading.current_thread() is threading.main_thread()  # tests run a server on a thread
        previous: dict[signal.Signals, Any] = {}
        if on_main:
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, lambda *_: self.stop())
        self._running = True
        next_idle = time.monotonic() + IDLE_SECONDS
        try:
            io.start()
            self.watchdog.start()
            if on_ready:
                on_ready()
            while self._running:
                timeout = 0 if self._want_tick else max(0.0, next_idle - time.monotonic())
                for fd, _ in epoll.poll(timeout):
                    if fd == io_fd:
                        self._arrived(io.take())
                    elif fd == sync_fd:
                        self._synced()
                    elif fd == wake_fd:
                        self._woken()
                    elif fd == replica_fd:
                        self._step(self.committer.acked)
                    if not self._running:
                        break
                if self._want_tick and self._running:
                    self._tick()
                if time.monotonic() >= next_idle and self._running:
                    self._idle()
                    next_idle = time.monotonic() + IDLE_SECONDS
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.watchdog.stop()
            io.stop()  # closes every connection
            for conn in self._conns.values():
                conn.closed = True
            self._conns.clear()
            epoll.close()
            with self._wake_lock:
                os.close(self._wake)
                self._wake = None
            self.committer.attach(None)
            syncer.close()
            listener.close()
            try:
                os.unlink(self.socket_path)
            except OSError:
                pass
        if self.failure is not None:
            raise self.failure
