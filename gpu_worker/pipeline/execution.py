"""The life of an admitted input after its admission (SPEC "Results and memory", "Recorded state
and recovery"), each step a journal transfer made saved before the next starts:

  LEASE       lease rows (storage/leases.py: the revision and retention mode its admission
              recorded) once the admission is saved, the input before it in its conversation
              has its saved terminal, and its principal's turn comes (`LeaseQueue`); the
              execution deadline starts when this lease is applied (saved), and covers
              everything below, up to the append of its COMPLETION
  (memory)    the query is embedded (helper thread), the conversation's memory owner recalled
              (tick thread, bounded by the memory capacity) and rendered per the revision
  MEMORY      the input's source text retained as a memory row (or why not: a full table, a quota)
  (engine)    the prompt is built (helper thread) and the engine thread generates
  OUTPUT      result bytes at an offset, flushed every few hundred bytes or 100 ms
  MEMORY      retention mode 2: the same model's interpretation of the turn
  COMPLETION  terminal status, finish reason and token counts

Once leased, an input is in one `Phase` (state/executions.py) — MEMORY, QUEUED, GENERATING,
INTERPRETING (mode 2), ENDED, CONTROLLED (revision 5), COMPLETING — and moves only through
`Execution.move` / `Execution.end`, which refuse a move its phase does not lead to (`MOVES`).
Every step here first asks the phase whether it still applies: a helper thread's result for an
input that a cancellation or its deadline ended meanwhile changes nothing.

One conversation runs one input at a time, in conversation order (DESIGN §8): only succeeded
turns enter a prompt, so the next input waits, unleased and cancellable, until the one before has
its saved terminal, and its prompt then holds that turn. Its deadline does not run meanwhile (SPEC:
it starts when the lease is applied; DESIGN's "its deadline running" yields to it).

Leases are fair per principal (the participant's): ready admissions wait per principal, FIFO
within one and round-robin across them, and a principal's next input is leased only while fewer
than LEASE_AHEAD of its leased inputs have not started generating. Everything after the lease —
the embedding and the prompt on helper threads, a place in the engine's queue — runs on the
deadline's clock, so a principal with many queued inputs holds at most that many there: the rest
wait unleased (their deadlines not started), and another principal's single input is leased at
its next turn, not behind the backlog, and does not share the helper threads with it.

Readers see result bytes only once their OUTPUT transfer is saved. An input whose admission was
saved but which has no COMPLETION when the device restarts becomes `interrupted` at boot and is
never run again, so it never repeats its memory input; so does every unfinished input once the
journal takes writes again after an ENOSPC rebuilt the state (`interrupt_after_failure`). A
cancellation stops what is still to do and leaves memory already written. Replay applies the same
transfers through the same functions. The transfers' payloads are pipeline/transfers.py; the MEMORY
steps (retention, interpretation) pipeline/retention.py.
"""
from __future__ import annotations

import functools
import struct
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

import msgpack
import numpy as np

from ..contract import structured
from ..contract.ids import participant_id
from ..engine.grammar import schema_grammar
from . import images
from ..memory import render
from ..memory.rows import Flag
from ..memory.rows import Kind as MemoryKind
from ..memory import shared as memory
from ..kinds import events, history, quotas
from ..kinds.inputs import input_body, input_text, media_links
from ..kinds.kind import Admitting, Context, Executing, Kind, Notifying, Rendering, Running, Tables
from .prompt import fit_prompt
from .retention import control_record, interpret, retain
from .transfers import (actor_of, completion_payload, inconsistent, input_row, lease_payload, lease_revision,
                        output_payload)
from ..state.executions import IN_THE_ENGINE, LEASE_AHEAD, READY_TO_COMPLETE, Execution, Phase
from ..state.tables import C, Finish, P, R, Terminal, join16
from ..storage import leases
from ..storage.journal import Transfer, TransferKind, record_count

T = TypeVar("T")

if TYPE_CHECKING:
    import torch


OUTPUT_CHUNK = 480            # bytes per OUTPUT transfer: 4 records with its header
FLUSH_SECONDS = 0.1           # how stale unjournaled output may get
ENGINE_RECORDS_PER_TICK = 10  # engine work never takes the whole tick from admissions
FINISHES = {"stop": Finish.STOP, "length": Finish.LENGTH, "cancelled": Finish.CANCELLED,
            "deadline": Finish.DEADLINE}
TERMINAL_OF = {Finish.STOP: Terminal.SUCCEEDED, Finish.LENGTH: Terminal.SUCCEEDED,
               Finish.CANCELLED: Terminal.CANCELLED, Finish.DEADLINE: Terminal.DEADLINE_EXCEEDED,
               Finish.INTERRUPTED: Terminal.INTERRUPTED, Finish.FAILED: Terminal.FAILED}
# a completion's finish code -> its Finish, for those a completion may have (`replay_ends`)
_FINISHES = {int(finish): finish for finish in TERMINAL_OF}
# a completion's columns from TERM_TRANSFER on, in one write: its save fields, its counts, its finish
_ENDED = struct.Struct("<7q")
_INPUT = int(Kind.INPUT)
_INT64 = 1 << 63
assert (R.TERM_SOURCE + 1, R.INPUT_TOKENS + 1, R.OUTPUT_TOKENS + 1) == (R.INPUT_TOKENS, R.OUTPUT_TOKENS, R.FINISH)


# ---- building the model's input ----------------------------------------------------------

def conversation_turns(d: Tables, rrow: int, everyone: bool = True) -> list[dict[str, str]]:
    """The conversation's earlier succeeded turns before this input, in event order, then this
    input, as chat messages: the retired ones from its history (kinds/history.py), the others from
    their live receipts (copies of the saved bytes, taken on the tick thread: `fit_prompt` runs
    elsewhere). Every member's turns when its submitter may read the space (`everyone`), else
    (a write-only member, or one without its read grant now) the submitter's own only: a prompt
    never carries bytes its submitter could not read (DESIGN §8)."""
    t = d.state.tables
    crow = t.value(t.receipts, rrow, R.TARGET)
    order = t.value(t.receipts, rrow, R.ORDER)
    submitter = t.value(t.receipts, rrow, R.PARTICIPANT)
    earlier = [(turn_order, user, answer) for turn_order, author, user, answer in history.turns(d, crow)
               if turn_order < order and (everyone or author == submitter)]
    for other in d.state.conversations.inputs_of(crow):
        if other == rrow:
            break
        if t.value(t.receipts, other, R.TERMINAL) != Terminal.SUCCEEDED:
            continue
        if not everyone and t.value(t.receipts, other, R.PARTICIPANT) != submitter:
            continue
        result = t.get_bytes(t.result_bytes, other, t.value(t.receipts, other, R.RESULT_LEN))
        earlier.append((t.value(t.receipts, other, R.ORDER), input_text(d, other), result.decode("utf-8", "replace")))
    messages: list[dict[str, str]] = []
    for _, user, answer in sorted(earlier):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return messages + [{"role": "user", "content": input_text(d, rrow)}]


def has_work(d: Running) -> bool:
    """Whether a tick has engine transfers to journal now (none while the disk is full)."""
    ex = d.executions
    if not d.holds.writable:
        return False
    return bool(ex.to_interrupt) or bool(ex.to_lease and d.runner is not None and ex.leasable()) or any(
        e.buffered and (e.finish or len(e.buffered) >= OUTPUT_CHUNK
                        or time.monotonic() - e.flushed_at >= FLUSH_SECONDS)
        or e.phase in READY_TO_COMPLETE for e in ex.live.values())


def journal_work(d: Context, budget: int) -> int:
    """Append lease, output and completion transfers within budget; returns the records used.
    Nothing while the disk is full (a `disk_full` hold): the first tick the journal takes again
    ends the inputs an ENOSPC stopped (`to_interrupt`)."""
    ex = d.executions
    used = 0
    if not d.holds.writable:
        return used
    while ex.to_interrupt:
        rrow = ex.to_interrupt[0]
        payload = completion_payload(d, rrow, Finish.INTERRUPTED, 0, 0)
        if used + record_count(len(payload)) > budget:
            return used
        del ex.to_interrupt[0]
        d.append(TransferKind.COMPLETION, payload, functools.partial(apply_completion, d, payload))
        used += record_count(len(payload))
    if ex.to_lease and d.runner is not None:
        rrows = _lease_turns(d, budget)
        if rrows:
            revision = lease_revision(d, rrows[0])
            payload = lease_payload(d, rrows)
            d.append(TransferKind.LEASE, payload,
                     functools.partial(lease_saved, d, rrows, live=True, revision=revision))
            used += record_count(len(payload))
    now, now_ns = time.monotonic(), time.time_ns()
    for execution in list(ex.live.values()):
        _expire(d, execution, now_ns)  # up to its completion's append, the deadline can still end it
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
        if execution.phase in READY_TO_COMPLETE and not execution.buffered:
            if execution.phase is Phase.ENDED and execution.revision == leases.AFFECT_MANAGED:
                control_record(d, execution)  # its control record, before its completion
                execution.move(Phase.CONTROLLED)
            payload = completion_payload(d, execution.rrow, execution.finish, execution.input_tokens,
                                         execution.output_tokens)
            if used + record_count(len(payload)) > budget:
                return used
            d.append(TransferKind.COMPLETION, payload, functools.partial(apply_completion, d, payload))
            execution.move(Phase.COMPLETING)
            used += record_count(len(payload))
    return used


def _lease_turns(d: Executing, budget: int) -> list[int]:
    """The rows of this tick's lease, taken in turn (LeaseQueue): round after round, each
    participant that may have another input ahead (`Executions.leasable`) gives the head of its
    queue, while the lease fits `budget` records. One lease carries one revision (its header
    does), the first taken's: a participant whose head has another waits for a later tick,
    keeping its place in the turn order."""
    ex = d.executions
    queue, ahead = ex.to_lease, ex.ahead()
    rrows: list[int] = []
    revision = None
    while record_count(leases.HEADER.size + leases.ROW.size * (len(rrows) + 1)) <= budget:
        turns = [prow for prow in queue.queues if ahead[prow] < LEASE_AHEAD
                 and (revision is None or lease_revision(d, queue.queues[prow][0]) == revision)]
        if not turns:
            break
        for prow in turns:
            if record_count(leases.HEADER.size + leases.ROW.size * (len(rrows) + 1)) > budget:
                break
            if revision is None:
                revision = lease_revision(d, queue.queues[prow][0])
            elif lease_revision(d, queue.queues[prow][0]) != revision:
                continue
            rrow = queue.take(prow)
            rrows.append(rrow)
            ex.leasing[rrow] = prow
            ahead[prow] += 1
    return rrows


# ---- applying them (live once saved, and at replay) --------------------------------------

def lease_saved(d: Admitting, rrows: list[int], transfer: Transfer, live: bool, revision: int = leases.COMPACT,
                modes: list[int | None] | None = None) -> None:
    """The lease is saved: its recorded revision and retention modes are the inputs' (recovery
    uses them, never the current qualification: a row of revision 0 or 1 has no mode, and reads
    mode 1 until an interpretation record says 2), the deadline starts, and (live) each input
    goes on to its memory: the query is embedded on a helper thread (`_embedded` follows)."""
    t = d.state.tables
    modes = modes or [t.value(t.receipts, rrow, R.RETENTION) for rrow in rrows]
    for rrow, mode in zip(rrows, modes):
        t.write_row(t.receipts, rrow, {R.LEASE: transfer.seq, R.REVISION: revision + 1,
                                       R.RETENTION: mode or leases.RETAIN_SOURCE})
    if not live:
        return
    assert d.runner is not None
    ex = d.executions
    deadline = time.time_ns() + d.runtime.runtime_profile["deadline_ms"] * 1_000_000
    for rrow, mode in zip(rrows, modes):
        execution = ex.live[rrow] = Execution(rrow, deadline, flushed_at=time.monotonic(),
                                              mode=mode or leases.RETAIN_SOURCE, revision=revision,
                                              participant=t.value(t.receipts, rrow, R.PARTICIPANT))
        ex.leasing.pop(rrow, None)
        if rrow in ex.cancel_when_leased:
            ex.cancel_when_leased.discard(rrow)
            execution.end(Finish.CANCELLED)
            continue
        body = input_body(d, rrow)
        text, links = str(body["text"]), media_links(body)
        query = render.query(revision, text, links)
        texts = [query] if query == text + links else [query, text + links]
        d.off_thread(functools.partial(d.embedder.encode, texts), functools.partial(_embedded, d, rrow, body))


def _embedded(d: Admitting, rrow: int, body: dict[str, Any], vectors: torch.Tensor | None,
              error: BaseException | None) -> None:
    """On the tick thread, the query embedded: recall from the conversation's memory, retain the
    source (a MEMORY transfer, applied now like an admission), and build the prompt with the
    recalled memory on a helper thread. Its context is what its submitter may read now, its lease
    saved (`memory.context_reader`): the recalled rows and the earlier turns are filtered by its
    read rights. Nothing happens for an input that ended meanwhile (cancelled, or past its
    deadline, which covers this memory work)."""
    execution = d.executions.live.get(rrow)
    if execution is None or execution.phase is not Phase.MEMORY or d.runner is None:
        return
    if error is not None or vectors is None:  # (the embedding failed)
        execution.end(Finish.FAILED)
        return
    t = d.state.tables
    srow = t.value(t.conversations, t.value(t.receipts, rrow, R.TARGET), C.SPACE)
    readable, reads_space = memory.context_reader(d, rrow)
    items = memory.recall_items(d, srow, vectors[0], readable)
    flags = Flag.MANAGED if execution.revision == leases.AFFECT_MANAGED else 0
    retain(d, rrow, MemoryKind.SOURCE, flags, None, vectors[-1])
    row = t.row(t.receipts, rrow)
    owner = t.row(t.participants, row[R.PARTICIPANT])
    settings = {"max_new_tokens": row[R.MAX_OUTPUT], "page_limit": row[R.PAGE_LIMIT],
                "temperature": float(body.get("temperature", 0.0)), "top_p": float(body.get("top_p", 1.0)),
                # its principal's turn in the engine's round-robin, shared with its chats
                "tenant": join16(owner[P.PRINCIPAL_HI], owner[P.PRINCIPAL_LO])}
    room = row[R.PAGE_LIMIT] * d.runtime.runtime_profile["page_size"] - row[R.MAX_OUTPUT]
    messages, tokenizer = conversation_turns(d, rrow, everyone=reads_space), d.runner.engine.tokenizer
    system = render.render(execution.revision, items, submitter=participant_id(actor_of(d, rrow)[0]))
    schema = structured.schema_of(body.get("response_format"))
    grammars = d.runner.engine.grammars

    def constrained(work: Callable[[], T]) -> Callable[[], T]:
        """`work` (its prompt) after its grammar is compiled into its settings, on the same helper
        thread (the tick thread reads them back in the callback)."""
        if schema is None:
            return work

        def compile_then() -> T:
            settings["grammar"] = grammars.compile(schema_grammar(schema))
            return work()
        return compile_then
    if images.start(d, rrow, body, messages, room, system, settings, constrained):  # its images: images.py
        return
    d.off_thread(constrained(functools.partial(fit_prompt, tokenizer, messages, room, system)),
                 functools.partial(_prompted, d, rrow, settings))


def _prompted(d: Executing, rrow: int, settings: dict[str, Any], ids: list[int] | None,
              error: BaseException | None) -> None:
    """On the tick thread, the prompt built: the engine gets the input (unless it ended meanwhile:
    cancelled, or past its deadline)."""
    execution = d.executions.live.get(rrow)
    if execution is None or d.runner is None or not execution.prompted(ids, error, settings):
        return
    assert ids is not None
    d.runner.submit(("input", rrow), ids, **settings)


def replay_lease(d: Admitting, transfer: Transfer) -> None:
    try:
        revision, rows = leases.decode(transfer.payload)  # every row checked before any is applied
    except leases.LeaseError as exc:
        raise inconsistent(d, transfer, f"lease transfer seq {transfer.seq}: {exc}") from None
    rrows = [input_row(d, row.actor, row.sequence, transfer, "lease") for row in rows]
    lease_saved(d, rrows, transfer, False, revision, [row.retention_mode for row in rows])


def apply_output(d: Notifying, payload: bytes, transfer: Transfer) -> None:
    actor, sequence, offset, data = msgpack.unpackb(payload)
    rrow = input_row(d, actor, sequence, transfer, "output")
    t = d.state.tables
    if offset != t.value(t.receipts, rrow, R.RESULT_LEN) or offset + len(data) > d.state.capacities["result_bytes"]:
        raise inconsistent(d, transfer, f"output transfer seq {transfer.seq} at result offset {offset} does "
                                         "not follow the saved result")
    _output_written(d, rrow, offset, data)
    events.output_saved(d, rrow, offset, data)


def _output_written(d: Tables, rrow: int, offset: int, data: bytes) -> None:
    """An output's bytes after its input's saved result (checked to follow it), and the result's length."""
    t = d.state.tables
    t.put_bytes(t.result_bytes, rrow, data, offset)
    t.put_value(t.receipts, rrow, R.RESULT_LEN, offset + len(data))


def apply_completion(d: Context, payload: bytes, transfer: Transfer, source: int | None = None) -> None:
    """An input's completion is saved (live: `source` None) or replayed (the replay's source)."""
    from .admission import save_source
    actor, sequence, finish, input_tokens, output_tokens = msgpack.unpackb(payload)
    rrow = input_row(d, actor, sequence, transfer, "completion")
    t = d.state.tables
    _completed(d, rrow, t.row(t.receipts, rrow), Finish(finish), input_tokens, output_tokens, transfer,
               save_source(d, transfer.seq) if source is None else source)
    events.terminal_saved(d, rrow)


def _completed(d: Context, rrow: int, row: list[int], finish: Finish, input_tokens: int, output_tokens: int,
               transfer: Transfer, source: int) -> None:
    """A completion's columns — its terminal; its save fields, counts and finish in one write; its
    digest — and what the input's end releases: its quota, its execution, its conversation's turn
    (the next input's, if it held it). `row`: the input's receipt row as it was read."""
    state = d.state
    t = state.tables
    t.put_value(t.receipts, rrow, R.TERMINAL, TERMINAL_OF[finish])
    t.put_struct(t.receipts, rrow, R.TERM_TRANSFER, _ENDED, transfer.seq, state.boot, state.save_generation, source,
                 input_tokens, output_tokens, finish)
    t.put_digest(rrow, 1, transfer.digest)
    quotas.input_finished(d, row[R.PARTICIPANT], rrow)
    d.executions.live.pop(rrow, None)
    d.executions.to_lease.finished(row[R.TARGET], rrow)


def replay_ends(d: Context, transfers: Sequence[Transfer], source: int) -> None:
    """A run of OUTPUT and COMPLETION transfers at replay, on the CPU (a round's inputs end one
    after another: an output, then its completion), in one loop: each checked as `apply_output`
    and `apply_completion` check it and written by the same writers, without their layers (the
    input's row read once, no events: a loading device has no stream open; with one open, every
    transfer goes through its own path). `source`: the replay's (DeviceState.replay_source; no
    transfer of the run changes it). A transfer it does not take as it is (a payload in another
    layout, no such input, an offset that does not follow the saved result, a finish it does not
    know) goes through its own path in its place, which applies it or raises that path's error."""
    state = d.state
    t = state.tables
    by_raw, at = state.participants.by_raw, state.receipts.at
    capacity = state.capacities["result_bytes"]
    streams = d.subscriptions.count() > 0
    for transfer in transfers:
        fields = _fields(transfer.payload)
        taken = False
        if fields is not None and not streams:
            prow = by_raw.get(fields[0])
            rrow = at(prow, fields[1]) if prow is not None else None
            row = t.row(t.receipts, rrow) if rrow is not None else None
            if rrow is None or row is None or row[R.KIND] != _INPUT:
                pass
            elif transfer.kind is TransferKind.OUTPUT and len(fields) == 4:
                offset, data = fields[2], fields[3]
                if type(data) is bytes and offset == row[R.RESULT_LEN] and offset + len(data) <= capacity:
                    _output_written(d, rrow, offset, data)
                    taken = True
            elif transfer.kind is TransferKind.COMPLETION and len(fields) == 5:
                finish, input_tokens, output_tokens = _FINISHES.get(fields[2]), fields[3], fields[4]
                if (finish is not None and type(input_tokens) is int and type(output_tokens) is int
                        and 0 <= input_tokens < _INT64 and 0 <= output_tokens < _INT64):
                    _completed(d, rrow, row, finish, input_tokens, output_tokens, transfer, source)
                    taken = True
        if not taken:
            if transfer.kind is TransferKind.OUTPUT:
                apply_output(d, transfer.payload, transfer)
            else:
                apply_completion(d, transfer.payload, transfer, source)


def _fields(payload: bytes) -> list[Any] | None:
    """An OUTPUT's or a COMPLETION's fields as `replay_ends` takes them (a list whose first two
    are a 16-byte actor and an int sequence), else None."""
    try:
        fields = msgpack.unpackb(payload)
    except Exception:  # (its own path raises what it raises)
        return None
    if type(fields) is not list or len(fields) < 2 or type(fields[0]) is not bytes or type(fields[1]) is not int:
        return None
    return fields


# ---- the engine's side ---------------------------------------------------------------------

def engine_event(d: Rendering, rrow: int, token: int | None, data: bytes, finish: str | None) -> None:
    execution = d.executions.live.get(rrow)
    if execution is None or execution.phase not in (Phase.QUEUED, Phase.GENERATING):
        return
    if execution.phase is Phase.QUEUED:
        execution.move(Phase.GENERATING)  # its principal's next input may be leased (LEASE_AHEAD)
    if token is not None:
        execution.output_tokens += 1
    room = d.state.capacities["result_bytes"] - execution.offset - len(execution.buffered)
    execution.buffered += data[:max(room, 0)]
    if len(data) > room and finish is None and d.runner is not None:
        d.runner.cancel(("input", rrow), "length")  # the result table row is full
    if finish is not None:
        ended = FINISHES.get(finish, Finish.FAILED)
        if execution.mode == leases.RETAIN_AND_INTERPRET and ended in (Finish.STOP, Finish.LENGTH):
            interpret(d, execution, ended)
        else:
            execution.end(ended)


def cancel(d: Executing, rrow: int) -> None:
    """Stop a live input now (a saved cancellation): its completion says `cancelled`."""
    ex = d.executions
    execution = ex.live.get(rrow)
    if execution is not None:
        if execution.phase in IN_THE_ENGINE:
            if d.runner is not None:
                d.runner.cancel(("input", rrow))
            execution.end(Finish.CANCELLED)
        elif execution.phase is Phase.INTERPRETING:  # the turn stays, its interpretation is not written
            if d.runner is not None:
                d.runner.cancel(("interpret", rrow))
            execution.end(Finish.CANCELLED)
    elif rrow in ex.to_lease:
        ex.to_lease.remove(rrow)
        ex.live[rrow] = Execution(rrow, 0, Phase.ENDED, Finish.CANCELLED)
    else:  # saved but the lease is still in flight, or not yet saved: cancel once it starts
        ex.cancel_when_leased.add(rrow)


def check_deadlines(d: Executing) -> None:
    now = time.time_ns()
    for execution in d.executions.live.values():
        _expire(d, execution, now)


def _expire(d: Executing, execution: Execution, now_ns: int) -> None:
    """Past its deadline, an input ends `deadline_exceeded` wherever it is: generating, writing
    its interpretation, or with its result not yet published (SPEC: the deadline includes memory
    processing, model generation and result publication). What it has not journaled is never
    published. Once its completion (or, revision 5, the control record before it) is appended its
    end is decided: the journal saves what it queued, in order, within its ticks."""
    if (now_ns < execution.deadline_ns or execution.phase in (Phase.CONTROLLED, Phase.COMPLETING)
            or execution.finish not in (Finish.NONE, Finish.STOP, Finish.LENGTH)):
        return
    rrow = execution.rrow
    if execution.phase in IN_THE_ENGINE and d.runner is not None:
        d.runner.cancel(("input", rrow), "deadline")
    if execution.phase is Phase.INTERPRETING and d.runner is not None:  # it covers memory processing too
        d.runner.cancel(("interpret", rrow), "deadline")
    execution.end(Finish.DEADLINE)
    execution.buffered.clear()


def unfinished_inputs(d: Tables) -> list[int]:
    """Inputs with a saved admission and no saved terminal, by conversation row, each conversation's
    in admission order."""
    t = d.state.tables
    rows = [rrow for rrows in d.state.conversations.inputs if rrows for rrow in rrows]
    terminals = t.take(t.receipts, np.array(rows, dtype=np.int64))[:, R.TERMINAL].tolist()  # (one read of them all)
    return [rrow for rrow, terminal in zip(rows, terminals) if terminal == Terminal.NONE]


def interrupt_unfinished(d: Context) -> None:
    """At boot: saved admissions with no completion never run again (SPEC)."""
    for rrow in unfinished_inputs(d):
        payload = completion_payload(d, rrow, Finish.INTERRUPTED, 0, 0)
        d.append(TransferKind.COMPLETION, payload, functools.partial(apply_completion, d, payload))


def stop_all(d: Executing) -> None:
    """The unsaved outputs are gone (ENOSPC): stop every live input and interpretation in the
    engine (the state is then rebuilt from what is saved, and `interrupt_after_failure` ends
    them)."""
    if d.runner is not None:
        for rrow, execution in d.executions.live.items():
            d.runner.cancel(("input", rrow))
            if execution.phase is Phase.INTERPRETING:
                d.runner.cancel(("interpret", rrow))
    d.executions.leasing.clear()  # leases not saved are gone with the rest


def interrupt_after_failure(d: Executing) -> None:
    """After ENOSPC, in the state rebuilt from what is saved: every unfinished input (queued,
    waiting for its conversation's turn, or running: its lease and output not saved are gone)
    ends `interrupted` with a saved COMPLETION once the journal takes writes again (`journal_work`,
    the first tick after the `disk_full` hold lifts), as at a restart (SPEC: a restored
    unfinished admission becomes interrupted and does not repeat its memory input). Resuming
    instead would run again an input whose saved lease may have retained its memory, or continue
    an output cut at its last save."""
    d.executions.to_interrupt = unfinished_inputs(d)
