"""The life of an admitted input after its admission (SPEC "Results and memory", "Recorded state
and recovery"), each step a journal transfer made saved before the next starts:

  LEASE       lease rows (storage/leases.py, revision 3, retention mode 1) once the admission is
              saved; the execution deadline starts when this lease is applied (saved)
  (engine)    the prompt is built and the engine thread generates (loop/runner.py)
  OUTPUT      result bytes at an offset, flushed every few hundred bytes or 100 ms
  COMPLETION  terminal status, finish reason and token counts

Readers see result bytes only once their OUTPUT transfer is saved. An input whose admission was
saved but which has no COMPLETION when the device restarts becomes `interrupted` at boot and is
never run again. Replay applies the same transfers through the same functions.
"""
from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack

from .ops import events
from .state.tables import Finish, P, R, Terminal, join16
from .storage import leases
from .storage.journal import JournalCorrupt, Transfer, TransferKind, record_count, segment_name

if TYPE_CHECKING:
    from .device import Device

OUTPUT_CHUNK = 480            # bytes per OUTPUT transfer: 4 records with its header
FLUSH_SECONDS = 0.1           # how stale unjournaled output may get
ENGINE_RECORDS_PER_TICK = 10  # engine work never takes the whole tick from admissions
FINISHES = {"stop": Finish.STOP, "length": Finish.LENGTH, "cancelled": Finish.CANCELLED,
            "deadline": Finish.DEADLINE}
TERMINAL_OF = {Finish.STOP: Terminal.SUCCEEDED, Finish.LENGTH: Terminal.SUCCEEDED,
               Finish.CANCELLED: Terminal.CANCELLED, Finish.DEADLINE: Terminal.DEADLINE_EXCEEDED,
               Finish.INTERRUPTED: Terminal.INTERRUPTED, Finish.FAILED: Terminal.FAILED}


@dataclass
class Execution:
    """Live state of one leased input (host side; its saved bytes are in the tables)."""
    rrow: int
    deadline_ns: int
    buffered: bytearray = field(default_factory=bytearray)
    offset: int = 0                # result bytes journaled so far (saved or in flight)
    flushed_at: float = 0.0
    finish: Finish = Finish.NONE   # set when the engine ended it; journaled as COMPLETION
    input_tokens: int = 0
    output_tokens: int = 0
    completing: bool = False       # its COMPLETION transfer is in flight


class Executions:
    """Inputs between their saved admission and their saved completion."""

    def __init__(self) -> None:
        self.live: dict[int, Execution] = {}      # receipt row -> leased, not yet completed
        self.to_lease: list[int] = []             # receipt rows whose admission is saved, awaiting a lease
        self.cancel_when_leased: set[int] = set()  # cancelled before their lease was saved


def media_link(sha256: str) -> str:
    return "\nmedia://" + sha256


# ---- building the model's input ----------------------------------------------------------

def _body(d: Device, rrow: int) -> dict[str, Any]:
    t = d.state.tables
    body: dict[str, Any] = json.loads(t.get_bytes(t.command_bytes, rrow, t.value(t.receipts, rrow, R.COMMAND_LEN)))["body"]
    return body


def input_text(d: Device, rrow: int) -> str:
    """The input's text with the device's media links appended."""
    body = _body(d, rrow)
    return str(body["text"]) + "".join(media_link(m["sha256"]) for m in body.get("media", []))


def conversation_turns(d: Device, rrow: int) -> list[dict[str, str]]:
    """The conversation's earlier succeeded turns before this input, then this input, as chat
    messages (copies of the saved bytes, taken on the tick thread: `fit_prompt` runs elsewhere)."""
    t = d.state.tables
    crow = t.value(t.receipts, rrow, R.TARGET)
    messages = []
    for earlier in d.state.conversations.inputs.get(crow, []):
        if earlier == rrow:
            break
        if t.value(t.receipts, earlier, R.TERMINAL) != Terminal.SUCCEEDED:
            continue
        answer = t.get_bytes(t.result_bytes, earlier, t.value(t.receipts, earlier, R.RESULT_LEN))
        messages += [{"role": "user", "content": input_text(d, earlier)},
                     {"role": "assistant", "content": answer.decode("utf-8", "replace")}]
    return messages + [{"role": "user", "content": input_text(d, rrow)}]


def fit_prompt(tokenizer: Any, messages: list[dict[str, str]], room: int) -> list[int] | None:
    """The prompt of the most recent turns that fit `room` tokens (turns are user + assistant
    pairs before the last message), or None when the input alone does not fit. Any thread: it
    reads nothing but its arguments. The number of oldest turns to drop is found by bisection
    (the prompt only shrinks as turns go), so a long history costs O(log turns) encodings, not
    one per dropped turn."""
    turns = (len(messages) - 1) // 2

    def encoded(dropped: int) -> list[int]:
        ids: list[int] = tokenizer.encode_chat(messages[2 * dropped:])
        return ids

    ids = encoded(0)
    if len(ids) <= room:
        return ids
    alone = encoded(turns)
    if len(alone) > room:
        return None
    low, high = 0, turns  # encoded(low) does not fit, encoded(high) does
    best = alone
    while high - low > 1:
        middle = (low + high) // 2
        candidate = encoded(middle)
        if len(candidate) <= room:
            high, best = middle, candidate
        else:
            low = middle
    return best


# ---- journal transfers -------------------------------------------------------------------

def _actor(d: Device, rrow: int) -> tuple[bytes, int]:
    t = d.state.tables
    row = t.row(t.receipts, rrow)
    return d.state.participants.raw[row[R.PARTICIPANT]], row[R.SEQUENCE]


def lease_payload(d: Device, rrows: list[int]) -> bytes:
    t = d.state.tables
    rows = []
    for i, rrow in enumerate(rrows):
        actor, sequence = _actor(d, rrow)
        rows.append(leases.LeaseRow(i, t.value(t.receipts, rrow, R.TARGET), sequence, actor, leases.RETAIN_SOURCE))
    return leases.encode(leases.COMPACT, rows)


def output_payload(d: Device, rrow: int, offset: int, data: bytes) -> bytes:
    actor, sequence = _actor(d, rrow)
    return msgpack.packb([actor, sequence, offset, data], use_bin_type=True)


def completion_payload(d: Device, rrow: int, finish: Finish, input_tokens: int, output_tokens: int) -> bytes:
    actor, sequence = _actor(d, rrow)
    return msgpack.packb([actor, sequence, int(finish), input_tokens, output_tokens], use_bin_type=True)


def has_work(d: Device) -> bool:
    """Whether a tick has engine transfers to journal now."""
    ex = d.executions
    return bool(ex.to_lease and d.runner is not None) or any(
        e.buffered and (e.finish or len(e.buffered) >= OUTPUT_CHUNK
                        or time.monotonic() - e.flushed_at >= FLUSH_SECONDS)
        or (e.finish and not e.completing) for e in ex.live.values())


def journal_work(d: Device, budget: int) -> int:
    """Append lease, output and completion transfers within budget; returns the records used."""
    ex = d.executions
    used = 0
    if ex.to_lease and d.runner is not None:
        rrows: list[int] = []
        while ex.to_lease and record_count(leases.HEADER.size + leases.ROW.size * (len(rrows) + 1)) <= budget:
            rrows.append(ex.to_lease.pop(0))
        if rrows:
            payload = lease_payload(d, rrows)
            d.append(TransferKind.LEASE, payload, functools.partial(lease_saved, d, rrows, live=True))
            used += record_count(len(payload))
    now = time.monotonic()
    for execution in list(ex.live.values()):
        while execution.buffered and (execution.finish or len(execution.buffered) >= OUTPUT_CHUNK
                                      or now - execution.flushed_at >= FLUSH_SECONDS):
            chunk = bytes(execution.buffered[:OUTPUT_CHUNK])
            payload = output_payload(d, execution.rrow, execution.offset, chunk)
            if used + record_count(len(payload)) > budget:
                return used
            d.append(TransferKind.OUTPUT, payload, functools.partial(apply_output, d, payload))
            del execution.buffered[:len(chunk)]
            execution.offset += len(chunk)
            execution.flushed_at = now
            used += record_count(len(payload))
        if execution.finish and not execution.buffered and not execution.completing:
            payload = completion_payload(d, execution.rrow, execution.finish, execution.input_tokens,
                                         execution.output_tokens)
            if used + record_count(len(payload)) > budget:
                return used
            d.append(TransferKind.COMPLETION, payload, functools.partial(apply_completion, d, payload))
            execution.completing = True
            used += record_count(len(payload))
    return used


# ---- applying them (live once saved, and at replay) --------------------------------------

def lease_saved(d: Device, rrows: list[int], transfer: Transfer, live: bool) -> None:
    """The lease is saved: the deadline starts and (live) the engine gets the inputs."""
    t = d.state.tables
    for rrow in rrows:
        t.write_row(t.receipts, rrow, {R.LEASE: transfer.seq})
    if not live:
        return
    assert d.runner is not None
    ex = d.executions
    deadline = time.time_ns() + d.runtime.runtime_profile["deadline_ms"] * 1_000_000
    for rrow in rrows:
        execution = ex.live[rrow] = Execution(rrow, deadline, flushed_at=time.monotonic())
        if rrow in ex.cancel_when_leased:
            ex.cancel_when_leased.discard(rrow)
            execution.finish = Finish.CANCELLED
            continue
        row = t.row(t.receipts, rrow)
        body = _body(d, rrow)
        owner = t.row(t.participants, row[R.PARTICIPANT])
        settings = {"max_new_tokens": row[R.MAX_OUTPUT], "page_limit": row[R.PAGE_LIMIT],
                    "temperature": float(body.get("temperature", 0.0)), "top_p": float(body.get("top_p", 1.0)),
                    # its principal's turn in the engine's round-robin, shared with its chats
                    "tenant": join16(owner[P.PRINCIPAL_HI], owner[P.PRINCIPAL_LO])}
        room = row[R.PAGE_LIMIT] * d.runtime.runtime_profile["page_size"] - row[R.MAX_OUTPUT]
        messages, tokenizer = conversation_turns(d, rrow), d.runner.engine.tokenizer
        d.off_thread(functools.partial(fit_prompt, tokenizer, messages, room),
                     functools.partial(_prompted, d, rrow, settings))


def _prompted(d: Device, rrow: int, settings: dict[str, Any], ids: list[int] | None,
              error: BaseException | None) -> None:
    """On the tick thread, the prompt built: the engine gets the input (unless it ended meanwhile:
    cancelled, or past its deadline)."""
    execution = d.executions.live.get(rrow)
    if execution is None or execution.finish or d.runner is None:
        return
    if error is not None or ids is None:
        execution.finish = Finish.FAILED
        return
    execution.input_tokens = len(ids)
    d.runner.submit(("input", rrow), ids, **settings)


def _inconsistent(d: Device, transfer: Transfer, reason: str) -> JournalCorrupt:
    return JournalCorrupt(os.path.join(d.journal_dir, segment_name(transfer.segment)), transfer.offset, reason)


def _input_row(d: Device, actor: bytes, sequence: int, transfer: Transfer, what: str) -> int:
    """The input a lease/output/completion transfer names; anything else fails closed."""
    from .ops.kind import Kind
    prow = d.state.participants.by_raw.get(actor)
    rrow = d.state.receipts.by_sequence.get((prow, sequence)) if prow is not None else None
    if rrow is None or d.state.tables.value(d.state.tables.receipts, rrow, R.KIND) != Kind.INPUT:
        raise _inconsistent(d, transfer, f"{what} transfer seq {transfer.seq} names no input at sequence {sequence}")
    return rrow


def replay_lease(d: Device, transfer: Transfer) -> None:
    try:
        _, rows = leases.decode(transfer.payload)  # every row checked before any is applied
    except leases.LeaseError as exc:
        raise _inconsistent(d, transfer, f"lease transfer seq {transfer.seq}: {exc}") from None
    rrows = [_input_row(d, row.actor, row.sequence, transfer, "lease") for row in rows]
    lease_saved(d, rrows, transfer, live=False)


def apply_output(d: Device, payload: bytes, transfer: Transfer) -> None:
    actor, sequence, offset, data = msgpack.unpackb(payload)
    rrow = _input_row(d, actor, sequence, transfer, "output")
    t = d.state.tables
    if offset != t.value(t.receipts, rrow, R.RESULT_LEN) or offset + len(data) > d.state.capacities["result_bytes"]:
        raise _inconsistent(d, transfer, f"output transfer seq {transfer.seq} at result offset {offset} does "
                                         "not follow the saved result")
    t.put_bytes(t.result_bytes, rrow, data, offset)
    t.write_row(t.receipts, rrow, {R.RESULT_LEN: offset + len(data)})
    events.output_saved(d, rrow, offset, data)


def apply_completion(d: Device, payload: bytes, transfer: Transfer) -> None:
    from .admission import record_save
    actor, sequence, finish, input_tokens, output_tokens = msgpack.unpackb(payload)
    rrow = _input_row(d, actor, sequence, transfer, "completion")
    t = d.state.tables
    finish = Finish(finish)
    t.write_row(t.receipts, rrow, {R.TERMINAL: TERMINAL_OF[finish], R.FINISH: finish, R.INPUT_TOKENS: input_tokens,
                                   R.OUTPUT_TOKENS: output_tokens})
    record_save(d, rrow, transfer, (1,))
    d.executions.live.pop(rrow, None)
    events.terminal_saved(d, rrow)


# ---- the engine's side ---------------------------------------------------------------------

def engine_event(d: Device, rrow: int, token: int | None, data: bytes, finish: str | None) -> None:
    execution = d.executions.live.get(rrow)
    if execution is None or execution.finish:
        return
    if token is not None:
        execution.output_tokens += 1
    room = d.state.capacities["result_bytes"] - execution.offset - len(execution.buffered)
    execution.buffered += data[:max(room, 0)]
    if len(data) > room and finish is None and d.runner is not None:
        d.runner.cancel(("input", rrow), "length")  # the result table row is full
    if finish is not None:
        execution.finish = FINISHES.get(finish, Finish.FAILED)


def cancel(d: Device, rrow: int) -> None:
    """Stop a live input now (a saved cancellation): its completion says `cancelled`."""
    ex = d.executions
    execution = ex.live.get(rrow)
    if execution is not None:
        if not execution.finish and d.runner is not None:
            d.runner.cancel(("input", rrow))
        execution.finish = execution.finish or Finish.CANCELLED
    elif rrow in ex.to_lease:
        ex.to_lease.remove(rrow)
        ex.live[rrow] = Execution(rrow, 0, finish=Finish.CANCELLED)
    else:  # saved but the lease is still in flight, or not yet saved: cancel once it starts
        ex.cancel_when_leased.add(rrow)


def check_deadlines(d: Device) -> None:
    now = time.time_ns()
    for rrow, execution in d.executions.live.items():
        if not execution.finish and now >= execution.deadline_ns:
            execution.finish = Finish.DEADLINE
            if d.runner is not None:
                d.runner.cancel(("input", rrow), "deadline")


def interrupt_unfinished(d: Device) -> None:
    """At boot: saved admissions with no completion never run again (SPEC)."""
    t = d.state.tables
    for rrows in d.state.conversations.inputs.values():
        for rrow in rrows:
            if t.value(t.receipts, rrow, R.TERMINAL) == Terminal.NONE:
                payload = completion_payload(d, rrow, Finish.INTERRUPTED, 0, 0)
                d.append(TransferKind.COMPLETION, payload, functools.partial(apply_completion, d, payload))


def stop_all(d: Device) -> None:
    """The unsaved outputs are gone (ENOSPC): stop every live input; they end at the next boot."""
    if d.runner is not None:
        for rrow in d.executions.live:
            d.runner.cancel(("input", rrow))
