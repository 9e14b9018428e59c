"""Conversations (SPEC "Resources"): created in a space the caller may write; the row is the
conversation's execution slot, and its identity stays when the slot changes."""
from __future__ import annotations

from typing import Any

from ..contract import ids
from ..contract.commands import ConversationRef, NewConversation, SpacePage
from ..contract.errors import ServiceError
from ..state.tables import C, R, Right, join16, split16
from . import access, quotas
from .kind import Admission, Caller, Kind, OperationKind, Read, Tables
from .lists import page
from .spaces import resource_key, space_key



def check(d: Caller, principal: bytes, prow: int | None, args: NewConversation, key: bytes,
          sequence: int) -> dict[str, Any]:
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


def apply(d: Tables, a: Admission, prow: int, transfer_seq: int | None, rrow: int) -> int:
    state = d.state
    srow = state.spaces.row(space_key(a.extra["space"]))
    crow = state.conversations.free.pop()
    id_hi, id_lo = split16(a.extra["id"])
    op_hi, op_lo = split16(a.op)
    state.tables.write_row(state.tables.conversations, crow, {
        C.STATE: 1, C.SPACE: srow, C.CREATOR: prow, C.ID_HI: id_hi, C.ID_LO: id_lo,
        C.CREATED: state.admissions, C.OP_HI: op_hi, C.OP_LO: op_lo})
    state.conversations.by_id[(state.participants.lineage[prow], a.extra["id"])] = crow
    return crow


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
                       target_id=target_id, visible_to=visible_to)


def view(d: Tables, crow: int) -> dict[str, Any]:
    t = d.state.tables
    row = t.row(t.conversations, crow)
    lineage = d.state.participants.lineage_at(row[C.CREATOR], row[C.CREATED])  # the one its ID was made with
    return {"id": ids.conversation_id(lineage, join16(row[C.ID_HI], row[C.ID_LO])),
            "space": access.space_id(d, row[C.SPACE]), "slot": str(crow),
            "created_by_operation": ids.operation_id(lineage, join16(row[C.OP_HI], row[C.OP_LO]))}


def list_conversations(d: Caller, principal: bytes, args: SpacePage) -> tuple[int, Any]:
    srow = access.space_row(d, args.space, principal, d.state.participants.by_principal.get(principal),
                            Right.READ)
    cursor, limit = args.after, args.limit
    table = d.state.tables.conversations
    rows, next_cursor = page(table, C.CREATED, (table[:, C.STATE] == 1) & (table[:, C.SPACE] == srow), cursor, limit)
    return 200, {"items": [view(d, r) for r in rows], "next_cursor": next_cursor}


def get_conversation(d: Caller, principal: bytes, args: ConversationRef) -> tuple[int, Any]:
    crow = access.conversation_row(d, args.conversation, principal,
                                   d.state.participants.by_principal.get(principal), Right.READ)
    return 200, view(d, crow)


READS: dict[str, Read] = {"conversations.list": list_conversations, "conversations.get": get_conversation}
