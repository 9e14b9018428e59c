"""The mutation protocol (SPEC "Mutations and retries"): every mutation's envelope, retry and
sequence rules, then its kind's own check; the admission transfer that records it; applying it
to the tables (live and at replay, the same code); and the save fields once it is saved.

Order of the checks: grant (403), command bytes (400), exact retry (200, whatever the lineage),
fenced (503 `not_primary`: a deposed primary refuses nothing else), changed bytes (409
`operation_changed` under the current lineage), retry floor (410), lineage (409 `stale_lineage`: not
admitted in this line of history), future sequence (409), key in
use (409), registration (409 `participant_not_registered`), hold (429; not for a cancellation
while the journal can be written), the principal's receipts
quota (429 `quota_exceeded`, kinds/quotas.py; never for a retirement), receipt table (507; the last
slot is a retirement's, and `registration_reserve` slots before it are new participants'
registrations'), then the kind's own checks (its quotas among them). Nothing changes unless all
pass. This is the busiest path of a device:
bench/tick_cpu.py measures it.
"""
from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .. import native
from ..contract.errors import ServiceError
from ..contract.commands import Mutation, parse
from ..contract.wire import Message
from ..kinds import quotas
from ..memory.forgetting import same_command
from ..kinds.kind import ADMISSION_VERSION, Admission, Context, Journaling, Kind, OperationKind, Tables
from .. import derived as ids
from ..state.indexes import take_free
from ..state.tables import ALONE, HELD, C, M, P, R, S, Source, Terminal, width
from ..storage.journal import TransferKind, record_count
from ..storage.journal_writer import MAX_RECORDS_PER_TICK

if TYPE_CHECKING:
    from ..storage.journal import Transfer

# (transfer, boot, generation, source) columns of the admission (0) and terminal (1) save fields,
# consecutive so that record_save writes the four, or all eight, at once
SAVE_COLUMNS = ((R.ADM_TRANSFER, R.ADM_BOOT, R.ADM_GENERATION, R.ADM_SOURCE),
                (R.TERM_TRANSFER, R.TERM_BOOT, R.TERM_GENERATION, R.TERM_SOURCE))
assert all(cols == tuple(range(cols[0], cols[0] + 4)) for cols in SAVE_COLUMNS)
assert SAVE_COLUMNS[1][0] == SAVE_COLUMNS[0][0] + 4
ADMISSION_ONLY, ADMISSION_AND_TERMINAL = (0,), (0, 1)
# Plain ints for the per-request path: an IntEnum member read is slow on Python 3.11 (docs/performance.md).
_REGISTER, _RETIREMENT, _CANCELLATION = int(Kind.PARTICIPANT_REGISTER), int(Kind.RETIREMENT), int(Kind.CANCELLATION)
_SUCCEEDED, _JOURNAL = int(Terminal.SUCCEEDED), int(Source.JOURNAL)
_ADMISSION_TRANSFER = int(TransferKind.ADMISSION)
_ADMISSION_TRANSFER_KIND = TransferKind.ADMISSION  # (a read transfer's kind is this very object)
_UNSAVED = (0, 0, 0, 0)
# A receipt row as admission writes it, R's columns in order: STATE, PARTICIPANT, SEQUENCE, KIND;
# the operation key and ID (16 bytes each, KEY_HI/KEY_LO and OP_HI/OP_LO); TARGET, CREATED,
# COMMAND_LEN, RESULT_LEN, TERMINAL; the admission's and the terminal's save fields; zeros after.
_RECEIPT_ROW = struct.Struct(f"<4q16s16s5q8q{8 * (width(R) - R.INPUT_TOKENS)}x")
assert (R.KEY_HI, R.OP_HI, R.TARGET, R.TERMINAL, SAVE_COLUMNS[0][0], R.INPUT_TOKENS) == (4, 6, 8, 12, 13, 21)
assert _RECEIPT_ROW.size == 8 * width(R)
_R_WIDTH = width(R)  # (width() walks the class: once, not once a run)


class Admitter(Context, Protocol):
    """What admission sees beyond an operation's context: the device's bounds on a command and on
    the receipt table, and the admissions whose transfers are not yet saved."""

    @property
    def command_bytes(self) -> int: ...

    @property
    def registration_reserve(self) -> int: ...

    @property
    def pending_admissions(self) -> dict[int, tuple[int, int]]: ...

    def fenced(self) -> str | None: ...


# what `admit` answers for a command of a kind with work before admission that passed the envelope's
# checks without that work done: the tick starts it (pipeline/preparing.py), then admits it again
UNPREPARED = (0, -1, 0)


def admit(d: Admitter, msg: Message, kind: OperationKind, budget: int,
          prepared: bytes | None = None) -> tuple[int, int, int] | None:
    """One mutation in a tick: (status, receipt row, journal records used), None when it does not
    fit what is left of the tick's record budget, or a ServiceError. A kind with work before
    admission (`prepare`) answers UNPREPARED when every check before its own passed (an exact
    retry answers its receipt as ever); `prepared`, what that work made, is recorded with what its
    check returns."""
    return admit_as(d, d.principal(msg, kind.action), parse(kind.args, msg.get("args")), kind, budget, prepared)


def admit_as(d: Admitter, principal: bytes, args: Mutation, kind: OperationKind, budget: int,
             prepared: bytes | None = None) -> tuple[int, int, int] | None:
    """`admit` of a principal and typed arguments already known: a command's (its principal's
    grant checked, its arguments parsed as its kind's type), or an admission the device makes
    itself (Device.admit_as: the operator's, memory/ops.py), which no grant names."""
    lineage, key, sequence, canonical = args.lineage, args.operation_key, args.sequence, args.canonical
    if len(canonical) > d.command_bytes:  # a payload too large for its receipt (413, as for a body)
        raise ServiceError(413, "command_too_large",
                           f"canonical operation is {len(canonical)} bytes; the limit is {d.command_bytes}")
    state = d.state
    participants = state.participants
    receipts = state.receipts
    tables = state.tables
    prow = participants.by_principal.get(principal)
    if prow is None:
        expected, floor, next_seq = participants.unregistered_lineage(principal).hex(), 1, 1
    else:
        row = tables.row(tables.participants, prow)
        expected, floor, next_seq = participants.lineage_hex[prow], row[P.RETRY_FLOOR], row[P.NEXT_SEQUENCE]
    # An exact retry answers its receipt whatever the lineage is now (DESIGN §9): after a restore the
    # participant has a new lineage, and the very bytes of an operation the restored state kept
    # (their lineage the old one) must find it, or a client would submit it again as new.
    rrow = receipts.at(prow, sequence) if prow is not None else None
    if rrow is not None:
        n = tables.value(tables.receipts, rrow, R.COMMAND_LEN)
        stored = tables.get_bytes(tables.command_bytes, rrow, n)
        if stored == canonical or same_command(stored, canonical):  # (its text forgotten since: same_command)
            return 200, rrow, 0
    # A primary whose leadership may have lapsed answers nothing else: its state may lag the new
    # primary's, and a refusal from it (a future sequence, a changed operation) would tell a client
    # that an operation the new primary admitted was not, and the client would submit it anew.
    fenced = d.fenced()
    if fenced is not None:
        raise ServiceError(503, "not_primary", f"{fenced}: send it to the current primary")
    if rrow is not None and lineage == expected:
        raise ServiceError(409, "operation_changed", f"sequence {sequence} was admitted with different operation bytes")
    if sequence < floor:  # admitted and retired in this line of history, whatever its lineage was
        raise ServiceError(410, "below_retry_floor", f"sequence {sequence} is below the retry floor {floor}",
                           retry_floor=str(floor))
    if lineage != expected:  # not admitted in this line of history: the client may submit it anew
        raise ServiceError(409, "stale_lineage", "lineage is not the participant's current lineage", lineage=expected)
    if sequence > next_seq:
        raise ServiceError(409, "future_sequence", f"sequence {sequence} is ahead of the next sequence {next_seq}",
                           next_sequence=str(next_seq))
    key_raw = bytes.fromhex(key)
    if prow is not None and receipts.key_in_use(prow, key_raw):
        raise ServiceError(409, "operation_key_in_use",
                           "operation key belongs to another live operation of this participant")
    code = kind.code
    if code != _REGISTER and prow is None:
        raise ServiceError(409, "participant_not_registered", "register the participant first (POST /participant)")
    # a hold refuses every new mutation but a cancellation while the journal can be written (a
    # file_cap or low_disk hold): one small admission that ends its target's output, memory and
    # completion, which would otherwise still be journaled (docs/checkpoint.md, "Journal holds")
    if d.holds.current and not (code == _CANCELLATION and d.holds.writable):
        raise d.holds.refusal(d.committer.writer.queued_bytes)
    if code != _RETIREMENT:  # (every principal has a receipts limit: its own, or the default)
        quotas.check(d, principal, prow, "receipts")
    # one receipt slot stays in reserve so that a full table can always record a retirement, and
    # `registration_reserve` more so that a new participant can always register
    free = len(receipts.free)
    if free < (1 if code == _RETIREMENT else 2 if code == _REGISTER else 2 + d.registration_reserve):
        raise ServiceError(507, "receipt_table_full",
                           "the receipt table is full; record a retirement (POST /retirements) to free receipts"
                           + ("" if free < 2 else " (the rest is held back for new participants' registrations)"))
    if kind.prepare is not None and prepared is None:  # the envelope passed: its work first (preparing.py)
        return UNPREPARED
    extra = kind.check(d, principal, prow, args, key_raw, sequence)
    if prepared is not None:
        extra["prepared"] = prepared
    op = ids.operation(state.incarnation, state.admissions + 1, participants.nonce)  # its line of history's
    admission = Admission(code, principal, sequence, key_raw, op, canonical, extra)
    payload = admission.encode()
    records = record_count(len(payload))
    if records > budget and budget < MAX_RECORDS_PER_TICK:
        return None
    seq = d.committer.writer.append(_ADMISSION_TRANSFER, payload)
    rrow = apply(d, admission, seq)
    d.pending_admissions[seq] = (rrow, code)
    return 202, rrow, records


def apply(d: Admitter, a: Admission, transfer_seq: int | None, saved: Transfer | None = None) -> int:
    """Apply one admission to the tables, live (transfer_seq: its journal transfer, not yet saved)
    and at replay (transfer_seq None; `saved`: the transfer that saved it, whose save fields go
    in with the row, as `mark_saved` writes them live). Returns its receipt row."""
    kind = d.kinds[a.kind]  # replay checked the code: an unknown kind fails closed there
    state = d.state
    state.admissions += 1
    t = state.tables
    receipts = state.receipts
    rrow = receipts.free.pop()
    prow = state.participants.by_principal.get(a.principal, -1)
    target = kind.apply(d, a, prow, transfer_seq, rrow)
    if prow < 0:  # a registration: it wrote the new participant's whole row, next sequence included
        prow = target
    else:
        t.put_value(t.participants, prow, P.NEXT_SEQUENCE, a.sequence + 1)
    which = () if saved is None else ADMISSION_ONLY if kind.executes else ADMISSION_AND_TERMINAL
    fields = _UNSAVED if saved is None else (saved.seq, state.boot, state.save_generation, state.replay_source)
    # the whole row is written: a reused slot starts clean
    t.put_struct(t.receipts, rrow, 0, _RECEIPT_ROW, 1, prow, a.sequence, a.kind, a.key, a.op, target,
                 state.admissions, len(a.canonical), 0, _SUCCEEDED, *fields, *(_UNSAVED if len(which) < 2 else fields))
    if kind.columns is not None:
        t.write_row(t.receipts, rrow, kind.columns(d, a))
    t.put_bytes(t.command_bytes, rrow, a.canonical)
    if saved is not None:
        _put_digests(d, rrow, saved.digest, which)
    receipts.add(rrow, prow, a.sequence, a.key, a.op)
    return rrow


# A run shorter than this goes one admission at a time (replay_run answers False): below it, the
# columns' numpy calls cost more than the calls per admission they save (docs/checkpoint.md,
# "Replaying a mixed journal").
MIN_RUN = 16


def replay_run(d: Admitter, kind: OperationKind, transfers: list[Transfer], prows: list[int]) -> bool:
    """At replay, admission transfers of one kind with runs (`decode_run`, `apply_run`), in journal
    order, by participants already registered (`prows`), each saved by its transfer: what
    `apply(d, a, None, transfer)` of each does, as columns, one write per table (a million
    admissions, one call each, were most of a replay: docs/performance.md, "Runs of admissions as
    columns"). Only while the load defers indexing. False, with nothing changed, when the run is
    shorter than MIN_RUN or a payload is not in the layout the run decoder reads: then apply each
    by itself."""
    assert kind.decode_run is not None and kind.apply_run is not None
    n = len(transfers)
    if n < MIN_RUN:
        return False
    run = kind.decode_run([transfer.payload for transfer in transfers])
    if run is None:
        return False
    state = d.state
    t = state.tables
    rrows = np.array(take_free(state.receipts.free, n), dtype=np.int64)
    counters = np.arange(state.admissions + 1, state.admissions + n + 1, dtype=np.int64)
    state.admissions += n
    participants = np.array(prows, dtype=np.int64)
    targets = kind.apply_run(d, run, participants, counters)
    for prow, sequence in dict(zip(prows, run.sequences.tolist())).items():  # (each one's last)
        t.put_value(t.participants, prow, P.NEXT_SEQUENCE, sequence + 1)
    values = np.zeros((n, _R_WIDTH), dtype=np.int64)
    values[:, R.STATE] = 1
    values[:, R.PARTICIPANT] = participants
    values[:, R.SEQUENCE] = run.sequences
    values[:, R.KIND] = kind.code
    values[:, R.KEY_HI:R.KEY_LO + 1] = run.keys
    values[:, R.OP_HI:R.OP_LO + 1] = run.ops
    values[:, R.TARGET] = targets
    values[:, R.CREATED] = counters
    values[:, R.COMMAND_LEN] = run.lengths
    values[:, R.TERMINAL] = _SUCCEEDED
    # the transfer that saved each admission saved its result too (the kind finishes at admission)
    seqs = np.array([transfer.seq for transfer in transfers], dtype=np.int64)
    for first, _, _, _ in SAVE_COLUMNS:
        values[:, first] = seqs
        values[:, first + 1:first + 4] = (state.boot, state.save_generation, state.replay_source)
    t.put_rows(t.receipts, rrows, values)
    t.put_packed(t.command_bytes, rrows, run.lengths, run.commands)
    digests = np.frombuffer(b"".join([transfer.digest for transfer in transfers]), dtype=np.uint8).reshape(n, 1, 32)
    t.put_digest_block(rrows, np.repeat(digests, 2, axis=1))
    state.receipts.noted(rrows.tolist())
    return True


_stretch = native.load("jcodec").replay_stretch
# The kinds a replay on the CPU applies natively in stretches (`replay_stretch`), and the row
# layouts jcodec.cpp writes for them: a receipt as _RECEIPT_ROW, a participant's next sequence, a
# space's and a conversation's first eight columns, a member row's five (kinds/*.py `apply`).
STRETCH_KINDS = (int(Kind.SPACE_CREATE), int(Kind.CONVERSATION_CREATE), int(Kind.MEMBER_SET))
assert (P.NEXT_SEQUENCE, S.OWNER, S.SCOPE, S.ID_HI, S.CREATED, S.OP_HI, C.SPACE, C.CREATOR, C.ID_HI, C.CREATED,
        C.OP_HI, M.SPACE, M.PARTICIPANT, M.RIGHTS, M.CREATED) == (1, 1, 2, 3, 5, 6, 1, 2, 3, 5, 6, 1, 2, 3, 4)
assert (R.RESULT_LEN, R.TERM_TRANSFER) == (11, 17)


# what replay_stretch writes through: the tables' memory and the indexes' own maps and lists,
# fixed for one load (`stretch_context`)
StretchContext = tuple[tuple[object, ...], tuple[object, ...]]


def stretch_context(d: Admitter) -> StretchContext | None:
    """What `replay_stretch` writes through for the state now loading, made once a load (the
    tables' memory, the indexes' maps, free lists and the receipts' list of noted rows, none of
    which a load replaces); None when the tables are not the CPU's or receipts are not deferred."""
    state = d.state
    t, receipts = state.tables, state.receipts
    noting = receipts.noting
    if t.raw(t.receipts) is None or noting is None or not STRETCH_KINDS:
        return None
    return ((t.raw(t.receipts), t.raw(t.receipt_digests), t.raw(t.command_bytes), t.raw(t.participants),
             t.raw(t.spaces), t.raw(t.conversations), t.raw(t.members), _R_WIDTH, t.command_bytes.shape[1],
             t.participants.shape[1], t.spaces.shape[1], t.conversations.shape[1], t.members.shape[1]),
            (state.participants.by_principal, receipts.free, receipts.by_sequence, noting,
             state.spaces.free, state.spaces.by_id, state.conversations.free, state.conversations.by_id,
             state.members.free, state.members.rows, state.participants.lineage, state.participants.by_raw))


def replay_stretch(d: Admitter, transfers: list[Transfer], start: int, context: StretchContext) -> int:
    """At replay on the CPU, transfers from transfers[start] on while each is an admission of
    the STRETCH_KINDS by a participant already registered, each applied natively
    (jcodec.replay_stretch) exactly as `apply(d, a, None, transfer)` applies it; it stops at the
    first it does not apply so (another transfer or kind, a payload in another layout, a space not
    found: the caller applies that one by itself). A mixed journal interleaves these kinds in
    stretches of one to dozens, where runs of one kind as columns (`replay_run`) average one and a
    half (docs/checkpoint.md, "Replaying a mixed journal"). Returns how many it applied."""
    state = d.state
    applied: int = _stretch(transfers, start, _ADMISSION_TRANSFER_KIND, ADMISSION_VERSION, STRETCH_KINDS,
                            state.admissions, (state.boot, state.save_generation, state.replay_source), *context)
    state.admissions += applied
    return applied


def mark_saved(d: Journaling, rrow: int, transfer: Transfer, kind: OperationKind) -> None:
    """Record the save fields of the transfer that saved this receipt's admission. A kind that
    does not execute finishes at admission: the same transfer saves its terminal result."""
    record_save(d, rrow, transfer, ADMISSION_ONLY if kind.executes else ADMISSION_AND_TERMINAL)


def save_source(d: Journaling, seq: int) -> int:
    """The source of a transfer saved now: the journal, and whether a standby held it (its
    acknowledgement covers it) or it was saved alone (async, --standby-timeout, no standby)."""
    replica = d.committer.replica
    return _JOURNAL | (HELD if replica is not None and seq <= replica.acked_seq else ALONE)


def record_save(d: Journaling, rrow: int, transfer: Transfer, which: tuple[int, ...],
                source: int | None = None) -> None:
    """Save fields of a transfer into the admission (0) and/or terminal (1) columns; `source`: a
    replay's (DeviceState.replay_source), None for a transfer saved now (`save_source`)."""
    state = d.state
    t = state.tables
    fields = (transfer.seq, state.boot, state.save_generation,
              save_source(d, transfer.seq) if source is None else source)
    if which is ADMISSION_AND_TERMINAL:  # adjacent columns: one write
        t.put_cols(t.receipts, rrow, SAVE_COLUMNS[0][0], fields + fields)
    else:
        for w in which:
            t.put_cols(t.receipts, rrow, SAVE_COLUMNS[w][0], fields)
    _put_digests(d, rrow, transfer.digest, which)


def _put_digests(d: Tables, rrow: int, digest: bytes, which: tuple[int, ...]) -> None:
    t = d.state.tables
    if which is ADMISSION_AND_TERMINAL:  # adjacent digests: one write
        t.put_digests(rrow, digest)
        return
    for w in which:
        t.put_digest(rrow, w, digest)
