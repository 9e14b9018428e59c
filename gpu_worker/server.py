"""The device process: the socket server on DIR/service.sock, and the tick loop.

One thread owns the shared state (the engine computes on its own thread, runner.py, and hands its
events back to this loop). Frames read from every connection collect in an inbox; a tick is
scheduled as soon as the first one arrives, and it takes all that arrived since the previous
tick. While a tick's fdatasync blocks this thread, the kernel keeps queuing requests on the
sockets, so the next tick's batch grows exactly when the disk is slow: group commit without any
hand-off between threads (an owner thread beside the event loop spent most of its time
re-acquiring the GIL after every syscall).
"""
import asyncio
import collections
import logging
import os
import signal

from .protocol import PROTOCOL_VERSION, FrameBuffer, ProtocolError, encode_frame, reply

log = logging.getLogger("gpu_worker.server")
IDLE_SECONDS = 0.1
VERSION_REFUSED = (b'{"error":{"code":"protocol_version","message":"unsupported device protocol version; '
                   b'expected 1"}}')


class Connection(asyncio.Protocol):
    def __init__(self, server):
        self.server = server
        self.frames = FrameBuffer()
        self.transport = None

    def connection_made(self, transport):
        self.transport = transport

    def connection_lost(self, exc):
        self.server.device.connection_closed(self)

    def data_received(self, data):
        try:
            msgs = self.frames.feed(data)
        except ProtocolError as exc:
            log.warning("closing connection: %s", exc)
            self.transport.close()
            return
        for msg in msgs:
            if msg.get("v") != PROTOCOL_VERSION:
                self.transport.write(encode_frame(reply(msg.get("id"), 400, VERSION_REFUSED)))
                continue
            self.server.submit(self, msg)


class Server:
    def __init__(self, device, socket_path):
        self.device = device
        self.socket_path = socket_path
        self.inbox = collections.deque()
        self.loop = None
        self.failure = None
        self._scheduled = False

    def submit(self, conn, msg):
        self.inbox.append((conn, msg))
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._tick)

    def _tick(self):
        self._scheduled = False
        try:
            replies = self.device.tick(self.inbox)
        except BaseException as exc:  # a journal I/O error stops the device so a restart recovers
            self.failure = exc
            self.loop.stop()
            return
        self._send(replies)
        if self.inbox or self.device.internal_work:  # what did not fit this tick's record budget
            self._scheduled = True
            self.loop.call_soon(self._tick)

    def _idle(self):
        """Ten times a second: holds, deadlines, stale output to journal, automatic checkpoint."""
        try:
            self.device.idle()
        except BaseException as exc:
            self.failure = exc
            self.loop.stop()
            return
        self._schedule_if_work()
        self.loop.call_later(IDLE_SECONDS, self._idle)

    def _schedule_if_work(self):
        if not self._scheduled and (self.inbox or self.device.internal_work):
            self._scheduled = True
            self.loop.call_soon(self._tick)

    def engine_events(self, events):
        """The engine thread's events, on this loop's thread (call_soon_threadsafe)."""
        try:
            self.device.engine_events(events)
        except BaseException as exc:
            self.failure = exc
            self.loop.stop()
            return
        self._send(self.device.outbox)
        self.device.outbox = []
        self._schedule_if_work()

    @staticmethod
    def _send(replies):
        by_conn = {}
        for conn, msg in replies:
            by_conn.setdefault(conn, []).append(encode_frame(msg))
        for conn, frames in by_conn.items():
            if not conn.transport.is_closing():
                conn.transport.write(b"".join(frames))

    def deliver(self, events):
        self.loop.call_soon_threadsafe(self.engine_events, events)

    async def _serve(self):
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)  # we hold the journal lock, so no live device owns it
        server = await self.loop.create_unix_server(lambda: Connection(self), self.socket_path)
        os.chmod(self.socket_path, 0o660)
        return server

    def run(self, on_ready=None):
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(self._serve())
        self.loop.call_later(IDLE_SECONDS, self._idle)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self.loop.stop)
        if on_ready:
            on_ready()
        try:
            self.loop.run_forever()
        finally:
            server.close()
            try:
                os.unlink(self.socket_path)
            except OSError:
                pass
        if self.failure is not None:
            raise self.failure
