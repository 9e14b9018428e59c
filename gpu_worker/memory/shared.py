"""Shared memory on the device (SPEC "Results and memory"; docs/memory.md): whose memory a space
holds, who may see it, the rows retention and publication write, recall into a prompt, and the
two reads (`GET /spaces/{spc}/memory`, `GET /memory/{mem}`).

Visibility is transitive through publication: a row belongs to exactly one memory owner (a
private space, a room, or the instance), a publication copies it into another owner, and a caller
sees the rows of every owner whose space it may currently read (grants ∩ membership, computed for
all spaces in one batch: access.visible_spaces). The instance's memory is shared by every instance
space, and each of its rows is fenced to the readers of the instance space it was retained or
published in, so a zero-rights row (or an explicit row without read) keeps its participant from
the memory of that space through every other. A row the caller may not see is 404, as if it did
not exist.

What a caller may read is also what its inputs' prompts may hold (DESIGN §8): recall takes the
rows of the conversation's memory that its submitter may read when its lease is saved
(`context_reader`), and nothing else.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..contract import ids
from ..contract.commands import MemoryRead, SpacePage
from ..contract.errors import ServiceError
from ..contract.limits import RECALL_FLOOR, RECALL_K, RECALL_MARGIN
from ..contract.vocabulary import MEMORY_KINDS, NOT_RETAINED
from ..kinds import access
from ..kinds.kind import Caller, Read, Tables
from ..kinds.kind import Kind as OperationCode
from ..kinds.lists import byte_offset, byte_span
from .. import derived
from ..state.tables import C, NotRetained, P, R, S, Right, Scope, join16
from ..storage import leases
from . import render, table as memory_table
from .recall import recall
from .rows import SUPERSEDED, ZERO, Flag, MemoryRow, memory_id
from .rows import Kind as MemoryKind


KIND_NAMES = {int(k): k.name.lower() for k in MemoryKind}
TEXT_KINDS = frozenset({int(MemoryKind.SOURCE), int(MemoryKind.INTERPRETATION)})  # what a publication copies


def owner_number(d: Tables, srow: int) -> int:
    """The number the memory table files space srow's rows under (table.py): its row + 1,
    whatever its scope. For a private space or a room it is the memory owner; for an instance
    space, the fence of the instance rows it retained or received (`scope_table`)."""
    return srow + 1


def new_row(d: Tables, srow: int, lineage: bytes, obj: bytes, kind: int, flags: int, length: int,
            source: bytes, actor: bytes) -> MemoryRow:
    """The metadata row of a new object owned by space `srow`'s memory owner."""
    t = d.state.tables
    row = t.row(t.spaces, srow)
    scope = row[S.SCOPE]
    raw = join16(row[S.ID_HI], row[S.ID_LO])
    space_lineage = d.state.participants.lineage_at(row[S.OWNER], row[S.CREATED])  # the one in the space's ID
    owner, room_lineage, room = ZERO, ZERO, ZERO
    if scope == Scope.ROOM:
        owner, room_lineage, room = raw, space_lineage, raw
    elif scope == Scope.PRIVATE:
        owner = derived.memory_owner(d.state.incarnation, ids.space_id(space_lineage, raw))
    return MemoryRow(lineage, obj, 1, MemoryKind(kind), scope, Flag(flags), length, owner, room_lineage, room,
                     source, actor)


def readable_owners(d: Caller, principal: bytes, prow: int | None) -> torch.Tensor:
    """A bool table over owner numbers: those whose rows the caller may read now (read right on
    their space, grants ∩ membership). The instance rows of a checkpoint written before the
    fence, which do not say their space, only for a reader of every live instance space."""
    memory = d.state.memory
    rights = access.visible_spaces(d, principal, prow)
    readable = (rights & Right.READ) != 0
    table = torch.zeros(memory.legacy_instance + 1, dtype=torch.bool, device=rights.device)
    table[1:memory.legacy_instance] = readable
    spaces = d.state.tables.spaces
    instance = (spaces[:, S.STATE] == 1) & (spaces[:, S.SCOPE] == Scope.INSTANCE)
    table[memory.legacy_instance] = bool(instance.any()) and bool(readable[instance].all())
    return table


def scope_table(d: Tables, srow: int) -> torch.Tensor:
    """A bool table over owner numbers: the rows that make up space srow's memory. A private
    space's or a room's own; for an instance space, the instance's: the rows of every live
    instance space (and those of an earlier checkpoint)."""
    memory = d.state.memory
    spaces = d.state.tables.spaces
    table = torch.zeros(memory.legacy_instance + 1, dtype=torch.bool, device=spaces.device)
    if d.state.tables.value(spaces, srow, S.SCOPE) == Scope.INSTANCE:
        table[1:memory.legacy_instance] = (spaces[:, S.STATE] == 1) & (spaces[:, S.SCOPE] == Scope.INSTANCE)
        table[memory.legacy_instance] = True
    else:
        table[owner_number(d, srow)] = True
    return table


def _slot_of(d: Tables, value: object) -> int | None:
    """The row holding the memory object a `mem-` ID names (its lineage too), None for none."""
    m = ids.MEMORY_ID.match(value) if isinstance(value, str) else None
    if m is None:
        return None
    memory = d.state.memory
    slot = memory.by_id.get(bytes.fromhex(m.group(2)))
    return slot if slot is not None and memory.row(slot).lineage == bytes.fromhex(m.group(1)) else None


def visible_slot(d: Caller, principal: bytes, prow: int | None, value: object) -> int:
    """The row of a memory object the caller may see (404 otherwise)."""
    slot = _slot_of(d, value)
    if slot is not None and bool(readable_owners(d, principal, prow)[
            int(d.state.memory.current_owners(memory_table.now())[slot])]):
        return slot
    raise ServiceError(404, "memory_not_found", f"no memory object {value} visible to this principal")


def any_slot(d: Tables, value: object) -> int:
    """The row of a saved memory object whoever's it is (the console's staff: memory/ops.py);
    404 otherwise, as for an object never written."""
    slot = _slot_of(d, value)
    if slot is not None and int(d.state.memory.owners[slot]) != 0:  # (0: written by a transfer not yet saved)
        return slot
    raise ServiceError(404, "memory_not_found", f"no memory object {value}")


def editable_slot(d: Caller, principal: bytes, prow: int | None, value: object) -> int:
    """The row of a memory object the caller may correct or forget: one it sees (404 otherwise)
    in a space where it holds `write` now, `manage` for a row another participant wrote (403).
    The rights are those on the space the row was retained or published in (its owner number);
    an instance row of a checkpoint written before that fence names no space: only a manager of
    every live instance space may change it."""
    slot = visible_slot(d, principal, prow, value)
    memory = d.state.memory
    row = memory.row(slot)
    mine = prow is not None and row.actor == d.state.participants.raw[prow]
    need = Right.WRITE if mine else Right.MANAGE
    owner = int(memory.owners[slot])
    if owner == memory.legacy_instance:
        rights = access.visible_spaces(d, principal, prow)
        spaces = d.state.tables.spaces
        instance = (spaces[:, S.STATE] == 1) & (spaces[:, S.SCOPE] == Scope.INSTANCE)
        allowed = bool(((rights[instance] & need) != 0).all())
    else:
        allowed = bool(access.effective_rights(d, principal, prow, owner - 1) & need)
    if not allowed:
        raise ServiceError(403, "right_missing", f"this participant lacks the {access.right_names(need)[0]} right "
                                                 f"on the space of {value}"
                                                 + ("" if mine else " (the row was written by another participant)"))
    return slot


def current_version(row: MemoryRow, version: int, what: str) -> None:
    """SPEC "The device checks ... current object versions": a read or a publication naming a
    version of an object must name its current one (409 `stale_version`; `version` is the
    current one)."""
    if version != row.version:
        raise ServiceError(409, "stale_version", f"{what} is at version {row.version}, not {version}",
                           version=str(row.version))


def release_space(d: Tables, srow: int) -> None:
    """A deleted space's memory goes with it: a private space's or a room's, and the instance
    rows retained or published in an instance space (fenced to its readers, nobody could read
    them again)."""
    d.state.memory.release_owner(owner_number(d, srow))


def context_reader(d: Caller, rrow: int) -> tuple[torch.Tensor, bool]:
    """What an input's prompt may hold (DESIGN §8), from its submitting participant's rights now
    (stored rights ∩ current grants, asked when its lease is saved): the owner numbers whose
    memory it may read (`readable_owners`), and whether it may read its conversation's space (if
    not, its context holds its own turns only)."""
    t = d.state.tables
    prow = t.value(t.receipts, rrow, R.PARTICIPANT)
    principal = join16(*t.row(t.participants, prow)[P.PRINCIPAL_HI:P.PRINCIPAL_LO + 1])
    srow = t.value(t.conversations, t.value(t.receipts, rrow, R.TARGET), C.SPACE)
    readable = readable_owners(d, principal, prow)
    return readable, bool(readable[owner_number(d, srow)])


def interpreted(d: Tables, op: bytes) -> None:
    """The interpretation of the turn that input operation `op` wrote is retained (its transfer
    saved, or replayed): the turn's source object changes to its next version, flagged
    `interpreted`, so a read or a publication naming the version it had before answers 409
    `stale_version` (docs/memory.md "Object versions"). Nothing when the source was not retained."""
    table = d.state.memory
    slot = table.by_id.get(object_raw(d, op, MemoryKind.SOURCE))
    if slot is not None:
        table.change(slot, table.row(slot).bumped(Flag.INTERPRETED))


# ---- recall (tick thread: bounded by the memory capacity, not by any input) ---------------

def nearest(d: Tables, srow: int, query: torch.Tensor, readable: torch.Tensor, k: int) -> list[tuple[float, int]]:
    """(cosine similarity, memory slot) of the k rows of space srow's memory most similar to
    `query`, of the owners in `readable`, best first: what recall and a memory search rank."""
    memory = d.state.memory
    if not memory.used():
        return []
    visibility = scope_table(d, srow) & readable.to(memory.owners.device)
    if not bool(visibility.any()):
        return []
    found = recall(memory.embeddings, memory.current_owners(memory_table.now()), visibility,
                   query.to(memory.embeddings.device), k)
    return [(score, slot) for score, slot in zip(found.scores[0].tolist(), found.rows[0].tolist()) if slot >= 0]


def recall_items(d: Tables, srow: int, query: torch.Tensor, readable: torch.Tensor,
                 k: int = RECALL_K, floor: float = RECALL_FLOOR, margin: float = RECALL_MARGIN) -> list[render.Item]:
    """The text rows of space srow's memory most similar to `query`, best first, of those in
    `readable` (the submitter's: `context_reader`): of the k most similar, those whose cosine
    similarity is at least `floor` and within `margin` of the best one's, so that a row is
    recalled because it is relevant, not because k rows were asked for (docs/memory.md)."""
    memory = d.state.memory
    found = nearest(d, srow, query, readable, k)
    items = []
    for score, slot in found:
        if score < floor or score < found[0][0] - margin:
            continue
        row = memory.row(slot)
        if int(row.kind) in TEXT_KINDS:
            items.append(render.Item(KIND_NAMES[int(row.kind)], ids.participant_id(row.actor),
                                     memory.payload_of(slot).decode("utf-8", "replace")))
    return items


# ---- reads ----------------------------------------------------------------------------------

def list_memory(d: Caller, principal: bytes, args: SpacePage) -> tuple[int, dict[str, object]]:
    """The rows of a space's memory owner, in write order after `cursor` (a memory counter)."""
    cursor, limit = args.after, args.limit
    prow = d.state.participants.by_principal.get(principal)
    srow = access.space_row(d, args.space, principal, prow, Right.READ)
    owners = scope_table(d, srow) & readable_owners(d, principal, prow)
    slots, next_cursor = rows_page(d, owners, cursor, limit)
    return 200, {"items": [row_json(d, s) for s in slots], "next_cursor": next_cursor}


def rows_page(d: Tables, owners: torch.Tensor, cursor: int | None, limit: int) -> tuple[list[int], str | None]:
    """The rows of the owner numbers `owners` holds (a bool table over them), in write order
    after `cursor` (a memory counter), at most `limit`: (slots, next cursor)."""
    memory = d.state.memory
    mask = owners[memory.current_owners(memory_table.now())]
    if cursor is not None:
        mask &= memory.order > cursor
    found = torch.nonzero(mask).flatten()
    slots: list[int] = found[torch.argsort(memory.order[found])][:limit + 1].tolist()
    more = len(slots) > limit
    slots = slots[:limit]
    return slots, str(int(memory.order[slots[-1]])) if more and slots else None


def row_json(d: Tables, slot: int) -> dict[str, object]:
    """A row as the reads show it, with a published copy's provenance and when it expires."""
    memory = d.state.memory
    return memory.row(slot).to_json(memory.provenance_of(slot), int(memory.expires[slot]))


def get_memory(d: Caller, principal: bytes, args: MemoryRead) -> tuple[int, dict[str, object]]:
    """One row and its exact payload bytes from a byte offset (base64; `text` null unless the span
    is complete UTF-8); with `version`, only while that is the object's current version."""
    prow = d.state.participants.by_principal.get(principal)
    slot = visible_slot(d, principal, prow, args.memory)
    memory = d.state.memory
    row = memory.row(slot)
    if args.version is not None and args.version != row.version:
        kept = superseded(d, row, args.version)
        if kept is None:
            current_version(row, args.version, args.memory)
        else:  # a version a live correction replaced (kinds/memory_versions.py)
            offset = byte_offset(args.offset, len(kept))
            earlier = replace(row, version=args.version, byte_length=len(kept))
            return 200, {"memory": earlier.to_json(memory.provenance_of(slot), int(memory.expires[slot])),
                         **byte_span(kept[offset:], offset)}
    offset = byte_offset(args.offset, row.byte_length)
    return 200, {"memory": row_json(d, slot), **byte_span(memory.payload_of(slot, offset), offset)}


def corrections(d: Tables, lineage: bytes, obj: bytes) -> list[tuple[int, int, bytes]]:
    """The live corrections of an object: (receipt row, the version it replaced, that version's
    payload), each read from the correction's result bytes (kinds/memory_versions.SUPERSEDED)."""
    t = d.state.tables
    receipts = t.receipts
    found = (receipts[:, R.STATE] == 1) & (receipts[:, R.KIND] == int(OperationCode.MEMORY_VERSION))
    out = []
    for rrow in torch.nonzero(found).flatten().tolist():
        kept = t.get_bytes(t.result_bytes, rrow, t.value(receipts, rrow, R.RESULT_LEN))
        kept_lineage, kept_obj, version = SUPERSEDED.unpack_from(kept)
        if (kept_lineage, kept_obj) == (lineage, obj):
            out.append((rrow, version, kept[SUPERSEDED.size:]))
    return out


def superseded(d: Tables, row: MemoryRow, version: int) -> bytes | None:
    """The payload an object had at `version` before a correction replaced it, while that
    correction's receipt is live."""
    return next((kept for _, v, kept in corrections(d, row.lineage, row.object) if v == version), None)



def object_raw(d: Tables, operation: bytes, tag: int) -> bytes:
    """The id of the memory object an operation writes: one per (operation, tag), where the tag is
    the memory kind an input retains, or a publication's copy tag."""
    return derived.memory_object(d.state.incarnation, operation, tag)


def object_id(d: Tables, lineage: bytes, operation: bytes, tag: int) -> str:
    return memory_id(lineage, object_raw(d, operation, tag))


REFUSAL_NAMES = {int(r): r.name.lower() for r in NotRetained if r != NotRetained.NONE}
assert tuple(REFUSAL_NAMES.values()) == NOT_RETAINED and tuple(KIND_NAMES.values()) == MEMORY_KINDS
RETENTION_NAMES = {mode: name for name, mode in leases.RETENTION_OF.items()}
CONTEXT_NAMES = {revision: name for name, revision in leases.REVISION_OF.items()}


def input_receipt(d: Tables, row: list[int], lineage: bytes) -> str:
    """An input's receipt `memory`: its retention and context as recorded, the objects it
    retained and what it did not, with why (canonical JSON: sorted keys, compact)."""
    op = join16(row[R.OP_HI], row[R.OP_LO])
    retained = [object_id(d, lineage, op, kind) for kind in sorted(KIND_NAMES) if row[R.RETAINED] & 1 << kind]
    missing = [(kind, (row[R.NOT_RETAINED] >> 4 * kind) & 15) for kind in sorted(KIND_NAMES)]
    not_retained = ",".join(f'{{"kind":"{KIND_NAMES[kind]}","reason":"{REFUSAL_NAMES[code]}"}}'
                            for kind, code in missing if code)
    context = CONTEXT_NAMES[row[R.REVISION] - 1] if row[R.REVISION] > 2 else "plain"
    objects = ",".join(f'"{m}"' for m in retained)
    return (f'{{"context":"{context}","not_retained":[{not_retained}],"retained":[{objects}],'
            f'"retention":"{RETENTION_NAMES[row[R.RETENTION] or 1]}"}}')


READS: dict[str, Read] = {"memory.list": list_memory, "memory.get": get_memory}
