"""Conversations (SPEC "Resources"): created in a space the caller may write; the row is the
conversation's execution slot, and its identity stays when the slot changes."""
from __future__ import annotations

import struct
from typing import TypedDict

import numpy as np

from .. import native
from ..contract import ids
from ..contract.commands import ConversationRef, NewConversation, SpacePage
from ..contract.errors import ServiceError
from ..state.indexes import take_free
from ..state.tables import C, R, Right, join16
from . import access, quotas
from .kind import ADMISSION_VERSION, Admission, Caller, Extra, Kind, OperationKind, Read, Run, Tables
from .lists import page
from .spaces import halves, resource_key, sixteens, space_key



def check(d: Caller, principal: bytes, prow: int | None, args: NewConversation, key: bytes,
          sequence: int) -> Extra:
    assert prow is not None
    access.space_row(d, args.space, principal, prow, Right.WRITE)  # 404 / 403 before anything else
    raw = resource_key(args.id, key)
    state = d.state
    lineage = state.participants.lineage[prow]
    if (lineage, raw) in state.conversations.by_id:
        raise ServiceError(409, "conversation_exists", f"conversation {ids.conversation_id(lineage, raw)} "
                                                        "already exists")
    quotas.check(d, principal, prow, "conversations")
    if not state.conversations.free:
        raise ServiceError(507, "conversation_capacity",
                           f"the conversation table is full ({state.capacities['conversations']})")
    space = ids.SPACE_ID.match(args.space)
    assert space is not None
    return {"space": list(ids.split_id(space)), "id": raw}


# a conversation row as its creation writes it, C's columns in order: STATE, SPACE, CREATOR, the ID
# (16 bytes: ID_HI, ID_LO), CREATED, the creating operation (OP_HI, OP_LO); INPUTS and HISTORY_LEN
# stay as they are
_ROW = struct.Struct("<3q16sq16s")
assert (C.ID_HI, C.CREATED, C.OP_HI, C.OP_LO) == (3, 5, 6, 7) and _ROW.size == 8 * 8


def apply(d: Tables, a: Admission, prow: int, transfer_seq: int | None, rrow: int) -> int:
    state = d.state
    srow = state.spaces.row(space_key(a.extra["space"]))
    crow = state.conversations.free.pop()
    state.tables.put_struct(state.tables.conversations, crow, 0, _ROW, 1, srow, prow, a.extra["id"],
                            state.admissions, a.op)
    state.conversations.by_id[(state.participants.lineage[prow], a.extra["id"])] = crow
    return crow


_conversation_creates = native.load("jcodec").conversation_creates
_ROW_WIDTH = _ROW.size // 8  # the columns a creation writes


def decode_run(payloads: list[bytes]) -> Run | None:
    """A run of conversation creations as columns, decoded natively (jcodec.conversation_creates);
    None when a payload is not exactly as Admission.encode packs a creation."""
    columns = _conversation_creates(payloads, ADMISSION_VERSION, int(Kind.CONVERSATION_CREATE))
    if columns is None:
        return None
    sequences, keys, ops, commands, lengths, space_lineages, space_ids, raw_ids = columns
    return Run(np.frombuffer(sequences, dtype=np.int64), halves(keys), halves(ops), commands,
               np.frombuffer(lengths, dtype=np.int64), (sixteens(space_lineages), sixteens(space_ids), raw_ids))


def apply_run(d: Tables, run: Run, prows: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """`apply` of each creation of the run, in order: the spaces looked up, the conversation rows
    in one write, their IDs indexed."""
    state = d.state
    space_lineages, space_ids, raw_ids = run.extra
    row_of = state.spaces.row
    srows = [row_of(key) for key in zip(space_lineages, space_ids)]
    crows = np.array(take_free(state.conversations.free, len(prows)), dtype=np.int64)
    values = np.empty((len(prows), _ROW_WIDTH), dtype=np.int64)
    values[:, C.STATE] = 1
    values[:, C.SPACE] = srows
    values[:, C.CREATOR] = prows
    values[:, C.ID_HI:C.ID_LO + 1] = halves(raw_ids)
    values[:, C.CREATED] = counters
    values[:, C.OP_HI:C.OP_LO + 1] = run.ops
    state.tables.put_rows(state.tables.conversations, crows, values)
    lineage = state.participants.lineage
    state.conversations.by_id.update(zip(zip([lineage[p] for p in prows.tolist()], sixteens(raw_ids)),
                                         crows.tolist()))
    return crows


def target_id(d: Tables, row: list[int], lineage: bytes) -> str:
    return access.conversation_id(d, row[R.TARGET])


def visible_to(d: Caller, principal: bytes, reader: int | None, row: list[int]) -> bool:
    """Readable where the conversation's space is (members read each other's inputs too); a
    deleted conversation's receipts only by their own participant."""
    t = d.state.tables
    if t.value(t.conversations, row[R.TARGET], C.STATE) != 1:
        return False
    return access.space_readable(d, principal, reader, t.value(t.conversations, row[R.TARGET], C.SPACE))


CREATE: OperationKind = OperationKind(Kind.CONVERSATION_CREATE, "conversations.create", check=check, apply=apply,
                       target_id=target_id, visible_to=visible_to, runs=(decode_run, apply_run))


class ConversationView(TypedDict):
    """A conversation resource as a read renders it."""
    id: str
    space: str
    slot: str
    created_by_operation: str


def view(d: Tables, crow: int) -> ConversationView:
    t = d.state.tables
    row = t.row(t.conversations, crow)
    lineage = d.state.participants.lineage_at(row[C.CREATOR], row[C.CREATED])  # the one its ID was made with
    return {"id": ids.conversation_id(lineage, join16(row[C.ID_HI], row[C.ID_LO])),
            "space": access.space_id(d, row[C.SPACE]), "slot": str(crow),
            "created_by_operation": ids.operation_id(lineage, join16(row[C.OP_HI], row[C.OP_LO]))}


def list_conversations(d: Caller, principal: bytes, args: SpacePage) -> tuple[int, object]:
    srow = access.space_row(d, args.space, principal, d.state.participants.by_principal.get(principal),
                            Right.READ)
    cursor, limit = args.after, args.limit
    table = d.state.tables.conversations
    rows, next_cursor = page(table, C.CREATED, (table[:, C.STATE] == 1) & (table[:, C.SPACE] == srow), cursor, limit)
    return 200, {"items": [view(d, r) for r in rows], "next_cursor": next_cursor}


def get_conversation(d: Caller, principal: bytes, args: ConversationRef) -> tuple[int, object]:
    crow = access.conversation_row(d, args.conversation, principal,
                                   d.state.participants.by_principal.get(principal), Right.READ)
    return 200, view(d, crow)


READS: dict[str, Read] = {"conversations.list": list_conversations, "conversations.get": get_conversation}
