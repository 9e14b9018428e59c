"""Events (SPEC "Results and memory"): a conversation's inputs as events in input order, and an
operation's output as byte spans, read once or followed as the device saves them.

Event cursors count conversation input order: the n-th input admitted to a conversation is event
n, for good (retiring receipts does not renumber). Only live receipts have events, so retirements
leave retired orders: below the `event_floor` (the first order still readable) when the oldest
inputs go, and holes above it when another member retires an input between two readable ones.
A read covers a window of orders — from the one after its cursor (order 1 without a cursor) to
its last event, or to the last order admitted when nothing follows — and says `gap` whenever a
retired order lies in that window, so a reader always knows it missed events (`window_gap`).
Every reader with the read right on the conversation's space sees every member's events; another
participant's `sequence` is null, as in receipts.

Followed reads are subscriptions (loop/subscriptions.py). A conversation subscription gets the
events after its cursor, then each new input's event when its admission is saved (the event as it
is then; `GET /operations/{op}/events` follows that input's output). An operation subscription
gets the saved output from its byte offset, then each output span as it is saved, then one
terminal event, which ends it. Each frame names its `event` — first `open` (the subscription is
accepted; a refusal is instead one error frame), then `event`, `gap`, `output` or `terminal` —
and, but for `open`, its `cursor`; its body is that event's JSON, ready for the stream's `data:`.
A `gap` frame goes before the first event after retired orders (or alone, when only retired
orders follow the cursor); its cursor is the last retired order it stands for, so resuming from
it (Last-Event-ID) neither repeats the gap nor skips an event. A subscription is opened against saved state only and rechecked whenever grants or
memberships change: a reader who lost the right gets a last frame with the error (403 or 404).
"""
from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..contract.commands import ConversationPage, ConversationSubscribe, OperationBytes, SubscriptionClose
from ..contract.errors import ServiceError
from ..contract.vocabulary import CHAT, ENVELOPE, READ
from ..contract.wire import Message, dumps, reply
from ..state.tables import C, R, Right
from . import access, chat, receipts
from .lists import byte_offset, byte_span
from .operations import refuse_past_deadline, visible_result

from .kind import Admitting, Context, Journaling, Notifying, Publishing, Read, Rendering, Serving, Tables

if TYPE_CHECKING:
    from ..loop.subscriptions import Subscription
    from ..storage.committer import Batch


# ---- one event ---------------------------------------------------------------------------------

def status_of(row: list[int], receipt: dict[str, Any]) -> str:
    if receipt["terminal"]["saved"]:
        status: str = receipt["terminal"]["status"]
        return status
    return "running" if row[R.LEASE] else "admitted"


def event(d: Rendering, rrow: int, own: bool) -> dict[str, Any]:
    """The event of one input: who, what was submitted, how far it is."""
    t = d.state.tables
    row = t.row(t.receipts, rrow)
    receipt = json.loads(receipts.render(d, rrow, own)[1])
    body = json.loads(t.get_bytes(t.command_bytes, rrow, row[R.COMMAND_LEN]))["body"]
    return {"cursor": str(row[R.ORDER]), "operation": receipt["operation"], "participant": receipt["participant"],
            "sequence": receipt["sequence"], "input": {k: v for k, v in body.items() if k not in ENVELOPE},
            "status": status_of(row, receipt), "result": receipt["result"], "admission": receipt["admission"],
            "terminal": receipt["terminal"]}


def _orders(d: Tables, crow: int) -> tuple[list[int], Sequence[int]]:
    """(event orders, receipt rows) of a conversation's live inputs, ascending."""
    t = d.state.tables
    rrows = d.state.conversations.inputs_of(crow)
    return [t.value(t.receipts, r, R.ORDER) for r in rrows], rrows


def event_floor(d: Tables, crow: int, orders: list[int]) -> int:
    t = d.state.tables
    return orders[0] if orders else t.value(t.conversations, crow, C.INPUTS) + 1


def window_gap(first: int, last: int, readable: int) -> bool:
    """Whether a read covering orders first..last, of which `readable` are live events, steps
    over a retired one (orders are numbered without holes, so any shortfall is retired)."""
    return last >= first and readable < last - first + 1


# ---- the read --------------------------------------------------------------------------------------

def list_events(d: Admitting, principal: bytes, args: ConversationPage) -> tuple[int, object]:
    prow = d.state.participants.by_principal.get(principal)
    crow = access.conversation_row(d, args.conversation, principal, prow, Right.READ)
    cursor, limit = args.after, args.limit
    orders, rrows = _orders(d, crow)
    floor = event_floor(d, crow, orders)
    start = bisect.bisect_right(orders, cursor) if cursor is not None else 0
    page = rrows[start:start + limit]
    items = [event(d, r, d.state.tables.value(d.state.tables.receipts, r, R.PARTICIPANT) == prow) for r in page]
    more = start + limit < len(rrows)
    # the window this page covers: after the cursor, to its last event (more follow) or to the last order
    t = d.state.tables
    last = orders[start + len(page) - 1] if more else t.value(t.conversations, crow, C.INPUTS)
    gap = window_gap((cursor or 0) + 1, last, len(page))
    return 200, {"items": items, "next_cursor": items[-1]["cursor"] if more and items else None,
                 "gap": gap, "event_floor": str(floor)}


READS: dict[str, Read] = {"conversations.events": list_events}


# ---- subscriptions -----------------------------------------------------------------------------------

def _deferred(d: Journaling, conn: object, msg: Message, batch: Batch) -> bool:
    """A subscription opens against saved state only: while anything is unsaved it waits, as a
    read does, until the saves before it are done (then the device answers it again)."""
    if d.committer.writer.queued_records:
        batch.reads.append((conn, msg))
        return True
    return False


def _refuse(d: Publishing, conn: object, msg: Message, err: ServiceError) -> None:
    d.subscriptions.outbox.append((conn, reply(msg.get("id"), err.status, err.body())))


def open_conversation(d: Context, conn: object, msg: Message, batch: Batch) -> int:
    """`conversations.subscribe {conversation, cursor?}`: the events after cursor, then new ones."""
    if _deferred(d, conn, msg, batch):
        return 0
    try:
        principal = d.principal(msg, READ)
        args = d.args(msg, ConversationSubscribe)
        prow = d.state.participants.by_principal.get(principal)
        crow = access.conversation_row(d, args.conversation, principal, prow, Right.READ)
        cursor = None if args.cursor is None else int(args.cursor)
    except ServiceError as err:
        _refuse(d, conn, msg, err)
        return 0
    sub = d.subscriptions.open(conn, msg["id"], ("con", crow), principal, {"conversation": args.conversation})
    orders, rrows = _orders(d, crow)
    floor = event_floor(d, crow, orders)
    d.subscriptions.push(sub, dumps({"event_floor": str(floor)}), event="open")
    start = bisect.bisect_right(orders, cursor) if cursor is not None else 0
    t = d.state.tables
    gap = dumps({"gap": True, "event_floor": str(floor)})
    seen = cursor or 0  # the last order this reader has been told about, an event or a gap
    for rrow, order in zip(rrows[start:], orders[start:]):
        if window_gap(seen + 1, order - 1, 0):  # retired orders before this event
            d.subscriptions.push(sub, gap, event="gap", cursor=str(order - 1))
        own = t.value(t.receipts, rrow, R.PARTICIPANT) == prow
        d.subscriptions.push(sub, dumps(event(d, rrow, own)), event="event", cursor=str(order))
        seen = order
    admitted = t.value(t.conversations, crow, C.INPUTS)
    if window_gap(seen + 1, admitted, 0):  # only retired orders after the last event
        d.subscriptions.push(sub, gap, event="gap", cursor=str(admitted))
    return 0


def input_saved(d: Notifying, rrow: int) -> None:
    """An input's admission is saved: its event goes to the conversation's subscribers."""
    t = d.state.tables
    subs = d.subscriptions.of(("con", t.value(t.receipts, rrow, R.TARGET)))
    if not subs:
        return
    author = t.value(t.receipts, rrow, R.PARTICIPANT)
    readers: dict[bool, list[Subscription]] = {True: [], False: []}  # the author's own, everyone else's
    by_principal = d.state.participants.by_principal
    for sub in subs:
        readers[by_principal.get(sub.principal or b"") == author].append(sub)
    cursor = str(t.value(t.receipts, rrow, R.ORDER))
    for own, group in readers.items():
        if group:
            d.subscriptions.push_all(group, dumps(event(d, rrow, own)), event="event", cursor=cursor)


def _span(offset: int, data: bytes) -> bytes:
    """An `output` event: the span as a result read shows it (lists.byte_span)."""
    return dumps(byte_span(data, offset))


def _terminal(d: Rendering, rrow: int, own: bool) -> tuple[bytes, str]:
    """(the terminal event, its cursor: the result's length)."""
    t = d.state.tables
    row = t.row(t.receipts, rrow)
    receipt = json.loads(receipts.render(d, rrow, own)[1])
    return dumps({"operation": receipt["operation"], "status": status_of(row, receipt), "result": receipt["result"],
                  "terminal": receipt["terminal"]}), str(row[R.RESULT_LEN])


def open_operation(d: Context, conn: object, msg: Message, batch: Batch) -> int:
    """`operations.subscribe {operation, offset}`: saved output from offset, new spans as they are
    saved, then the terminal event (at once for an operation that has ended, or never executes)."""
    if _deferred(d, conn, msg, batch):
        return 0
    try:
        principal = d.principal(msg, READ)
        args = d.args(msg, OperationBytes)
        rrow, own = visible_result(d, principal, args.operation)
        t = d.state.tables
        refuse_past_deadline(t.row(t.receipts, rrow))
        length = t.value(t.receipts, rrow, R.RESULT_LEN)
        offset = byte_offset(args.offset, length)
    except ServiceError as err:
        _refuse(d, conn, msg, err)
        return 0
    sub = d.subscriptions.open(conn, msg["id"], ("op", rrow), principal,
                               {"operation": args.operation, "offset": length, "own": own})
    d.subscriptions.push(sub, dumps({"offset": str(offset), "length": str(length)}), event="open")
    if length > offset:
        d.subscriptions.push(sub, _span(offset, t.get_bytes(t.result_bytes, rrow, length - offset, offset)),
                             event="output", cursor=str(length))
    if t.value(t.receipts, rrow, R.TERM_TRANSFER) or not d.kinds[t.value(t.receipts, rrow, R.KIND)].executes:
        body, cursor = _terminal(d, rrow, own)
        d.subscriptions.end(sub, 200, body, event="terminal", cursor=cursor)
    return 0


def output_saved(d: Publishing, rrow: int, offset: int, data: bytes) -> None:
    subs = d.subscriptions.of(("op", rrow))
    if not subs:
        return
    due = [sub for sub in subs if offset >= sub.data["offset"]]  # not already sent when it opened
    for sub in due:
        sub.data["offset"] = offset + len(data)
    if due:
        d.subscriptions.push_all(due, _span(offset, data), event="output", cursor=str(offset + len(data)))


def terminal_saved(d: Notifying, rrow: int) -> None:
    """An operation's terminal is saved: its streams end with the terminal event, or with the
    504 its result read answers when it exceeded its deadline."""
    subs = d.subscriptions.of(("op", rrow))
    t = d.state.tables
    try:
        refuse_past_deadline(t.row(t.receipts, rrow))
    except ServiceError as err:
        if subs:
            d.subscriptions.end_all(subs, err.status, err.body())
        return
    for own in (True, False):
        group = [sub for sub in subs if sub.data["own"] is own]
        if group:
            body, cursor = _terminal(d, rrow, own)
            d.subscriptions.end_all(group, 200, body, event="terminal", cursor=cursor)


def state_rebuilt(d: Serving) -> None:
    """The state was rebuilt from what is saved (ENOSPC: Context.refuse_unsaved). Replay hands
    out receipt rows in its own order, so a receipt's row may differ from the one it had live:
    each operation subscription finds its receipt again by operation ID (or ends as a new read
    would be refused). Conversation rows are handed out the same way live and at replay."""
    for sub in d.subscriptions.all():
        if sub.topic[0] != "op":
            continue
        try:
            rrow, _ = visible_result(d, sub.principal or b"", sub.data["operation"])
        except ServiceError as err:
            d.subscriptions.end(sub, err.status, err.body())
            continue
        d.subscriptions.move(sub, ("op", rrow))


def close(d: Serving, conn: object, msg: Message, batch: Batch) -> int:
    """`subscriptions.close {id}`: the gateway's client went away. Never cancels execution (a
    chat, which has no existence beyond its stream, stops)."""
    try:
        target = d.args(msg, SubscriptionClose).id
    except ServiceError as err:
        batch.replies.append((conn, reply(msg.get("id"), err.status, err.body())))
        return 0
    sub = d.subscriptions.close(conn, target)
    if sub is not None and sub.topic[0] == "chat":
        chat.cancel(d, sub.topic, len(sub.data["choices"]))
    batch.replies.append((conn, reply(msg.get("id"), 200, b'{"closed":' + (b"true" if sub else b"false") + b"}")))
    return 0


def recheck(d: Serving) -> None:
    """Grants or memberships changed: end every subscription whose reader lost the right."""
    for sub in d.subscriptions.all():
        principal = sub.principal or b""
        kind, _ = sub.topic
        try:
            if kind == "chat":
                if not d.grants.allows(principal.hex(), CHAT):
                    raise ServiceError(403, "grant_missing", f"principal has no current {CHAT} grant")
                continue
            if not d.grants.allows(principal.hex(), READ):
                raise ServiceError(403, "grant_missing", f"principal has no current {READ} grant")
            prow = d.state.participants.by_principal.get(principal)
            if kind == "con":
                access.conversation_row(d, sub.data["conversation"], principal, prow, Right.READ)
            else:
                visible_result(d, principal, sub.data["operation"])
        except ServiceError as err:
            d.subscriptions.end(sub, err.status, err.body())
            if kind == "chat":
                chat.cancel(d, sub.topic, len(sub.data["choices"]))
