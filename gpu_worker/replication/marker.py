"""DIR/standby, the marker beside a standby's journal copy (docs/replication.md): the replication the
journal was kept under (`read_mark`: `boot --takeover` continues the primary's line of history only
from a journal kept in sync), this copy's standby identity (`member_of`), the newest leadership
generation it followed (`leader_of`), and the journal positions where a takeover began a new
primary's part of the journal (`takeovers`; a takeover boot records its own, `record_takeover`).
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

from gpu_worker.storage.filelayer import FileLayer, OsFileLayer

from . import MARKER

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


def member_of(directory: str, fs: FileLayer | None = None) -> str:
    """This journal copy's standby identity (DIR/standby "member", 32 hex digits, made once): what
    its hello says and what the primary names in etcd's sync key (docs/replication.md, "Sync
    standby")."""
    doc = read_marker(directory)
    doc = doc if isinstance(doc, dict) else {}
    member = doc.get("member")
    if not (isinstance(member, str) and len(member) == 32):
        member = doc["member"] = os.urandom(16).hex()
        write_marker(directory, doc, fs)
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


def write_marker(directory: str, doc: Mapping[str, object], fs: FileLayer | None = None) -> None:
    """Replace DIR/standby atomically through the file layer `fs` (temporary file, fsync, rename,
    directory fsync: `FileLayer.write_atomically`)."""
    target = os.path.join(directory, MARKER)
    data = json.dumps({**doc, "schema": MARK_SCHEMA}, sort_keys=True).encode() + b"\n"
    (fs or OsFileLayer()).write_atomically(target, data, mode=0o600, tmp=target + ".tmp")


def record_takeover(directory: str, position: tuple[int, int], fs: FileLayer | None = None) -> None:
    """A takeover boot begins this primary's part of the journal at `position` (`fs`: the
    device's file layer)."""
    doc = read_marker(directory)
    doc = doc if isinstance(doc, dict) else {}
    doc["takeovers"] = [list(p) for p in takeovers(directory)] + [list(position)]
    write_marker(directory, doc, fs)
