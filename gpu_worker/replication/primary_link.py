"""One standby's link on the primary's side (gpu_worker/replication/__init__.py, docs/replication.md).

The Shipper (primary.py) makes a `Link` for each standby that says hello. Its sender thread writes
what the tick thread queued for it, in order — the journal bytes the standby lacks from the segment
files, then each tick as it starts on the primary's disk, frames, a checkpoint's or a catch-up's
runtime file components, media sources — and beats when nothing else was sent for a while; its
reader thread takes the standby's acknowledgements (`position`, what it holds durable).
"""
from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from typing import TYPE_CHECKING, Iterable, Literal, Protocol, Union

import msgspec

from gpu_worker.contract.wire import FrameReader, ProtocolError, encode_frame
from gpu_worker.storage.journal import segment_name
from gpu_worker.storage.runtime_file import RuntimeFile, RuntimeFileError

from . import SEGMENT_CHUNK, read_frames
from .frames import Beat, Bytes, CatchUpEnd, CheckpointEnd, Frame, MediaPiece, Piece, Refused, ack

if TYPE_CHECKING:
    from hashlib import _Hash as Hash

    from gpu_worker.storage.runtime_file_writer import Stored

    from .lease import Leadership

    # what the tick thread queues for a link's sender thread, in stream order: journal bytes from the
    # segment files (from, to), a frame, a checkpoint's components (generation, components, names
    # to drop, the last segment folded), a catch-up's or an adoption's (generation, names, drop), a
    # media source (sha256, path), a tick's journal bytes (segment, offset, bytes)
    Queued = Union[tuple[Literal["files"], "Position", "Position"], tuple[Literal["frame"], Frame],
                   tuple[Literal["checkpoint"], int, list[Stored], list[str], int],
                   tuple[Literal["catchup", "adopt"], int, list[str], list[str]],
                   tuple[Literal["media"], str, str], tuple[int, int, bytes]]

log = logging.getLogger("gpu_worker.replication")

Position = tuple[int, int]  # (segment, offset): journal bytes before it


class Shipping(Protocol):
    """What a link sees of the Shipper that made it (primary.py)."""

    @property
    def leader(self) -> int: ...  # the leadership generation every frame carries

    @property
    def leadership(self) -> Leadership | None: ...  # the etcd Leadership (its fence), None without etcd

    @property
    def dead_after(self) -> float: ...

    @property
    def journal_dir(self) -> str: ...

    @property
    def runtime(self) -> str: ...  # the runtime file's path

    @property
    def cuts(self) -> int: ...

    def wake(self) -> None: ...


class Link:
    """One standby's connection: its sender thread writes what the tick thread queued for it, in
    order; its reader thread takes its acknowledgements (`position`, what it holds durable)."""

    def __init__(self, shipper: Shipping, sock: socket.socket, position: Position) -> None:
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
        self.check: tuple[int, int, bytes, int, Hash] | None = None
        self.media: set[str] = set()  # the media sources the standby holds (its hello says)
        self.generation = 0  # its runtime file copy's, and that copy's components' SHA-256 (its hello says)
        self.components: dict[str, str] = {}
        self.emptied = False  # its journal must begin again at this journal's oldest segment (a catch-up)
        # its copy lacks only this primary's failover component (an old primary rejoining): it adopts
        # them with its journal kept, as (generation, names, drop) the hello found (`copies.adopt`)
        self.adopt: tuple[int, list[str], list[str]] | None = None
        self.catching_up = False  # sent a catch-up that it has not acknowledged yet (`ping` shows it)
        self.queue: queue.SimpleQueue[Queued | None] = queue.SimpleQueue()
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
            self.sock.sendall(encode_frame(Refused(refused=why, again=again)))
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

    def frame(self, msg: Frame) -> None:
        """Send one frame, with the primary's leadership generation (the sender thread)."""
        self.sock.sendall(encode_frame(msgspec.structs.replace(msg, g=self.shipper.leader)))

    def _send(self) -> None:
        beat = self.shipper.dead_after / 3
        leadership = self.shipper.leadership
        try:
            while True:
                try:
                    item = self.queue.get(timeout=beat)
                except queue.Empty:  # nothing to send for a while: a heartbeat (the standby acknowledges it)
                    item = ("frame", Beat(beat=1))
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
                    _, generation, components, drop, through = item
                    self._send_components(generation, components, CheckpointEnd(
                        checkpoint=generation, components=[c[0] for c in components], drop=list(drop), through=through))
                elif item[0] == "catchup":
                    self._send_catch_up(*item[1:])
                elif item[0] == "adopt":
                    self._send_catch_up(item[1], item[2], item[3], kept=True)
                elif item[0] == "media":
                    self._send_media(item[1], item[2])
                else:
                    segment, offset, data = item
                    self.frame(Bytes(segment=segment, offset=offset, data=data))
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
                    self.frame(Bytes(segment=segment, offset=offset, data=data))
                    offset += len(data)
            finally:
                os.close(fd)

    def _send_media(self, sha: str, path: str) -> None:
        """A media source's bytes in pieces (MediaPiece)."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            offset = 0
            while True:
                data = f.read(SEGMENT_CHUNK)
                self.frame(MediaPiece(media=sha, size=size, offset=offset, data=data))
                offset += len(data)
                if offset >= size or not data:
                    return

    def _send_components(self, generation: int, components: Iterable[Stored],
                         end: CheckpointEnd | CatchUpEnd) -> None:
        """Runtime file components in pieces (Piece: of the checkpoint or the catch-up to
        `generation`), then the frame `end` that has the standby append them: a checkpoint's, or a
        catch-up's."""
        checkpoint, catchup = (None, generation) if isinstance(end, CatchUpEnd) else (generation, None)
        for name, kind, data in components:
            view = memoryview(bytes(data) if not isinstance(data, (bytes, bytearray)) else data)
            for at in range(0, max(len(view), 1), SEGMENT_CHUNK):
                self.frame(Piece(checkpoint=checkpoint, catchup=catchup, component=name, kind=kind, offset=at,
                                 data=bytes(view[at:at + SEGMENT_CHUNK])))
        self.frame(end)

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
            end = CatchUpEnd(catchup=generation, components=digests, drop=drop, journal="kept" if kept else None)
            try:  # (one component in memory at a time)
                self._send_components(generation, read, end)
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
                    acked = ack(msg)
                    segment, offset, cut = acked.segment, acked.offset, acked.cut
                    if acked.g != self.shipper.leader:
                        raise ProtocolError(f"an acknowledgement of leadership generation {acked.g}, "
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
