"""Shared memory on the device (SPEC "Results and memory"; docs/memory.md): whose memory a space
holds, who may see it, the rows retention and publication write, recall into a prompt, and the
two reads (`GET /spaces/{spc}/memory`, `GET /memory/{mem}`).

Visibility is transitive through publication: a row belongs to exactly one memory owner (a
private space, a room, or the instance), a publication copies it into another owner, and a caller
sees the rows of every owner whose space it may currently read (grants ∩ membership, computed for
all spaces in one batch: access.visible_spaces). A row the caller may not see is 404, as if it
did not exist.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..contract import ids
from ..contract.errors import ServiceError
from ..contract.limits import RECALL_K
from ..contract.vocabulary import MEMORY_KINDS, NOT_RETAINED
from ..memory import render
from ..memory.recall import recall
from ..memory.rows import ZERO, Flag, MemoryRow, memory_id
from ..memory.rows import Kind as MemoryKind
from ..state import ids as derived
from ..state.tables import NotRetained, R, S, Right, Scope, join16
from ..storage import leases
from . import access
from .lists import byte_offset, byte_span, page_args
from .kind import Read

if TYPE_CHECKING:
    from ..device import Device

KIND_NAMES = {int(k): k.name.lower() for k in MemoryKind}
TEXT_KINDS = frozenset({int(MemoryKind.SOURCE), int(MemoryKind.INTERPRETATION)})  # what a publication copies


def owner_number(d: Device, srow: int) -> int:
    """The memory owner of a space as the memory table numbers it (state/memory.py)."""
    t = d.state.tables
    if t.value(t.spaces, srow, S.SCOPE) == Scope.INSTANCE:
        return d.state.memory.instance_owner
    return srow + 1


def new_row(d: Device, srow: int, lineage: bytes, obj: bytes, kind: int, flags: int, length: int,
            source: bytes, actor: bytes) -> MemoryRow:
    """The metadata row of a new object owned by space `srow`'s memory owner."""
    t = d.state.tables
    row = t.row(t.spaces, srow)
    scope = row[S.SCOPE]
    raw = join16(row[S.ID_HI], row[S.ID_LO])
    space_lineage = d.state.participants.lineage[row[S.OWNER]]
    owner, room_lineage, room = ZERO, ZERO, ZERO
    if scope == Scope.ROOM:
        owner, room_lineage, room = raw, space_lineage, raw
    elif scope == Scope.PRIVATE:
        owner = derived.memory_owner(d.state.incarnation, ids.space_id(space_lineage, raw))
    return MemoryRow(lineage, obj, 1, MemoryKind(kind), scope, Flag(flags), length, owner, room_lineage, room,
                     source, actor)


def readable_owners(d: Device, principal: bytes, prow: int | None) -> torch.Tensor:
    """A bool table over owner numbers: the owners whose memory the caller may read now."""
    memory = d.state.memory
    rights = access.visible_spaces(d, principal, prow)
    readable = (rights & Right.READ) != 0
    table = torch.zeros(memory.instance_owner + 1, dtype=torch.bool, device=rights.device)
    table[1:memory.instance_owner] = readable
    spaces = d.state.tables.spaces
    table[memory.instance_owner] = bool((readable & (spaces[:, S.SCOPE] == Scope.INSTANCE)).any())
    return table


def visible_slot(d: Device, principal: bytes, prow: int | None, value: Any) -> int:
    """The row of a memory object the caller may see (404 otherwise)."""
    m = ids.MEMORY_ID.match(value) if isinstance(value, str) else None
    memory = d.state.memory
    slot = memory.by_id.get(bytes.fromhex(m.group(2))) if m else None
    if slot is not None and m is not None and memory.row(slot).lineage == bytes.fromhex(m.group(1)):
        if bool(readable_owners(d, principal, prow)[int(memory.owners[slot])]):
            return slot
    raise ServiceError(404, "memory_not_found", f"no memory object {value} visible to this principal")


def release_space(d: Device, srow: int) -> None:
    """A deleted space's memory goes with it (a room's or a private space's; the instance's memory
    belongs to every instance space and stays)."""
    memory = d.state.memory
    number = owner_number(d, srow)
    if number != memory.instance_owner:
        memory.release_owner(number)


# ---- recall (tick thread: bounded by the memory capacity, not by any input) ---------------

def recall_items(d: Device, srow: int, query: torch.Tensor, k: int = RECALL_K) -> list[render.Item]:
    """The k text rows of space srow's memory owner most similar to `query`, best first."""
    memory = d.state.memory
    if not memory.used():
        return []
    visibility = torch.zeros(memory.instance_owner + 1, dtype=torch.bool, device=memory.owners.device)
    visibility[owner_number(d, srow)] = True
    found = recall(memory.embeddings, memory.owners, visibility, query.to(memory.embeddings.device), k)
    items = []
    for slot in found.rows[0].tolist():
        if slot < 0:
            continue
        row = memory.row(slot)
        if int(row.kind) in TEXT_KINDS:
            items.append(render.Item(KIND_NAMES[int(row.kind)], ids.participant_id(row.actor),
                                     memory.payload_of(slot).decode("utf-8", "replace")))
    return items


# ---- reads ----------------------------------------------------------------------------------

def list_memory(d: Device, principal: bytes, args: dict[str, Any]) -> tuple[int, Any]:
    """The rows of a space's memory owner, in write order after `cursor` (a memory counter)."""
    cursor, limit = page_args(args)
    prow = d.state.participants.by_principal.get(principal)
    srow = access.space_row(d, args.get("space"), principal, prow, Right.READ)
    memory = d.state.memory
    mask = memory.owners == owner_number(d, srow)
    if cursor is not None:
        mask &= memory.order > cursor
    found = torch.nonzero(mask).flatten()
    slots: list[int] = found[torch.argsort(memory.order[found])][:limit + 1].tolist()
    more = len(slots) > limit
    slots = slots[:limit]
    next_cursor = str(int(memory.order[slots[-1]])) if more and slots else None
    return 200, {"items": [memory.row(s).to_json() for s in slots], "next_cursor": next_cursor}


def get_memory(d: Device, principal: bytes, args: dict[str, Any]) -> tuple[int, Any]:
    """One row and its exact payload bytes from a byte offset (base64; `text` null unless the span
    is complete UTF-8)."""
    prow = d.state.participants.by_principal.get(principal)
    slot = visible_slot(d, principal, prow, args.get("memory"))
    memory = d.state.memory
    row = memory.row(slot)
    offset = byte_offset(args, row.byte_length)
    return 200, {"memory": row.to_json(), **byte_span(memory.payload_of(slot, offset), offset)}


def object_raw(d: Device, operation: bytes, tag: int) -> bytes:
    """The id of the memory object an operation writes: one per (operation, tag), where the tag is
    the memory kind an input retains, or a publication's copy tag."""
    return derived.memory_object(d.state.incarnation, operation, tag)


def object_id(d: Device, lineage: bytes, operation: bytes, tag: int) -> str:
    return memory_id(lineage, object_raw(d, operation, tag))


REFUSAL_NAMES = {int(r): r.name.lower() for r in NotRetained if r != NotRetained.NONE}
assert tuple(REFUSAL_NAMES.values()) == NOT_RETAINED and tuple(KIND_NAMES.values()) == MEMORY_KINDS
RETENTION_NAMES = {mode: name for name, mode in leases.RETENTION_OF.items()}
CONTEXT_NAMES = {revision: name for name, revision in leases.REVISION_OF.items()}


def input_receipt(d: Device, row: list[int], lineage: bytes) -> str:
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
