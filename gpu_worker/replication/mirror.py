"""The standby's copy of the primary's journal (gpu_worker/replication/__init__.py, docs/replication.md).

`Mirror` is the standby's journal directory: the primary's bytes written at the same segment and
offset (a segment the primary rewrote after a failed tick is rewritten and cut to the new end, as
the primary's was), made durable with one fdatasync per batch of frames, a new segment file's
directory entry with an fsync of the directory; the media sources the journal names beside it, and
the marker (DIR/standby, marker.py) that says how it was kept. What it holds is also a journal a
device boots from (`boot --takeover` on this journal directory and the runtime file copy). Its link
to the primary is standby.py's `Standby`.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from typing import TYPE_CHECKING, Iterator

from gpu_worker.contract.wire import ProtocolError
from gpu_worker.storage.filelayer import FileLayer, OsFileLayer, RandomAccessFile
from gpu_worker.storage.journal import list_segments, segment_name
from gpu_worker.storage.journal_lock import JournalLock
from gpu_worker.storage.journal_reader import recover

from .frames import MediaPiece
from .marker import MARK_SCHEMA, read_marker, write_marker

if TYPE_CHECKING:
    from hashlib import _Hash as Hash

log = logging.getLogger("gpu_worker.replication")


class StandbyDiskError(Exception):
    """A write or a sync of the journal copy failed: the standby stops, acknowledging nothing more.
    After a failed fdatasync the kernel may have dropped the dirty pages it could not write and a
    later fdatasync succeeds, so retrying (as a link error) could acknowledge bytes that are not on
    the disk; PostgreSQL panics for the same reason. Not an OSError: `Standby.run` must not take it
    for a broken link."""


class Mirror:
    """The standby's copy of the primary's journal (module docstring)."""

    def __init__(self, directory: str, incarnation: bytes, lock: JournalLock | None = None,
                 position: tuple[int, int] | None = None, fs: FileLayer | None = None) -> None:
        """`lock`: the journal's, when the caller took it already; `position`: where the journal's
        transfers end, when the caller recovered it already (a hot standby's device); `fs`: the
        file layer its media sources and DIR/standby are written through (tests inject faults)."""
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.fs: FileLayer = fs or OsFileLayer()
        self.lock = lock or JournalLock(directory)  # one writer per journal, as for a device
        if position is None:
            try:
                found = recover(directory, OsFileLayer(), incarnation)
            except BaseException:
                self.lock.release()
                raise
            if found.dropped:
                log.warning("standby journal: %s", found.dropped)
            position = (found.segment, found.end_offset) if found.segment else (0, 0)
        self.segment, self.offset = position
        self._fd: int | None = None
        self._fd_segment = 0
        # a source being received: (sha, hash, its temporary file, bytes)
        self._media: tuple[str, Hash, RandomAccessFile, int] | None = None
        self._new_entry = False  # a segment file was created since the last sync: fsync the directory
        if self.segment:
            self._open(self.segment)
            if os.fstat(self._fd).st_size != self.offset:  # type: ignore[arg-type]
                os.ftruncate(self._fd, self.offset)  # type: ignore[arg-type]  # a torn tail, as the writer cuts it
                os.fdatasync(self._fd)  # type: ignore[arg-type]

    @property
    def position(self) -> tuple[int, int]:
        return self.segment, self.offset

    @contextlib.contextmanager
    def disk(self, what: str) -> Iterator[None]:
        """Any OSError of the journal copy's files becomes StandbyDiskError (the standby stops)."""
        try:
            yield
        except OSError as exc:
            raise StandbyDiskError(f"standby journal {self.directory}: {what} failed: {exc}") from exc

    def write(self, segment: int, offset: int, data: bytes) -> None:
        """Bytes the primary wrote at `offset` of `segment`: continuing this journal, or rewriting
        its tail (never leaving a hole)."""
        if segment == self.segment:
            if offset > self.offset:
                raise ProtocolError(f"bytes at {segment}:{offset} leave a hole after {self.offset}")
        elif segment == self.segment + 1 or self.segment == 0:  # (an empty copy begins where the primary's does)
            if offset != 0:
                raise ProtocolError(f"segment {segment} begins at offset {offset}, not at its header")
        else:
            raise ProtocolError(f"bytes for segment {segment} after segment {self.segment}")
        with self.disk(f"writing segment {segment} at {offset}"):
            if segment != self._fd_segment:
                self._open(segment)
            fd = self._fd
            assert fd is not None
            os.pwrite(fd, data, offset)
            end = offset + len(data)
            if os.fstat(fd).st_size > end:  # the primary cut a failed tick and wrote again from here
                os.ftruncate(fd, end)
        self.segment, self.offset = segment, end

    def mark(self, replication: str, primary: str, points: list[tuple[int, int]], leader: int | None = None) -> None:
        """Record the replication this journal is kept under (`read_mark`), the primary's takeover
        points and the leadership generation it follows (DIR/standby): `boot --takeover` continues
        the primary's line of history only from a journal in sync, a later rejoin needs the points,
        and an older primary is not followed again. The member identity stays."""
        kept = read_marker(self.directory)
        kept = kept if isinstance(kept, dict) else {}
        doc = {**kept, "replication": replication, "primary": primary, "takeovers": [list(p) for p in points]}
        if leader is not None:
            doc["leader"] = leader
        doc.pop("schema", None)
        if kept != {**doc, "schema": MARK_SCHEMA}:
            with self.disk("writing DIR/standby"):
                write_marker(self.directory, doc, self.fs)

    def rewind(self, segment: int, offset: int) -> None:
        """Cut this journal back to `offset` of `segment` (a takeover point of the primary): what
        follows it here was never saved (the primary it came from was replaced before its standby
        held it)."""
        log.warning("standby: journal %s at %s is cut back to %s, the primary's takeover point (the tail after it "
                    "was never saved)", self.directory, self.position, (segment, offset))
        with self.disk("cutting the journal back"):
            if self._fd is not None:
                os.close(self._fd)
                self._fd, self._fd_segment = None, 0
            for number in list_segments(self.directory, OsFileLayer()):
                if number > segment:
                    os.remove(os.path.join(self.directory, segment_name(number)))
            self._open(segment)
            assert self._fd is not None
            os.ftruncate(self._fd, offset)
            os.fdatasync(self._fd)
            OsFileLayer().fsync_dir(self.directory)
        self.segment, self.offset = segment, offset

    def empty(self) -> None:
        """Remove every segment (a catch-up replaces what they held: the primary's stream begins
        again at its oldest segment)."""
        with self.disk("emptying the journal"):
            if self._fd is not None:
                os.close(self._fd)
                self._fd, self._fd_segment = None, 0
            for number in list_segments(self.directory, OsFileLayer()):
                os.remove(os.path.join(self.directory, segment_name(number)))
            OsFileLayer().fsync_dir(self.directory)
        self.segment, self.offset = 0, 0

    def media_held(self) -> list[str]:
        """The media sources this copy holds (their files under media/, named by their sha256)."""
        directory = os.path.join(self.directory, "media")
        return sorted(n for n in os.listdir(directory) if len(n) == 64) if os.path.isdir(directory) else []

    def media_piece(self, piece: MediaPiece) -> None:
        """A piece of a media source's bytes; the last one makes the file whole and durable (under
        its name only once it hashes to it), before any later frame's journal bytes are acknowledged."""
        sha, size, at, data = piece.media, piece.size, piece.offset, piece.data
        if len(sha) != 64:
            raise ProtocolError(f"not a media piece: a name of {len(sha)} characters")
        directory = os.path.join(self.directory, "media")
        path = os.path.join(directory, sha)
        if at == 0:
            with self.disk(f"creating media {sha}"):
                os.makedirs(directory, exist_ok=True)
                self._media = (sha, hashlib.sha256(), self.fs.open_new(path + ".tmp.standby", 0o600), 0)
        if self._media is None or self._media[0] != sha or self._media[3] != at:
            raise ProtocolError(f"media {sha} piece at {at} out of order")
        _, digest, f, _ = self._media
        with self.disk(f"writing media {sha}"):
            f.pwrite(data, at)
        digest.update(data)
        self._media = (sha, digest, f, at + len(data))
        if at + len(data) < size:
            return
        self._media = None
        with self.disk(f"syncing media {sha}"):
            try:
                f.fsync()
            finally:
                f.close()
        if digest.hexdigest() != sha:
            self.fs.remove(path + ".tmp.standby")
            raise ProtocolError(f"media {sha}: the bytes hash to {digest.hexdigest()}")
        with self.disk(f"placing media {sha}"):
            self.fs.replace(path + ".tmp.standby", path)  # renamed, the directory fsynced

    def trim(self, keep_from: int) -> None:
        """Remove the segments before `keep_from` (a checkpoint folded them into the runtime file
        copy, as the primary removed its own)."""
        removed = [n for n in list_segments(self.directory, OsFileLayer()) if n < keep_from]
        with self.disk("removing folded segments"):
            for number in removed:
                os.remove(os.path.join(self.directory, segment_name(number)))
            if removed:
                OsFileLayer().fsync_dir(self.directory)

    def digest(self) -> bytes:
        """SHA-256 of the last segment's bytes (the primary checks that its own begins with them)."""
        if self._fd is None:
            return hashlib.sha256(b"").digest()
        h, offset = hashlib.sha256(), 0
        while offset < self.offset:
            chunk = os.pread(self._fd, min(1 << 20, self.offset - offset), offset)
            if not chunk:
                break
            h.update(chunk)
            offset += len(chunk)
        return h.digest()

    def cut(self, segment: int, offset: int) -> None:
        """The primary cut its journal back to `offset` of `segment` (the segment it writes): so
        does this copy, when it holds more."""
        if segment == self.segment and offset < self.offset:
            assert self._fd is not None and self._fd_segment == segment
            with self.disk("cutting the segment"):
                os.ftruncate(self._fd, offset)
            self.offset = offset

    def sync(self) -> tuple[int, int]:
        """Make everything written durable; the position it holds now. A failure is a
        StandbyDiskError: nothing more may be acknowledged (its class says why)."""
        with self.disk("fdatasync"):
            if self._fd is not None:
                os.fdatasync(self._fd)
            if self._new_entry:
                OsFileLayer().fsync_dir(self.directory)
                self._new_entry = False
        return self.position

    def _open(self, segment: int) -> None:
        if self._fd is not None:
            os.fdatasync(self._fd)  # the segment it leaves is whole on the disk before the next begins
            os.close(self._fd)
        path = os.path.join(self.directory, segment_name(segment))
        self._new_entry = self._new_entry or not os.path.exists(path)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._fd_segment = segment

    def close(self, keep_lock: bool = False) -> None:
        """Close the journal; its lock is released unless `keep_lock` (a hot standby's device takes
        it over with the journal)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if not keep_lock:
            self.lock.release()
