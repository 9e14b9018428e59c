"""The stall watchdog: a thread that notices when the device has commands or replies waiting and
the pipeline has not moved for `stall_seconds`, and says so where an operator looks.

"Moved" is any of: a batch gathered, a tick finished on the disk, a reply handed to the socket
thread (the server's `progress`). "Waiting" is any of: commands in the inbox, batches gathered and
not answered, journal records queued, engine or helper-thread results not yet taken, frames the
socket thread read and the loop has not taken. A device with work waiting and no progress is
stalled; an idle one never is.

When a stall passes `stall_seconds` (and again every REPEAT_SECONDS while it lasts) the watchdog
logs, at ERROR, the pipeline's state (inbox, gathered batches, the journal writer's counters,
ticks in flight, per-connection requests in flight from the socket thread) and every thread's
stack: Python's (sys._current_frames) and native (native/stacks.cpp), so the log of a device that
stops answering says where each thread waits. The device's `ping`, which the loop answers as soon
as it arrives (no tick, no journal: loop/server.py), reports `stalled_seconds`; the gateway's
/metrics exports it as `aotx_device_stalled_seconds` and /healthz answers 503 while it passes the
threshold.

The watchdog reads the loop's state without a lock (a snapshot taken under the interpreter lock,
one container at a time): good enough to describe a stall, never used to decide anything. A loop
that holds the interpreter lock for good (a native call that never returns while holding it)
stops the watchdog too; the gateway then sees the device's ping time out (/healthz: unreachable).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Callable

from .. import native

if TYPE_CHECKING:
    from .server import Server

log = logging.getLogger("gpu_worker.watchdog")

STALL_SECONDS = 5.0     # default of `boot --stall-seconds`
CHECK_SECONDS = 0.5     # how often the thread looks
REPEAT_SECONDS = 60.0   # a stall that lasts is reported again this often
NATIVE_STACK_SECONDS = 1.0  # how long one thread may take to answer the native stack signal


class Watchdog:
    def __init__(self, server: Server, stall_seconds: float = STALL_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.server = server
        self.stall_seconds = stall_seconds
        self.clock = clock
        self.reports = 0                  # stall reports logged (tests read it)
        self._seen = -1                   # the server's progress at the last look
        self._since = clock()             # when progress (or an idle pipeline) was last seen
        self._reported_at: float | None = None
        self._stop = threading.Event()    # stop()'s waker for the thread's periodic wait
        self._thread: threading.Thread | None = None

    # ---- the thread --------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="aotx-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(CHECK_SECONDS + 10 * NATIVE_STACK_SECONDS)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(CHECK_SECONDS):
            try:
                self.check()
            except Exception:  # the watchdog must outlive a snapshot that failed
                log.exception("stall watchdog check failed")

    # ---- the rule ----------------------------------------------------------------------------

    def stalled_seconds(self) -> float:
        """Seconds with work waiting and no progress (0 while the pipeline moves or is idle), as of
        the last look, brought up to now when nothing has moved since."""
        if self._seen != self.server.progress or self._seen < 0:
            return 0.0
        if not self._waiting():
            return 0.0
        return max(0.0, self.clock() - self._since)

    @property
    def stalled(self) -> bool:
        return self.stalled_seconds() >= self.stall_seconds

    def check(self) -> float:
        """One look: note progress, or report a stall that passed the threshold."""
        now = self.clock()
        progress = self.server.progress
        if progress != self._seen or not self._waiting():
            if self._reported_at is not None:
                log.warning("device pipeline moving again after a stall of %.1f s", now - self._since)
                self._reported_at = None
            self._seen, self._since = progress, now
            return 0.0
        stalled = now - self._since
        if stalled >= self.stall_seconds and (self._reported_at is None or now - self._reported_at >= REPEAT_SECONDS):
            self._reported_at = now
            log.error("device pipeline stalled: work has waited %.1f s with no progress\n%s", stalled, self.report())
            self.reports += 1  # after the log line: a reader of `reports` finds the report written
        return stalled

    def _waiting(self) -> bool:
        server = self.server
        writer = server.committer.writer
        if server.inbox or server.committer.batches or writer.queued_records or server.pending_deliveries:
            return True
        io = server.io
        if io is None:
            return False
        stats = io.stats()
        return bool(stats["events"] or stats["commands"])

    # ---- the report --------------------------------------------------------------------------

    def report(self) -> str:
        sections = []
        for title, part in (("pipeline", self._pipeline), ("python stacks", _python_stacks),
                            ("native stacks", _native_stacks)):
            try:
                sections.append(f"--- {title} ---\n{part()}")
            except Exception as exc:  # one part failing must not hide the others
                sections.append(f"--- {title} ---\n(unavailable: {type(exc).__name__}: {exc})")
        return "\n".join(sections)

    def _pipeline(self) -> str:
        server = self.server
        committer = server.committer
        writer = committer.writer
        inbox = list(server.inbox)
        lines = [
            f"progress {server.progress} (batches gathered {committer.gathered}, ticks finished {committer.finished}, "
            f"replies sent {server.sent}); tick wanted {server.want_tick}; "
            f"engine/helper results not taken {server.pending_deliveries}",
            f"inbox: {len(inbox)} commands; the first: {[_describe(msg) for _, msg in inbox[:8]]}",
            f"batches gathered, not answered: {len(committer.batches)}: "
            + ", ".join(f"(last_seq {b.last_seq}, admissions {len(b.waiting)}, replies {len(b.replies)}, "
                        f"deferred reads {len(b.reads)})" for b in list(committer.batches)[:8]),
            f"journal writer: next_seq {writer.next_seq}, durable_seq {writer.durable_seq}, queued records "
            f"{writer.queued_records} ({writer.queued_bytes} bytes), not yet on the disk {writer.untaken_records}, "
            f"ticks in flight {writer.ticks_in_flight}",
            f"committer: gather waits {committer.gather_waits(len(inbox))}, io waits {committer.io_waits()}, "
            f"drain waiters {committer.drain_waiters}",
        ]
        executions = getattr(server.device, "executions", None)
        if executions is not None:
            lines.append(f"inputs: {len(executions.to_lease)} awaiting a lease, {len(executions.live)} leased")
        io = server.io
        if io is not None:
            stats = io.stats()
            lines.append(f"socket thread: {stats['events']} frames read and not taken, {stats['commands']} sends "
                         f"queued and not run")
            for conn_id, in_flight, queued, reading in stats["connections"]:
                lines.append(f"  connection {conn_id}: {in_flight} requests in flight, {queued} reply bytes "
                             f"unsent, {'reading' if reading else 'NOT reading (backpressure)'}")
        return "\n".join(lines)


def _describe(msg: object) -> str:
    return f"{msg.get('op')}#{msg.get('id')}" if isinstance(msg, dict) else type(msg).__name__


def _python_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f"thread {names.get(ident, '?')} (ident {ident}):\n" + "".join(traceback.format_stack(frame)))
    return "".join(out)


def _native_stacks() -> str:
    fd = os.memfd_create("aotx-stacks", os.MFD_CLOEXEC)
    try:
        native.load("stacks").dump(fd, NATIVE_STACK_SECONDS)
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks).decode("utf-8", "replace")
    finally:
        os.close(fd)
