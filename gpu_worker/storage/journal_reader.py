"""Reading a journal back: recovery's scan of every segment in order (`recover`), the same on a
thread of its own ahead of a boot's replay (`ReadAhead`), and a hot standby's reading of what its
copy of the primary's journal gains (`Tail`).

docs/journal.md, "Reading: recovery", gives the rules this reader keeps (the layout is journal.py's):
a torn tail is dropped, anything else that does not fit raises JournalCorrupt naming the file and
offset. Whole, intact transfers are read natively (jcodec.check and make), the rest by the Python reader
here, with every rule. All segment file I/O goes through a `FileLayer` so tests can inject faults.
"""

from __future__ import annotations

import os
import queue
import threading
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from gpu_worker import native
from gpu_worker.storage.filelayer import FileLayer, OsFileLayer
from gpu_worker.storage.journal import (CHECKSUM_OFFSET, CLASS_A, KIND_OF, MAX_DATA, PART_HEADER, PART_HEADER_SIZE,
                                        SEGMENT_HEADER, SEGMENT_HEADER_SIZE, SEGMENT_MAGIC, SEGMENT_VERSION,
                                        TYPE_SHARED, ZERO_DIGEST, JournalCorrupt, Transfer, TransferKind,
                                        chain_digest, list_segments, record_count, segment_name)

_RECORD_START = bytes((TYPE_SHARED, CLASS_A))
_ZERO_CHECKSUM = bytes(4)

_jcodec = native.load("jcodec")
_check, _make = _jcodec.check, _jcodec.make
_KIND_MASK = sum(1 << k for k in KIND_OF)  # the kinds the native reader accepts (all below 64)
_KIND_OBJECTS = tuple(KIND_OF.get(k) for k in range(64))  # what it names them by


class Unmade:
    """Transfers the native reader found whole and intact in a segment's bytes, their digests
    chained (jcodec.check, without the GIL), not yet made into Transfer objects: `make` makes
    them (jcodec.make), on the thread that takes them. A boot's reading thread hands these on
    (ReadAhead), so that it holds the GIL for no object while the main thread imports torch and
    replays; made there, a million objects held it for as long as a second."""

    __slots__ = ("data", "found", "segment", "base")

    def __init__(self, data: bytes, found: bytes, segment: int, base: int) -> None:
        self.data, self.found, self.segment, self.base = data, found, segment, base

    def __len__(self) -> int:
        return len(self.found) // _jcodec.FOUND_SIZE

    def make(self) -> list[Transfer]:
        made: list[Transfer] = _make(self.data, self.found, _KIND_OBJECTS, Transfer, self.segment, self.base)
        return made


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
                 after_seq: int, sink: Callable[[list[Transfer] | Unmade], None] | None = None) -> None:
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
        read natively (jcodec.check; with a sink, READ_PIECE at a time, each piece handed on
        unmade as it is read: `Unmade`); where the first one that is not begins (the end of the
        data when all are): the loop in `_parts` reads on from there with every rule."""
        limit = READ_PIECE if self.sink is not None else 0
        while True:
            lo, hi = (1, self.after_seq + 1) if self.next_seq is None else (self.next_seq, self.next_seq)
            found, stop, last, digest = _check(data, pos, lo, hi, _KIND_MASK, MAX_DATA, self.digest, self.after_seq,
                                               limit)
            if found:  # (those a checkpoint holds are not in it)
                self.digest = digest
                unmade = Unmade(data, found, number, self._base)
                if self.sink is None:
                    self.transfers.extend(unmade.make())
                else:
                    self._hand_on()  # (what the Python path read before them, first)
                    self.count += len(unmade)
                    self.sink(unmade)
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
        if kind not in KIND_OF:
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


def recover(
    directory: str,
    fs: FileLayer,
    incarnation: bytes,
    *,
    start_digest: bytes = ZERO_DIGEST,
    after_seq: int = 0,
    sink: Callable[[list[Transfer] | Unmade], None] | None = None,
) -> RecoveryResult:
    """Read every segment in order and return the saved transfers after `after_seq` — or, with a
    `sink`, give them to it in pieces as they are read, in order, each a list of Transfers or an
    `Unmade` (a device replays each piece while this reads on, on another thread: ReadAhead).

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
    the records' checks and digests (jcodec.check, without the GIL) and the file reads run
    beside the replay of the pieces before, or beside boot's imports (recovery/reading.py); the
    iterating thread makes each piece's Transfer objects (`Unmade.make`) as it takes it. `result`
    is recover's (its `transfers` empty: every one was handed over), or raises what the reading raised (a
    damaged journal: after the pieces before the damage). Waker of the iteration: each piece the
    thread hands over and, always last, None (the thread's end, whatever ended it); `close` makes
    the thread stop at its next piece (a replay that failed)."""

    class _Closed(Exception):
        pass

    def __init__(self, directory: str, fs: FileLayer, incarnation: bytes, *, start_digest: bytes = ZERO_DIGEST,
                 after_seq: int = 0) -> None:
        self._pieces: queue.SimpleQueue[list[Transfer] | Unmade | None] = queue.SimpleQueue()
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

    def _hand(self, piece: list[Transfer] | Unmade) -> None:
        if self._closed:
            raise ReadAhead._Closed("the replay stopped")
        self._pieces.put(piece)

    def __iter__(self) -> Iterator[list[Transfer]]:
        while (piece := self._pieces.get()) is not None:
            yield piece if isinstance(piece, list) else piece.make()

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
