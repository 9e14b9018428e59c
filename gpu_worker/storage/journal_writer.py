"""Writing a journal: transfers appended and made durable in ticks, one write and one fdatasync
each (group commit: docs/journal.md, "Writing: ticks and group commit"). `JournalWriter` continues
where recovery (journal_reader.py) found the journal's end; the records' layout is journal.py's. All
segment file I/O goes through a `FileLayer` so tests can inject faults.
"""

from __future__ import annotations

import errno
import os
from collections import deque
from typing import TYPE_CHECKING

from gpu_worker import native
from gpu_worker.storage.filelayer import AppendFile, FileLayer
from gpu_worker.storage.journal import (KIND_OF, MAX_DATA, SEGMENT_HEADER_SIZE, JournalError, Transfer, TransferKind,
                                        chain_digest, encode_segment_header, segment_name)

if TYPE_CHECKING:
    from gpu_worker.storage.journal_reader import RecoveryResult

MAX_RECORDS_PER_TICK = 16
MAX_TICKS_IN_FLIGHT = 2  # one running, the next queued behind it (JournalWriter.begin_tick)

_records = native.load("jcodec").records


class JournalIOError(JournalError):
    """A write or fdatasync failed. `errno` tells a full disk (ENOSPC) from a broken one;
    `ended_ticks` counts the ticks in flight behind a failed one, which it ended unrun."""

    def __init__(self, err: int, message: str):
        super().__init__(message)
        self.errno = err
        self.ended_ticks = 0


def encode_transfer(kind: int, transfer_seq: int, payload: bytes) -> list[bytes]:
    """The records of one transfer (native: gpu_worker/native/jcodec.cpp, the layout journal.py gives)."""
    if kind not in KIND_OF:
        raise ValueError(f"{kind!r} is not a valid TransferKind")
    if not 1 <= transfer_seq < 1 << 64:
        raise ValueError(f"transfer_seq {transfer_seq} out of range")
    return _records(kind, transfer_seq, payload, MAX_DATA)


class _Queued:
    __slots__ = ("kind", "seq", "payload", "digest", "records", "written", "taken", "offset")

    def __init__(self, kind: TransferKind, seq: int, payload: bytes, digest: bytes, records: list[bytes]) -> None:
        self.kind, self.seq, self.payload, self.digest = kind, seq, payload, digest
        self.records = records
        self.written = 0  # records durable
        self.taken = 0    # records durable or in a tick in flight
        self.offset = 0


class TickIO:
    """One tick's write + fdatasync, prepared by JournalWriter.begin_tick."""

    __slots__ = ("file", "data", "plan", "records", "error")

    def __init__(self, file: AppendFile, data: bytes, plan: list[tuple[_Queued, int, int]], records: int) -> None:
        self.file, self.data, self.plan, self.records = file, data, plan, records
        self.error: OSError | None = None

    def run(self) -> None:
        """The tick's I/O: write, then fdatasync. The device's server hands `data` to its native
        tick I/O thread instead when the file allows it (AppendFile.native_io) and sets `error`
        from the errno that thread reports."""
        self.write()
        if self.error is None:
            try:
                self.file.fdatasync()
            except OSError as e:
                self.error = e

    def write(self) -> None:
        try:
            self.file.write(self.data)
        except OSError as e:
            self.error = e


class JournalWriter:
    """Appends transfers and makes them durable in ticks: one write and one fdatasync each.

    `append` only queues (and pre-encodes, so the tick does nothing but join and write);
    `commit_tick` writes at most MAX_RECORDS_PER_TICK records and reports the transfers whose
    last part became durable (`begin_tick`/`finish_tick` split it around the I/O, so the device
    can admit the next tick while this one's fdatasync runs). `next_seq` is the seq the next
    `append` gets; `last_digest` is the commit digest of the last durable transfer.
    """

    def __init__(self, directory: str, fs: FileLayer, incarnation: bytes, recovery: RecoveryResult):
        if len(incarnation) != 16:
            raise ValueError("file incarnation must be 16 bytes")
        self._dir = directory
        self._fs = fs
        self._incarnation = bytes(incarnation)
        self._next_seq = recovery.next_seq
        self._digest = recovery.last_digest
        self._queued_digest = recovery.last_digest
        self._pending: deque[_Queued] = deque()
        self._queued = 0
        self._in_flight: deque[TickIO] = deque()  # oldest first, at most MAX_TICKS_IN_FLIGHT
        self._durable_seq = recovery.next_seq - 1
        self._failed: int | None = None
        self._file: AppendFile | None = None
        self._segment = recovery.segment
        self._offset = recovery.end_offset
        self._durable_bytes = recovery.durable_bytes
        try:
            if self._segment == 0 or self._offset < SEGMENT_HEADER_SIZE:
                self._open_new_segment(max(self._segment, 1))
            else:
                self._file = fs.open_append(self._path(self._segment))
                if self._file.size() != self._offset:
                    # Cut the dropped torn tail before anything new follows it, or the next
                    # recovery would see damage followed by valid records: corruption.
                    self._file.truncate(self._offset)
                    self._file.fdatasync()
        except OSError as e:
            if self._file is not None:
                self._file.close()
            raise JournalIOError(e.errno or errno.EIO, f"journal {directory}: {e}") from e

    @property
    def next_seq(self) -> int:
        return self._next_seq

    @property
    def last_digest(self) -> bytes:
        return self._digest

    @property
    def durable_seq(self) -> int:
        """The seq of the last durable transfer (0 when there is none)."""
        return self._durable_seq

    @property
    def durable_bytes(self) -> int:
        return self._durable_bytes

    @property
    def segment(self) -> int:
        return self._segment

    @property
    def offset(self) -> int:
        return self._offset

    @property
    def queued_records(self) -> int:
        return self._queued

    @property
    def queued_bytes(self) -> int:
        """Bytes appended but not yet durable (what a receipt or a hold reports as pending)."""
        return sum(len(r) for q in self._pending for r in q.records[q.written:])

    @property
    def at_transfer_boundary(self) -> bool:
        """No transfer is partly written, so a new segment may start."""
        return not self._pending or self._pending[0].written == 0

    def append(self, kind: int, payload: bytes) -> int:
        self._check_usable()
        seq = self._next_seq
        payload = bytes(payload)
        records = encode_transfer(kind, seq, payload)
        kind = KIND_OF[kind]
        # The chain order is fixed at append time (a failed tick keeps the queue in order), so
        # the digest is computed here, off the tick's critical path.
        self._queued_digest = chain_digest(self._queued_digest, kind, seq, payload)
        self._pending.append(_Queued(kind, seq, payload, self._queued_digest, records))
        self._queued += len(records)
        self._next_seq = seq + 1
        return seq

    def commit_tick(self) -> list[Transfer]:
        """One tick, synchronously: begin_tick, its write and fdatasync, finish_tick."""
        tick = self.begin_tick()
        if tick is None:
            return []
        tick.run()
        return self.finish_tick(tick)

    def begin_tick(self) -> TickIO | None:
        """Take the next tick's records (at most MAX_RECORDS_PER_TICK, in queue order, after
        those of the ticks in flight) for one write and one fdatasync (TickIO), or None when no
        record waits. While its I/O runs, `append` may queue more and one more tick may begin
        (MAX_TICKS_IN_FLIGHT): the device's tick I/O thread runs them one after another, so the
        next tick's I/O starts the moment the last one's ends. `finish_tick` publishes each, in
        the order they began."""
        self._check_usable()
        if len(self._in_flight) >= MAX_TICKS_IN_FLIGHT:
            raise JournalError(f"{MAX_TICKS_IN_FLIGHT} ticks are already in flight")
        if not self.untaken_records:
            return None
        chunks: list[bytes] = []
        plan: list[tuple[_Queued, int, int]] = []  # (transfer, records taken, first offset)
        room = MAX_RECORDS_PER_TICK
        offset = self._offset + sum(len(t.data) for t in self._in_flight)
        for queued in self._pending:
            taken = queued.records[queued.taken:queued.taken + room]
            if not taken:
                continue  # all of it is in a tick in flight already
            queued.taken += len(taken)
            plan.append((queued, len(taken), offset))
            chunks += taken
            offset += sum(map(len, taken))
            room -= len(taken)
            if not room:
                break
        # self._file is not None: _check_usable() above
        tick = TickIO(self._file, b"".join(chunks), plan, len(chunks))  # type: ignore[arg-type]
        self._in_flight.append(tick)
        return tick

    @property
    def untaken_records(self) -> int:
        """Queued records that no tick in flight holds."""
        return self._queued - sum(tick.records for tick in self._in_flight)

    @property
    def ticks_in_flight(self) -> int:
        return len(self._in_flight)

    def ticks_begun(self) -> list[tuple[int, bytes]]:
        """(offset, bytes) of each tick in flight, oldest first: written or being written in the
        current segment after `offset`, not yet durable (a standby that joins now gets them)."""
        return [(tick.plan[0][2], tick.data) for tick in self._in_flight]

    @property
    def oldest_tick(self) -> TickIO | None:
        """The tick in flight that finish_tick takes next."""
        return self._in_flight[0] if self._in_flight else None

    def finish_tick(self, tick: TickIO) -> list[Transfer]:
        """Publish the oldest tick in flight, whose I/O ran: the transfers whose last part is now
        durable, oldest first. A failed write or fdatasync raises JournalIOError (see
        _tick_failed) and ends every tick in flight: none of their I/O may count."""
        if not self._in_flight or tick is not self._in_flight[0]:
            raise JournalError("finish_tick of a tick that is not the oldest in flight")
        self._in_flight.popleft()
        if tick.error is not None:
            ended = len(self._in_flight)
            self._in_flight.clear()
            for queued in self._pending:
                queued.taken = queued.written
            failure = self._tick_failed(tick.error)
            failure.ended_ticks = ended
            raise failure from tick.error
        done = []
        for queued, count, first in tick.plan:
            if not queued.written:
                queued.offset = first
            queued.written += count
            if queued.written == len(queued.records):
                self._pending.popleft()
                done.append(Transfer(
                    queued.kind, queued.seq, queued.payload, queued.digest,
                    self._segment, queued.offset,
                ))
        self._queued -= tick.records
        self._offset += len(tick.data)
        self._durable_bytes += len(tick.data)
        if done:
            self._digest = done[-1].digest
            self._durable_seq = done[-1].seq
        return done

    def start_new_segment(self) -> None:
        self._check_usable()
        if self._in_flight:  # the tick I/O thread may be writing the current file
            raise JournalError("a tick is in flight; finish it before a new segment")
        if not self.at_transfer_boundary:
            # Recovery refuses a transfer split across segments (it cannot cut both files).
            raise JournalError("a transfer is partly written; commit it before a new segment")
        previous = self._file
        assert previous is not None  # _check_usable() above
        try:
            self._open_new_segment(self._segment + 1)
        except OSError as e:
            err = e.errno or errno.EIO
            if err != errno.ENOSPC:
                self._failed = err
            # The old segment stays current: a header-only or torn new file left behind is
            # harmless, since recovery treats it as the (empty) end of the journal.
            raise JournalIOError(err, f"journal {self._dir}: new segment: {e}") from e
        previous.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    # -----------------------------------------------------------------------------------------

    def _path(self, number: int) -> str:
        return os.path.join(self._dir, segment_name(number))

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise JournalIOError(
                self._failed,
                f"journal {self._dir} failed earlier ({os.strerror(self._failed)}); "
                "the writer is unusable",
            )
        if self._file is None:
            raise JournalError("journal writer is closed")

    def _open_new_segment(self, number: int) -> None:
        path = self._path(number)
        handle = self._fs.open_append(path)
        try:
            if handle.size():
                handle.truncate(0)  # a torn header left by an interrupted creation
            handle.write(encode_segment_header(number, self._incarnation))
            handle.fdatasync()
            self._fs.fsync_dir(self._dir)
        except OSError:
            handle.close()
            try:
                self._fs.remove(path)
            except OSError:
                pass
            raise
        self._file = handle
        self._segment = number
        self._offset = SEGMENT_HEADER_SIZE
        self._durable_bytes += SEGMENT_HEADER_SIZE

    def _tick_failed(self, e: OSError) -> JournalIOError:
        # Never retry the fdatasync: after a failed writeback Linux may mark the pages clean,
        # so a second fdatasync can succeed without the data. Cut back to what is known
        # durable instead; a later tick rewrites the queued records from the start.
        err = e.errno or errno.EIO
        assert self._file is not None  # the segment the failed tick wrote (open while ticks are in flight)
        try:
            self._file.truncate(self._offset)
        except OSError:
            self._failed = errno.EIO  # the tail is unknown now
        if err != errno.ENOSPC:
            self._failed = err
        return JournalIOError(err, f"journal {self._path(self._segment)}: {e}")
