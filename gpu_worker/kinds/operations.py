"""Operation reads: the caller's own receipts by sequence, one receipt (another participant's
where its kind says the caller may see it, with null sequence counters), and an operation's
result bytes from a byte offset (SPEC "Results and memory")."""
from __future__ import annotations

import bisect

from ..contract import ids
from ..contract.commands import OperationBytes, OperationRef, Page, ReceiptFilter
from ..contract.errors import ServiceError
from ..contract.wire import RawJSON
from .. import derived
from ..state.tables import C, R, Terminal, join16
from . import access, receipts
from .lists import byte_offset, byte_span, page

from .kind import Admitting, Caller, Read, Rendering, Tables



def visible_receipt(d: Caller, principal: bytes, op: str) -> tuple[int, bool]:
    """(receipt row, own) of an operation the principal may read; 410 once retired, else 404."""
    m = ids.OPERATION_ID.match(op)
    if not m:
        raise ServiceError(404, "operation_not_found", f"no operation {op} visible to this principal")
    lineage, raw = ids.split_id(m)
    state = d.state
    rrow = state.receipts.op_row(raw)
    caller = state.participants.by_principal.get(principal)
    if rrow is not None:
        t = state.tables
        row = t.row(t.receipts, rrow)
        if state.participants.lineage_at(row[R.PARTICIPANT], row[R.CREATED]) == lineage:
            if row[R.PARTICIPANT] == caller:
                return rrow, True
            if d.kinds[row[R.KIND]].visible_to(d, principal, caller, row):
                return rrow, False
    elif caller is not None:
        # retired (410) only if this state's history issued it to the caller; an ID of a line of
        # history a restore left behind (lost with the journal's tail) was never issued here (404)
        counter = derived.operation_counter(state.incarnation, raw, state.participants.nonce_at)
        if counter is not None and state.participants.lineage_at(caller, counter) == lineage:
            raise ServiceError(410, "operation_retired", f"operation {op} was retired")
    raise ServiceError(404, "operation_not_found", f"no operation {op} visible to this principal")


def visible_result(d: Caller, principal: bytes, op: str) -> tuple[int, bool]:
    """visible_receipt, for the operation's result bytes and output events. SPEC: current grants
    intersect with stored membership on each read. An input's result is made from its space (the
    conversation's earlier turns, the room's memory): even its own submitter reads it only while it
    may read that space (a member removed from a room, or left with a zero-rights or write-only row,
    does not); its receipt (status, counts) stays readable to it. 403 `right_missing` otherwise."""
    rrow, own = visible_receipt(d, principal, op)
    if own:
        t = d.state.tables
        row = t.row(t.receipts, rrow)
        if d.kinds[row[R.KIND]].executes:
            crow = row[R.TARGET]
            if t.value(t.conversations, crow, C.STATE) == 1 and not access.space_readable(
                    d, principal, row[R.PARTICIPANT], t.value(t.conversations, crow, C.SPACE)):
                raise ServiceError(403, "right_missing", f"this participant can no longer read the space of {op}: "
                                                         "its result bytes are withheld (its receipt stays readable)")
    return rrow, own


def list_operations(d: Rendering, principal: bytes, args: Page) -> tuple[int, object]:
    cursor, limit = args.after, args.limit
    prow = d.state.participants.by_principal.get(principal)
    seqs = d.state.live_sequences(prow) if prow is not None else range(0)
    start = bisect.bisect_right(seqs, cursor) if cursor is not None else 0
    page = seqs[start:start + limit]
    row_of = d.state.receipts.row_of
    # prow is None only where seqs is empty
    items = [RawJSON(receipts.receipt_bytes(d, row_of(prow, s))) for s in page]  # type: ignore[arg-type]
    more = start + limit < len(seqs)
    return 200, {"items": items, "next_cursor": str(page[-1]) if more and page else None}


def get_operation(d: Admitting, principal: bytes, args: OperationRef) -> tuple[int, object]:
    rrow, own = visible_receipt(d, principal, args.operation)
    return 200, RawJSON(receipts.receipt_bytes(d, rrow, own=own))


def read_result(d: Caller, principal: bytes, args: OperationBytes) -> tuple[int, object]:
    """An operation's saved result bytes from a byte offset: exact base64, `text` null unless the
    span is complete UTF-8 (nothing is ever replaced); 504 past its execution deadline."""
    rrow, _ = visible_result(d, principal, args.operation)
    return result(d, rrow, args)


def refuse_past_deadline(row: list[int]) -> None:
    """504 for an operation whose saved terminal is `deadline_exceeded` (SPEC: a request that
    exceeds its execution deadline returns 504): its result read and its event stream alike."""
    if row[R.TERMINAL] == Terminal.DEADLINE_EXCEEDED:
        raise ServiceError(504, "deadline_exceeded", "the operation exceeded its execution deadline")


def result(d: Tables, rrow: int, args: OperationBytes) -> tuple[int, object]:
    t = d.state.tables
    row = t.row(t.receipts, rrow)
    if not d.kinds[row[R.KIND]].executes:
        raise ServiceError(409, "no_result", "this operation has no result bytes")
    refuse_past_deadline(row)
    length = row[R.RESULT_LEN]
    offset = byte_offset(args.offset, length)
    ended = row[R.TERM_TRANSFER] != 0
    return 200, {
        "operation": ids.operation_id(d.state.participants.lineage_at(row[R.PARTICIPANT], row[R.CREATED]),
                                      join16(row[R.OP_HI], row[R.OP_LO])),
        **byte_span(t.get_bytes(t.result_bytes, rrow, length - offset, offset), offset), "complete": ended,
        "status": receipts.TERMINAL_NAMES[row[R.TERMINAL]] if ended else ("running" if row[R.LEASE] else "admitted"),
        "finish": receipts.FINISH_NAMES.get(row[R.FINISH]) if ended else None,
        "input_tokens": str(row[R.INPUT_TOKENS]) if ended else None,
        "output_tokens": str(row[R.OUTPUT_TOKENS]) if ended else None,
    }


READS: dict[str, Read] = {"operations.list": list_operations, "operations.get": get_operation,
                                   "operations.result": read_result}


# ---- ops reads (the local socket, no principal: the admin's receipt browser) ---------------------

_STATUS_CODES = {name: code for code, name in receipts.TERMINAL_NAMES.items()}


def _any_receipt(d: Tables, op: object) -> int:
    m = ids.OPERATION_ID.match(op) if isinstance(op, str) else None
    rrow = d.state.receipts.op_row(ids.split_id(m)[1]) if m else None
    if rrow is None:
        raise ServiceError(404, "operation_not_found", f"no live operation {op}")
    return rrow


def ops_receipts(d: Rendering, principal: bytes | None, args: ReceiptFilter) -> tuple[int, object]:
    """Every live receipt, in admission order, filtered by participant, kind, status and save state."""
    table = d.state.tables.receipts
    mask = table[:, R.STATE] == 1
    if args.participant is not None:
        m = ids.PARTICIPANT_ID.match(args.participant)
        prow = d.state.participants.by_raw.get(bytes.fromhex(m.group(1))) if m else None
        mask &= table[:, R.PARTICIPANT] == (prow if prow is not None else -1)
    if args.kind is not None:
        kind = next((k.code for k in d.kinds.values() if k.name == args.kind), None)
        if kind is None:
            raise ServiceError(400, "bad_field", f"kind must be one of {sorted(k.name for k in d.kinds.values())}")
        mask &= table[:, R.KIND] == kind
    status = args.status
    if status is not None:
        if status == "admitted":
            mask &= (table[:, R.TERMINAL] == Terminal.NONE) & (table[:, R.LEASE] == 0)
        elif status == "running":
            mask &= (table[:, R.TERMINAL] == Terminal.NONE) & (table[:, R.LEASE] != 0)
        elif status in _STATUS_CODES:
            mask &= (table[:, R.TERMINAL] == _STATUS_CODES[status]) & (table[:, R.TERM_TRANSFER] != 0)
        else:
            raise ServiceError(400, "bad_field", "status must be admitted, running or a terminal status")
    saved = args.saved
    if saved is not None:
        conditions = {"unsaved": table[:, R.ADM_TRANSFER] == 0,
                      "admission": (table[:, R.ADM_TRANSFER] != 0) & (table[:, R.TERM_TRANSFER] == 0),
                      "terminal": table[:, R.TERM_TRANSFER] != 0}
        if saved not in conditions:
            raise ServiceError(400, "bad_field", "saved must be unsaved, admission or terminal")
        mask &= conditions[saved]
    cursor, limit = args.after, args.limit
    rows, next_cursor = page(table, R.CREATED, mask, cursor, limit)
    return 200, {"items": [RawJSON(receipts.receipt_bytes(d, r)) for r in rows], "next_cursor": next_cursor}


def ops_receipt(d: Rendering, principal: bytes | None, args: OperationRef) -> tuple[int, object]:
    return 200, RawJSON(receipts.receipt_bytes(d, _any_receipt(d, args.operation)))


def ops_result(d: Tables, principal: bytes | None, args: OperationBytes) -> tuple[int, object]:
    return result(d, _any_receipt(d, args.operation), args)


def ops_command(d: Tables, principal: bytes | None, args: OperationRef) -> tuple[int, object]:
    """An operation's canonical command bytes as its receipt keeps them (a forgotten text
    emptied: docs/memory.md "Forgetting"), whoever's it is: what a staff forget's reason is read
    from."""
    rrow = _any_receipt(d, args.operation)
    t = d.state.tables
    data = t.get_bytes(t.command_bytes, rrow, t.value(t.receipts, rrow, R.COMMAND_LEN))
    return 200, {"operation": args.operation, **byte_span(data, 0)}


OPS_READS: dict[str, Read] = {"ops.receipts": ops_receipts, "ops.receipt": ops_receipt, "ops.result": ops_result,
                              "ops.command": ops_command}
