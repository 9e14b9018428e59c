"""Forgetting a memory object (`POST /memory/{mem}/deletion {reason?}`; docs/memory.md
"Forgetting"): the object is gone at once, as if it had never been (`GET /memory/{mem}` 404;
lists, search and recall never return it), and its bytes leave the runtime file and the journal
at the next checkpoint (memory/forgetting.py says where each copy of them is erased).

Who may: as for a correction, a caller that sees the object and holds `write` on the space it was
retained or published in, `manage` for an object another participant wrote. Any kind of object
may be forgotten. The receipt keeps the reason (its command bytes) and names the object. The
admin console's staff may forget any object (`StaffDeletion`, admitted by the device's operator
participant: memory/ops.py); the deletion is this same kind, replayed and erased the same way.

What goes with it: every version its live corrections keep, the text of those corrections and,
for a retained source, the text of the input it came from (its receipt's command bytes, or its
conversation's history once that receipt was retired), so the conversation's later context no
longer carries it either. What does not: another object made from it — an interpretation of the
same turn, a published copy in another space (its `published_from` then names an object that
reads 404) — each is forgotten by its own deletion, by a caller with the rights there.
"""
from __future__ import annotations

import re

import torch

from ..contract.commands import MemoryDeletion
from ..memory import shared as memory
from ..memory.forgetting import redact_command
from ..memory.rows import SUPERSEDED, Flag, Forgotten, memory_id
from ..memory.rows import Kind as MemoryKind
from ..state.tables import C, R, Terminal
from . import history
from .kind import Admission, Applying, Caller, Extra, Kind, OperationKind, Tables


class StaffDeletion(MemoryDeletion, kw_only=True, frozen=True):
    """A forget the console's staff asked for (`ops.memory.forget`, memory/ops.py), which the
    device admits as its operator participant: the object need only exist, whoever's it is.
    Never a command's arguments: a `memory.delete` command is parsed as MemoryDeletion, which
    refuses any field it does not declare (`staff` among them), and only the device's own
    admission (Device.admit_as) passes this type."""
    staff: str


def check(d: Caller, principal: bytes, prow: int | None, args: MemoryDeletion, key: bytes,
          sequence: int) -> Extra:
    if isinstance(args, StaffDeletion):  # (staff are no member of any space: no rights to ask)
        slot = memory.any_slot(d, args.memory)
    else:
        slot = memory.editable_slot(d, principal, prow, args.memory)
    row = d.state.memory.row(slot)
    return {"memory": [row.lineage, row.object]}


def apply(d: Applying, a: Admission, prow: int, transfer_seq: int | None, rrow: int) -> int:
    t = d.state.tables
    table = d.state.memory
    lineage, obj = a.extra["memory"]
    slot = table.by_id[obj]
    t.put_bytes(t.result_bytes, rrow, SUPERSEDED.pack(lineage, obj, table.row(slot).version))  # (target_id)
    erase(d, slot)
    return rrow


def erase(d: Tables, slot: int) -> None:
    """Forget the object in memory row `slot` with everything that holds its bytes (the module's
    docstring), and note it for the next checkpoint's erasure: a deletion's, and an expiry's
    (memory/expiry.py)."""
    table = d.state.memory
    row = table.row(slot)
    texts = [table.payload_of(slot), *_erase_corrections(d, row.lineage, row.object)]  # every version known
    published = bool(row.flags & Flag.PUBLISHED)
    if row.kind == MemoryKind.SOURCE and not published:
        _erase_input_text(d, row.source, texts, int(table.owners[slot]) - 1)
    table.release([slot])
    table.forgotten.append(Forgotten(row.object, row.source, row.actor, int(row.kind), published))
    # the media its text links to, when only the row's own actor uploaded it and nothing else names
    # it: a link typed into a text can name another's upload, which a forgetting never removes
    actor = d.state.participants.by_raw.get(row.actor, -1)
    for sha in sorted({m.decode() for text in texts for m in MEDIA_LINK.findall(text)}):
        source = d.state.media.get(sha)
        if source is not None and source.owners <= {actor} and not _media_named(d, sha):
            del d.state.media[sha]  # its bytes leave with the next checkpoint (kinds/media.remove_forgotten)
            table.forgotten_media.append(sha)


MEDIA_LINK = re.compile(rb"media://([0-9a-f]{64})")  # kinds/inputs.media_link, as a memory payload holds it


def _media_named(d: Tables, sha: str) -> bool:
    """Whether a media source is still named: by a live memory row, or by an unfinished input
    (which may yet need its bytes for its prompt)."""
    table = d.state.memory
    needle = b"media://" + sha.encode()
    if needle in table.payload[table.owners != 0].cpu().numpy().tobytes():
        return True
    t = d.state.tables
    receipts = t.receipts
    unfinished = (receipts[:, R.STATE] == 1) & (receipts[:, R.KIND] == int(Kind.INPUT)) \
        & (receipts[:, R.TERMINAL] == Terminal.NONE)
    return any(sha.encode() in t.get_bytes(t.command_bytes, rrow, t.value(receipts, rrow, R.COMMAND_LEN))
               for rrow in torch.nonzero(unfinished).flatten().tolist())


def columns(d: Tables, a: Admission) -> dict[int, int]:
    return {R.RESULT_LEN: SUPERSEDED.size}


def _erase_corrections(d: Tables, lineage: bytes, obj: bytes) -> list[bytes]:
    """The live corrections of the object: the versions they keep (returned) and their texts."""
    t = d.state.tables
    versions = []
    for crow, _, kept in memory.corrections(d, lineage, obj):
        versions.append(kept)
        t.put_bytes(t.result_bytes, crow, bytes(len(kept)), SUPERSEDED.size)
        t.put_value(t.receipts, crow, R.RESULT_LEN, SUPERSEDED.size)
        _redact(d, crow)
    return versions


def _redact(d: Tables, rrow: int) -> None:
    t = d.state.tables
    length = t.value(t.receipts, rrow, R.COMMAND_LEN)
    redacted = redact_command(t.get_bytes(t.command_bytes, rrow, length))
    t.put_bytes(t.command_bytes, rrow, redacted + bytes(max(0, length - len(redacted))))
    t.put_value(t.receipts, rrow, R.COMMAND_LEN, len(redacted))


def _erase_input_text(d: Tables, op: bytes, texts: list[bytes], srow: int) -> None:
    """A retained source's input (operation `op`): its receipt's text while it is live, else the
    turn its retirement folded into its conversation's history, found among the conversations of
    the source's space by its text (`texts`: the versions of the object still known; the
    original is the input's text unless a retired correction replaced it)."""
    rrow = d.state.receipts.op_row(op)
    if rrow is not None:
        _redact(d, rrow)
        return
    conversations = d.state.tables.conversations
    live = (conversations[:, C.STATE] == 1) & (conversations[:, C.SPACE] == srow)
    for crow in torch.nonzero(live).flatten().tolist():
        history.forget_user_texts(d, crow, texts)


def target_id(d: Tables, row: list[int], lineage: bytes) -> str:
    """The object forgotten, from the receipt's own result bytes."""
    t = d.state.tables
    object_lineage, obj, _ = SUPERSEDED.unpack(t.get_bytes(t.result_bytes, row[R.TARGET], SUPERSEDED.size))
    return memory_id(object_lineage, obj)


DELETE: OperationKind = OperationKind(Kind.MEMORY_DELETE, "memory.delete", check=check, apply=apply,
                                      target_id=target_id, columns=columns)
