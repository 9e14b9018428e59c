"""The admin console's memory page at the device: two ops commands of the local socket (no
principal; docs/protocol.md, docs/memory.md "Forgetting").

`ops.memory {space, cursor?, limit?}` lists every row of a space's memory, whoever may read it
(staff see everything): the rows `memory.list` would show a reader of every space, in write order,
paged as it pages, each with a preview of its payload (its first MEMORY_PREVIEW_BYTES bytes, as
text when they are UTF-8).

`ops.memory.forget {memory, reason, staff}` forgets one for a console user. Staff are no
participant, so the forget is admitted by the device's operator participant, whose principal is
derived from the file incarnation (derived.operator): no grant file names it, and the device
refuses it as a command's principal. The device registers it at its first forget (a
`participant.register` admission whose command bytes are `POST /ops/participant {"staff"}`), then
admits a `memory.delete` with the operator's lineage, its next sequence and a fresh operation key,
and the command bytes `{"method":"POST","path":"/ops/memory/{mem}/deletion","body":{"reason",
"staff"}}` (contract/canonical.py): the same journaled kind as a participant's forget
(kinds/memory_deletions.py), so the erasure, its replay and the checkpoint's redaction are the
same code. Its check asks only that the object exists (`StaffDeletion`: 404 `memory_not_found`
otherwise, nothing admitted); the rest of admission is a command's (a journal hold, the receipt
table, the operator's receipts quota). The reply is the deletion's receipt once it is saved, 202
as for any new mutation; the receipt's command bytes (`ops.command`) keep the reason and the name.
"""
from __future__ import annotations

import base64
import secrets
from typing import TYPE_CHECKING

from ..contract import ids
from ..contract.canonical import NotCanonical, operation_bytes
from ..contract.commands import Mutation, Retirement, SpacePage, StaffForget
from ..contract.errors import ServiceError
from ..contract.limits import MEMORY_PREVIEW_BYTES
from ..contract.wire import Message, reply
from ..kinds.kind import Context, Journaling, Kind, Later, Read, Tables
from ..kinds.memory_deletions import StaffDeletion
from .. import derived
from ..state.tables import P
from . import shared as memory

if TYPE_CHECKING:
    from ..storage.committer import Batch

REGISTER_PATH = "/ops/participant"  # the operator's registration's command bytes
RETIRE_PATH = "/ops/retirements"  # its retirements' (OPERATOR_KEEP)


def deletion_path(obj: str) -> str:
    """The path in a staff forget's command bytes."""
    return f"/ops/memory/{obj}/deletion"


def preview(d: Tables, slot: int) -> dict[str, object]:
    """The first MEMORY_PREVIEW_BYTES bytes of a row's payload: base64, and as text up to the
    last whole character when they are UTF-8 (null otherwise); `complete`: they are all of it."""
    table = d.state.memory
    data = table.payload_of(slot, 0, MEMORY_PREVIEW_BYTES)
    complete = len(data) == table.row(slot).byte_length
    text: str | None = None
    for cut in range(1 if complete else 4):  # (a cut through a character leaves it out of the text)
        try:
            text = data[:len(data) - cut].decode("utf-8")
            break
        except UnicodeDecodeError:
            continue
    return {"bytes": base64.b64encode(data).decode(), "text": text, "complete": complete}


def ops_memory(d: Tables, principal: bytes | None, args: SpacePage) -> tuple[int, object]:
    """Every row of a live space's memory, in write order after `cursor`, with its preview."""
    m = ids.SPACE_ID.match(args.space)
    srow = d.state.spaces.get(ids.split_id(m)) if m else None
    if srow is None:
        raise ServiceError(404, "space_not_found", f"no space {args.space}")
    slots, next_cursor = memory.rows_page(d, memory.scope_table(d, srow), args.after, args.limit)
    return 200, {"items": [{**memory.row_json(d, s), "preview": preview(d, s)} for s in slots],
                 "next_cursor": next_cursor}


def forget(d: Context, conn: object, msg: Message, batch: Batch) -> int:
    """`ops.memory.forget`: the operator registered if it is not yet, then the deletion admitted;
    its receipt answers once saved. A refusal changes nothing but, at a first forget, the
    operator's registration (admitted before the deletion's own checks ran)."""
    req_id = msg.get("id")
    used = 0
    try:
        args = d.args(msg, StaffForget)
        memory.any_slot(d, args.memory)  # (an unknown object registers nobody)
        try:
            canonical = operation_bytes("POST", deletion_path(args.memory), {"reason": args.reason,
                                                                             "staff": args.staff})
            registration = operation_bytes("POST", REGISTER_PATH, {"staff": args.staff})
        except NotCanonical as exc:
            raise ServiceError(400, "bad_field", f"reason and staff must be text: {exc}") from None
        principal = derived.operator(d.state.incarnation)
        participants = d.state.participants
        prow = participants.by_principal.get(principal)
        if prow is None:
            lineage = participants.unregistered_lineage(principal).hex()
            used += d.admit_as(principal, Kind.PARTICIPANT_REGISTER, Mutation(
                lineage=lineage, operation_key=_fresh_key(), sequence=1, canonical=registration))[2]
            prow = participants.by_principal[principal]
        t = d.state.tables
        used += _retire_oldest(d, principal, prow)
        status, rrow, records = d.admit_as(principal, Kind.MEMORY_DELETE, StaffDeletion(
            lineage=participants.lineage_hex[prow], operation_key=_fresh_key(),
            sequence=t.value(t.participants, prow, P.NEXT_SEQUENCE), canonical=canonical, memory=args.memory,
            reason=args.reason, staff=args.staff))
    except ServiceError as err:
        batch.replies.append((conn, reply(req_id, err.status, err.body())))
        return used
    batch.waiting.append((conn, req_id, status, rrow))  # (its receipt, once saved: Tick.answer)
    return used + records


# The operator's live receipts it keeps: nobody else can retire them, so once it holds this many
# it retires the older half itself before the next staff forget (their command bytes, reasons and
# staff names, stay in the runtime file's audit prefix: `audit export`).
OPERATOR_KEEP = 64


def _retire_oldest(d: Journaling, principal: bytes, prow: int) -> int:
    """The operator's older receipts retired when it holds OPERATOR_KEEP: journal records used. A
    retirement refused (a receipt below the floor not yet saved) is tried again at the next forget."""
    if len(d.state.live_sequences(prow)) < OPERATOR_KEEP:
        return 0
    t = d.state.tables
    sequence = t.value(t.participants, prow, P.NEXT_SEQUENCE)
    floor = sequence - OPERATOR_KEEP // 2
    try:
        return d.admit_as(principal, Kind.RETIREMENT, Retirement(
            lineage=d.state.participants.lineage_hex[prow], operation_key=_fresh_key(), sequence=sequence,
            canonical=operation_bytes("POST", RETIRE_PATH, {"retry_floor": str(floor)}), retry_floor=floor))[2]
    except ServiceError:
        return 0


def _fresh_key() -> str:
    """A new operation key (admission refuses one of the operator's live operations': 409)."""
    return secrets.token_hex(16)


READS: dict[str, Read] = {"ops.memory": ops_memory}
LATER: dict[str, Later] = {"ops.memory.forget": forget}
