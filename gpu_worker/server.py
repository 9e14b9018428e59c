"""The device process: the socket server on DIR/service.sock, and the tick loop.

One thread owns the shared state (the engine computes on its own thread, runner.py, and hands its
events back to this loop). Frames read from every connection collect in an inbox; after each
round of events a tick gathers what arrived, up to its 16-record budget (Device.gather).
A native thread (sockio.Syncer) writes the tick's records and makes them durable with one
fdatasync; while it does, this thread gathers the next tick, so the disk and the interpreter work
at the same time. A whole next tick is handed to that thread behind the running one, so its I/O
starts the moment the last one's ends, without waiting for this thread (at most two ticks in
flight and one more gathered behind them; ticks still run one after another, one fdatasync each).
A batch's replies go out once every transfer it appended is saved.

The sockets themselves belong to a native thread (sockio.cpp): it accepts, reads, splits frames
and sends, holding no interpreter lock, and hands this loop whole frame payloads through one
eventfd. On a busy device the socket work (epoll, one recv and one send per request, each send
waking a client) had taken about 40% of this thread's time; it now runs on the other core. This
loop decodes each payload, checks the protocol version and answers through `io.send`, one call per
round of replies. Other threads reach the loop only through `deliver` and `stop`, which queue work
and write to an eventfd the loop polls.
"""
import collections
import errno
import logging
import os
import select
import signal
import socket
import threading
import time

from . import native
from .journal import MAX_RECORDS_PER_TICK, MAX_TICKS_IN_FLIGHT, JournalIOError
from .protocol import MAX_FRAME, PROTOCOL_VERSION, ProtocolError, decode_payload, encode_frame, reply

log = logging.getLogger("gpu_worker.server")
IDLE_SECONDS = 0.1
VERSION_REFUSED = (b'{"error":{"code":"protocol_version","message":"unsupported device protocol version; '
                   b'expected 1"}}')
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

    def __init__(self, conn_id):
        self.id = conn_id
        self.closed = False


class Server:
    def __init__(self, device, socket_path):
        self.device = device
        self.socket_path = socket_path
        self.inbox = collections.deque()
        self.failure = None
        self.batches = collections.deque()  # gathered, not yet answered (oldest first)
        self.syncer = None
        self._want_tick = False
        self._running = False
        self.io = None                       # the native socket loop (sockio), while run() runs
        self._conns = {}                     # conn id -> Connection, from its first frame
        self._wake = None                    # run()'s eventfd: other threads wake the loop through it
        self._wake_lock = threading.RLock()  # re-entrant: stop() may run in a signal handler
        self._from_threads = collections.deque()  # engine events queued by deliver()
        self._stop_asked = False

    # ---- the tick pipeline -------------------------------------------------------------

    def submit(self, conn, msg):
        self.inbox.append((conn, msg))
        self._want_tick = True

    def _tick(self):
        """Gather a batch unless one already waits for the disk behind the tick in flight."""
        self._want_tick = False
        if self._gathered_ahead():
            return  # _complete gathers the next one
        try:
            self.batches.append(self.device.gather(self.inbox))
            self._flush()
        except BaseException as exc:  # a journal I/O error stops the device so a restart recovers
            self._fail(exc)

    def _gathered_ahead(self):
        """True while no batch may be gathered: a whole tick's records already wait behind the
        ticks in flight; a batch not yet answered holds reads that wait for its saves (gathering
        applies admissions to the tables, and those reads must see saved state only); or a
        checkpoint command waits for the journal queue to drain."""
        batches = self.batches
        return (self.device.writer.untaken_records >= MAX_RECORDS_PER_TICK
                or any(batch.reads for batch in batches)
                or bool(self.device.checkpoint_waiters and self.device.writer.queued_records))

    def _flush(self):
        """Start the next tick's I/O; answer the batches that are saved; gather again if asked.

        The I/O goes first so the disk does not wait while the answers are rendered (they read
        state the next tick cannot have changed: no batch is gathered behind deferred reads)."""
        device = self.device
        saved = []
        while self.batches and self.batches[0].last_seq <= device.writer.durable_seq:
            saved.append(self.batches.popleft())
        checkpoints = device.run_checkpoints()  # only while nothing is queued for the journal
        ran = self._begin_io()
        self._send([r for batch in saved for r in device.answer(batch)] + checkpoints)  # in request order
        if ran is not None:
            self._complete(ran)
            return
        self._schedule_if_work()

    def _begin_io(self):
        """Hand ticks to the tick I/O thread: the queued records when nothing is in flight, and
        behind a tick in flight a whole tick's (16 records), so the disk starts it the moment
        the last one ends and no tick goes out emptier than it must. Returns the tick when its
        I/O already ran here (a test's faulty file: one at a time), else None."""
        writer = self.device.writer
        while (writer.untaken_records and writer.ticks_in_flight < MAX_TICKS_IN_FLIGHT
               and (not writer.ticks_in_flight or writer.untaken_records >= MAX_RECORDS_PER_TICK)):
            tick = writer.begin_tick()
            if not tick.file.native_io:
                tick.run()  # its write and fdatasync run here, now
                return tick
            self.syncer.request(tick.file.fileno(), tick.data)
        return None

    def _synced(self):
        """The tick I/O thread finished the oldest tick: its errno, 0 when written and durable."""
        err = self.syncer.result()
        if err is None:  # still running (a result is posted only once it is done)
            return
        tick = self.device.writer.oldest_tick
        if err:
            tick.error = OSError(err, os.strerror(err))
        self._complete(tick)

    def _complete(self, tick):
        try:
            try:
                transfers = self.device.writer.finish_tick(tick)
            except JournalIOError as err:
                self._take_cancelled(err.ended_ticks)
                if err.errno != errno.ENOSPC:
                    raise  # EIO and the like: stop admitting; the process exits and a restart recovers
                self._send(self.device.refuse_unsaved(err, self.batches))
                self.batches.clear()
            else:
                if tick.file.native_io:  # the disk's next tick first (it never runs here): the
                    self._begin_io()     # saves and the answers below are made while it runs
                self.device.saved(transfers)
            self._flush()
        except BaseException as exc:
            self._fail(exc)

    def _take_cancelled(self, count):
        """A failed tick ended the `count` ticks in flight behind it; the tick I/O thread ran none
        of them and has already posted each as cancelled."""
        for _ in range(count):
            err = self.syncer.result()
            if err != errno.ECANCELED:
                raise RuntimeError(f"the tick I/O thread ran a tick queued behind a failure ({err})")

    def _fail(self, exc):
        self.failure = exc
        self._running = False

    def _idle(self):
        """Ten times a second: holds, deadlines, stale output to journal, automatic checkpoint."""
        try:
            self.device.idle()
        except BaseException as exc:
            self._fail(exc)
            return
        self._schedule_if_work()

    def _schedule_if_work(self):
        if not self._want_tick and not self._gathered_ahead() and (self.inbox or self.device.internal_work):
            self._want_tick = True

    def engine_events(self, events):
        """The engine thread's events, on this loop's thread."""
        try:
            self.device.engine_events(events)
        except BaseException as exc:
            self._fail(exc)
            return
        self._send(self.device.outbox)
        self.device.outbox = []
        self._schedule_if_work()

    # ---- sockets -----------------------------------------------------------------------

    def _send(self, replies):
        """Hand replies to the socket thread: one (conn id, frames, count) per connection."""
        if not replies:
            return
        by_conn = {}
        for conn, msg in replies:
            frames = by_conn.get(conn)
            if frames is None:
                by_conn[conn] = [encode_frame(msg)]
            else:
                frames.append(encode_frame(msg))
        self.io.send([(conn.id, frames[0] if len(frames) == 1 else b"".join(frames), len(frames))
                      for conn, frames in by_conn.items() if not conn.closed])

    def _arrived(self, events):
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
                    msg = decode_payload(data)
                except ProtocolError as exc:
                    log.warning("closing connection: %s", exc)
                    self.io.close(conn_id)
                    self._closed(conn)
                    continue
                if msg.get("v") != PROTOCOL_VERSION:
                    self._send([(conn, reply(msg.get("id"), 400, VERSION_REFUSED))])
                    continue
                self.submit(conn, msg)
            elif data is None:  # the peer closed, the connection failed, or its frame was too large
                if conn is not None:
                    self._closed(conn)
            else:
                log.warning("%s", data)

    def _closed(self, conn):
        if conn.closed:
            return
        conn.closed = True
        del self._conns[conn.id]
        try:
            self.device.connection_closed(conn)
        except BaseException as exc:
            self._fail(exc)

    # ---- other threads -----------------------------------------------------------------

    def deliver(self, events):
        """From the engine thread: hand events to the loop (dropped while no loop runs)."""
        with self._wake_lock:
            if self._wake is not None:
                self._from_threads.append(events)
                os.eventfd_write(self._wake, 1)

    def stop(self):
        """From any thread or a signal handler: the loop ends after its current step."""
        with self._wake_lock:
            self._stop_asked = True
            if self._wake is not None:
                os.eventfd_write(self._wake, 1)

    def _woken(self):
        try:
            os.eventfd_read(self._wake)
        except BlockingIOError:
            pass
        if self._stop_asked:
            self._running = False
        while self._from_threads and self._running:
            self.engine_events(self._from_threads.popleft())

    # ---- the loop ----------------------------------------------------------------------

    def _listen(self):
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)  # we hold the journal lock, so no live device owns it
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.socket_path)
        os.chmod(self.socket_path, 0o660)
        listener.listen(1024)
        listener.setblocking(False)
        return listener

    def run(self, on_ready=None):
        listener = self._listen()
        self.io = io = native.load("sockio").Loop(listener.fileno(), HIGH_WATER, MAX_IN_FLIGHT, MAX_FRAME, ACCEPT_PAUSE)
        with self._wake_lock:
            self._wake = os.eventfd(1 if self._stop_asked else 0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        epoll = select.epoll()
        self.syncer = native.load("sockio").Syncer()
        io_fd, sync_fd, wake_fd = io.fileno(), self.syncer.fileno(), self._wake
        for fd in (io_fd, sync_fd, wake_fd):
            epoll.register(fd, _IN)
        on_main = threading.current_thread() is threading.main_thread()  # tests run a server on a thread
        previous = {}
        if on_main:
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, lambda *_: self.stop())
        self._running = True
        next_idle = time.monotonic() + IDLE_SECONDS
        try:
            io.start()
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
            io.stop()  # closes every connection
            for conn in self._conns.values():
                conn.closed = True
            self._conns.clear()
            epoll.close()
            with self._wake_lock:
                os.close(self._wake)
                self._wake = None
            self.syncer.close()
            listener.close()
            try:
                os.unlink(self.socket_path)
            except OSError:
                pass
        if self.failure is not None:
            raise self.failure
