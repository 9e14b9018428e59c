"""The tick pipeline: one owner for gathering, writing, saving and answering, used the same way by
the running server and by boot, replay-time commits, offline commands and tests.

A tick gathers commands from the inbox until its 16-record journal budget is used (the device's
`gather`, which applies admissions and appends their transfers); its records are then written
and made durable with one fdatasync; once every transfer a batch appended is saved, the batch's
replies go out (the device's `answer`). The write and fdatasync run either here (`commit`, and
every tick while no tick I/O thread is attached) or on the native tick I/O thread
(native/tick_io.cpp `Syncer`, attached by the server): then a whole next tick may wait behind the
one in flight, so the disk starts it the moment the last one ends (at most two in flight); less
than a whole tick's worth of commands waits in the inbox until the disk is done and is then
gathered in one batch (`gather_waits`). Gathering applies admissions to the tables at once, so no
batch is gathered while an unanswered one still holds reads waiting for its saves.

A failed tick ends the ticks behind it. ENOSPC: nothing unsaved survives; the device rebuilds
from the saved state, holds, and refuses every admission of the unsaved batches. Any other error
(EIO) stops the device; a restart recovers from the journal.
"""
from __future__ import annotations

import bisect
import errno
import os
import time
from collections import deque
from typing import TYPE_CHECKING, Protocol

from ..contract.wire import Answer, Message, Reply
from .journal import Transfer
from .journal_writer import MAX_RECORDS_PER_TICK, MAX_TICKS_IN_FLIGHT, JournalIOError, JournalWriter, TickIO

if TYPE_CHECKING:
    from .runtime_file_writer import Stored

class Batch:
    """One tick's commands between gather and answer: every reply waits until `last_seq`, the
    last journal transfer appended by then, is saved."""

    __slots__ = ("replies", "waiting", "reads", "last_seq")

    def __init__(self) -> None:
        self.replies: list[Answer] = []                    # ready now: refusals, reads of saved state
        self.waiting: list[tuple[object, int | None, int, int]] = []  # (conn, req_id, status, receipt row) of admissions
        self.reads: list[tuple[object, Message]] = []          # reads that must not see unsaved state before them
        self.last_seq = 0


IO_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)  # seconds


class IOStats:
    """How long each tick's write + fdatasync took (from its start on the disk, not its wait in
    the queue behind the tick before it), as a histogram, and how many transfers became saved."""

    def __init__(self) -> None:
        self.counts = [0] * (len(IO_BUCKETS) + 1)
        self.sum = 0.0
        self.saved_transfers = 0
        self._started: deque[float] = deque()  # ticks handed to the disk, oldest first
        self._last_end = 0.0

    def started(self) -> None:
        self._started.append(time.monotonic())

    def ended(self) -> None:
        now = time.monotonic()
        start = max(self._started.popleft(), self._last_end) if self._started else now
        self._last_end = now
        took = now - start
        self.sum += took
        self.counts[bisect.bisect_left(IO_BUCKETS, took)] += 1

    def cancelled(self) -> None:
        self._started.clear()

    def report(self) -> dict[str, object]:
        """Prometheus-style: cumulative counts per upper bound."""
        buckets, total = {}, 0
        for bound, count in zip((*map(str, IO_BUCKETS), "+Inf"), self.counts):
            total += count
            buckets[bound] = total
        return {"saved_transfers": self.saved_transfers,
                "io_seconds": {"count": total, "sum": self.sum, "buckets": buckets}}


class TickOwner(Protocol):
    """What the committer needs of the device."""

    def gather(self, inbox: deque[tuple[object, Message]], batch: Batch) -> None: ...

    def answer(self, batch: Batch) -> list[Answer]: ...

    def saved(self, transfers: list[Transfer]) -> None: ...

    def refuse_unsaved(self, err: JournalIOError, batches: list[Batch]) -> list[Answer]: ...

    def unconfirmed(self, batches: list[Batch]) -> list[Answer]: ...

    def fenced(self) -> str | None: ...

    def not_primary(self, batches: list[Batch], why: str) -> list[Answer]: ...

    def read(self, msg: Message) -> Reply: ...

    def drained(self, conn: object, msg: Message) -> Reply | None: ...

    def replication_marked(self, held: bool, start: int) -> int: ...


class Syncer(Protocol):
    """The native tick I/O thread (native/tick_io.cpp)."""

    def request(self, fd: int, data: bytes) -> None: ...

    def result(self) -> int | None: ...

    def fileno(self) -> int: ...


class Replica(Protocol):
    """Journal shipping to a standby (gpu_worker/replication/primary.py Shipper)."""

    @property
    def waits(self) -> bool: ...  # whether a transfer is saved only once the standby holds it (sync, not alone)

    @property
    def acked_seq(self) -> int: ...

    def begin(self, writer: JournalWriter) -> None: ...

    def ship(self, segment: int, offset: int, data: bytes, last_seq: int) -> None: ...

    def woken(self, writer: JournalWriter) -> bool: ...

    def cut(self, writer: JournalWriter) -> None: ...

    def checkpoint(self, generation: int, components: list[Stored], drop: list[str],
                   through_segment: int) -> bool: ...  # whether a link took them to send

    def media(self, sha: str, path: str) -> None: ...

    @property
    def stranded(self) -> bool: ...  # it waits for a standby and none is connected

    # (the Committer journals its changes of mode: `_mark_replication`)
    alone_due: bool
    alone_marker: int | None
    held_from: int | None


MAX_HELD_BATCHES = 64  # batches a sync standby may hold unanswered before gathering waits for it


class Committer:
    def __init__(self, owner: TickOwner, writer: JournalWriter) -> None:
        self.owner = owner
        self.writer = writer
        self.batches: deque[Batch] = deque()   # gathered, not yet answered (oldest first)
        self.syncer: Syncer | None = None      # the tick I/O thread, while a server runs
        self.replica: Replica | None = None    # a standby's journal shipping, while a server runs
        self._shipped_seq = 0                  # the last transfer whose bytes were shipped
        self._unacked: deque[Transfer] = deque()  # saved here, not yet on a sync standby (oldest first)
        self._drain_waiters: list[tuple[object, Message]] = []  # commands that run once nothing is queued
        self._first_seq = writer.next_seq  # the first transfer of this boot (those before keep their save mode)
        self.stats = IOStats()
        self.gathered = 0   # batches gathered and ticks finished so far: the stall watchdog's sign of
        self.finished = 0   # progress (loop/watchdog.py)

    # Transfers are queued with writer.append (which only queues); the pipeline below writes them.

    @property
    def drain_waiters(self) -> int:
        return len(self._drain_waiters)

    def when_drained(self, conn: object, msg: Message) -> None:
        """Answer msg (a checkpoint) once every transfer is saved (`all_saved`); gathering pauses
        meanwhile, unless the unsaved ones wait for a standby that is not there (`stranded`). conn
        None: the device's own (its automatic checkpoint), answered to no one."""
        self._drain_waiters.append((conn, msg))

    @property
    def all_saved(self) -> bool:
        """Every transfer appended so far is saved: durable here and, with a sync standby, held
        there too. A checkpoint folds only then: the state it writes is what a load rebuilds, and
        a receipt it held unsaved would stay so after a load (its admission's transfer is folded,
        no replay marks it), though the standby's acknowledgement later saved it here."""
        return not self.writer.queued_records and not self._unacked

    @property
    def stranded(self) -> bool:
        """What is unsaved waits for a sync standby that is not connected: it is saved once one
        is, or once `--standby-timeout` passes; until then pausing gathering for it (a checkpoint
        waiting) would only hold up the reads."""
        return self.replica is not None and self.replica.stranded

    # ---- the pipeline ---------------------------------------------------------------

    def attach(self, syncer: Syncer | None, replica: Replica | None = None) -> None:
        self.syncer = syncer
        self.replica = replica
        if replica is not None:
            self._shipped_seq = self.writer.durable_seq
            replica.begin(self.writer)
            if replica.waits:  # (a boot saves alone: its BOOT transfer says so at a replay)
                self.owner.replication_marked(True, self.writer.next_seq)

    def _mark_replication(self) -> None:
        """Journal the standby's changes of mode (REPLICATION transfers, docs/journal.md): before
        anything is saved alone, that it will be from the first transfer the standby does not hold
        (`Shipper.alone` waits for this transfer to be durable); and, back in sync, that a standby
        holds the transfers saved from then on."""
        replica = self.replica
        assert replica is not None
        if replica.alone_due and replica.alone_marker is None:
            # (after a boot no standby has acknowledged anything yet: what the journal held before
            # it was saved as its replay says, held or alone, not alone from seq 1)
            start = max(replica.acked_seq + 1, self._first_seq)
            replica.alone_marker = self.owner.replication_marked(False, start)
        if replica.held_from is not None:
            self.owner.replication_marked(True, replica.held_from)
            replica.held_from = None

    @property
    def saved_seq(self) -> int:
        """The last transfer that counts as saved: durable here and, with a sync standby, there."""
        durable = self.writer.durable_seq
        replica = self.replica
        return min(durable, replica.acked_seq) if replica is not None and replica.waits else durable

    def fence(self) -> list[Answer]:
        """Ten times a second (the loop's idle timer), with a sync standby: a primary whose leadership
        lease may have lapsed will never hear its standby again (it is the primary now). What waits
        for it is answered 503 `not_primary`: retry exactly at the current primary, which holds
        each such admission or admits it anew."""
        if self.replica is None or not self.replica.waits or not (self.batches or self._drain_waiters):
            return []
        why = self.owner.fenced()
        if why is None:
            return []
        batches = list(self.batches)
        self.batches.clear()
        if self._drain_waiters:  # a checkpoint waiting for the standby's acknowledgements: never here
            drains = Batch()
            drains.reads = [(conn, msg) for conn, msg in self._drain_waiters if conn is not None]
            self._drain_waiters = []
            batches.append(drains)
        return self.owner.not_primary(batches, why)

    def acked(self) -> list[Answer]:
        """The standby's link moved (an acknowledgement, a standby joined or left): what it saves."""
        assert self.replica is not None
        self.replica.woken(self.writer)
        self._mark_replication()
        self._release()
        return self._pump()

    def gather_waits(self, waiting: int) -> bool:
        """True while no batch is gathered, with `waiting` commands in the inbox: a whole tick's
        records already wait behind the ticks in flight; a batch not yet answered holds reads
        that wait for its saves; a command waits for every transfer to be saved; or a tick is on
        the disk and less than a tick's worth waits (records and commands). What a gather took
        then could not reach the disk before that tick ends (only a whole tick queues behind
        one), so it is gathered when the tick ends, in one gather instead of one per command as
        they arrive (each gather's own costs, the grant file's stat and the hold check's statvfs
        among them, were a third of a mutation's device time: docs/performance.md). A read gathered
        then is answered at once when nothing is queued, as it would have been."""
        writer = self.writer
        untaken = writer.untaken_records
        return (untaken >= MAX_RECORDS_PER_TICK
                or bool(writer.ticks_in_flight and untaken + waiting < MAX_RECORDS_PER_TICK)
                or any(batch.reads for batch in self.batches)
                or bool(self._drain_waiters and not self.all_saved and not self.stranded)
                or (self.replica is not None and self.replica.waits and len(self.batches) >= MAX_HELD_BATCHES))

    def io_waits(self) -> bool:
        """True when queued records could go to the disk now and nothing will send them there
        unless the pipeline is moved (`tick`): they were appended between ticks (an upload's bytes
        written, a memory row embedded, a deadline's completion, a hold) while no tick was on the
        disk, so no tick's end (`synced`) will come to start them. The loop must tick for them even
        when no batch may be gathered (`gather_waits`)."""
        writer = self.writer
        return bool(writer.untaken_records and writer.ticks_in_flight < MAX_TICKS_IN_FLIGHT
                    and (not writer.ticks_in_flight or writer.untaken_records >= MAX_RECORDS_PER_TICK))

    def tick(self, inbox: deque[tuple[object, Message]]) -> list[Answer]:
        """Gather a batch from inbox (unless one must not be gathered now) and move the pipeline:
        the replies that are ready. The pipeline moves also when nothing is gathered: records
        queued between ticks must reach the disk although they are the very reason gathering waits
        (a whole tick's worth of them, or a deferred read or a drain waiting for them)."""
        if not self.gather_waits(len(inbox)):
            batch = Batch()
            self.owner.gather(inbox, batch)
            batch.last_seq = self.writer.next_seq - 1
            self.batches.append(batch)
            self.gathered += 1
        return self._pump()

    def synced(self) -> list[Answer]:
        """The tick I/O thread finished the oldest tick (its fd is readable): publish it and move on."""
        assert self.syncer is not None
        err = self.syncer.result()
        if err is None:  # still running (a result is posted only once it is done)
            return []
        tick = self.writer.oldest_tick
        assert tick is not None
        if err:
            tick.error = OSError(err, os.strerror(err))
        return self._finish(tick) + self._pump()

    def commit(self) -> list[Answer]:
        """Write and save everything queued, here and now (boot, offline commands, tests)."""
        replies = []
        while self.writer.queued_records or self.writer.ticks_in_flight:
            replies += self._pump()
            if self.writer.ticks_in_flight:
                raise RuntimeError("commit() with ticks on the tick I/O thread")
        return replies

    def run_sync(self, inbox: deque[tuple[object, Message]]) -> list[Answer]:
        """One whole tick here: gather, write, save, answer (tests and offline use)."""
        return self.tick(inbox) + self.commit()

    # ---- inside -----------------------------------------------------------------------

    def _pump(self) -> list[Answer]:
        """Answer the saved batches and start the next ticks' I/O: the I/O first, so the disk does
        not wait while the answers are rendered (they read state the next tick cannot change: no
        batch is gathered behind deferred reads)."""
        replies: list[Answer] = []
        while True:
            saved = []
            durable = self.saved_seq
            while self.batches and self.batches[0].last_seq <= durable:
                saved.append(self.batches.popleft())
            drained = self._drained()
            here = self._start_io()
            for batch in saved:
                replies += self.owner.answer(batch)
            replies += drained
            if here is None:
                return replies
            self.stats.started()
            here.run()
            replies += self._finish(here)

    def _drained(self) -> list[Answer]:
        if not self._drain_waiters or not self.all_saved:
            return []
        waiters, self._drain_waiters = self._drain_waiters, []
        replies = [(conn, self.owner.drained(conn, msg)) for conn, msg in waiters]
        return [(conn, answer) for conn, answer in replies if conn is not None and answer is not None]

    def _start_io(self) -> TickIO | None:
        """Hand ticks to the tick I/O thread: the queued records when nothing is in flight, and
        behind a tick in flight a whole tick's (16 records), so no tick goes out emptier than it
        must. Returns the tick to run here instead when there is no such thread (or its file
        cannot use it: a test's faulty file), one at a time."""
        writer = self.writer
        while self.io_waits():
            tick = writer.begin_tick()
            assert tick is not None
            if self.replica is not None:
                self._ship(tick)
            if self.syncer is None or not tick.file.native_io:
                return tick
            self.stats.started()
            self.syncer.request(tick.file.fileno(), tick.data)
        return None

    def _finish(self, tick: TickIO) -> list[Answer]:
        """Publish a tick whose I/O ran: its saved transfers, or the failure's consequences."""
        self.stats.ended()
        self.finished += 1
        try:
            transfers = self.writer.finish_tick(tick)
        except JournalIOError as err:
            self.stats.cancelled()
            self._take_cancelled(err.ended_ticks)
            if err.errno != errno.ENOSPC:
                raise  # EIO and the like: stop admitting; the process exits and a restart recovers
            batches = list(self.batches)
            self.batches.clear()
            # batches durable here that a sync standby had not yet acknowledged: the rebuilt state
            # holds them, so they are not refused; their outcome is unconfirmed (retry exactly)
            durable = self.writer.durable_seq
            unconfirmed = [b for b in batches if b.last_seq <= durable]
            replies = self.owner.refuse_unsaved(err, [b for b in batches if b.last_seq > durable])
            if self.replica is not None:  # the state is rebuilt from what is durable here
                replies += self.owner.unconfirmed(unconfirmed)
                self._unacked.clear()
                self._shipped_seq = self.writer.durable_seq
                self.replica.cut(self.writer)
            return replies
        if self.syncer is not None and tick.file.native_io:
            self._start_io()  # the disk's next tick first: the saves below are recorded while it runs
        self.stats.saved_transfers += len(transfers)
        if self.replica is not None:
            self._unacked.extend(transfers)  # saved once a sync standby holds them too
            self._release()
        else:
            self.owner.saved(transfers)
        return []

    def _ship(self, tick: TickIO) -> None:
        """Hand a tick's bytes to the standby as they go to the disk here, with the last transfer
        they complete."""
        assert self.replica is not None
        last = self._shipped_seq
        for queued, _, _ in tick.plan:
            if queued.taken == len(queued.records):
                last = queued.seq
        self._shipped_seq = last
        self.replica.ship(self.writer.segment, tick.plan[0][2], tick.data, last)

    def _release(self) -> None:
        """Transfers saved here that the sync standby now holds too: saved."""
        assert self.replica is not None
        acked = self.replica.acked_seq if self.replica.waits else self.writer.durable_seq
        unacked = self._unacked
        done = []
        while unacked and unacked[0].seq <= acked:
            done.append(unacked.popleft())
        if done:
            self.owner.saved(done)

    def _take_cancelled(self, count: int) -> None:
        """A failed tick ended the `count` ticks in flight behind it; the tick I/O thread ran none
        of them and has already posted each as cancelled."""
        for _ in range(count):
            assert self.syncer is not None
            err = self.syncer.result()
            if err != errno.ECANCELED:
                raise RuntimeError(f"the tick I/O thread ran a tick queued behind a failure ({err})")

