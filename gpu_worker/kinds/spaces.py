"""Spaces (SPEC "Scope", "Resources"): created private (the default), room or instance; a space's
scope never changes. Reads list the spaces the caller has any effective right on."""
from __future__ import annotations

import struct
from typing import TypedDict

import numpy as np

from .. import native
from ..contract import ids, vocabulary
from ..contract.commands import NewSpace, Page, SpaceRef
from ..contract.errors import ServiceError
from .. import derived
from ..state.indexes import take_free
from ..state.tables import R, S, Right, Scope, join16
from . import access, quotas
from .kind import ADMISSION_VERSION, Admission, Caller, Extra, Kind, OperationKind, Read, Run, Tables
from .lists import page


SCOPES = {name: Scope[name.upper()] for name in vocabulary.SCOPES}  # the contract's names, the tables' codes
SCOPE_NAMES = {int(v): k for k, v in SCOPES.items()}
# a space row as its creation writes it, S's columns in order: STATE, OWNER, SCOPE, the ID (16
# bytes: ID_HI, ID_LO), CREATED, the creating operation (OP_HI, OP_LO)
_ROW = struct.Struct("<3q16sq16s")
assert (S.ID_HI, S.CREATED, S.OP_HI, S.OP_LO) == (3, 5, 6, 7) and _ROW.size == 8 * 8


def resource_key(value: str | None, key: bytes) -> bytes:
    """The new resource's ID: `id` when given (its shape checked by the contract), else the
    operation key (SPEC)."""
    return key if value is None else bytes.fromhex(value)


def space_key(recorded: list[bytes]) -> tuple[bytes, bytes]:
    """The space index key of a space recorded in an admission as [lineage, id]."""
    return recorded[0], recorded[1]


def check(d: Caller, principal: bytes, prow: int | None, args: NewSpace, key: bytes,
          sequence: int) -> Extra:
    assert prow is not None
    scope = SCOPES[args.scope]
    raw = resource_key(args.id, key)
    lineage = d.state.participants.lineage[prow]
    if d.state.spaces.has((lineage, raw)):
        raise ServiceError(409, "space_exists", f"space {ids.space_id(lineage, raw)} already exists")
    quotas.check(d, principal, prow, "spaces")
    if not d.state.spaces.free:
        raise ServiceError(507, "space_capacity", f"the space table is full ({d.state.capacities['spaces']})")
    extra: Extra = {"id": raw, "scope": int(scope)}
    if args.memory_ttl_seconds is not None:  # (only then: a run of creations without it decodes natively)
        extra["memory_ttl"] = args.memory_ttl_seconds
    return extra


def apply(d: Tables, a: Admission, prow: int, transfer_seq: int | None, rrow: int) -> int:
    state = d.state
    srow = state.spaces.free.pop()
    state.tables.put_struct(state.tables.spaces, srow, 0, _ROW, 1, prow, a.extra["scope"], a.extra["id"],
                            state.admissions, a.op)
    state.spaces.add((state.participants.lineage[prow], a.extra["id"]), srow)
    if "memory_ttl" in a.extra:  # (a free row's is zero: a deleted space's row is cleared before reuse)
        state.tables.put_value(state.tables.spaces, srow, S.MEMORY_TTL, a.extra["memory_ttl"])
    return srow


_space_creates = native.load("jcodec").space_creates


def halves(data: bytes) -> np.ndarray:
    """16-byte identifiers back to back as (n, 2) int64: the columns put_struct's "16s" writes."""
    return np.frombuffer(data, dtype="<i8").reshape(-1, 2)


def sixteens(data: bytes) -> list[bytes]:
    """16-byte identifiers back to back, each as bytes (an index's key)."""
    return [data[i:i + 16] for i in range(0, len(data), 16)]


def decode_run(payloads: list[bytes]) -> Run | None:
    """A run of space creations as columns, decoded natively (jcodec.space_creates); None when a
    payload is not exactly as Admission.encode packs a creation."""
    columns = _space_creates(payloads, ADMISSION_VERSION, int(Kind.SPACE_CREATE))
    if columns is None:
        return None
    sequences, keys, ops, commands, lengths, ids, scopes = columns
    return Run(np.frombuffer(sequences, dtype=np.int64), halves(keys), halves(ops), commands,
               np.frombuffer(lengths, dtype=np.int64), (halves(ids), np.frombuffer(scopes, dtype=np.int64)))


def apply_run(d: Tables, run: Run, prows: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """`apply` of each creation of the run, in order: the space rows in one write."""
    state = d.state
    srows = np.array(take_free(state.spaces.free, len(prows)), dtype=np.int64)
    ids, scopes = run.extra
    values = np.empty((len(prows), _ROW.size // 8), dtype=np.int64)
    values[:, S.STATE] = 1
    values[:, S.OWNER] = prows
    values[:, S.SCOPE] = scopes
    values[:, S.ID_HI:S.ID_LO + 1] = ids
    values[:, S.CREATED] = counters
    values[:, S.OP_HI:S.OP_LO + 1] = run.ops
    state.tables.put_rows(state.tables.spaces, srows, values)
    state.spaces.noted(srows.tolist())
    return srows


def target_id(d: Tables, row: list[int], lineage: bytes) -> str:
    return access.space_id(d, row[R.TARGET])


def visible_to(d: Caller, principal: bytes, reader: int | None, row: list[int]) -> bool:
    return access.space_readable(d, principal, reader, row[R.TARGET])


CREATE: OperationKind = OperationKind(Kind.SPACE_CREATE, "spaces.create", check=check, apply=apply, target_id=target_id,
                       visible_to=visible_to, runs=(decode_run, apply_run))


def memory_owner(d: Tables, scope: int, space: str) -> str:
    """Whose memory a space's conversations share. A room uses its exact space ID; an instance
    space the instance; each private space its own owner (derived from the space ID, so two
    private spaces never share one, even with one participant owning both)."""
    if scope == Scope.ROOM:
        return space
    if scope == Scope.INSTANCE:
        return "instance"
    return "private-" + derived.memory_owner(d.state.incarnation, space).hex()


class SpaceView(TypedDict):
    """A space resource as a read renders it, with the reader's rights in it."""
    id: str
    scope: str
    owner: str
    memory_owner: str
    memory_ttl_seconds: str | None
    created_by_operation: str
    rights: list[str]


def view(d: Tables, srow: int, rights: int) -> SpaceView:
    t = d.state.tables
    row = t.row(t.spaces, srow)
    owner = row[S.OWNER]
    lineage = d.state.participants.lineage_at(owner, row[S.CREATED])  # the one its ID was made with
    space = ids.space_id(lineage, join16(row[S.ID_HI], row[S.ID_LO]))
    return {"id": space, "scope": SCOPE_NAMES[row[S.SCOPE]], "owner": d.state.participants.public_id[owner],
            "memory_owner": memory_owner(d, row[S.SCOPE], space),
            "memory_ttl_seconds": str(row[S.MEMORY_TTL]) if row[S.MEMORY_TTL] else None,
            "created_by_operation": ids.operation_id(lineage, join16(row[S.OP_HI], row[S.OP_LO])),
            "rights": access.right_names(rights)}


def list_spaces(d: Caller, principal: bytes, args: Page) -> tuple[int, object]:
    rights = access.visible_spaces(d, principal, d.state.participants.by_principal.get(principal))
    rows, next_cursor = page(d.state.tables.spaces, S.CREATED, rights != 0, args.after, args.limit)
    by_row = rights.tolist()
    return 200, {"items": [view(d, r, by_row[r]) for r in rows], "next_cursor": next_cursor}


def get_space(d: Caller, principal: bytes, args: SpaceRef) -> tuple[int, object]:
    prow = d.state.participants.by_principal.get(principal)
    srow = access.space_row(d, args.space, principal, prow, Right.READ)
    return 200, view(d, srow, access.effective_rights(d, principal, prow, srow))


READS: dict[str, Read] = {"spaces.list": list_spaces, "spaces.get": get_space}
