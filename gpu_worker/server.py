"""The device process: the socket server on DIR/service.sock, and the tick loop.

One thread owns the shared state (the engine computes on its own thread, runner.py, and hands its
events back to this loop). Frames read from every connection collect in an inbox; a tick is
scheduled as soon as the first one arrives, and it gathers what arrived, up to its 16-record
budget (Device.gather). This thread writes the tick's records and the fdatasync helper process
(syncer.py) makes them durable; while it does, this thread reads the sockets and gathers the next
tick, so the disk and the interpreter work at the same time. The next tick's write and fdatasync
start when this one's are done (one tick in flight, at most one gathered ahead). A batch's
replies go out once every transfer it appended is saved.
"""
import asyncio
import collections
import errno
import logging
import os
import signal
import threading

from .journal import JournalIOError
from .syncer import Syncer
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
        self.batches = collections.deque()  # gathered, not yet answered (oldest first)
        self._io = None                      # the TickIO whose fdatasync the helper is making
        self.syncer = None

    def submit(self, conn, msg):
        self.inbox.append((conn, msg))
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._tick)

    def _tick(self):
        """Gather a batch unless one already waits for the disk behind the tick in flight."""
        self._scheduled = False
        if self._gathered_ahead():
            return  # _complete gathers the next one
        try:
            self.batches.append(self.device.gather(self.inbox))
            self._flush()
        except BaseException as exc:  # a journal I/O error stops the device so a restart recovers
            self._fail(exc)

    def _gathered_ahead(self):
        """True while no batch may be gathered: one already waits behind the tick in flight, or a
        checkpoint command waits for the journal queue to drain."""
        return (len(self.batches) > (1 if self._io is not None else 0)
                or bool(self.device.checkpoint_waiters and self.device.writer.queued_records))

    def _flush(self):
        """Answer the batches that are saved; start the next tick's I/O; gather again if asked."""
        device = self.device
        while self.batches and self.batches[0].last_seq <= device.writer.durable_seq:
            self._send(device.answer(self.batches.popleft()))
        self._send(device.run_checkpoints())
        if self._io is None and device.writer.queued_records:
            self._io = tick = device.writer.begin_tick()
            tick.write()
            if tick.error is None:
                self.syncer.request(tick.file)
            else:
                self._complete(tick)  # nothing to sync: ENOSPC or the like, now
                return
        self._schedule_if_work()

    def _synced(self):
        """The helper answered (a reader callback on this loop's thread)."""
        try:
            err = self.syncer.result()
        except BaseException as exc:
            self._fail(exc)
            return
        if err:
            self._io.error = OSError(err, os.strerror(err))
        self._complete(self._io)

    def _complete(self, tick):
        self._io = None
        try:
            try:
                self.device.saved(self.device.writer.finish_tick(tick))
            except JournalIOError as err:
                if err.errno != errno.ENOSPC:
                    raise  # EIO and the like: stop admitting; the process exits and a restart recovers
                self._send(self.device.refuse_unsaved(err, self.batches))
                self.batches.clear()
            self._flush()
        except BaseException as exc:
            self._fail(exc)

    def _fail(self, exc):
        self.failure = exc
        self.loop.stop()

    def _idle(self):
        """Ten times a second: holds, deadlines, stale output to journal, automatic checkpoint."""
        try:
            self.device.idle()
        except BaseException as exc:
            self._fail(exc)
            return
        self._schedule_if_work()
        self.loop.call_later(IDLE_SECONDS, self._idle)

    def _schedule_if_work(self):
        if self._scheduled or self._gathered_ahead():
            return
        if self.inbox or self.device.internal_work:
            self._scheduled = True
            self.loop.call_soon(self._tick)

    def engine_events(self, events):
        """The engine thread's events, on this loop's thread (call_soon_threadsafe)."""
        try:
            self.device.engine_events(events)
        except BaseException as exc:
            self._fail(exc)
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
        self.syncer = Syncer()
        self.loop.add_reader(self.syncer.fileno(), self._synced)
        self.loop.call_later(IDLE_SECONDS, self._idle)
        if threading.current_thread() is threading.main_thread():  # tests run a server on a thread
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.loop.add_signal_handler(sig, self.loop.stop)
        if on_ready:
            on_ready()
        try:
            self.loop.run_forever()
        finally:
            self.loop.remove_reader(self.syncer.fileno())
            self.syncer.close()
            server.close()
            try:
                os.unlink(self.socket_path)
            except OSError:
                pass
        if self.failure is not None:
            raise self.failure
