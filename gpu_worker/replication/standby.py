"""The standby's side of journal shipping (gpu_worker/replication/__init__.py, docs/replication.md).

`Standby` keeps a link to the primary: it says hello with the position its journal copy (mirror.py's
`Mirror`) holds, writes what comes, acknowledges each durable position, and connects again (bounded
back-off) when the link breaks; a checkpoint of the primary comes down the link too, and goes into
the standby's copy of the runtime file, and so does a catch-up. A hot standby's `Follower`
(follower.py) hears of each durable position and each cut; the marker beside the journal copy
(DIR/standby) is marker.py's.
"""
from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
from typing import TYPE_CHECKING

from gpu_worker.contract.wire import FrameReader, ProtocolError, encode_frame
from gpu_worker.storage import runtime_file_writer
from gpu_worker.storage.journal import SEGMENT_HEADER_SIZE
from gpu_worker.storage.runtime_file import AUDIT, RuntimeFile

from . import DEAD_SECONDS, connect, read_frames
from .frames import (Ack, Beat, CatchUpEnd, CheckpointEnd, Cut, Hello, MediaPiece, Piece, Refused, Replication,
                     Rewind, from_primary)
from .marker import leader_of, member_of, takeovers

if TYPE_CHECKING:
    from gpu_worker.storage.runtime_file_writer import Part

    from .follower import Follower
    from .mirror import Mirror

log = logging.getLogger("gpu_worker.replication")

# seconds between connection attempts: doubling, at most this (a standby waiting for its place, or
# for a new primary after a failover, finds it within RETRY_MOST: the new primary holds until then)
RETRY_FIRST, RETRY_MOST = 0.1, 0.5
CONNECT_SECONDS = 0.5  # a machine that does not answer in this long is not the primary now: the next is tried


class Rewound(Exception):
    """The journal was cut back to a takeover point: say hello again from there."""


class StandbyRefused(Exception):
    """The primary will not stream to this standby (another runtime file, a journal that is not a
    copy of its own, a segment it no longer has): connecting again would not help."""


class Stale(Exception):
    """The primary at the address leads an older leadership generation than one this copy already
    followed (a fenced or partitioned old primary): it is not followed; connect again later."""


class Standby:
    """Follows a primary (module docstring) until `stop`."""

    def __init__(self, address: str, mirror: Mirror, runtime: str, follower: Follower | None = None,
                 dead_after: float = DEAD_SECONDS, tls: ssl.SSLContext | None = None) -> None:
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
        self.member = member_of(mirror.directory, mirror.fs)  # this copy's identity (the sync key names it)
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
            sock.sendall(encode_frame(Hello(hello=1, incarnation=self.incarnation, generation=generation,
                                            components=components, segment=segment, offset=offset,
                                            digest=self.mirror.digest(), media=self.mirror.media_held(),
                                            member=self.member, leader=self.leader)))
            # the primary beats every third of dead_after: a link quiet for longer is dead (a silent
            # partition), and so is one whose sends block that long; stop() shuts the socket down
            sock.settimeout(self.dead_after)
            frames = FrameReader()
            # the primary's last cut this link saw: its "replication" frame says, and nothing is
            # acknowledged before it (a catch-up comes first: the position held until then is not
            # of the primary's journal)
            cut: int | None = None
            link: Replication | None = None  # the replication frame: its mode, leader and sync point
            log.info("standby: following %s from %s", self.address, (segment, offset))
            while True:
                try:
                    batch = read_frames(sock, frames)
                except TimeoutError:
                    raise ConnectionError(f"no frame from the primary for {self.dead_after}s: the link is dead") \
                        from None
                self.connected.set()
                for msg in batch:
                    frame = from_primary(msg)
                    if isinstance(frame, Refused):
                        if frame.again:
                            raise ConnectionError(f"the primary at {self.address} asks to connect again: "
                                                  f"{frame.refused}")
                        raise StandbyRefused(f"the primary at {self.address} refused: {frame.refused}")
                    if link is not None and frame.g != link.leader:
                        raise ProtocolError(f"a frame of leadership generation {frame.g} on a link of "
                                            f"{link.leader}")
                    if isinstance(frame, Beat):
                        continue  # (the acknowledgement below answers it)
                    if isinstance(frame, Rewind):  # this journal went on past a takeover point in other bytes
                        at, end = frame.rewind
                        # not in sync until the primary's stream covers what it had saved again
                        self.mirror.mark("catching-up", self.address, takeovers(self.mirror.directory))
                        self.mirror.rewind(at, end)
                        if self.follower is not None:
                            self.follower.cut((at, end))
                        raise Rewound(f"cut back to the primary's takeover point {(at, end)}")
                    if isinstance(frame, Replication):
                        link = self._linked(frame)
                        cut = frame.cut
                        continue
                    if isinstance(frame, Piece):
                        self._piece(frame)
                        continue
                    if isinstance(frame, CheckpointEnd):
                        self._checkpoint(frame)
                        continue
                    if isinstance(frame, CatchUpEnd):
                        self._catch_up(frame)
                        continue
                    if isinstance(frame, MediaPiece):
                        self.mirror.media_piece(frame)
                        continue
                    if isinstance(frame, Cut):  # the primary's journal was cut back (a failed tick): so is this copy
                        self.mirror.cut(frame.segment, frame.offset)
                        if self.follower is not None:
                            self.follower.cut((frame.segment, frame.offset))
                        cut = frame.cut
                        continue
                    at, start, data = frame.segment, frame.offset, frame.data
                    if start == 0 and len(data) < SEGMENT_HEADER_SIZE:
                        raise ProtocolError(f"segment {at} begins without its whole header")
                    self.mirror.write(at, start, data)
                segment, offset = self.mirror.sync()
                if cut is None:
                    continue
                assert link is not None  # (cut is the replication frame's)
                if link.replication == "sync" and not self.in_sync.is_set() and (segment, offset) >= link.sync_at:
                    # durable past what the primary had saved when this link began: it holds every
                    # saved transfer from now on, and may take over (docs/replication.md, "In sync")
                    self.mirror.mark("sync", self.address, link.takeovers)
                    self.in_sync.set()
                    log.info("standby: in sync with %s at %s", self.address, (segment, offset))
                sock.sendall(encode_frame(Ack(ack=1, segment=segment, offset=offset, cut=cut, g=link.leader)))
                self.acks += 1
                if self.follower is not None:
                    self.follower.durable((segment, offset))
        finally:
            self._sock = None
            sock.close()

    def _linked(self, frame: Replication) -> Replication:
        """The primary's first frame after the hello (after a catch-up's frames): its replication
        mode, leadership generation, takeover points and sync point. An older leadership than this
        copy followed is Stale; a sync link marks the journal "catching-up" until its durable
        position passes the sync point (every transfer the primary had saved when it connected)."""
        mode, leader, sync_at = frame.replication, frame.leader, frame.sync_at
        if leader < self.leader:
            raise Stale(f"the primary at {self.address} leads generation {leader}, older than {self.leader} "
                        "which this standby followed: not followed")
        points = frame.takeovers
        self.leader = leader
        held = self.mirror.sync() >= sync_at  # (what a broken link left written is durable first)
        self.mirror.mark(mode if mode == "async" or held else "catching-up", self.address, points, leader)
        if mode == "sync" and held:
            self.in_sync.set()
        return frame

    def _piece(self, piece: Piece) -> None:
        """Keep a piece of a runtime file component (a checkpoint's or a catch-up's) with those
        before it."""
        name, at = piece.component, piece.offset
        held = self._pieces.setdefault(name, (piece.kind, bytearray()))
        if at != len(held[1]):
            raise ProtocolError(f"component {name} piece at {at}, after {len(held[1])} bytes")
        held[1].extend(piece.data)

    def _components(self, names: list[str] | dict[str, str], drop: list[str]
                    ) -> tuple[list[Part], list[str]]:
        """The components the pieces made and the names to drop, for `runtime_file_writer.append` (the
        end frame names both)."""
        if set(names) != set(self._pieces):
            raise ProtocolError(f"an end frame names other components than came: {sorted(names or ())}")
        pieces, self._pieces = self._pieces, {}
        return ([(n, kind, data if kind == "bytes" else data.decode() if kind == "text" else bytes(data))
                 for n in names for kind, data in [pieces[n]]],  # (a state's bytes: not copied once more)
                [str(n) for n in drop])

    def _catch_up(self, end: CatchUpEnd) -> None:
        """A catch-up's end (its pieces came before): this copy of the runtime file was at an older
        generation than the primary's, which sends the saved state it lacks. The journal marker
        says "catch-up" first (a takeover refuses this journal until the primary's stream
        continues: the copy is not whole in between), the journal copy is emptied, the components
        go into the copy at the primary's generation (every one's SHA-256 checked against the
        primary's), and a hot device builds its tables again from it. The stream then goes on from
        the primary's oldest segment (docs/replication.md, "Catch-up")."""
        generation, digests = end.catchup, end.components
        components, drop = self._components(digests, end.drop)
        if end.journal == "kept":
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

    def _adopt(self, generation: int, components: list[Part], drop: list[str],
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

    def _checkpoint(self, end: CheckpointEnd) -> None:
        """A checkpoint's end (its components' pieces came before): the copy of the runtime file gets the
        components the primary's got (its generation must come out the same), and the journal
        segments the checkpoint folded go (those the hot device has not read yet stay). A checkpoint
        that writes an `audit/` component again redacted it (a forgotten memory object's bytes:
        memory/forgetting.py): the copy's unreachable bytes are zeroed too, as the primary's were."""
        generation = end.checkpoint
        components, drop = self._components(end.components, end.drop)
        self.mirror.sync()  # (the journal before the checkpoint is durable before the copy says it is folded)
        with RuntimeFile.open(self.runtime, verify=False) as copy:
            redacted = any(name.startswith(AUDIT) and name in copy.components for name, _, _ in components)
        made = runtime_file_writer.append(self.runtime, components, drop=drop, wipe=redacted)
        if made != generation:
            raise StandbyRefused(f"the runtime file copy {self.runtime} went to generation {made}, the primary's to "
                                 f"{generation}: start the standby from a copy of the primary's runtime file")
        keep = self.mirror.segment
        if end.through is not None:  # (the segments after it hold what came after the fold point)
            keep = min(keep, end.through + 1)
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
