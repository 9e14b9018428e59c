"""Forking a conversation (`POST /conversations/{con}/forks {at, id?}`; docs/memory.md "Forks"): a
new conversation in the source's space whose history is the source's through the input at event
cursor `at`; later inputs of either never appear in the other.

The fork is made at admission, from the source as it is then: its retired turns (its history
row) and its live succeeded inputs through `at`, written into the fork's own history row as
retired turns (kinds/history.py `copy_turns`, oldest first, within the row's bound), with their
authors, so a write-only member's prompt in the fork holds its own turns only, as in the source.
The fork's event orders go on from `at` (its first input is `at + 1`): its event reads show the
copied turns as the gap of orders 1..`at`, retired turns as a source's reads show them. An input
of the fork is prompted with the same earlier turns, rendered the same, as the same input in the
source at that point would be, so the engine's prefix cache shares their KV pages.

Refusals, changing nothing: 404 for a source the caller cannot read (403 `right_missing` without
`write` in its space, where a fork is a new conversation), 409 `fork_point_past_end` for a
cursor past the source's last input, 409 `conversation_busy` while an input through `at` is
unfinished (its answer is not yet history), and a creation's own: 409 `conversation_exists`, the
`conversations` quota, 507 `conversation_capacity`.
"""
from __future__ import annotations


from ..contract import ids
from ..contract.commands import ConversationFork
from ..contract.errors import ServiceError
from ..state.tables import C, R, Right, Terminal
from . import access, conversations, history, quotas
from .kind import Admission, Caller, Extra, Kind, OperationKind, Tables
from .spaces import resource_key


def check(d: Caller, principal: bytes, prow: int | None, args: ConversationFork, key: bytes,
          sequence: int) -> Extra:
    assert prow is not None
    crow = access.conversation_row(d, args.conversation, principal, prow, Right.READ)
    t = d.state.tables
    srow = t.value(t.conversations, crow, C.SPACE)
    if not access.effective_rights(d, principal, prow, srow) & Right.WRITE:
        raise ServiceError(403, "right_missing", f"this participant lacks the write right on the space of "
                                                 f"{args.conversation}, where the fork would be")
    at, last = int(args.at), t.value(t.conversations, crow, C.INPUTS)
    if at > last:
        raise ServiceError(409, "fork_point_past_end", f"{args.conversation} has {last} inputs; at must be 1.."
                                                       f"{last}", inputs=str(last))
    for rrow in d.state.conversations.inputs_of(crow):
        if t.value(t.receipts, rrow, R.ORDER) <= at and t.value(t.receipts, rrow, R.TERMINAL) == Terminal.NONE:
            raise ServiceError(409, "conversation_busy", f"an input through {args.at} is unfinished; fork once it "
                                                         "has its terminal result")
    raw = resource_key(args.id, key)
    lineage = d.state.participants.lineage[prow]
    if (lineage, raw) in d.state.conversations.by_id:
        raise ServiceError(409, "conversation_exists", f"conversation {ids.conversation_id(lineage, raw)} "
                                                        "already exists")
    quotas.check(d, principal, prow, "conversations")
    if not d.state.conversations.free:
        raise ServiceError(507, "conversation_capacity",
                           f"the conversation table is full ({d.state.capacities['conversations']})")
    source = ids.CONVERSATION_ID.match(args.conversation)
    space = ids.SPACE_ID.match(access.space_id(d, srow))
    assert source is not None and space is not None
    return {"source": list(ids.split_id(source)), "space": list(ids.split_id(space)), "id": raw, "at": at}


def apply(d: Tables, a: Admission, prow: int, transfer_seq: int | None, rrow: int) -> int:
    source = d.state.conversations.by_id[tuple(a.extra["source"])]
    crow = conversations.apply(d, a, prow, transfer_seq, rrow)  # the new conversation's row, as a creation's
    at = a.extra["at"]
    d.state.tables.write_row(d.state.tables.conversations, crow, {C.INPUTS: at})
    history.copy_turns(d, source, crow, at)
    return crow


FORK: OperationKind = OperationKind(Kind.CONVERSATION_FORK, "conversations.fork", check=check, apply=apply,
                                    target_id=conversations.target_id, visible_to=conversations.visible_to)
