"""Receipts (`aotx.shared.receipt.v1`) rendered from their table rows, at every read: there is no
cache to keep in step with the row, and none to grow by a kilobyte per receipt. A receipt read
after a restart is rebuilt from the same values and renders to the same bytes.

The rendering is a fixed template because every value is a hex ID, a decimal counter or a fixed
word (nothing to escape; a disk error, the one free text, is JSON-encoded); tests check that the
output is canonical JSON (sorted keys, compact). Every counter — `sequence`, the save fields'
generation and boot, `pending_bytes`, the result's `length` and token counts, the effective page
and output limits, a hold's `since_ns` — is a decimal string (SPEC "Counters use decimal
strings"): a JSON number past 2**53 is not exact in every client.

`transport.accepted` and `device.committed` are true for every receipt: a receipt exists only for
an operation the device received and applied (the gateway answers 503 for one it could not hand
over). `pending_bytes` counts this operation's bytes not yet saved — its admission's command bytes
until the admission is saved, then an input's output generated or journaled but not yet durable —
and `disk_error` says, while any are pending, why the journal cannot save them (a hold's disk
error, such as ENOSPC).
"""
from __future__ import annotations

import json

from ..contract import ids, structured
from ..contract.vocabulary import BASE_PATH, RECEIPT_SCHEMA
from ..contract.wire import Reply, dumps, reply
from ..state.tables import ALONE, HELD, SOURCE_MASK, Finish, R, Source, Terminal, join16
from .kind import Journaling, Rendering, Reporting


SOURCE_NAMES = {int(Source.JOURNAL): "journal", int(Source.FILE): "file"}
_HELD_JSON = {HELD: "true", ALONE: "false", 0: "null"}  # a save's "standby": whether a standby held it
TERMINAL_NAMES = {int(t): t.name.lower() for t in Terminal if t != Terminal.NONE}
FINISH_NAMES = {int(Finish.STOP): "stop", int(Finish.LENGTH): "length", int(Finish.CANCELLED): "cancelled",
                int(Finish.DEADLINE): "deadline", int(Finish.INTERRUPTED): "interrupted",
                int(Finish.FAILED): "failed"}
# (transfer, boot, generation, source) columns of the admission (0) and terminal (1) save fields
_SAVE = ((R.ADM_TRANSFER, R.ADM_BOOT, R.ADM_GENERATION, R.ADM_SOURCE),
         (R.TERM_TRANSFER, R.TERM_BOOT, R.TERM_GENERATION, R.TERM_SOURCE))
_ADM_SAVE = slice(R.ADM_TRANSFER, R.ADM_SOURCE + 1)
_TERM_SAVE = slice(R.TERM_TRANSFER, R.TERM_SOURCE + 1)
_NO_EXECUTION = '{"max_output_tokens":null,"model_digest":null,"page_limit":null,"response_format_digest":null}'


def response_format_digest(d: Reporting, rrow: int) -> str | None:
    """The digest of the input's response_format (contract/structured.digest), None without one:
    its receipt's `effective.response_format_digest`. Read from its saved command bytes, which
    hold the key only when the body does (a text's quotes are escaped)."""
    t = d.state.tables
    raw = t.get_bytes(t.command_bytes, rrow, t.value(t.receipts, rrow, R.COMMAND_LEN))
    if b'"response_format"' not in raw:
        return None
    response_format = json.loads(raw)["body"].get("response_format")
    return None if response_format is None else structured.digest(response_format)


def _save_json(d: Reporting, rrow: int, row: list[int], which: int) -> str:
    transfer_col, boot_col, gen_col, source_col = _SAVE[which]
    if not row[transfer_col]:
        return "null"
    source = row[source_col]
    return (f'{{"boot":"{row[boot_col]}","commit_digest":"{d.state.tables.get_digest(rrow, which).hex()}",'
            f'"file_incarnation":"{d.incarnation_hex}","generation":"{row[gen_col]}",'
            f'"source":"{SOURCE_NAMES[source & SOURCE_MASK]}","standby":{_HELD_JSON[source & (HELD | ALONE)]}}}')


def render(d: Rendering, rrow: int, own: bool) -> tuple[str, bytes]:
    """(operation ID, receipt bytes) of a receipt row; `own` False shows another participant's
    receipt, with null sequence counters."""
    t = d.state.tables
    row = t.row(t.receipts, rrow)
    prow = row[R.PARTICIPANT]
    lineage = d.state.participants.lineage_at(prow, row[R.CREATED])  # the one its IDs were made with
    kind = d.kinds[row[R.KIND]]
    op_id = ids.operation_id(lineage, join16(row[R.OP_HI], row[R.OP_LO]))
    admission = _save_json(d, rrow, row, 0)
    # the same transfer saved both (every kind that does not execute): the same fields and digest
    terminal = admission if row[_ADM_SAVE] == row[_TERM_SAVE] else _save_json(d, rrow, row, 1)
    saved = admission != "null"
    ended = terminal != "null"
    status = f'"{TERMINAL_NAMES[row[R.TERMINAL]]}"' if ended else "null"
    sequence = f'"{row[R.SEQUENCE]}"' if own else "null"
    finish: str | None = None
    tokens_in = tokens_out = "null"
    pending = 0 if saved else row[R.COMMAND_LEN]
    if kind.executes and not ended and saved:  # its output: generated or journaled, not yet saved
        live = d.executions.live.get(rrow)
        if live is not None:
            pending = len(live.buffered) + live.offset - row[R.RESULT_LEN]
    held = d.holds.current
    disk_error = json.dumps(held["disk_error"]) if pending and held and held["disk_error"] else "null"
    if kind.executes:
        schema_digest = response_format_digest(d, rrow)
        schema_json = "null" if schema_digest is None else f'"{schema_digest}"'
        effective = (f'{{"max_output_tokens":"{row[R.MAX_OUTPUT]}","model_digest":"{d.model_digest}",'
                     f'"page_limit":"{row[R.PAGE_LIMIT]}","response_format_digest":{schema_json}}}')
        if ended:
            finish = FINISH_NAMES.get(row[R.FINISH])
            tokens_in, tokens_out = f'"{row[R.INPUT_TOKENS]}"', f'"{row[R.OUTPUT_TOKENS]}"'
    else:
        effective = _NO_EXECUTION
    finish_json = f'"{finish}"' if finish else "null"
    # only an executing kind's result bytes are its result (a correction's keep what it replaced)
    result_length = row[R.RESULT_LEN] if kind.executes else 0
    return op_id, (
        f'{{"admission":{{"save":{admission},"saved":{"true" if saved else "false"}}},'
        f'"device":{{"committed":true}},"disk_error":{disk_error},'
        f'"effective":{effective},"journal_hold":null,'
        f'"kind":"{kind.name}",'
        f'"memory":{kind.memory(d, row, lineage) if kind.memory is not None else "null"},'
        f'"operation":"{op_id}",'
        f'"operation_key":"{join16(row[R.KEY_HI], row[R.KEY_LO]).hex()}",'
        f'"participant":"{d.state.participants.public_id[prow]}",'
        f'"pending_bytes":"{pending}",'
        f'"result":{{"finish":{finish_json},"input_tokens":{tokens_in},"length":"{result_length}",'
        f'"output_tokens":{tokens_out}}},'
        f'"schema":"{RECEIPT_SCHEMA}",'
        f'"sequence":{sequence},'
        f'"target":"{kind.target_id(d, row, lineage)}",'
        f'"terminal":{{"save":{terminal},"saved":{"true" if ended else "false"},"status":{status}}},'
        f'"transport":{{"accepted":true}}}}'
    ).encode()


def with_hold(d: Journaling, body: bytes) -> bytes:
    """A rendered receipt with the current journal hold spliced in while there is one."""
    held = d.holds.current
    if not held:
        return body
    hold = dumps({"cause": held["cause"], "since_ns": str(held["since_ns"]), "disk_error": held["disk_error"]})
    return body.replace(b'"journal_hold":null', b'"journal_hold":' + hold, 1)


def receipt_bytes(d: Rendering, rrow: int, *, own: bool = True) -> bytes:
    """A receipt as its reader sees it now (the current hold included)."""
    return with_hold(d, render(d, rrow, own)[1])


def receipt_reply(d: Rendering, req_id: int | None, status: int, rrow: int) -> Reply:
    """The reply to a mutation: its receipt, with `Location` for a new operation (202)."""
    op_id, body = render(d, rrow, True)
    body = with_hold(d, body)
    if status != 202:
        return reply(req_id, status, body)
    return reply(req_id, status, body, {"Location": f"{BASE_PATH}/operations/{op_id}"})
