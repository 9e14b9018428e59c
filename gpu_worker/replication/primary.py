"""The primary's side of journal shipping (gpu_worker/replication/__init__.py, docs/replication.md).

The tick thread calls `ship` as each tick starts on the disk (Committer._start_io) and `woken`
when the Shipper's eventfd is readable (an acknowledgement came, a standby said hello or left);
everything else runs on the Shipper's own threads, so nothing proportional to the journal's size
runs on the tick thread: the accept thread takes a standby's hello, and each standby's sender
thread writes what it lacks from the segment files, then the ticks queued for it, while its
reader thread takes its acknowledgements. `acked_seq`, the last transfer the standby holds
durable, is what sync replication waits for.
"""
from __future__ import annotations

import hashlib
import logging
import os
import queue
import socket
import threading
import time
from collections import deque
from typing import Any, Callable, Iterable

from gpu_worker.contract.wire import FrameReader, ProtocolError, encode_frame
from gpu_worker.storage.filelayer import OsFileLayer
from gpu_worker.storage.journal import SEGMENT_HEADER_SIZE, encode_segment_header, list_segments, segment_name
from gpu_worker.storage.journal_writer import JournalWriter
from gpu_worker.storage.runtime_file import RuntimeFile, RuntimeFileError

from . import DEAD_SECONDS, FAILOVER, HELLO_SECONDS, SEGMENT_CHUNK, accepted, listen, marker, read_frames

log = logging.getLogger("gpu_worker.replication")

MAX_TICKS_TRACKED = 1 << 16   # tick ends kept to map an acknowledged position to a transfer
MAX_QUEUED_BYTES = 64 << 20   # an async standby further behind than this is dropped (it catches up again)
# the runtime file components checkpoints (storage/checkpoint.py, ops/media.py) and takeovers
# (FAILOVER) write: the saved state a catch-up may replace; any other (the model, the profiles)
# must be the same on a standby
SAVED_STATE = ("state/", "audit/", "media/", FAILOVER)

Position = tuple[int, int]  # (segment, offset): journal bytes before it


class Link:
    """One standby's connection: its sender thread writes what the tick thread queued for it, in
    order; its reader thread takes its acknowledgements (`position`, what it holds durable)."""

    def __init__(self, shipper: Shipper, sock: socket.socket, position: Position) -> None:
        self.shipper = shipper
        self.sock = sock
        self.position = position
        self.peer = str(sock.getpeername() or "unix socket")
        self.member = ""  # the standby's identity (its hello says; the sync key names it)
        # what the primary had handed to its disk when the link began: the standby is in sync (its
        # acknowledgements save transfers, it may take over) only once it holds all of it
        self.sync_at: Position = (0, 0)
        self.in_sync = False
        # the prefix of the standby's last segment the accept thread could not find in the file (a
        # tick still being written there): (segment, offset, digest, bytes hashed, their hash),
        # finished from the ticks in flight on the tick thread (`Shipper._start`)
        self.check: tuple[int, int, bytes, int, Any] | None = None
        self.media: set[str] = set()  # the media sources the standby holds (its hello says)
        self.generation = 0  # its runtime file copy's, and that copy's components' SHA-256 (its hello says)
        self.components: dict[str, str] = {}
        self.emptied = False  # its journal must begin again at this journal's oldest segment (a catch-up)
        # its copy lacks only this primary's failover component (an old primary rejoining): it adopts
        # them with its journal kept, as (generation, names, drop) the hello found (`Shipper._adopt`)
        self.adopt: tuple[int, list[str], list[str]] | None = None
        self.catching_up = False  # sent a catch-up that it has not acknowledged yet (`ping` shows it)
        self.queue: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self.queued_bytes = 0  # queued for the sender and not yet sent (the tick thread adds, it subtracts)
        self.closed = False
        self.started = False
        self.threads = [threading.Thread(target=self._send, name="aotx-replication-send", daemon=True),
                        threading.Thread(target=self._read, name="aotx-replication-acks", daemon=True)]

    def start(self) -> None:
        self.started = True
        for thread in self.threads:
            thread.start()

    def refuse(self, why: str, again: bool = False) -> None:
        """Tell the standby why it is not streamed to, and close; `again`: it may connect again at
        once (a passing reason), else its journal or copy must change first."""
        try:
            self.sock.sendall(encode_frame({"refused": why, **({"again": True} if again else {})}))
        except OSError:
            pass
        self.close()

    def close(self) -> None:
        """End the link (idempotent; from any thread): both threads stop, the tick thread hears of it."""
        if self.closed:
            return
        self.closed = True
        self.queue.put(None)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if not self.started:
            self.sock.close()  # (else its sender thread closes it as it ends)
        self.shipper.wake()

    # ---- the sender thread -------------------------------------------------------------------

    def frame(self, msg: dict[str, Any]) -> None:
        """Send one frame, with the primary's leadership generation (the sender thread)."""
        msg["g"] = self.shipper.leader
        self.sock.sendall(encode_frame(msg))

    def _send(self) -> None:
        beat = self.shipper.dead_after / 3
        leadership = self.shipper.leadership
        try:
            while True:
                try:
                    item = self.queue.get(timeout=beat)
                except queue.Empty:  # nothing to send for a while: a heartbeat (the standby acknowledges it)
                    item = ("frame", {"beat": 1})
                if item is None:
                    break
                fenced = leadership.fenced() if leadership is not None else None
                if fenced is not None:  # a deposed primary keeps no standby: it goes to the new primary
                    raise OSError(f"this primary is fenced ({fenced}): the standby is let go")
                if item[0] == "files":
                    self._send_files(item[1], item[2])
                elif item[0] == "frame":
                    self.frame(item[1])
                elif item[0] == "checkpoint":
                    self._send_components("checkpoint", item[1], item[2], {"components": [c[0] for c in item[2]],
                                                                           "drop": list(item[3]),
                                                                           "through": item[4]})
                elif item[0] == "catchup":
                    self._send_catch_up(*item[1:])
                elif item[0] == "adopt":
                    self._send_catch_up(item[1], item[2], item[3], kept=True)
                elif item[0] == "media":
                    self._send_media(item[1], item[2])
                else:
                    segment, offset, data = item
                    self.frame({"segment": segment, "offset": offset, "data": data})
                    self.queued_bytes -= len(data)
        except OSError as exc:
            log.warning("replication to %s: %s", self.peer, exc)
        finally:
            self.close()
            self.sock.close()

    def _send_files(self, start: Position, end: Position) -> None:
        """The journal bytes from `start` to `end`, read from the primary's segment files."""
        directory = self.shipper.journal_dir
        for segment in range(start[0], end[0] + 1):
            path = os.path.join(directory, segment_name(segment))
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # (a missing segment: the link fails, see `woken`)
            try:
                offset = start[1] if segment == start[0] else 0
                stop = end[1] if segment == end[0] else os.fstat(fd).st_size
                while offset < stop:
                    data = os.pread(fd, min(SEGMENT_CHUNK, stop - offset), offset)
                    if not data:
                        raise OSError(f"{path} ends at {offset}, before {stop}")
                    self.frame({"segment": segment, "offset": offset, "data": data})
                    offset += len(data)
            finally:
                os.close(fd)

    def _send_media(self, sha: str, path: str) -> None:
        """A media source's bytes in pieces: {"media": sha, "size": n, "offset": o, "data": bytes}."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            offset = 0
            while True:
                data = f.read(SEGMENT_CHUNK)
                self.frame({"media": sha, "size": size, "offset": offset, "data": data})
                offset += len(data)
                if offset >= size or not data:
                    return

    def _send_components(self, key: str, generation: int, components: Iterable[tuple[str, str, Any]],
                         end: dict[str, Any]) -> None:
        """Runtime file components in pieces ({key: generation, "component", "kind", "offset",
        "data"}), then the frame `end` that has the standby append them: a checkpoint's, or a
        catch-up's."""
        for name, kind, data in components:
            view = memoryview(bytes(data) if not isinstance(data, (bytes, bytearray)) else data)
            for at in range(0, max(len(view), 1), SEGMENT_CHUNK):
                self.frame({key: generation, "component": name, "kind": kind, "offset": at,
                            "data": bytes(view[at:at + SEGMENT_CHUNK])})
        self.frame({key: generation, **end})

    def _send_catch_up(self, generation: int, names: list[str], drop: list[str], kept: bool = False) -> None:
        """The components of the primary's runtime file at `generation` that the standby's copy
        lacks or holds other bytes of, read here (off the tick thread); the end frame names every
        one's SHA-256, which the copy must come out with, and, `kept`, says the standby's journal
        stays (a failover component adopted). A checkpoint that moved the file on meanwhile fails
        the link: the standby connects again and catches up to the newer one."""
        with RuntimeFile.open(self.shipper.runtime, verify=False) as current:
            if current.generation != generation:
                raise OSError(f"the runtime file went on to generation {current.generation} while a standby caught "
                              f"up to {generation}")
            digests = {name: current.components[name].sha256 for name in names}
            read = ((name, current.components[name].kind, current.read_verified(name)) for name in names)
            end: dict[str, Any] = {"components": digests, "drop": drop, **({"journal": "kept"} if kept else {})}
            try:  # (one component in memory at a time)
                self._send_components("catchup", generation, read, end)
            except RuntimeFileError as exc:
                raise OSError(str(exc)) from None

    # ---- the reader thread -------------------------------------------------------------------

    def _read(self) -> None:
        frames = FrameReader()
        try:
            while not self.closed:
                try:
                    batch = read_frames(self.sock, frames)
                except TimeoutError:  # (the socket's timeout is dead_after: the standby acknowledges every beat)
                    raise ConnectionError(f"no acknowledgement for {self.shipper.dead_after}s: the link is dead") \
                        from None
                for msg in batch:
                    segment, offset, cut = msg.get("segment"), msg.get("offset"), msg.get("cut")
                    if msg.get("ack") != 1 or type(segment) is not int or type(offset) is not int or type(cut) is not int:
                        raise ProtocolError(f"not an acknowledgement: {sorted(msg)}")
                    if msg.get("g") != self.shipper.leader:
                        raise ProtocolError(f"an acknowledgement of leadership generation {msg.get('g')}, "
                                            f"not this primary's {self.shipper.leader}")
                    if cut == self.shipper.cuts:  # (an acknowledgement of bytes from before a cut counts for nothing)
                        self.position = (segment, offset)
                        self.catching_up = False  # (it acknowledges only after the catch-up is in its copy)
                self.shipper.wake()
        except (OSError, ProtocolError) as exc:
            if not self.closed:
                log.warning("replication from %s: %s", self.peer, exc)
        finally:
            self.close()


class Shipper:
    """Ships the journal to one standby at a time (module docstring). `sync`: a transfer counts as
    saved only once the standby acknowledged it (the Committer asks `acked_seq`)."""

    def __init__(self, address: str, journal_dir: str, runtime: str, sync: bool = True,
                 alone_after: float | None = None, *, leadership: Any = None, dead_after: float = DEAD_SECONDS,
                 tls: Any = None) -> None:
        """`runtime`: the path of the primary's runtime file (a standby whose copy is at an older
        generation catches up from it). `leadership`: the etcd Leadership this primary holds (its
        generation goes on every frame; the sync key it keeps says which standby may take over);
        None without etcd (generation 0). `dead_after`: a link quiet this long is dead. `tls`: the
        ssl.SSLContext of a TCP link (tls.py)."""
        self.leadership = leadership
        self.leader = leadership.generation if leadership is not None else 0
        self.dead_after = dead_after
        self.tls = tls
        self.address = address
        self.runtime = runtime
        with RuntimeFile.open(runtime, verify=False) as current:
            self.incarnation = current.incarnation
        # a standby's copy follows this generation (the checkpoints' frames), or catches up to it:
        # read at `begin` (a takeover's boot made its own generation by then)
        self.generation = 0
        self.journal_dir = journal_dir
        self.sync = sync
        # sync only: seconds without a standby after which transfers are saved here alone (None:
        # never, the primary holds), until a standby has caught up again
        self.alone_after = alone_after
        # with etcd, saving alone is recorded first: the sync key is cleared (compare-and-swap on
        # this primary's leadership) by the timer's thread, which then sets this and wakes the loop
        self._alone_recorded = False
        # Saving alone is journaled too, before anything is saved alone (the receipts' save fields
        # say whether a standby held each transfer, after a replay as when they were given):
        # `alone_due` asks the Committer for a REPLICATION transfer, whose seq is `alone_marker`;
        # transfers are saved alone (`alone`) once it is durable here. Back in sync, `held_from` asks
        # for the one that says a standby holds them again.
        self.alone_due = False
        self.alone_marker: int | None = None
        self.held_from: int | None = None
        self._writer: JournalWriter | None = None
        self._lost_at = time.monotonic()  # since when no standby is streamed to
        self._timer: threading.Timer | None = None  # wakes the tick loop when alone_after passes
        self.takeovers: list[Position] = []  # where a rejoining standby may be cut back to (read at `begin`)
        self.listener = listen(address)
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # the tick loop's waker (`fileno`)
        self._lock = threading.Lock()
        self._arrived: Link | None = None  # said hello; the tick thread starts its stream (`woken`)
        self.link: Link | None = None      # the standby being streamed to (tick thread)
        self._ticks: deque[tuple[int, int, int]] = deque()  # (segment, end offset, last whole transfer) begun
        self.acked_seq = 0  # the last transfer the standby holds durable
        self.position: Position = (0, 0)  # the end of the journal bytes handed to the disk here
        self.last_seq = 0   # the last transfer whose bytes were handed to the disk here
        self.cuts = 0       # times the journal was cut back (a failed tick): acknowledgements name the last they saw
        self.links = 0      # standbys streamed to since boot
        self.losses = 0     # of them, how many left or were dropped
        self.catch_ups = 0  # standbys sent a catch-up from the runtime file since boot
        self._stopping = False
        self._accepting = threading.Thread(target=self._accept, name="aotx-replication-accept", daemon=True)

    def fileno(self) -> int:
        return self._wake

    @property
    def alone(self) -> bool:
        """A sync primary that saves alone now (--standby-timeout passed, and both etcd's sync key
        and the journal say so)."""
        return self.alone_marker is not None and self._writer is not None \
            and self._writer.durable_seq >= self.alone_marker

    @property
    def waits(self) -> bool:
        """Whether a transfer is saved only once the standby holds it: sync, and not alone."""
        return self.sync and not self.alone

    @property
    def stranded(self) -> bool:
        """It waits for a standby (`waits`) and none is streamed to (tick thread)."""
        return self.waits and (self.link is None or self.link.closed)

    def _lost(self) -> None:
        """No standby is streamed to from now (boot, or one left): arm the alone_after timer."""
        self._lost_at = time.monotonic()
        if self.sync and self.alone_after is not None and self.alone_marker is None:
            self._arm(self.alone_after)

    def _arm(self, seconds: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = threading.Timer(seconds, self._alone_due)
        self._timer.daemon = True
        self._timer.start()

    def _alone_due(self) -> None:
        """alone_after passed without a standby (the timer's thread): with etcd, the sync key is
        cleared first, so that no standby takes over by itself from now on (it may lack what is
        saved alone); only then may the tick thread save alone. A failed clear (etcd unreachable,
        the leadership lost) is tried again each second, the primary holding meanwhile."""
        leadership = self.leadership
        if leadership is not None:
            try:
                leadership.record_sync(None)
            except Exception as exc:  # (LeadershipError, or anything etcd answered)
                log.warning("replication: could not record in etcd that this primary saves alone (%s); it holds "
                            "until it can", exc)
                if not self._stopping:
                    self._arm(1.0)
                return
        self._alone_recorded = True
        self.wake()

    def _named(self, member: str) -> None:
        """The standby `member` is in sync: the sync key names it (a helper thread), so that it
        may take over by itself. Until then it may not; a failure is logged and tried again when
        it next catches up (the primary saves nothing alone while it is in sync)."""
        leadership = self.leadership
        if leadership is None:
            return

        def name() -> None:
            try:
                leadership.record_sync(member)
            except Exception as exc:
                log.warning("replication: could not name the standby %s in etcd's sync key: %s", member, exc)
        threading.Thread(target=name, name="aotx-sync-key", daemon=True).start()

    def wake(self) -> None:
        with self._lock:  # (close() takes the descriptor away under the lock: never a write to a reused number)
            if self._wake >= 0:
                os.eventfd_write(self._wake, 1)

    # ---- the tick thread ----------------------------------------------------------------------

    def begin(self, writer: JournalWriter) -> None:
        """Start shipping: what the journal holds now is the baseline a standby catches up to."""
        self.last_seq = writer.durable_seq
        self.position = (writer.segment, writer.offset)
        self._ticks.append((writer.segment, writer.offset, writer.durable_seq))
        self._writer = writer
        self.takeovers = marker.takeovers(self.journal_dir)  # (a takeover boot has recorded its own by now)
        with RuntimeFile.open(self.runtime, verify=False) as current:
            self.generation = current.generation
        self._accepting.start()
        self._lost()

    def ship(self, segment: int, offset: int, data: bytes, last_seq: int) -> None:
        """A tick's bytes, handed to the disk at `offset` of `segment` now; `last_seq` is the last
        transfer they complete (or the one before them)."""
        self.last_seq = last_seq
        self.position = (segment, offset + len(data))
        self._ticks.append((segment, offset + len(data), last_seq))
        if len(self._ticks) > MAX_TICKS_TRACKED:  # (no standby acknowledges: keep the newest)
            self._ticks.popleft()
        link = self.link
        if link is None or link.closed:
            return
        if offset == SEGMENT_HEADER_SIZE:  # a new segment's first tick: its header too (the same bytes)
            data, offset = encode_segment_header(segment, self.incarnation) + data, 0
        link.queued_bytes += len(data)
        if not self.waits and link.queued_bytes > MAX_QUEUED_BYTES:
            log.warning("replication: the standby at %s is %d bytes behind; dropped (it catches up from the files "
                        "when it connects again)", link.peer, link.queued_bytes)
            link.close()
            return
        link.queue.put((segment, offset, data))

    def cut(self, writer: JournalWriter) -> None:
        """A tick failed (ENOSPC) and the device rebuilt its state from what is durable here: the
        journal ends at the writer's position again, and the transfers after it will be others
        with the same numbers. The standby cuts its copy there too; what it acknowledged of the
        bytes after it counts for nothing (acknowledgements name the cut they follow)."""
        self.cuts += 1
        self.acked_seq = min(self.acked_seq, writer.durable_seq)
        self.last_seq = writer.durable_seq
        self.position = (writer.segment, writer.offset)
        self._ticks.clear()
        self._ticks.append((writer.segment, writer.offset, writer.durable_seq))
        link = self.link
        if link is not None and not link.closed:
            if link.position > (writer.segment, writer.offset):
                link.position = (writer.segment, writer.offset)
            link.queue.put(("frame", {"cut": self.cuts, "segment": writer.segment, "offset": writer.offset}))

    def media(self, sha: str, path: str) -> None:
        """A media source's bytes, written at `path`, about to get an owner in the journal: the
        standby gets them first (in stream order, before the tick that holds the MEDIA transfer)."""
        link = self.link
        if link is not None and not link.closed:
            link.queue.put(("media", sha, path))

    def checkpoint(self, generation: int, components: list[tuple[str, str, Any]], drop: list[str],
                   through_segment: int) -> None:
        """A checkpoint made the runtime file generation `generation` with these components, folding
        the journal segments through `through_segment` (it was made beside the ticks: later
        segments may exist already): the standby's copy gets the same, in stream order."""
        self.generation = generation
        link = self.link
        if link is not None and not link.closed:
            link.queue.put(("checkpoint", generation, components, drop, through_segment))

    def woken(self, writer: JournalWriter) -> bool:
        """The eventfd was readable: start a standby that said hello, forget one that left, and take
        acknowledgements. True when `acked_seq` moved."""
        try:
            os.eventfd_read(self._wake)
        except BlockingIOError:
            pass
        with self._lock:
            arrived, self._arrived = self._arrived, None
        if self.link is not None and self.link.closed:
            log.warning("replication: the standby at %s left (acknowledged through transfer %d of %d)",
                        self.link.peer, self.acked_seq, self.last_seq)
            self.link = None
            self.losses += 1
            self._lost()
        if arrived is not None:
            self._start(arrived, writer)
        link = self.link
        if link is None:
            if (self.sync and not self.alone_due and self.alone_marker is None and self.alone_after is not None
                    and self._alone_recorded and time.monotonic() - self._lost_at >= self.alone_after):
                self.alone_due = True  # (the Committer journals it: `alone_marker`)
                log.warning("replication: no standby for %.1fs: transfers are saved here alone until one has "
                            "caught up (--standby-timeout)", self.alone_after)
            return False
        if not link.in_sync:
            if link.position < link.sync_at:
                return False  # catching up: its acknowledgements save nothing yet (docs/replication.md, "In sync")
            link.in_sync = True
            log.info("replication: the standby at %s (%s) is in sync at %s", link.peer, link.member, link.position)
            self._named(link.member)
        acked, ticks = self.acked_seq, self._ticks
        while ticks and (ticks[0][0], ticks[0][1]) <= link.position:
            acked = max(acked, ticks.popleft()[2])
        moved, self.acked_seq = acked > self.acked_seq, acked
        if (self.alone_due or self.alone_marker is not None) and acked >= self.last_seq:
            self.alone_due = self._alone_recorded = False
            self.alone_marker = None
            self.held_from = writer.durable_seq + 1  # (those before were saved alone; the Committer journals it)
            log.info("replication: the standby at %s has caught up: transfers wait for it again", link.peer)
        return moved

    def _start(self, link: Link, writer: JournalWriter) -> None:
        """Stream to a standby that said hello: what it lacks from the files up to what is durable
        here, then the ticks on the disk now, then every tick as it starts. One standby at a time:
        another one waits (refused, to connect again: it takes the place when this one is gone,
        as a third machine's standby does). The same standby saying hello while its link is up
        replaces the link: it died unnoticed from this side (a silent partition), and the standby
        is not refused for its own dead link."""
        if self.link is not None and not self.link.closed:
            if link.member != self.link.member:
                link.refuse(f"a standby ({self.link.peer}) is connected: wait for its place", again=True)
                return
            log.warning("replication: the standby %s said hello again (%s) while its link (%s) is up: the new link "
                        "replaces it", link.member, link.peer, self.link.peer)
            self.link.close()
            self.link = None
            self.losses += 1
        durable = (writer.segment, writer.offset)
        begun = writer.ticks_begun()
        written = (writer.segment, begun[-1][0] + len(begun[-1][1])) if begun else durable
        if link.check is not None:
            why = self._not_handed(link.check, writer.segment, begun)
            if why is not None:
                if not self._rewind(link, (link.check[0], link.check[1])):
                    link.refuse(f"{why}: the standby's journal is not a copy of this journal")
                return
        if link.generation > self.generation:
            link.refuse(f"the standby's runtime file is at generation {link.generation}, past this primary's "
                        f"{self.generation} (it checkpointed what this primary may never have held): start it from a "
                        "copy of this primary's runtime file and an empty journal")
            return
        start = link.position  # where the journal bytes it is sent begin
        if link.adopt is not None and link.adopt[0] == self.generation and not link.emptied:
            link.queue.put(("adopt", *link.adopt))  # its journal checked as a copy of this one: it stays
            log.info("replication: the standby at %s adopts this primary's failover generation %d (%d components)",
                     link.peer, self.generation, len(link.adopt[1]))
        elif link.generation < self.generation or link.emptied:  # (a checkpoint may have come after its hello)
            if not self._catch_up(link):
                return
            # its journal copy begins again at this journal's oldest segment; it holds nothing
            # (acknowledges nothing) until the catch-up is durable there
            start, link.position = (min(list_segments(self.journal_dir, OsFileLayer()), default=1), 0), (0, 0)
        elif link.position > written:
            if not self._rewind(link, link.position):
                link.refuse(f"the standby holds journal bytes to {link.position}, past this primary's {written}: "
                            "it is not a copy of this journal")
            return
        # in sync once it holds what was handed to the disk here now (saved, or waiting for a standby)
        link.sync_at = written
        link.queue.put(("frame", {"replication": "sync" if self.sync else "async", "cut": self.cuts,
                                  "takeovers": [list(p) for p in self.takeovers], "sync_at": list(written)}))
        media = os.path.join(self.journal_dir, "media")
        for sha in sorted(set(os.listdir(media)) - link.media if os.path.isdir(media) else ()):
            if len(sha) == 64:  # (not a file being written: `<sha>.tmp.*`)
                link.queue.put(("media", sha, os.path.join(media, sha)))
        if start < durable:
            link.queue.put(("files", (start[0] or 1, start[1]), durable))
        for offset, data in begun:  # (bytes the standby already holds are written again: the same bytes)
            link.queue.put((writer.segment, offset, data))
        self.link = link
        self.links += 1
        link.start()
        log.info("replication: streaming to the standby at %s from %s", link.peer, link.position)

    def _catch_up(self, link: Link) -> bool:
        """A standby whose copy of the runtime file is at an older generation (or whose journal
        ends too far before this one's oldest segment to go on there: `emptied`): it gets the
        components of this generation its copy lacks or holds other bytes of (read and sent by its
        sender thread), drops those this file no longer has, and empties its journal; the stream
        goes on from this journal's oldest segment, as for a new standby with a copy of the file
        as it is now (docs/replication.md, "Catch-up"). False (refused) when the copy holds another
        model or profile: a catch-up replaces saved state (`SAVED_STATE`), never what the standby's
        device was built from."""
        _, names, drop = self._differences(link)
        other = [n for n in names + drop if not n.startswith(SAVED_STATE)]
        if other or (link.generation == self.generation and names + drop):
            link.refuse(f"the standby's runtime file holds another model or profile, or other state at the same "
                        f"generation (components {(other or names + drop)[:3]} differ): start it from a copy of this "
                        "primary's runtime file")
            return False
        link.queue.put(("catchup", self.generation, names, drop))
        link.catching_up = True
        self.catch_ups += 1
        log.info("replication: the standby at %s is at generation %d: it catches up to %d (%d components)",
                 link.peer, link.generation, self.generation, len(names))
        return True

    def state(self) -> dict[str, Any]:
        """What `ping` reports (tick thread)."""
        link = self.link if self.link is not None and not self.link.closed else None
        return {"role": "primary", "replication": "sync" if self.sync else "async", "alone": self.alone,
                "address": self.address,
                "standby": link.peer if link is not None else None,
                "acked_position": list(link.position) if link is not None else None,
                "acked_seq": self.acked_seq, "last_seq": self.last_seq,
                "lag_transfers": self.last_seq - self.acked_seq,
                "lag_bytes": self._bytes_between(link.position, self.position) if link is not None else None,
                "queued_bytes": link.queued_bytes if link is not None else 0,
                "catching_up": link is not None and link.catching_up, "catch_ups": self.catch_ups,
                "in_sync": link is not None and link.in_sync, "sync_at": list(link.sync_at) if link else None,
                "member": link.member if link is not None else None, "leader": self.leader,
                "standbys": self.links, "standby_losses": self.losses}

    def _bytes_between(self, start: Position, end: Position) -> int:
        """Journal bytes from `start` to `end` (segments between: their sizes on the disk)."""
        if start >= end:
            return 0
        if start[0] == end[0]:
            return end[1] - start[1]
        total = end[1]
        for segment in range(start[0], end[0]):
            try:
                size = os.path.getsize(os.path.join(self.journal_dir, segment_name(segment)))
            except OSError:
                size = 0
            total += max(0, size - (start[1] if segment == start[0] else 0))
        return total

    def close(self) -> None:
        self._stopping = True
        if self._timer is not None:
            self._timer.cancel()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        except OSError:
            pass
        self.listener.close()
        if self._accepting.is_alive():
            self._accepting.join(10)
        for link in (self.link, self._arrived):
            if link is not None:
                link.close()
                for thread in link.threads:
                    if thread.is_alive():
                        thread.join(10)
        with self._lock:
            fd, self._wake = self._wake, -1
        os.close(fd)

    # ---- the accept thread --------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stopping:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            try:
                sock = accepted(sock, self.tls, self.dead_after)
                link = self._hello(sock)
            except (OSError, ProtocolError, ValueError) as exc:
                log.warning("replication: a standby's hello failed: %s", exc)
                sock.close()
                continue
            if link is None:
                continue
            with self._lock:
                previous, self._arrived = self._arrived, link
            if previous is not None:
                previous.refuse("another standby said hello meanwhile", again=True)
            self.wake()

    def _hello(self, sock: socket.socket) -> Link | None:
        sock.settimeout(HELLO_SECONDS)
        msg = read_frames(sock, FrameReader())[0]
        segment, offset, incarnation = msg.get("segment"), msg.get("offset"), msg.get("incarnation")
        digest = msg.get("digest")
        if (msg.get("hello") != 1 or type(segment) is not int or type(offset) is not int or segment < 0
                or offset < 0 or type(digest) is not bytes):
            raise ProtocolError(f"not a hello: {sorted(msg)}")
        member, leader = msg.get("member", ""), msg.get("leader", 0)
        if type(member) is not str or type(leader) is not int:
            raise ProtocolError("a hello with a malformed member or leader")
        sock.settimeout(self.dead_after)  # (both threads: a quiet link is dead; the sender beats before)
        link = Link(self, sock, (segment, offset))
        link.member = member
        fenced = self.leadership.fenced() if self.leadership is not None else None
        if fenced is not None:
            link.refuse(f"this primary is fenced ({fenced}): follow the new primary", again=True)
            return None
        current = self.link  # (the tick thread's: read here only to spare a waiting standby's checks)
        if current is not None and not current.closed and current.member != member:
            link.refuse(f"a standby ({current.peer}) is connected: wait for its place", again=True)
            return None
        if leader > self.leader:
            link.refuse(f"the standby followed leadership generation {leader}, newer than this primary's "
                        f"{self.leader}: this primary is not the leader", again=True)
            return None
        link.media = {str(m) for m in msg.get("media") or ()}
        if incarnation != self.incarnation:
            link.refuse(f"the standby's runtime file is incarnation {bytes(incarnation or b'').hex()}, "
                        f"this primary's {self.incarnation.hex()}")
            return None
        generation, components = msg.get("generation"), msg.get("components") or {}
        if (type(generation) is not int or not isinstance(components, dict)
                or not all(type(k) is str and type(v) is str for k, v in components.items())):
            raise ProtocolError("a hello without its runtime file copy's generation and components")
        link.generation, link.components = generation, components
        if generation != self.generation:
            link.adopt = self._adopt(link)
            if link.adopt is None:
                return link  # it catches up from this primary's file, or is refused (`_start`, on the tick thread)
        oldest = min(list_segments(self.journal_dir, OsFileLayer()), default=1)
        if segment < oldest:
            # its copy is at this generation: it holds, folded or in its journal, everything before
            # this primary's oldest segment (the last checkpoint began it): it goes on from there
            # (a journal that ends before the segment just before it cannot continue there: it is
            # emptied, as for a catch-up)
            link.position = (oldest, 0)
            link.emptied = bool(segment) and segment < oldest - 1
            return link
        why = self._not_a_copy(link, segment, offset, digest)
        if why is not None:
            if not self._rewind(link, (segment, offset)):
                link.refuse(f"{why}: the standby's journal is not a copy of this journal")
            return None
        if segment and not os.path.exists(os.path.join(self.journal_dir, segment_name(segment))):
            newest = max(list_segments(self.journal_dir, OsFileLayer()), default=0)  # (segment >= oldest)
            if not self._rewind(link, (segment, offset)):
                link.refuse(f"the standby holds segment {segment}, past this primary's last ({newest}): "
                            "the standby's journal is not a copy of this journal")
            return None
        return link

    def _adopt(self, link: Link) -> tuple[int, list[str], list[str]] | None:
        """(generation, components to send, to drop) when the standby's copy of the runtime file is
        behind this one's by failover components only (FAILOVER: an old primary rejoining the
        standby that took over from it, which made a generation that folds nothing): its journal
        is then checked, and cut back, as a copy of this one at the same generation, and it adopts
        the components with its journal kept (docs/replication.md, "Failover generations"). None:
        any other difference (a catch-up, or a refusal). Read on the accept thread."""
        generation, names, drop = self._differences(link)
        if link.generation >= generation or not names + drop or any(n != FAILOVER for n in names + drop):
            return None
        return generation, names, drop

    def _differences(self, link: Link) -> tuple[int, list[str], list[str]]:
        """(this runtime file's generation, the components the standby's copy lacks or holds other
        bytes of, those it holds that this file has not), from its hello's digests and this file's
        directory (a small read)."""
        with RuntimeFile.open(self.runtime, verify=False) as current:
            names = sorted(n for n, c in current.components.items() if link.components.get(n) != c.sha256)
            return current.generation, names, sorted(set(link.components) - set(current.components))

    def _rewind(self, link: Link, position: Position) -> bool:
        """A standby whose journal goes on past one of this journal's takeover points in other
        bytes: it is told to cut back to the latest point before its position (then it says hello
        again, and is checked again). False when there is none."""
        points = [p for p in self.takeovers if p < position]
        if not points:
            return False
        try:
            link.sock.sendall(encode_frame({"rewind": list(points[-1])}))
        except OSError:
            pass
        link.close()
        return True

    def _not_a_copy(self, link: Link, segment: int, offset: int, digest: bytes) -> str | None:
        """Why the standby's last segment, `offset` bytes hashing to `digest`, is not the start of
        this journal's segment (None: it is, or may be). Read here, on the accept thread: a
        segment's size. The bytes handed to the disk count, not only those in the file: a tick
        being written here on a slow disk may already be acknowledged by the standby (its copy is
        written first), and must not be cut back from it. When the file is shorter than `offset`,
        the rest is checked on the tick thread against the ticks in flight (`link.check`)."""
        if not segment:
            return None
        h = hashlib.sha256()
        try:
            with open(os.path.join(self.journal_dir, segment_name(segment)), "rb") as f:
                have = 0
                while have < offset and (chunk := f.read(min(SEGMENT_CHUNK, offset - have))):
                    h.update(chunk)
                    have += len(chunk)
        except FileNotFoundError:
            return None  # (refused next: the segment is gone)
        if have < offset:
            link.check = (segment, offset, digest, have, h)  # the rest may be in flight (`_not_handed`)
            return None
        if h.digest() != digest:
            return f"segment {segment}'s first {offset} bytes differ"
        return None

    def _not_handed(self, check: tuple[int, int, bytes, int, Any], current: int,
                    begun: list[tuple[int, bytes]]) -> str | None:
        """The end of `_not_a_copy`, on the tick thread: the bytes from what the accept thread
        read of the file to the standby's offset, from the file now and the ticks in flight."""
        segment, offset, digest, have, h = check
        path = os.path.join(self.journal_dir, segment_name(segment))
        with open(path, "rb") as f:
            f.seek(have)
            data = f.read(offset - have)  # (a tick in flight then may be whole in the file now)
        have += len(data)
        h.update(data)
        if have < offset and segment == current:
            for at, tick in begun:
                if at <= have < at + len(tick):
                    piece = tick[have - at:offset - at]
                    h.update(piece)
                    have += len(piece)
        if have < offset:
            return f"the standby holds {offset} bytes of segment {segment}, this primary handed {have} to its disk"
        if h.digest() != digest:
            return f"segment {segment}'s first {offset} bytes differ"
        return None
