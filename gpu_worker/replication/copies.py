"""Whether what a standby holds goes on from what this primary holds (docs/replication.md, "Catch-up",
"Failover generations", "Rejoin"), asked by the Shipper (primary.py) of each standby that says hello:
its journal checked as a copy of this one's (`not_a_copy` on the accept thread, finished by
`not_handed` on the tick thread against the ticks in flight), its copy of the runtime file compared
by the components' digests (`differences`, `adopt`), and a standby whose journal went on past one of
this journal's takeover points told to cut back to it (`rewind`).
"""
from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING

from gpu_worker.contract.wire import encode_frame
from gpu_worker.storage.journal import segment_name
from gpu_worker.storage.runtime_file import RuntimeFile

from . import FAILOVER, SEGMENT_CHUNK
from .frames import Rewind
from .primary_link import Link, Position

if TYPE_CHECKING:
    from hashlib import _Hash as Hash


def adopt(runtime: str, link: Link) -> tuple[int, list[str], list[str]] | None:
    """(generation, components to send, to drop) when the standby's copy of the runtime file is
    behind this one's by failover components only (FAILOVER: an old primary rejoining the
    standby that took over from it, which made a generation that folds nothing): its journal
    is then checked, and cut back, as a copy of this one at the same generation, and it adopts
    the components with its journal kept (docs/replication.md, "Failover generations"). None:
    any other difference (a catch-up, or a refusal). Read on the accept thread."""
    generation, names, drop = differences(runtime, link)
    if link.generation >= generation or not names + drop or any(n != FAILOVER for n in names + drop):
        return None
    return generation, names, drop


def differences(runtime: str, link: Link) -> tuple[int, list[str], list[str]]:
    """(this runtime file's generation, the components the standby's copy lacks or holds other
    bytes of, those it holds that this file has not), from its hello's digests and this file's
    directory (a small read)."""
    with RuntimeFile.open(runtime, verify=False) as current:
        names = sorted(n for n, c in current.components.items() if link.components.get(n) != c.sha256)
        return current.generation, names, sorted(set(link.components) - set(current.components))


def rewind(takeovers: list[Position], link: Link, position: Position) -> bool:
    """A standby whose journal goes on past one of this journal's takeover points in other
    bytes: it is told to cut back to the latest point before its position (then it says hello
    again, and is checked again). False when there is none."""
    points = [p for p in takeovers if p < position]
    if not points:
        return False
    try:
        link.sock.sendall(encode_frame(Rewind(rewind=points[-1])))
    except OSError:
        pass
    link.close()
    return True


def not_a_copy(journal_dir: str, link: Link, segment: int, offset: int, digest: bytes) -> str | None:
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
        with open(os.path.join(journal_dir, segment_name(segment)), "rb") as f:
            have = 0
            while have < offset and (chunk := f.read(min(SEGMENT_CHUNK, offset - have))):
                h.update(chunk)
                have += len(chunk)
    except FileNotFoundError:
        return None  # (refused next: the segment is gone)
    if have < offset:
        link.check = (segment, offset, digest, have, h)  # the rest may be in flight (`not_handed`)
        return None
    if h.digest() != digest:
        return f"segment {segment}'s first {offset} bytes differ"
    return None


def not_handed(journal_dir: str, check: tuple[int, int, bytes, int, Hash], current: int,
               begun: list[tuple[int, bytes]]) -> str | None:
    """The end of `not_a_copy`, on the tick thread: the bytes from what the accept thread
    read of the file to the standby's offset, from the file now and the ticks in flight."""
    segment, offset, digest, have, h = check
    path = os.path.join(journal_dir, segment_name(segment))
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
