"""Deleting a space or a conversation (`POST /spaces/{spc}/deletion`, `POST
/conversations/{con}/deletion`): a manager of the space gives the capacity back. Two kinds, one
module: they share the tombstone rule below.

A conversation can be deleted while none of its inputs is unfinished (409 `conversation_busy`);
a space once it holds no conversation (409 `space_not_empty`: delete those first). Deleting
removes the resource at once: its ID no longer resolves (404), its events and streams end, its
member rows and its memory (a space's: a room's or a private space's own rows) are freed, it
stops counting against its creator's quota, and the same ID may be created again. Its table row
becomes a tombstone (state 2) that keeps the old ID, because live receipts still name it as their
target (its creation, its inputs, this deletion); the row itself returns to the table once the last
of those receipts is retired (`release_tombstones`, called by retirements). Receipts of a deleted
resource stay readable by the participants who made them, and by nobody else. Replay applies the
same functions, so a restart reproduces it all.
"""
from __future__ import annotations

import numpy as np

from ..contract import ids
from ..contract.commands import ConversationDeletion, SpaceDeletion
from ..contract.errors import ServiceError
from ..state.indexes import ConversationIndex, SpaceIndex
from ..state.tables import TOMBSTONE, C, R, S, Right, Terminal
from ..memory import shared as memory
from . import access, events
from .kind import Admission, Caller, Extra, Kind, OperationKind, Serving, Tables
from .spaces import space_key


# the kinds whose receipts target a row of each table (R.TARGET), as lookup columns by kind code
# (a retirement's receipts' kinds index them at once)
_TARGETING = {"spaces": np.isin(np.arange(max(Kind) + 1), [Kind.SPACE_CREATE, Kind.MEMBER_SET, Kind.SPACE_DELETE]),
              "conversations": np.isin(np.arange(max(Kind) + 1), [Kind.CONVERSATION_CREATE, Kind.INPUT,
                                                                   Kind.CONVERSATION_DELETE, Kind.CONVERSATION_FORK])}


def _release(free: list[int], row: int) -> None:
    """Back on a free list, which stays highest first (pop() hands out the lowest row), as a
    rebuild from the tensors orders it."""
    free.append(row)
    free.sort(reverse=True)


# ---- conversations --------------------------------------------------------------------------

def check_conversation(d: Caller, principal: bytes, prow: int | None, args: ConversationDeletion, key: bytes,
                       sequence: int) -> Extra:
    crow = access.conversation_row(d, args.conversation, principal, prow, Right.MANAGE)
    t = d.state.tables
    for rrow in d.state.conversations.inputs_of(crow):
        if t.value(t.receipts, rrow, R.TERMINAL) == Terminal.NONE:
            raise ServiceError(409, "conversation_busy", "the conversation has an unfinished input; cancel it or "
                                                         "wait for its terminal result")
    m = ids.CONVERSATION_ID.match(args.conversation)
    assert m is not None
    return {"conversation": list(ids.split_id(m))}


def apply_conversation(d: Tables, a: Admission, prow: int, transfer_seq: int | None, rrow: int) -> int:
    conversations = d.state.conversations
    recorded = a.extra["conversation"]
    crow = conversations.by_id.pop((recorded[0], recorded[1]))
    d.state.tables.write_row(d.state.tables.conversations, crow, {C.STATE: TOMBSTONE})
    conversations.tombstones.add(crow)
    return crow


def conversation_target(d: Tables, row: list[int], lineage: bytes) -> str:
    return access.conversation_id(d, row[R.TARGET])


def conversation_saved(d: Serving, rrow: int) -> None:
    """Its streams end (404), as for a reader who lost the right."""
    events.recheck(d)


DELETE_CONVERSATION: OperationKind = OperationKind(
    Kind.CONVERSATION_DELETE, "conversations.delete", check=check_conversation, apply=apply_conversation,
    target_id=conversation_target, saved=conversation_saved)


# ---- spaces ---------------------------------------------------------------------------------

def check_space(d: Caller, principal: bytes, prow: int | None, args: SpaceDeletion, key: bytes,
                sequence: int) -> Extra:
    srow = access.space_row(d, args.space, principal, prow, Right.MANAGE)
    conversations = d.state.tables.conversations
    if bool(((conversations[:, C.STATE] == 1) & (conversations[:, C.SPACE] == srow)).any()):
        raise ServiceError(409, "space_not_empty", "the space still holds conversations; delete them first")
    m = ids.SPACE_ID.match(args.space)
    assert m is not None
    return {"space": list(ids.split_id(m))}


def apply_space(d: Tables, a: Admission, prow: int, transfer_seq: int | None, rrow: int) -> int:
    state = d.state
    t = state.tables
    srow = state.spaces.pop(space_key(a.extra["space"]))
    memory.release_space(d, srow)  # before the tombstone: its scope names the owner
    t.write_row(t.spaces, srow, {S.STATE: TOMBSTONE})
    state.spaces.tombstones.add(srow)
    members = state.members
    for key in [k for k in members.rows if k[0] == srow]:  # member rows are named by no receipt: free now
        mrow = members.rows.pop(key)
        t.put_cols(t.members, mrow, 0, [0] * t.members.shape[1])
        _release(members.free, mrow)
    return srow


def space_target(d: Tables, row: list[int], lineage: bytes) -> str:
    return access.space_id(d, row[R.TARGET])


DELETE_SPACE: OperationKind = OperationKind(
    Kind.SPACE_DELETE, "spaces.delete", check=check_space, apply=apply_space, target_id=space_target,
    saved=conversation_saved)


# ---- tombstones -----------------------------------------------------------------------------

def release_tombstones(d: Tables, kinds: np.ndarray, targets: np.ndarray) -> None:
    """After a retirement freed receipts (`kinds`, `targets`: their R.KIND and R.TARGET columns):
    a tombstone no live receipt names any more returns to its table's free list, cleared. The
    candidates are the freed receipts' targets among the index's tombstones (a set: a retirement
    frees dozens of receipts, nearly none of them naming a tombstone, and reading their targets'
    rows from the tables to find out was a fifth of a retirement's replay: docs/performance.md,
    "Replay")."""
    state = d.state
    indexes: dict[str, SpaceIndex | ConversationIndex] = {"spaces": state.spaces, "conversations": state.conversations}
    candidates = sorted((name, row) for name, index in indexes.items() if index.tombstones
                        for row in set(targets[_TARGETING[name][kinds]].tolist()) & index.tombstones)
    if not candidates:
        return
    t = state.tables
    receipts = t.receipts
    for table_name, row in candidates:
        named = (receipts[:, R.STATE] == 1) & (receipts[:, R.TARGET] == row)
        if _TARGETING[table_name][receipts[named, R.KIND].cpu().numpy()].any():
            continue
        table = getattr(t, table_name)
        t.put_cols(table, row, 0, [0] * table.shape[1])
        indexes[table_name].tombstones.discard(row)
        if table_name == "spaces":
            _release(state.spaces.free, row)
        else:
            state.conversations.inputs[row] = None
            _release(state.conversations.free, row)

