"""The standby's side of journal shipping (gpu_worker/replication/__init__.py, docs/replication.md).

`Mirror` is the standby's journal directory: the primary's bytes written at the same segment and
offset (a segment the primary rewrote after a failed tick is rewritten and cut to the new end, as
the primary's was), made durable with one fdatasync per batch of frames, a new segment file's
directory entry with an fsync of the directory. `Standby` keeps a link to the primary: it says
hello with the position its journal holds, writes what comes, acknowledges each durable position,
and connects again (bounded back-off) when the link breaks; a checkpoint of the primary comes
down the link too, and goes into the standby's copy of the runtime file. `Follower` keeps a hot
standby's device applying what the journal copy gains (boot --standby-of): a takeover serves at
once (Device.take_over). What the standby holds is also a journal a device boots from (`boot
--takeover` on this journal directory and the runtime file copy).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import threading
from typing import Any, Iterator

from gpu_worker.contract.wire import FrameReader, ProtocolError, encode_frame
from gpu_worker.storage.filelayer import OsFileLayer
from gpu_worker.storage import runtime_file_writer
from gpu_worker.storage.journal import SEGMENT_HEADER_SIZE, list_segments, segment_name
from gpu_worker.storage.journal_lock import JournalLock
from gpu_worker.storage.journal_reader import recover
from gpu_worker.storage.runtime_file import RuntimeFile

from . import DEAD_SECONDS, MARKER, connect, read_frames

log = logging.getLogger("gpu_worker.replication")

# seconds between connection attempts: doubling, at most this (a standby waiting for its place, or
# for a new primary after a failover, finds it within RETRY_MOST: the new primary holds until then)
RETRY_FIRST, RETRY_MOST = 0.1, 0.5
CONNECT_SECONDS = 0.5  # a machine that does not answer in this long is not the primary now: the next is tried


MARK_SCHEMA = "aotx.journal.standby.v1"


def read_marker(directory: str) -> dict[str, Any] | str | None:
    """DIR/standby as a dict, None without one, or why it cannot be read."""
    try:
        with open(os.path.join(directory, MARKER), "rb") as f:
            doc = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return f"unreadable ({exc})"
    if not isinstance(doc, dict) or doc.get("schema") != MARK_SCHEMA:
        return "of an unknown schema"
    return doc


def read_mark(directory: str) -> str | None:
    """The replication DIR/standby records, None without one: "sync" (it holds everything the
    primary saved), "catching-up" (it follows a sync primary but has not yet acknowledged what the
    primary had saved when it connected, or was cut back since), "catch-up" (its copy is being
    replaced), "async"."""
    doc = read_marker(directory)
    return doc.get("replication") if isinstance(doc, dict) else doc


def member_of(directory: str) -> str:
    """This journal copy's standby identity (DIR/standby "member", 32 hex digits, made once): what
    its hello says and what the primary names in etcd's sync key (docs/replication.md, "Sync
    standby")."""
    doc = read_marker(directory)
    doc = doc if isinstance(doc, dict) else {}
    member = doc.get("member")
    if not (isinstance(member, str) and len(member) == 32):
        member = doc["member"] = os.urandom(16).hex()
        write_marker(directory, doc)
    return member


def leader_of(directory: str) -> int:
    """The newest leadership generation this journal copy followed (DIR/standby "leader"): an
    older primary's stream is refused."""
    doc = read_marker(directory)
    leader = doc.get("leader", 0) if isinstance(doc, dict) else 0
    return leader if type(leader) is int else 0


def takeovers(directory: str) -> list[tuple[int, int]]:
    """The journal positions where a takeover began a new primary's part of this journal, oldest
    first (DIR/standby "takeovers"): a rejoining standby whose journal goes on past one in other
    bytes held a tail never saved, and is cut back there (docs/replication.md, "Rejoin")."""
    doc = read_marker(directory)
    points = doc.get("takeovers", []) if isinstance(doc, dict) else []
    return [(int(p[0]), int(p[1])) for p in points]


def write_marker(directory: str, doc: dict[str, Any]) -> None:
    """Replace DIR/standby atomically (temporary file, fsync, rename, directory fsync)."""
    target = os.path.join(directory, MARKER)
    data = json.dumps({**doc, "schema": MARK_SCHEMA}, sort_keys=True).encode() + b"\n"
    fd = os.open(target + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(target + ".tmp", target)
    OsFileLayer().fsync_dir(directory)


def record_takeover(directory: str, position: tuple[int, int]) -> None:
    """A takeover boot begins this primary's part of the journal at `position`."""
    doc = read_marker(directory)
    doc = doc if isinstance(doc, dict) else {}
    doc["takeovers"] = [list(p) for p in takeovers(directory)] + [list(position)]
    write_marker(directory, doc)


class Rewound(Exception):
    """The journal was cut back to a takeover point: say hello again from there."""


class StandbyRefused(Exception):
    """The primary will not stream to this standby (another runtime file, a journal that is not a
    copy of its own, a segment it no longer has): connecting again would not help."""


class StandbyDiskError(Exception):
    """A write or a sync of the journal copy failed: the standby stops, acknowledging nothing more.
    After a failed fdatasync the kernel may have dropped the dirty pages it could not write and a
    later fdatasync succeeds, so retrying (as a link error) could acknowledge bytes that are not on
    the disk; PostgreSQL panics for the same reason. Not an OSError: `Standby.run` must not take it
    for a broken link."""


class Stale(Exception):
    """The primary at the address leads an older leadership generation than one this copy already
    followed (a fenced or partitioned old primary): it is not followed; connect again later."""


class Mirror:
    """The standby's copy of the primary's journal (module docstring)."""

    def __init__(self, directory: str, incarnation: bytes, lock: JournalLock | None = None,
                 position: tuple[int, int] | None = None) -> None:
        """`lock`: the journal's, when the caller took it already; `position`: where the journal's
        transfers end, when the caller recovered it already (a hot standby's device)."""
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
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
        self._media: tuple[str, Any, int, int] | None = None  # a source being received: (sha, hash, fd, bytes)
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
                write_marker(self.directory, doc)

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

    def media_piece(self, msg: dict[str, Any]) -> None:
        """A piece of a media source's bytes; the last one makes the file whole and durable (under
        its name only once it hashes to it), before any later frame's journal bytes are acknowledged."""
        sha, size, at, data = msg.get("media"), msg.get("size"), msg.get("offset"), msg.get("data")
        if (type(sha) is not str or len(sha) != 64 or type(size) is not int or type(at) is not int
                or type(data) is not bytes):
            raise ProtocolError(f"not a media piece: {sorted(msg)}")
        directory = os.path.join(self.directory, "media")
        path = os.path.join(directory, sha)
        if at == 0:
            with self.disk(f"creating media {sha}"):
                os.makedirs(directory, exist_ok=True)
                self._media = (sha, hashlib.sha256(), os.open(path + ".tmp.standby", os.O_WRONLY | os.O_CREAT
                                                             | os.O_TRUNC | os.O_CLOEXEC, 0o600), 0)
        if self._media is None or self._media[0] != sha or self._media[3] != at:
            raise ProtocolError(f"media {sha} piece at {at} out of order")
        _, digest, fd, _ = self._media
        with self.disk(f"writing media {sha}"):
            os.write(fd, data)
        digest.update(data)
        self._media = (sha, digest, fd, at + len(data))
        if at + len(data) < size:
            return
        self._media = None
        with self.disk(f"syncing media {sha}"):
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        if digest.hexdigest() != sha:
            os.remove(path + ".tmp.standby")
            raise ProtocolError(f"media {sha}: the bytes hash to {digest.hexdigest()}")
        with self.disk(f"placing media {sha}"):
            os.replace(path + ".tmp.standby", path)
            OsFileLayer().fsync_dir(directory)

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


class Standby:
    """Follows a primary (module docstring) until `stop`."""

    def __init__(self, address: str, mirror: Mirror, runtime: str, follower: Follower | None = None,
                 dead_after: float = DEAD_SECONDS, tls: Any = None) -> None:
        """`address`: the primary's replication address, or several, comma-separated (every
        machine's: the standby follows whichever serves as the primary, trying the next after a
        failure, so that it finds a new primary after a failover by itself). `runtime`: this
        standby's copy of the primary's runtime file (its checkpoints follow the primary's).
        `dead_after`: seconds without a frame (the primary beats a third of it) after which the link
        is dead and made again. `tls`: an ssl.SSLContext for a TCP link (replication/tls.py), None
        for a Unix socket."""
        self.addresses = [a for a in address.split(",") if a]
        self.address = self.addresses[0]
        self.mirror = mirror
        self.runtime = runtime
        self.dead_after = dead_after
        self.tls = tls
        with RuntimeFile.open(runtime, verify=False) as copy:
            self.incarnation = copy.incarnation
        self.member = member_of(mirror.directory)  # this copy's identity (the sync key names it)
        self.leader = leader_of(mirror.directory)  # the newest leadership generation followed
        self._pieces: dict[str, tuple[str, bytearray]] = {}  # a checkpoint's components as they come
        self.follower = follower  # a hot standby's: told each durable position and each cut
        self.connected = threading.Event()  # set while a link streams (tests and `run`'s log wait on it)
        self.in_sync = threading.Event()  # set while its acknowledged position is past the link's sync point
        self.acks = 0
        self.failures = 0  # links that ended in an error (each is tried again after a back-off)
        self._stop = threading.Event()
        self._wake = threading.Event()  # the back-off wait's waker: stop(), and prefer() (a new primary)
        self._preferred: str | None = None  # the primary's address as etcd's leader key says
        self._sock: socket.socket | None = None

    def run(self) -> None:
        """Follow the primary, connecting again after each loss (the next address after a failure),
        until `stop`; a refusal, or a failure of this journal's disk (StandbyDiskError), is raised."""
        wait = RETRY_FIRST
        at = 0
        while not self._stop.is_set():
            preferred, self._preferred = self._preferred, None
            self.address = preferred or self.addresses[at % len(self.addresses)]
            try:
                self._follow()
                wait = RETRY_FIRST
            except Rewound:
                continue  # at once, from the takeover point
            except (OSError, ProtocolError, Stale) as exc:
                if self._stop.is_set():
                    break
                self.failures += 1
                at += 1
                log.warning("standby: the link to %s: %s; next %s in %.1fs", self.address, exc,
                            self.addresses[at % len(self.addresses)], wait)
            finally:
                self.connected.clear()
                self.in_sync.clear()
            if self._preferred is None:
                self._wake.wait(wait)
                self._wake.clear()
            if at % len(self.addresses) == 0:  # (back off once every address was tried)
                wait = min(wait * 2, RETRY_MOST)

    def prefer(self, address: str | None) -> None:
        """The leader key names a primary whose link is at `address`: the next connection goes
        there, at once (a standby waiting for its place, or following a deposed primary, finds the
        new one without trying every machine's address)."""
        if address and not (self.connected.is_set() and address == self.address):
            self._preferred = address  # (even the address just tried: it may have been before it listened)
            self._wake.set()

    def _follow(self) -> None:
        sock = connect(self.address, CONNECT_SECONDS, self.tls, self.dead_after)
        self._sock = sock
        self._pieces = {}  # (pieces of a component a broken link left half sent come again whole)
        try:
            if self._stop.is_set():
                return
            segment, offset = self.mirror.position
            with RuntimeFile.open(self.runtime, verify=False) as copy:  # (a checkpoint of the link moves it)
                generation = copy.generation
                components = {name: c.sha256 for name, c in copy.components.items()}
            sock.sendall(encode_frame({"hello": 1, "incarnation": self.incarnation, "generation": generation,
                                       "components": components, "segment": segment, "offset": offset,
                                       "digest": self.mirror.digest(), "media": self.mirror.media_held(),
                                       "member": self.member, "leader": self.leader}))
            # the primary beats every third of dead_after: a link quiet for longer is dead (a silent
            # partition), and so is one whose sends block that long; stop() shuts the socket down
            sock.settimeout(self.dead_after)
            frames = FrameReader()
            # the primary's last cut this link saw: its "replication" frame says, and nothing is
            # acknowledged before it (a catch-up comes first: the position held until then is not
            # of the primary's journal)
            cut: int | None = None
            link: dict[str, Any] = {}  # the replication frame's: its mode, leader and sync point
            log.info("standby: following %s from %s", self.address, (segment, offset))
            while True:
                try:
                    batch = read_frames(sock, frames)
                except TimeoutError:
                    raise ConnectionError(f"no frame from the primary for {self.dead_after}s: the link is dead") \
                        from None
                self.connected.set()
                for msg in batch:
                    if "refused" in msg:
                        if msg.get("again"):
                            raise ConnectionError(f"the primary at {self.address} asks to connect again: "
                                                  f"{msg['refused']}")
                        raise StandbyRefused(f"the primary at {self.address} refused: {msg['refused']}")
                    if link and msg.get("g") != link["leader"]:
                        raise ProtocolError(f"a frame of leadership generation {msg.get('g')} on a link of "
                                            f"{link['leader']}")
                    if "beat" in msg:
                        continue  # (the acknowledgement below answers it)
                    if "rewind" in msg:  # this journal went on past a takeover point in other bytes
                        at, end = msg["rewind"]
                        # not in sync until the primary's stream covers what it had saved again
                        self.mirror.mark("catching-up", self.address, takeovers(self.mirror.directory))
                        self.mirror.rewind(int(at), int(end))
                        if self.follower is not None:
                            self.follower.cut((int(at), int(end)))
                        raise Rewound(f"cut back to the primary's takeover point {(at, end)}")
                    if "replication" in msg:
                        link = self._linked(msg)
                        cut = msg.get("cut", 0)
                        continue
                    if "checkpoint" in msg:
                        self._checkpoint(msg)
                        continue
                    if "catchup" in msg:
                        self._catch_up(msg)
                        continue
                    if "media" in msg:
                        self.mirror.media_piece(msg)
                        continue
                    if "cut" in msg:  # the primary's journal was cut back (a failed tick): so is this copy
                        at, end = msg.get("segment"), msg.get("offset")
                        if type(at) is not int or type(end) is not int:
                            raise ProtocolError(f"not a cut: {sorted(msg)}")
                        self.mirror.cut(at, end)
                        if self.follower is not None:
                            self.follower.cut((at, end))
                        cut = msg["cut"]
                        continue
                    at, start, data = msg.get("segment"), msg.get("offset"), msg.get("data")
                    if type(at) is not int or type(start) is not int or type(data) is not bytes:
                        raise ProtocolError(f"not journal bytes: {sorted(msg)}")
                    if start == 0 and len(data) < SEGMENT_HEADER_SIZE:
                        raise ProtocolError(f"segment {at} begins without its whole header")
                    self.mirror.write(at, start, data)
                segment, offset = self.mirror.sync()
                if cut is None:
                    continue
                if link["mode"] == "sync" and not self.in_sync.is_set() and (segment, offset) >= link["sync_at"]:
                    # durable past what the primary had saved when this link began: it holds every
                    # saved transfer from now on, and may take over (docs/replication.md, "In sync")
                    self.mirror.mark("sync", self.address, link["takeovers"])
                    self.in_sync.set()
                    log.info("standby: in sync with %s at %s", self.address, (segment, offset))
                sock.sendall(encode_frame({"ack": 1, "segment": segment, "offset": offset, "cut": cut,
                                           "g": link["leader"]}))
                self.acks += 1
                if self.follower is not None:
                    self.follower.durable((segment, offset))
        finally:
            self._sock = None
            sock.close()

    def _linked(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The primary's first frame after the hello (after a catch-up's frames): its replication
        mode, leadership generation, takeover points and sync point. An older leadership than this
        copy followed is Stale; a sync link marks the journal "catching-up" until its durable
        position passes the sync point (every transfer the primary had saved when it connected)."""
        mode, leader, sync_at = msg.get("replication"), msg.get("g", 0), msg.get("sync_at", [0, 0])
        if mode not in ("sync", "async") or type(leader) is not int or not (
                isinstance(sync_at, list) and len(sync_at) == 2 and all(type(x) is int for x in sync_at)):
            raise ProtocolError(f"not a replication frame: {sorted(msg)}")
        if leader < self.leader:
            raise Stale(f"the primary at {self.address} leads generation {leader}, older than {self.leader} "
                        "which this standby followed: not followed")
        points = [(int(p[0]), int(p[1])) for p in msg.get("takeovers", [])]
        self.leader = leader
        held = self.mirror.sync() >= tuple(sync_at)  # (what a broken link left written is durable first)
        self.mirror.mark(mode if mode == "async" or held else "catching-up", self.address, points, leader)
        if mode == "sync" and held:
            self.in_sync.set()
        return {"mode": mode, "leader": leader, "sync_at": tuple(sync_at), "takeovers": points}

    def _piece(self, msg: dict[str, Any]) -> bool:
        """Keep a piece of a runtime file component (a checkpoint's or a catch-up's) with those
        before it; False when `msg` is the end frame instead."""
        if "data" not in msg:
            return False
        name, kind, at, data = msg.get("component"), msg.get("kind"), msg.get("offset"), msg.get("data")
        if type(name) is not str or type(kind) is not str or type(at) is not int or type(data) is not bytes:
            raise ProtocolError(f"not a runtime file component's piece: {sorted(msg)}")
        piece = self._pieces.setdefault(name, (kind, bytearray()))
        if at != len(piece[1]):
            raise ProtocolError(f"component {name} piece at {at}, after {len(piece[1])} bytes")
        piece[1].extend(data)
        return True

    def _components(self, names: Any, drop: Any) -> tuple[list[tuple[str, str, Any]], list[str]]:
        """The components the pieces made and the names to drop, for `runtime_file_writer.append` (the
        end frame names both)."""
        if not isinstance(names, (list, dict)) or not isinstance(drop, list) or set(names) != set(self._pieces):
            raise ProtocolError(f"an end frame names other components than came: {sorted(names or ())}")
        pieces, self._pieces = self._pieces, {}
        return ([(n, kind, data if kind == "bytes" else data.decode() if kind == "text" else bytes(data))
                 for n in names for kind, data in [pieces[n]]],  # (a state's bytes: not copied once more)
                [str(n) for n in drop])

    def _catch_up(self, msg: dict[str, Any]) -> None:
        """A piece of a catch-up, or its end: this copy of the runtime file was at an older
        generation than the primary's, which sends the saved state it lacks. The journal marker
        says "catch-up" first (a takeover refuses this journal until the primary's stream
        continues: the copy is not whole in between), the journal copy is emptied, the components
        go into the copy at the primary's generation (every one's SHA-256 checked against the
        primary's), and a hot device builds its tables again from it. The stream then goes on from
        the primary's oldest segment (docs/replication.md, "Catch-up")."""
        if self._piece(msg):
            return
        generation, digests = msg["catchup"], msg.get("components")
        if type(generation) is not int or not isinstance(digests, dict):
            raise ProtocolError(f"not a catch-up's end: {sorted(msg)}")
        components, drop = self._components(digests, msg.get("drop"))
        if msg.get("journal") == "kept":
            self._adopt(generation, components, drop, digests)
            return
        self.mirror.mark("catch-up", self.address, takeovers(self.mirror.directory))
        with self.follower.paused() if self.follower is not None else contextlib.nullcontext():
            self.mirror.empty()
            with RuntimeFile.open(self.runtime, verify=False) as copy:
                behind = copy.generation < generation
            if behind or components or drop:  # (else only the journal begins again: the copy is the primary's)
                runtime_file_writer.append(self.runtime, components, drop=drop, generation=generation)
            self._came_out(generation, digests)
            if self.follower is not None:
                self.follower.reload()
        log.info("standby: caught up to the primary's generation %d (%d components) in %s", generation,
                 len(components), self.runtime)

    def _adopt(self, generation: int, components: list[tuple[str, str, Any]], drop: list[str],
               digests: dict[str, str]) -> None:
        """A catch-up with the journal kept: this copy lacked only the failover component of the
        takeover that made the primary's generation (this standby is the old primary, or followed
        it): the copy gets it at that generation, and the journal, checked as a copy of the
        primary's (cut back to its takeover point if it went on past it), and the device's tables
        stay; the takeover's BOOT transfer, next in the stream, tells the tables the generation
        (docs/replication.md, "Failover generations")."""
        runtime_file_writer.append(self.runtime, components, drop=drop, generation=generation)
        self._came_out(generation, digests)
        log.info("standby: adopted the primary's failover generation %d in %s (the journal stays)", generation,
                 self.runtime)

    def _came_out(self, generation: int, digests: dict[str, str]) -> None:
        """The copy is at the primary's `generation`, every component named as the primary's; else
        StandbyRefused."""
        with RuntimeFile.open(self.runtime, verify=False) as copy:
            if copy.generation != generation or any(getattr(copy.components.get(n), "sha256", None) != d
                                                    for n, d in digests.items()):
                raise StandbyRefused(f"the runtime file copy {self.runtime} did not come out as the primary's "
                                     f"generation {generation}")

    def _checkpoint(self, msg: dict[str, Any]) -> None:
        """A piece of a checkpoint's component, or the end: the copy of the runtime file gets the
        components the primary's got (its generation must come out the same), and the journal
        segments the checkpoint folded go (those the hot device has not read yet stay)."""
        if self._piece(msg):
            return
        generation = msg["checkpoint"]
        components, drop = self._components(msg.get("components"), msg.get("drop"))
        self.mirror.sync()  # (the journal before the checkpoint is durable before the copy says it is folded)
        made = runtime_file_writer.append(self.runtime, components, drop=drop)
        if made != generation:
            raise StandbyRefused(f"the runtime file copy {self.runtime} went to generation {made}, the primary's to "
                                 f"{generation}: start the standby from a copy of the primary's runtime file")
        keep = self.mirror.segment
        if msg.get("through") is not None:  # (the segments after it hold what came after the fold point)
            keep = min(keep, int(msg["through"]) + 1)
        if self.follower is not None:
            keep = min(keep, self.follower.applied_segment())
        self.mirror.trim(keep)
        log.info("standby: checkpoint generation %d of the primary copied into %s", generation, self.runtime)

    def resume(self) -> None:
        """After `stop`: `run` follows again (a takeover decided, then found not possible)."""
        self._stop.clear()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the blocking read
            except OSError:
                pass


class Follower:
    """A hot standby's applier (`aotx-follow`): after each batch the standby made durable, the
    device (gpu_worker/device.py, `following`) applies what its journal copy gained to its tables,
    off the link's thread (acknowledgements never wait for it). Its waker is `durable`/`cut`/`stop`;
    it also looks every second. A cut before what was applied (a rewind, a primary's failed tick)
    builds the tables again from the journal. An error stops the applying (`error`): the takeover
    then boots from the journal instead."""

    LOOK_SECONDS = 1.0

    def __init__(self, device: Any, position: tuple[int, int]) -> None:
        self.device = device
        self.error: str | None = None
        self.refollowed = 0
        self._cond = threading.Condition()
        self._durable = position
        self._cut: tuple[int, int] | None = None
        self._reload = False  # a catch-up replaced the runtime file copy's state and emptied the journal
        # held while the device reads the journal copy: a catch-up empties it only in between (`paused`)
        self._reading = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="aotx-follow", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def durable(self, position: tuple[int, int]) -> None:
        with self._cond:
            self._durable = position
            self._cond.notify()

    def cut(self, position: tuple[int, int]) -> None:
        with self._cond:
            self._cut = position if self._cut is None else min(self._cut, position)
            self._durable = min(self._durable, position)
            self._cond.notify()

    def paused(self) -> threading.Lock:
        """Held, the device reads nothing of the journal copy (a catch-up empties it meanwhile)."""
        return self._reading

    def reload(self) -> None:
        """The copy of the runtime file is at a new generation and the journal copy begins again:
        the device builds its tables from them again (its next step)."""
        with self._cond:
            self._reload = True
            self._cut = None
            self._durable = (0, 0)  # (what the emptied copy held counts for nothing: acknowledgements say anew)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._reload and self._cut is None and self._durable <= self._applied():
                    self._cond.wait(self.LOOK_SECONDS)
                if self._stop:
                    return
            if not self._stepped():
                return

    def _applied(self) -> tuple[int, int]:
        return self.device.following.position

    def applied_segment(self) -> int:
        """The segment the device reads now (the ones before it are applied: a checkpoint may trim them)."""
        return max(self._applied()[0], 1)

    def _step(self) -> None:
        with self._reading:
            self._read()

    def _read(self) -> None:
        with self._cond:
            cut, self._cut = self._cut, None
            reload, self._reload = self._reload, False
            until = self._durable
        if reload:
            log.info("standby: building the tables again from the runtime file copy the catch-up made")
            self.device.refollow()
            self.refollowed += 1
        elif cut is not None and cut < self._applied():
            log.warning("standby: the journal was cut back to %s, before what its tables hold (%s): building them "
                        "again", cut, self._applied())
            self.device.refollow()
            self.refollowed += 1
        if until > self._applied():
            self.device.follow(until)

    def finish(self, until: tuple[int, int]) -> bool:
        """Stop following (the standby stopped: nothing more arrives) and apply a last cut: whether
        the device's tables are good to take over from (`Device.take_over` applies up to `until`)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join()
        return self.error is None and self._stepped()

    def _stepped(self) -> bool:
        """`_step`, or False once it failed (`error`: the takeover boots from the journal instead)."""
        try:
            self._step()
        except Exception as exc:
            log.exception("standby: applying the journal copy failed; a takeover will boot from the journal")
            self.error = f"{type(exc).__name__}: {exc}"
            return False
        return True
