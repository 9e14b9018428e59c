"""The device process: the socket server on DIR/service.sock, and the tick loop.

One thread owns the shared state (the engine computes on its own thread, runner.py, and hands its
events back to this loop). Frames read from every connection collect in an inbox; after each
round of socket events a tick gathers what arrived, up to its 16-record budget (Device.gather).
This thread writes the tick's records and the fdatasync helper process (syncer.py) makes them
durable; while it does, this thread reads the sockets and gathers the next tick, so the disk and
the interpreter work at the same time. The next tick's write and fdatasync start when this one's
are done (one tick in flight, at most one gathered ahead). A batch's replies go out once every
transfer it appended is saved.

The loop is a plain level-triggered epoll over non-blocking sockets, not asyncio: a busy device's
time per request went largely to the loop (asyncio's 256 KiB reads, handles and transports came
to ~60 us per registration on the CI machine); this one does one recv and one send per request
and little else. Other threads reach the loop only through `deliver` and `stop`,
which queue work and write to an eventfd the loop polls.
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

from .journal import JournalIOError
from .syncer import Syncer
from .protocol import PROTOCOL_VERSION, FrameBuffer, ProtocolError, encode_frame, reply

log = logging.getLogger("gpu_worker.server")
IDLE_SECONDS = 0.1
# Not larger: recv(n) allocates n bytes before it reads; 256 KiB (asyncio's size) measured 18 us a
# call here against 3 us for 64 KiB.
RECV_BYTES = 1 << 16
VERSION_REFUSED = (b'{"error":{"code":"protocol_version","message":"unsupported device protocol version; '
                   b'expected 1"}}')
# A connection whose unsent replies pass this many bytes is not read until they drain below it:
# a client that sends without reading gets backpressure, not a device that grows without bound.
HIGH_WATER = 4 << 20
ACCEPT_PAUSE = 1.0  # seconds without accepting after accept() fails (out of descriptors)
_IN = select.EPOLLIN
_OUT = select.EPOLLOUT
_GONE = select.EPOLLHUP | select.EPOLLERR


class Connection:
    """One gateway connection: its socket, the frames being read, the bytes not yet sent."""
    __slots__ = ("sock", "fd", "frames", "out", "events", "closed")

    def __init__(self, sock):
        self.sock = sock
        self.fd = sock.fileno()
        self.frames = FrameBuffer()
        self.out = bytearray()  # what a full socket buffer did not take yet (EPOLLOUT pending)
        self.events = _IN       # what epoll watches for it
        self.closed = False


class Server:
    def __init__(self, device, socket_path):
        self.device = device
        self.socket_path = socket_path
        self.inbox = collections.deque()
        self.failure = None
        self.batches = collections.deque()  # gathered, not yet answered (oldest first)
        self._io = None                      # the TickIO whose fdatasync the helper is making
        self.syncer = None
        self._want_tick = False
        self._running = False
        self._conns = {}                     # fd -> Connection
        self._epoll = None
        self._wake = None                    # run()'s eventfd: other threads wake the loop through it
        self._wake_lock = threading.RLock()  # re-entrant: stop() may run in a signal handler
        self._from_threads = collections.deque()  # engine events queued by deliver()
        self._stop_asked = False
        self._accept_paused_until = None

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
        """True while no batch may be gathered: one already waits behind the tick in flight; a
        batch not yet answered holds reads that wait for its saves (gathering applies admissions
        to the tables, and those reads must see saved state only); or a checkpoint command waits
        for the journal queue to drain."""
        batches = self.batches
        return (len(batches) > (1 if self._io is not None else 0)
                or any(batch.reads for batch in batches)
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
        """The helper answered."""
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
        if not replies:
            return
        by_conn = {}
        for conn, msg in replies:
            frames = by_conn.get(conn)
            if frames is None:
                by_conn[conn] = [encode_frame(msg)]
            else:
                frames.append(encode_frame(msg))
        for conn, frames in by_conn.items():
            if conn.closed:
                continue
            data = frames[0] if len(frames) == 1 else b"".join(frames)
            if conn.out:  # earlier bytes still wait for room: keep the order
                conn.out += data
                self._watch(conn)
                continue
            try:
                sent = conn.sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError:
                self._close(conn)
                continue
            if sent < len(data):
                conn.out += data[sent:]
                self._watch(conn)

    def _write_pending(self, conn):
        try:
            sent = conn.sock.send(conn.out)
        except BlockingIOError:
            return
        except OSError:
            self._close(conn)
            return
        del conn.out[:sent]
        self._watch(conn)

    def _watch(self, conn):
        """Poll for room while replies wait; stop reading while too many of them wait."""
        events = (_OUT if len(conn.out) > HIGH_WATER else _IN | _OUT) if conn.out else _IN
        if events != conn.events:
            conn.events = events
            self._epoll.modify(conn.fd, events)

    def _read(self, conn):
        try:
            data = conn.sock.recv(RECV_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        try:
            msgs = conn.frames.feed(data)
        except ProtocolError as exc:
            log.warning("closing connection: %s", exc)
            self._close(conn)
            return
        for msg in msgs:
            if msg.get("v") != PROTOCOL_VERSION:
                self._send([(conn, reply(msg.get("id"), 400, VERSION_REFUSED))])
                continue
            self.submit(conn, msg)

    def _accept(self, listener):
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: stop accepting a while (level-triggered
                # epoll would report the waiting connection again at once); served connections go on
                log.warning("accept failed, pausing new connections for %.1f s: %s", ACCEPT_PAUSE, exc)
                self._epoll.unregister(listener.fileno())
                self._accept_paused_until = time.monotonic() + ACCEPT_PAUSE
                return
            sock.setblocking(False)
            conn = Connection(sock)
            self._conns[conn.fd] = conn
            self._epoll.register(conn.fd, _IN)

    def _close(self, conn):
        if conn.closed:
            return
        conn.closed = True
        del self._conns[conn.fd]
        self._epoll.unregister(conn.fd)
        conn.sock.close()
        conn.out.clear()
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
        with self._wake_lock:
            self._wake = os.eventfd(1 if self._stop_asked else 0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll = epoll = select.epoll()
        self.syncer = Syncer()
        listen_fd, sync_fd, wake_fd = listener.fileno(), self.syncer.fileno(), self._wake
        for fd in (listen_fd, sync_fd, wake_fd):
            epoll.register(fd, _IN)
        on_main = threading.current_thread() is threading.main_thread()  # tests run a server on a thread
        previous = {}
        if on_main:
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, lambda *_: self.stop())
        self._running = True
        conns = self._conns
        next_idle = time.monotonic() + IDLE_SECONDS
        try:
            if on_ready:
                on_ready()
            while self._running:
                timeout = 0 if self._want_tick else max(0.0, next_idle - time.monotonic())
                for fd, events in epoll.poll(timeout):
                    conn = conns.get(fd)
                    if conn is not None:
                        if events & _OUT:
                            self._write_pending(conn)
                        if events & (_IN | _GONE) and not conn.closed:
                            self._read(conn)
                    elif fd == sync_fd:
                        self._synced()
                    elif fd == listen_fd:
                        self._accept(listener)
                    elif fd == wake_fd:
                        self._woken()
                    if not self._running:
                        break
                if self._want_tick and self._running:
                    self._tick()
                if time.monotonic() >= next_idle and self._running:
                    self._idle()
                    next_idle = time.monotonic() + IDLE_SECONDS
                    if self._accept_paused_until is not None and time.monotonic() >= self._accept_paused_until:
                        self._accept_paused_until = None
                        epoll.register(listen_fd, _IN)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for conn in list(conns.values()):
                conn.closed = True
                conn.sock.close()
            conns.clear()
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
