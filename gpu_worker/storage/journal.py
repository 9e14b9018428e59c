"""The journal: transfers split into type 37 / class A records, group commit, and recovery.

docs/journal.md describes the byte layout and the reader's rules; this module implements exactly
that and nothing else. Payloads are opaque bytes here; their meaning belongs to the device.
All segment file I/O goes through a `FileLayer` so tests can inject faults.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import os
import queue
import re
import struct
import threading
import zlib
from collections import deque
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Callable, Iterator, NamedTuple

from gpu_worker import native
from gpu_worker.storage.filelayer import AppendFile, FileLayer, OsFileLayer

TYPE_SHARED = 37
CLASS_A = 0x41
MAX_DATA = 160
PART_HEADER_SIZE = 32
MAX_RECORDS_PER_TICK = 16
MAX_TICKS_IN_FLIGHT = 2  # one running, the next queued behind it (JournalWriter.begin_tick)

SEGMENT_MAGIC = b"AOTXJNL1"
SEGMENT_VERSION = 1
# magic 0, version 8, header_size 10, segment_no 12, file_incarnation 16.
SEGMENT_HEADER = struct.Struct("<8sHHI16s")
SEGMENT_HEADER_SIZE = SEGMENT_HEADER.size
# type 0, class 1, kind 2, part_index 4, part_count 6, data_length 8, reserved 10,
# transfer_length 12, transfer_seq 16, checksum 24, reserved 28.
PART_HEADER = struct.Struct("<BBHHHHHIQII")
CHECKSUM_OFFSET = 24
assert SEGMENT_HEADER.size == 32 and PART_HEADER.size == PART_HEADER_SIZE

ZERO_DIGEST = bytes(32)
LOCK_NAME = "lock"

_RECORD_START = bytes((TYPE_SHARED, CLASS_A))
_KIND_SEQ = struct.Struct("<HQ")
_ZERO_CHECKSUM = bytes(4)
_SEGMENT_NAME = re.compile(r"(\d{8,})\.journal")


class TransferKind(IntEnum):
    BOOT = 1
    ADMISSION = 2
    LEASE = 3
    OUTPUT = 4
    COMPLETION = 5
    RETIREMENT = 6
    CHECKPOINT = 7
    MEDIA = 8
    HOLD = 9
    MEMORY = 10
    REPLICATION = 11


_jcodec = native.load("jcodec")
_records, _whole = _jcodec.records, _jcodec.transfers
_KIND_OF = {k.value: k for k in TransferKind}  # kind by value: a dict lookup, cheaper than an IntEnum call
_KIND_MASK = sum(1 << k for k in _KIND_OF)  # the kinds the native reader accepts (all below 64)
_KIND_OBJECTS = tuple(_KIND_OF.get(k) for k in range(64))  # what it names them by


class JournalError(Exception):
    pass


class JournalCorrupt(JournalError):
    def __init__(self, file: str, offset: int, reason: str):
        super().__init__(f"journal damaged: {file}: offset {offset}: {reason}")
        self.file = file
        self.offset = offset
        self.reason = reason


class JournalLocked(JournalError):
    pass


class JournalIOError(JournalError):
    """A write or fdatasync failed. `errno` tells a full disk (ENOSPC) from a broken one;
    `ended_ticks` counts the ticks in flight behind a failed one, which it ended unrun."""

    def __init__(self, err: int, message: str):
        super().__init__(message)
        self.errno = err
        self.ended_ticks = 0


def segment_name(segment_no: int) -> str:
    return "%08d.journal" % segment_no


def record_count(payload_len: int) -> int:
    return (payload_len + MAX_DATA - 1) // MAX_DATA or 1


def encode_segment_header(segment_no: int, incarnation: bytes) -> bytes:
    return SEGMENT_HEADER.pack(
        SEGMENT_MAGIC, SEGMENT_VERSION, SEGMENT_HEADER_SIZE, segment_no, incarnation
    )


def encode_transfer(kind: int, transfer_seq: int, payload: bytes) -> list[bytes]:
    """The records of one transfer (native: gpu_worker/jcodec.cpp, the layout above)."""
    if kind not in _KIND_OF:
        raise ValueError(f"{kind!r} is not a valid TransferKind")
    if not 1 <= transfer_seq < 1 << 64:
        raise ValueError(f"transfer_seq {transfer_seq} out of range")
    return _records(kind, transfer_seq, payload, MAX_DATA)


def chain_digest(previous: bytes, kind: int, transfer_seq: int, payload: bytes) -> bytes:
    h = hashlib.sha256(previous)
    h.update(_KIND_SEQ.pack(kind, transfer_seq))  # kind u16 LE, then transfer_seq u64 LE
    h.update(payload)
    return h.digest()


class Transfer(NamedTuple):
    """One transfer as recovery reads it (a tuple: the native reader makes a million of them)."""
    kind: TransferKind
    seq: int
    payload: bytes
    digest: bytes
    segment: int
    offset: int


_as_transfer = functools.partial(tuple.__new__, Transfer)  # a tuple of its fields as a Transfer, in C


@dataclass
class RecoveryResult:
    transfers: list[Transfer]
    next_seq: int
    last_digest: bytes
    segment: int  # the segment the writer continues; 0 when the journal has none
    end_offset: int  # where the writer continues in it; below the header size: rewrite it
    dropped: str | None
    durable_bytes: int = 0  # journal bytes kept, all segments together
    handed_on: int = 0  # transfers given to `recover`'s sink (not in `transfers`)


# ---------------------------------------------------------------------------------------------
# Reading


def _read_record(data: bytes, pos: int) -> str | tuple[Any, ...]:
    """The fields of the record at pos when it is intact (type, class, length, checksum),
    else the reason it is not. Intact says nothing yet about whether it belongs there."""
    if len(data) - pos < PART_HEADER_SIZE:
        return "record header cut short by end of file"
    fields = PART_HEADER.unpack_from(data, pos)
    if fields[0] != TYPE_SHARED:
        return f"record type {fields[0]}, expected {TYPE_SHARED}"
    if fields[1] != CLASS_A:
        return f"record class {fields[1]:#04x}, expected {CLASS_A:#04x}"
    if fields[5] > MAX_DATA:
        return f"data length {fields[5]} over {MAX_DATA}"
    end = pos + PART_HEADER_SIZE + fields[5]
    if end > len(data):
        return "record cut short by end of file"
    view = memoryview(data)
    checksum = zlib.crc32(view[pos:pos + CHECKSUM_OFFSET])
    checksum = zlib.crc32(_ZERO_CHECKSUM, checksum)
    checksum = zlib.crc32(view[pos + CHECKSUM_OFFSET + 4:end], checksum)
    if checksum != fields[9]:
        return "checksum mismatch"
    return fields


def _next_intact_record(data: bytes, start: int) -> int | None:
    pos = data.find(_RECORD_START, start)
    while pos != -1:
        if not isinstance(_read_record(data, pos), str):
            return pos
        pos = data.find(_RECORD_START, pos + 1)
    return None


class _Open:
    """A transfer whose first parts have been read."""

    __slots__ = ("kind", "count", "length", "seq", "start", "parts")

    def __init__(self, kind: int, count: int, length: int, seq: int, start: int) -> None:
        self.kind, self.count, self.length, self.seq, self.start = kind, count, length, seq, start
        self.parts: list[bytes] = []


READ_PIECE = 8192  # transfers a reader with a sink hands on at a time (`recover`)


class _Recovery:
    def __init__(self, directory: str, fs: FileLayer, incarnation: bytes, start_digest: bytes,
                 after_seq: int, sink: Callable[[list[Transfer]], None] | None = None) -> None:
        self.directory = directory
        self.fs = fs
        self.incarnation = incarnation
        self.after_seq = after_seq
        self.digest = start_digest
        self.transfers: list[Transfer] = []  # read and not yet handed to `sink` (all of them without one)
        self.sink = sink
        self.count = 0  # transfers handed to `sink` so far
        self.next_seq: int | None = None  # None until the first transfer is read
        self._base = 0  # the file offset of the bytes _parts reads (0 but for a Tail's read)

    def run(self) -> RecoveryResult:
        numbers = list_segments(self.directory, self.fs)
        for previous, number in zip(numbers, numbers[1:]):
            if number != previous + 1:
                raise JournalCorrupt(self._path(number), 0, f"segment {previous + 1} is missing")
        kept, segment, end, dropped = 0, 0, 0, None
        for i, number in enumerate(numbers):
            data = self.fs.read_file(self._path(number))
            final = i == len(numbers) - 1
            segment = number
            end, dropped = self._segment(number, data, final)
            kept += end
            self._hand_on()
        if self.next_seq is None:
            self.next_seq = self.after_seq + 1
        elif self.next_seq <= self.after_seq:
            raise JournalCorrupt(
                self._path(segment), end,
                f"journal ends at transfer seq {self.next_seq - 1}, "
                f"before checkpoint seq {self.after_seq}",
            )
        return RecoveryResult(
            self.transfers, self.next_seq, self.digest, segment, end, dropped, kept, self.count
        )

    def _hand_on(self) -> None:
        """Give the sink the transfers read since it was last given some."""
        if self.sink is not None and self.transfers:
            self.count += len(self.transfers)
            self.sink(self.transfers)
            self.transfers = []

    def _path(self, number: int) -> str:
        return os.path.join(self.directory, segment_name(number))

    def _segment(self, number: int, data: bytes, final: bool, base: int = 0) -> tuple[int, str | None]:
        """Read segment `number`'s transfers from `data`: the whole file (base 0, header first), or
        its bytes from `base`, a transfer boundary, on (a standby following the journal, `Tail`).
        Where the kept bytes end in the file, and what a final segment's torn end dropped."""
        if base:
            self._base = base
            try:
                end, dropped = self._parts(self._path(number), number, data, final, 0)
            except JournalCorrupt as exc:
                raise JournalCorrupt(exc.file, exc.offset + base, exc.reason) from None
            finally:
                self._base = 0
            return end + base, dropped
        path = self._path(number)
        header = data[:SEGMENT_HEADER_SIZE]
        if len(header) < SEGMENT_HEADER_SIZE or not any(header):
            # A segment whose creation a crash interrupted: only at the very end, and empty.
            if final and _next_intact_record(data, 0) is None:
                torn = f"dropped torn segment header at {path} offset 0" if data else None
                return 0, torn
            reason = "segment header cut short" if len(header) < 32 else "segment header is zero"
            raise JournalCorrupt(path, 0, reason)
        self._check_segment_header(path, number, header)
        return self._parts(path, number, data, final, SEGMENT_HEADER_SIZE)

    def _parts(self, path: str, number: int, data: bytes, final: bool, pos: int) -> tuple[int, str | None]:
        pos = self._whole_transfers(number, data, pos)  # the native fast path; the rest (if any) below
        current: _Open | None = None
        while pos < len(data):
            record = _read_record(data, pos)
            if isinstance(record, str):
                if _next_intact_record(data, pos + 1) is None:
                    if final:
                        return self._torn_tail(path, data, pos, current)
                    # Only the end of the journal can be torn; a later segment exists.
                    record += f", yet segment {number + 1} follows"
                raise JournalCorrupt(path, pos, record)
            _, _, kind, index, count, size, reserved, length, seq, _, reserved2 = record
            self._check_part(path, pos, kind, index, count, size, reserved, length, reserved2)
            end = pos + PART_HEADER_SIZE + size
            if current is None:
                if index != 0:
                    raise JournalCorrupt(
                        path, pos, f"part {index} of transfer seq {seq} without its first part"
                    )
                self._check_seq(path, pos, seq)
                current = _Open(kind, count, length, seq, pos)
            elif seq != current.seq:
                raise JournalCorrupt(
                    path, pos,
                    f"transfer seq {seq} interrupts incomplete transfer seq {current.seq} "
                    f"at offset {current.start}",
                )
            elif (kind, count, length) != (current.kind, current.count, current.length):
                raise JournalCorrupt(
                    path, pos, f"part {index} of transfer seq {seq} disagrees with its first part"
                )
            elif index != len(current.parts):
                raise JournalCorrupt(
                    path, pos,
                    f"part {index} of transfer seq {seq} where part {len(current.parts)} belongs",
                )
            current.parts.append(data[pos + PART_HEADER_SIZE:end])
            if index == count - 1:
                self._accept(current, number)
                current = None
            pos = end
        if current is not None:
            if final:
                return self._torn_tail(path, data, pos, current)
            # The writer never starts a segment inside a transfer.
            raise JournalCorrupt(
                path, current.start, f"transfer seq {current.seq} is cut off by the segment end"
            )
        return pos, None

    def _whole_transfers(self, number: int, data: bytes, pos: int) -> int:
        """Accept the whole transfers from `pos` on that are exactly as the writer makes them,
        read natively (jcodec.transfers; with a sink, READ_PIECE at a time, each piece handed on
        as it is read); where the first one that is not begins (the end of the data when all
        are): the loop in `_parts` reads on from there with every rule."""
        limit = READ_PIECE if self.sink is not None else 0
        while True:
            lo, hi = (1, self.after_seq + 1) if self.next_seq is None else (self.next_seq, self.next_seq)
            found, stop, last = _whole(data, pos, lo, hi, _KIND_MASK, MAX_DATA, self.digest, self.after_seq,
                                       _KIND_OBJECTS, number, self._base, limit)
            if found:  # each a Transfer's fields, its digest chained (those a checkpoint holds are not here)
                self.transfers.extend(map(_as_transfer, found))
                self.digest = found[-1][3]
            if last:
                self.next_seq = last + 1
            self._hand_on()
            if not limit or stop == pos or stop >= len(data):
                return stop
            pos = stop

    def _torn_tail(self, path: str, data: bytes, pos: int, current: _Open | None) -> tuple[int, str]:
        if current is None and len(data) - pos >= PART_HEADER_SIZE:
            fields = PART_HEADER.unpack_from(data, pos)
            expected = self.after_seq + 1 if self.next_seq is None else self.next_seq
            if fields[:2] == (TYPE_SHARED, CLASS_A) and fields[8] == expected:
                current = _Open(fields[2], fields[4], fields[7], fields[8], pos)
        if current is None:
            # Zero fill, garbage, or a header too short to say which transfer it began.
            return pos, f"dropped torn tail of {len(data) - pos} bytes at {path} offset {pos}"
        return current.start, (
            f"dropped incomplete final transfer seq {current.seq} at {path} offset {current.start}"
        )

    def _check_segment_header(self, path: str, number: int, header: bytes) -> None:
        magic, version, header_size, segment_no, incarnation = SEGMENT_HEADER.unpack(header)
        if magic != SEGMENT_MAGIC:
            raise JournalCorrupt(path, 0, f"segment magic {magic!r}, expected {SEGMENT_MAGIC!r}")
        if version != SEGMENT_VERSION or header_size != SEGMENT_HEADER_SIZE:
            raise JournalCorrupt(
                path, 0, f"segment version {version} header size {header_size} not supported"
            )
        if segment_no != number:
            raise JournalCorrupt(path, 0, f"segment header says segment {segment_no}")
        if incarnation != self.incarnation:
            raise JournalCorrupt(
                path, 0,
                f"segment belongs to file incarnation {incarnation.hex()}, "
                f"not {self.incarnation.hex()}",
            )

    @staticmethod
    def _check_part(path: str, pos: int, kind: int, index: int, count: int, size: int, reserved: int,
                    length: int, reserved2: int) -> None:
        # An intact record that breaks these was written wrong, not torn: always corruption.
        if reserved or reserved2:
            raise JournalCorrupt(path, pos, "reserved field not zero")
        if kind not in _KIND_OF:
            raise JournalCorrupt(path, pos, f"unknown transfer kind {kind}")
        if count != record_count(length) or index >= count:
            raise JournalCorrupt(
                path, pos, f"part {index} of {count} for a transfer of {length} bytes"
            )
        if size != min(MAX_DATA, length - index * MAX_DATA):
            raise JournalCorrupt(path, pos, f"part {index} holds {size} data bytes")

    def _check_seq(self, path: str, pos: int, seq: int) -> None:
        if self.next_seq is None:
            # The oldest segments may be gone once a checkpoint holds their transfers.
            if not 1 <= seq <= self.after_seq + 1:
                raise JournalCorrupt(
                    path, pos,
                    f"journal starts at transfer seq {seq} after checkpoint seq {self.after_seq}",
                )
        elif seq != self.next_seq:
            raise JournalCorrupt(
                path, pos, f"transfer seq {seq} where seq {self.next_seq} belongs"
            )

    def _accept(self, current: _Open, number: int) -> None:
        self.next_seq = current.seq + 1
        if current.seq <= self.after_seq:
            return
        payload = b"".join(current.parts)
        kind = TransferKind(current.kind)
        self.digest = chain_digest(self.digest, kind, current.seq, payload)
        self.transfers.append(
            Transfer(kind, current.seq, payload, self.digest, number, self._base + current.start)
        )


def list_segments(directory: str, fs: FileLayer) -> list[int]:
    if not fs.exists(directory):
        return []
    numbers = []
    for name in fs.listdir(directory):
        match = _SEGMENT_NAME.fullmatch(name)
        if match and segment_name(int(match.group(1))) == name:
            numbers.append(int(match.group(1)))
    return sorted(numbers)


def recover(
    directory: str,
    fs: FileLayer,
    incarnation: bytes,
    *,
    start_digest: bytes = ZERO_DIGEST,
    after_seq: int = 0,
    sink: Callable[[list[Transfer]], None] | None = None,
) -> RecoveryResult:
    """Read every segment in order and return the saved transfers after `after_seq` — or, with a
    `sink`, give them to it in pieces as they are read, in order (a device replays each piece
    while this reads on, on another thread: Device._load_state).

    A torn tail (an unacknowledged write cut by a crash) is dropped; anything else that does not
    fit raises JournalCorrupt naming the file and offset (after the sink was given the transfers
    before it). See docs/journal.md.
    """
    if len(incarnation) != 16:
        raise ValueError("file incarnation must be 16 bytes")
    return _Recovery(directory, fs, bytes(incarnation), bytes(start_digest), after_seq, sink).run()


class ReadAhead:
    """`recover` on a thread of its own (`aotx-journal-read`), handing its transfers over in
    pieces as it reads them: iterating gives the pieces in order while the thread reads on, so
    the records' checks and digests (jcodec.transfers, without the GIL) and the file reads run
    beside the replay of the pieces before (a boot: Device._load_state). `result` is recover's
    (its `transfers` empty: every one was handed over), or raises what the reading raised (a
    damaged journal: after the pieces before the damage). Waker of the iteration: each piece the
    thread hands over and, always last, None (the thread's end, whatever ended it); `close` makes
    the thread stop at its next piece (a replay that failed)."""

    class _Closed(Exception):
        pass

    def __init__(self, directory: str, fs: FileLayer, incarnation: bytes, *, start_digest: bytes = ZERO_DIGEST,
                 after_seq: int = 0) -> None:
        self._pieces: queue.SimpleQueue[list[Transfer] | None] = queue.SimpleQueue()
        self._outcome: RecoveryResult | BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._read, args=(directory, fs, incarnation, start_digest, after_seq),
                                        name="aotx-journal-read", daemon=True)
        self._thread.start()

    def _read(self, directory: str, fs: FileLayer, incarnation: bytes, start_digest: bytes, after_seq: int) -> None:
        try:
            self._outcome = recover(directory, fs, incarnation, start_digest=start_digest, after_seq=after_seq,
                                    sink=self._hand)
        except BaseException as exc:  # (handed to the caller by `result`)
            self._outcome = exc
        finally:
            self._pieces.put(None)

    def _hand(self, piece: list[Transfer]) -> None:
        if self._closed:
            raise ReadAhead._Closed("the replay stopped")
        self._pieces.put(piece)

    def __iter__(self) -> Iterator[list[Transfer]]:
        while (piece := self._pieces.get()) is not None:
            yield piece

    def result(self) -> RecoveryResult:
        self._thread.join()  # (it put None last: it has ended or is ending)
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        assert self._outcome is not None
        return self._outcome

    def close(self) -> None:
        self._closed = True


class Tail:
    """The transfers a journal gains after a recovery, read as its files grow: a hot standby's
    device applies what its copy of the primary's journal receives (gpu_worker/replication/,
    docs/replication.md). Only bytes before the position `read` is given are looked at (the
    standby's durable end); a transfer not yet whole there is read the next time.

    `position` is where the transfers read so far end: (segment, offset), a transfer boundary
    ((0, 0) before the first segment). `next_seq` and `last_digest` continue the recovery's."""

    def __init__(self, directory: str, incarnation: bytes, recovery: RecoveryResult) -> None:
        self.directory = directory
        self.incarnation = bytes(incarnation)
        self.next_seq = recovery.next_seq
        self.last_digest = recovery.last_digest
        self.position = (recovery.segment, recovery.end_offset) if recovery.segment else (0, 0)
        self.durable_bytes = recovery.durable_bytes

    def read(self, until: tuple[int, int]) -> list[Transfer]:
        """The whole transfers between `position` and `until` (a position this journal's files
        hold durably), in order; `position` moves past them."""
        transfers: list[Transfer] = []
        while self.position < until:
            segment, offset = self.position
            if segment == 0:  # an empty journal: its first segment (after a checkpoint, not the first there was)
                segment, offset = min(list_segments(self.directory, OsFileLayer()), default=until[0]), 0
            elif offset < SEGMENT_HEADER_SIZE and segment < until[0]:
                offset = 0  # a segment from its header on
            elif segment < until[0] and offset >= self._size(segment):
                segment, offset = segment + 1, 0  # this one is whole: the next
            if offset == 0 and (segment, SEGMENT_HEADER_SIZE) > until:
                break  # not even its header yet
            limit = until[1] if segment == until[0] else self._size(segment)
            path = os.path.join(self.directory, segment_name(segment))
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                data = os.pread(fd, limit - offset, offset)
            finally:
                os.close(fd)
            reader = _Recovery(self.directory, OsFileLayer(), self.incarnation, self.last_digest, self.next_seq - 1)
            reader.next_seq = self.next_seq
            # a segment a later one follows ends at a transfer boundary (the writer starts segments there)
            end, _ = reader._segment(segment, data, segment == until[0], offset)
            if offset == 0 and end < SEGMENT_HEADER_SIZE:
                break  # its header is not whole yet
            transfers += reader.transfers
            self.next_seq, self.last_digest = reader.next_seq, reader.digest
            self.durable_bytes += end - offset
            self.position = (segment, end)
            if end < limit or segment == until[0]:
                break  # the rest is a transfer not yet whole
        return transfers

    def _size(self, segment: int) -> int:
        return os.stat(os.path.join(self.directory, segment_name(segment))).st_size


# ---------------------------------------------------------------------------------------------
# Writing


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
        kind = _KIND_OF[kind]
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


# ---------------------------------------------------------------------------------------------
# One device per journal


class JournalLock:
    """An exclusive flock on DIR/lock, held for the life of the device.

    flock belongs to the open file description, so a second JournalLock conflicts even inside
    the same process. The lock file is never removed: removing it would let two processes lock
    two different inodes.
    """

    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise JournalLocked(
                f"journal {directory} is locked by another device (pid {holder})"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> JournalLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
