"""The journal directory's owner marker, `DIR/owner`: which runtime file this journal belongs to
(docs/checkpoint.md, "Restart and restore").

A restart boots a runtime file on its own journal directory with no operator step; a restore (the
file on a journal directory that is not its own, or a file copied from elsewhere) needs a grant
file written after the file's last boot. Segment headers name the file incarnation, but a copy of
the file has the same incarnation, and right after a checkpoint the journal may hold no transfer
at all; the marker says which file (incarnation and inode) last booted here, at which boot, and
which grant file it accepted. The device rewrites it at every boot, before the boot is recorded.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from .filelayer import FileLayer, OsFileLayer

NAME = "owner"
SCHEMA = "aotx.journal.owner.v1"


@dataclass(frozen=True)
class Owner:
    incarnation: str  # the runtime file's incarnation, 32 lowercase hex
    inode: int  # the runtime file's inode: a copy of the file is another one
    boot: int  # the boot counter of the boot that wrote the marker
    grants_written_at_ns: int  # written_at_ns of the grant file that boot accepted
    # the lines of history (lineages) the state has once that boot is recorded: one more than the
    # saved state says when the boot that wrote the marker started a line and stopped before recording
    # it (docs/checkpoint.md, "Lineages after a restore"); 0 in markers from before lineage nonces
    lineages: int = 0


def path(directory: str) -> str:
    return os.path.join(directory, NAME)


def read(directory: str) -> Owner | str:
    """The marker, or why there is none to trust (missing, unreadable)."""
    try:
        with open(path(directory), "rb") as f:
            doc = json.loads(f.read().decode("utf-8"))
        if doc.get("schema") != SCHEMA:
            raise ValueError(f"schema {doc.get('schema')!r}")
        owner = Owner(doc["incarnation"], doc["inode"], doc["boot"], doc["grants_written_at_ns"],
                      doc.get("lineages", 0))
        if not (isinstance(owner.incarnation, str) and all(type(v) is int for v in (
                owner.inode, owner.boot, owner.grants_written_at_ns, owner.lineages))):
            raise ValueError("bad field types")
    except FileNotFoundError:
        return f"journal {directory} has no owner marker"
    except (OSError, UnicodeDecodeError, ValueError, KeyError, AttributeError) as exc:
        return f"journal {directory} has an unreadable owner marker ({exc})"
    return owner


def why_not_own(marker: Owner | str, directory: str, incarnation: str, inode: int, boot: int) -> str | None:
    """None when the journal directory is the runtime file's own, else why it is not.

    Own: the marker names this file (incarnation and inode) and a boot the recovered state agrees
    with, the last one recorded (`boot`) or the one after it (written before a crash cut that
    boot short of recording itself)."""
    if isinstance(marker, str):
        return marker
    if marker.incarnation != incarnation:
        return f"journal {directory} belongs to runtime file incarnation {marker.incarnation}, not {incarnation}"
    if marker.inode != inode:
        return (f"journal {directory} belongs to another copy of this runtime file (inode {marker.inode}, "
                f"not {inode})")
    if boot not in (marker.boot, marker.boot - 1):
        return f"the runtime file's state is at boot {boot}, while journal {directory} last saw boot {marker.boot}"
    return None


def write(directory: str, owner: Owner, fs: FileLayer | None = None) -> None:
    """Replace the marker atomically through the file layer `fs` (the device's): a temporary file,
    fsynced, renamed, the directory fsynced (`FileLayer.write_atomically`)."""
    target = path(directory)
    data = json.dumps({"schema": SCHEMA, **asdict(owner)}, sort_keys=True).encode("ascii") + b"\n"
    (fs or OsFileLayer()).write_atomically(target, data, mode=0o600, tmp=f"{target}.tmp")
