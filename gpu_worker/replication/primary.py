"""The primary's side of journal shipping (gpu_worker/replication/__init__.py, docs/replication.md).

The tick thread calls `ship` as each tick starts on the disk (Committer._start_io) and `woken`
when the Shipper's eventfd is readable (an acknowledgement came, a standby said hello or left);
everything else runs on the Shipper's own threads, so nothing proportional to the journal's size
runs on the tick thread: the accept thread takes a standby's hello (whether its copies go on
from this primary's: copies.py), and each standby's `Link` (primary_link.py) has a sender thread
that writes what it lacks from the segment files, then the ticks queued for it, while its reader
thread takes its acknowledgements. `acked_seq`, the last transfer the standby holds durable, is
what sync replication waits for.
"""
from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from gpu_worker.contract.wire import FrameReader, ProtocolError
from gpu_worker.storage.filelayer import OsFileLayer
from gpu_worker.storage.journal import SEGMENT_HEADER_SIZE, encode_segment_header, list_segments, segment_name
from gpu_worker.storage.journal_writer import JournalWriter
from gpu_worker.storage.runtime_file import AUDIT, RuntimeFile

from . import DEAD_SECONDS, FAILOVER, HELLO_SECONDS, accepted, listen, marker, read_frames
from .copies import adopt, differences, not_a_copy, not_handed, rewind
from .frames import Cut, Replication, hello
from .primary_link import Link, Position

if TYPE_CHECKING:
    from gpu_worker.storage.runtime_file_writer import Stored

    from .lease import Leadership

log = logging.getLogger("gpu_worker.replication")

MAX_TICKS_TRACKED = 1 << 16   # tick ends kept to map an acknowledged position to a transfer
MAX_QUEUED_BYTES = 64 << 20   # an async standby further behind than this is dropped (it catches up again)
# the runtime file components checkpoints (storage/checkpoint.py, kinds/media.py) and takeovers
# (FAILOVER) write: the saved state a catch-up may replace; any other (the model, the profiles)
# must be the same on a standby
SAVED_STATE = ("state/", AUDIT, "media/", FAILOVER)


class Shipper:
    """Ships the journal to one standby at a time (module docstring). `sync`: a transfer counts as
    saved only once the standby acknowledged it (the Committer asks `acked_seq`)."""

    def __init__(self, address: str, journal_dir: str, runtime: str, sync: bool = True,
                 alone_after: float | None = None, *, leadership: Leadership | None = None,
                 dead_after: float = DEAD_SECONDS,
                 tls: ssl.SSLContext | None = None) -> None:
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
            link.queue.put(("frame", Cut(cut=self.cuts, segment=writer.segment, offset=writer.offset)))

    def media(self, sha: str, path: str) -> None:
        """A media source's bytes, written at `path`, about to get an owner in the journal: the
        standby gets them first (in stream order, before the tick that holds the MEDIA transfer)."""
        link = self.link
        if link is not None and not link.closed:
            link.queue.put(("media", sha, path))

    def checkpoint(self, generation: int, components: list[Stored], drop: list[str],
                   through_segment: int) -> bool:
        """A checkpoint made the runtime file generation `generation` with these components, folding
        the journal segments through `through_segment` (it was made beside the ticks: later
        segments may exist already): the standby's copy gets the same, in stream order. Whether a
        link took them (it holds them until they are sent)."""
        self.generation = generation
        link = self.link
        if link is not None and not link.closed:
            link.queue.put(("checkpoint", generation, components, drop, through_segment))
            return True
        return False

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
            why = not_handed(self.journal_dir, link.check, writer.segment, begun)
            if why is not None:
                if not rewind(self.takeovers, link, (link.check[0], link.check[1])):
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
            if not rewind(self.takeovers, link, link.position):
                link.refuse(f"the standby holds journal bytes to {link.position}, past this primary's {written}: "
                            "it is not a copy of this journal")
            return
        # in sync once it holds what was handed to the disk here now (saved, or waiting for a standby)
        link.sync_at = written
        link.queue.put(("frame", Replication(replication="sync" if self.sync else "async", cut=self.cuts,
                                             takeovers=list(self.takeovers), sync_at=written)))
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
        _, names, drop = differences(self.runtime, link)
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

    def state(self) -> dict[str, object]:
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
        said = hello(read_frames(sock, FrameReader())[0])
        segment, offset, incarnation, digest = said.segment, said.offset, said.incarnation, said.digest
        member, leader = said.member, said.leader
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
        link.media = set(said.media or ())
        if incarnation != self.incarnation:
            link.refuse(f"the standby's runtime file is incarnation {bytes(incarnation or b'').hex()}, "
                        f"this primary's {self.incarnation.hex()}")
            return None
        generation, components = said.generation, said.components or {}
        if generation is None:
            raise ProtocolError("a hello without its runtime file copy's generation and components")
        link.generation, link.components = generation, components
        if generation != self.generation:
            link.adopt = adopt(self.runtime, link)
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
        why = not_a_copy(self.journal_dir, link, segment, offset, digest)
        if why is not None:
            if not rewind(self.takeovers, link, (segment, offset)):
                link.refuse(f"{why}: the standby's journal is not a copy of this journal")
            return None
        if segment and not os.path.exists(os.path.join(self.journal_dir, segment_name(segment))):
            newest = max(list_segments(self.journal_dir, OsFileLayer()), default=0)  # (segment >= oldest)
            if not rewind(self.takeovers, link, (segment, offset)):
                link.refuse(f"the standby holds segment {segment}, past this primary's last ({newest}): "
                            "the standby's journal is not a copy of this journal")
            return None
        return link
