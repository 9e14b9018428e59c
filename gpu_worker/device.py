"""The device state machine: tables, receipts, the mutation protocol and the journal.

Everything here runs on the device's one thread (see server.py). A tick gathers commands in
arrival order until its 16-record journal budget is used (the rest wait for the next tick),
then one write and one fdatasync make its admissions saved and its replies go out (the server
gathers the next tick while the fdatasync runs). Reads are answered at once only while nothing is
unsaved; otherwise once the saves before them are done. Replay at boot runs the same apply
functions over the recovered transfers, so a receipt read after a restart is rebuilt from the
same values and renders to the same bytes.
"""
import bisect
import errno
import logging
import time
from dataclasses import dataclass, field

import msgpack

from . import checkpoint, ids, runtime_file
from .filelayer import OsFileLayer
from .grants import GrantFileError
from .kinds import KIND_NAMES, Kind
from .journal import (MAX_RECORDS_PER_TICK, JournalIOError, JournalLock, JournalWriter, TransferKind,
                      record_count, recover)
from .protocol import DeviceError, RawJSON, dumps, pack, reply
from .chat import ChatCommands
from .inputs import ENGINE_RECORDS_PER_TICK, FINISH_NAMES, TERMINAL_NAMES, InputCommands, MediaCommands
from .spaces import SpaceCommands
from .tables import Finish, P, R, Source, Tables, Terminal, join16, split16, width

log = logging.getLogger("gpu_worker.device")

MUTATION_SCHEMA = "aotx.shared.mutation.v1"
RECEIPT_SCHEMA = "aotx.shared.receipt.v1"
ADMISSION_VERSION = 1
BASE = "/aotx/v1/shared"
DEFAULT_LIMIT = 50
DISK_FULL_MARGIN = 4 << 20
MAX_LIMIT = 200


SOURCE_NAMES = {Source.JOURNAL: "journal", Source.FILE: "file"}
# Plain-int copies of enum members the per-request path compares with (an IntEnum member read
# costs ~80 ns on Python 3.11; dict lookups by int find the IntEnum keys all the same).
_INPUT, _CANCELLATION, _JOURNAL = int(Kind.INPUT), int(Kind.CANCELLATION), int(Source.JOURNAL)
_PARTICIPANT_TARGETS = frozenset((int(Kind.PARTICIPANT_REGISTER), int(Kind.RETIREMENT)))
_CONVERSATION_TARGETS = frozenset((int(Kind.CONVERSATION_CREATE), int(Kind.INPUT)))
_ADMISSION_ONLY, _ADMISSION_AND_TERMINAL = (0,), (0, 1)
# (transfer, boot, generation, source) columns of the admission (0) and terminal (1) save fields
# (consecutive columns: _record_save writes the four at once)
SAVE_COLUMNS = ((R.ADM_TRANSFER, R.ADM_BOOT, R.ADM_GENERATION, R.ADM_SOURCE),
                (R.TERM_TRANSFER, R.TERM_BOOT, R.TERM_GENERATION, R.TERM_SOURCE))
assert all(cols == tuple(range(cols[0], cols[0] + 4)) for cols in SAVE_COLUMNS)
assert SAVE_COLUMNS[1][0] == SAVE_COLUMNS[0][0] + 4  # _record_save writes both saves at once
_ADM_SAVE, _TERM_SAVE = (slice(cols[0], cols[0] + 4) for cols in SAVE_COLUMNS)
_RECEIPT_WIDTH = width(R)
_ADMISSION_TRANSFER = int(TransferKind.ADMISSION)
HEX32_MATCH = ids.HEX32.match
_REGISTER, _RETIREMENT, _SUCCEEDED = int(Kind.PARTICIPANT_REGISTER), int(Kind.RETIREMENT), int(Terminal.SUCCEEDED)


class Batch:
    """One tick's commands between gather() and answer(): every reply waits until `last_seq`, the
    last journal transfer appended by then, is saved."""

    __slots__ = ("replies", "waiting", "media", "reads", "last_seq")

    def __init__(self):
        self.replies = []   # (conn, reply) ready now: refusals, chat refusals, reads of saved state
        self.waiting = []   # (conn, req_id, status, receipt row) of admitted mutations
        self.media = []     # (conn, req_id, sha256) of appended media uploads
        self.reads = []     # (conn, msg) reads that must not see the unsaved state before them
        self.last_seq = 0


@dataclass
class Admission:
    """The decoded admission transfer: what the journal records for one new operation.
    `extra` holds the kind's validated arguments (IDs, never rows), so replay re-resolves them."""
    kind: int
    principal: bytes
    sequence: int
    key: bytes
    op: bytes
    canonical: bytes
    extra: dict = field(default_factory=dict)

    def encode(self):
        return pack([ADMISSION_VERSION, self.kind, self.principal, self.sequence, self.key, self.op,
                     self.canonical, self.extra])

    @classmethod
    def decode(cls, payload):
        fields = msgpack.unpackb(payload, raw=False)
        if not isinstance(fields, list) or len(fields) != 8 or fields[0] != ADMISSION_VERSION:
            raise ValueError("unknown admission layout")
        return cls(*fields[1:])


class DeviceBootError(Exception):
    pass




class Device(SpaceCommands, InputCommands, MediaCommands, ChatCommands):
    def __init__(self, runtime, journal_dir, grants, *, device="cpu", fs=None, serve=True):
        """serve=False opens the state for an offline command (checkpoint): no grant check,
        no boot recorded."""
        self.runtime = runtime
        self.incarnation = runtime.incarnation
        self._incarnation_hex = runtime.incarnation.hex()
        self.model_digest = runtime.model_digest("gen")
        profile = runtime.shared_profile
        if profile is None:
            raise DeviceBootError(f"runtime file {runtime.path} has no shared profile; run pack --shared")
        runtime.check_bootable()
        self.capacities = profile["capacities"]
        self._command_bytes = self.capacities["command_bytes"]
        self.file_cap = profile["journal_file_cap_bytes"]
        self.checkpoint_bytes = profile["checkpoint_journal_bytes"]
        self.min_free_disk = runtime.runtime_profile["min_free_disk_bytes"]
        self.table_device = device
        self.grants = grants
        self._grant_problem = None
        self.fs = fs or OsFileLayer()
        self.journal_dir = journal_dir
        self.hold = None            # {"cause", "since_ns", "disk_error"} while persistent admission pauses
        self.hold_incidents = []    # ended holds, newest last (ops: admin console, capacity task)
        self.lock = JournalLock(journal_dir)
        self.init_chat()  # chats and the engine runner are not state: a rebuild of the tables keeps them
        self.checkpoint_waiters = []  # (conn, msg) checkpoint commands waiting for an empty journal queue
        self.runner = None  # set by boot (or a test) when an engine runs
        started = time.perf_counter()
        try:
            recovery = self._load()
            if serve:
                self._check_fresh_grants()
            self._open_writer(recovery)
        except Exception:
            self.lock.release()
            raise
        self.recovered = len(recovery.transfers)
        self.dropped = recovery.dropped
        if recovery.dropped:
            log.warning("%s", recovery.dropped)
        if serve:
            self.boot += 1
            self.last_boot_ns = time.time_ns()
            self._save_generation = self.generation
            self.writer.append(TransferKind.BOOT, msgpack.packb(
                {"boot": self.boot, "generation": self.generation, "at_ns": self.last_boot_ns}))
            self.interrupt_unfinished()
            self._commit()
        self.boot_seconds = time.perf_counter() - started

    def _load(self):
        """(Re)build every table and index from the runtime file's checkpoint plus the journal."""
        self.generation = self.runtime.generation
        self.tables = Tables(self.capacities, self.table_device)
        self.admissions = 0
        self.boot = 0
        self.last_boot_ns = 0
        self._save_generation = self.generation
        self.checkpoint_seq, self.checkpoint_digest = 0, bytes(32)
        media = {}
        if self.runtime.has(checkpoint.STATE):
            self.checkpoint_seq, self.checkpoint_digest, self._save_generation, media = checkpoint.load_state(
                self, self.runtime.bytes(checkpoint.STATE))
        self._index_tables()
        self.media = {sha: {"length": length, "type": kind, "owners": {self.by_participant[p] for p in owners}}
                      for sha, (length, kind, owners) in media.items()}
        recovery = recover(self.journal_dir, self.fs, self.incarnation, start_digest=self.checkpoint_digest,
                           after_seq=self.checkpoint_seq)
        for transfer in recovery.transfers:
            self._replay(transfer)
        return recovery

    def _open_writer(self, recovery):
        self.writer = JournalWriter(self.journal_dir, self.fs, self.incarnation, recovery)
        self._journal_base = self.writer.durable_bytes - recovery.durable_bytes  # bytes before the active journal

    def _index_tables(self):
        """Host-side indexes, derived from the tensors (empty, or just loaded from a checkpoint)."""
        t = self.tables
        self.by_principal = {}      # principal bytes -> participant row
        self.by_participant = {}    # participant raw id -> participant row
        # participant row -> (principal, lineage raw, participant raw, lineage hex, participant ID):
        # a plain tuple of atoms, which the cyclic GC stops tracking (a NamedTuple stays tracked)
        self.participant_ids = {}
        self.by_sequence = {}       # (participant row, sequence) -> receipt row
        self.by_key = {}            # (participant row, key) -> receipt row
        self.by_op = {}             # op raw -> receipt row
        self._lineages = {}         # unregistered principal -> lineage raw (a pure function, cached)
        self._release_on_save = {}  # transfer seq -> receipt rows a retirement frees once it is saved
        self._pending = {}          # journal transfer seq -> receipt row awaiting its save
        for prow, row in enumerate(t.participants.tolist()):
            if row[P.STATE]:
                self._index_participant(prow, join16(row[P.PRINCIPAL_HI], row[P.PRINCIPAL_LO]))
        for rrow, row in enumerate(t.receipts.tolist()):
            if row[R.STATE]:
                self._index_receipt(rrow, row[R.PARTICIPANT], row[R.SEQUENCE], join16(row[R.KEY_HI], row[R.KEY_LO]),
                                    join16(row[R.OP_HI], row[R.OP_LO]))
        self.free_participants = t.unused_rows(t.participants)
        self.free_receipts = t.unused_rows(t.receipts)
        self.init_spaces()
        self.init_inputs()
        self._on_saved = {}         # journal transfer seq -> what to apply once it is saved
        self._cancel_when_leased = set()
        self._admission_deferred = False

    def _index_participant(self, prow, principal):
        par = ids.participant(self.incarnation, principal)
        self.by_principal[principal] = prow
        self.by_participant[par] = prow
        lineage = self._lineages.pop(principal, None) or ids.lineage(self.incarnation, principal)
        self.participant_ids[prow] = (principal, lineage, par, lineage.hex(), ids.participant_id(par))

    def _index_receipt(self, rrow, prow, sequence, key, op):
        self.by_sequence[(prow, sequence)] = rrow
        self.by_key[(prow, key)] = rrow
        self.by_op[op] = rrow

    def _check_fresh_grants(self):
        """SPEC: restore requires fresh deployment grants."""
        if self.last_boot_ns and self.grants.written_at_ns <= self.last_boot_ns:
            raise DeviceBootError(
                f"restore requires fresh deployment grants: {self.grants.path} was written before this runtime "
                f"file's last boot; run `python manage.py write_grants --config gateway.json`, then boot again")

    def close(self):
        self.writer.close()
        self.lock.release()

    # ---- replay -------------------------------------------------------------------------

    def _replay(self, transfer):
        if transfer.kind == TransferKind.BOOT:
            info = msgpack.unpackb(transfer.payload, raw=False)
            self.boot = info["boot"]
            self._save_generation = info["generation"]
            self.last_boot_ns = info.get("at_ns", 0)
        elif transfer.kind == TransferKind.ADMISSION:
            admission = Admission.decode(transfer.payload)
            self._mark_saved(self._apply_admission(admission, None), transfer, admission.kind)
        elif transfer.kind == TransferKind.LEASE:
            self.replay_lease(transfer)
        elif transfer.kind == TransferKind.OUTPUT:
            self._apply_output(msgpack.unpackb(transfer.payload), transfer)
        elif transfer.kind == TransferKind.COMPLETION:
            self._apply_completion(msgpack.unpackb(transfer.payload), transfer)
        elif transfer.kind == TransferKind.MEDIA:
            self.apply_media(transfer.payload, transfer)
        else:
            raise DeviceBootError(f"journal transfer {transfer.seq} has kind {transfer.kind} this device cannot replay")

    # ---- holds and checkpoints (SPEC "Recorded state and recovery") --------------------

    @property
    def journal_bytes(self):
        """Bytes of the active journal (since the last checkpoint trimmed it)."""
        return self.writer.durable_bytes - self._journal_base

    def check_hold(self):
        """Pause persistent admission on file-cap or disk pressure; lift it once both clear."""
        try:
            free, _ = self.fs.statvfs(self.journal_dir)
        except OSError as exc:
            free, error = 0, f"statvfs: {exc.strerror}"
        else:
            error = None
        cause = ("file_cap" if self.journal_bytes >= self.file_cap else
                 "low_disk" if free < self.min_free_disk else None)
        if (cause is None and self.hold and self.hold["cause"] == "disk_full"
                and free < max(self.min_free_disk, DISK_FULL_MARGIN)):
            cause = "disk_full"  # after an ENOSPC, wait for real room, not for the bytes the cut gave back
        if cause and not self.hold:
            self.hold = {"cause": cause, "since_ns": time.time_ns(), "disk_error": error}
            log.warning("journal hold: %s (journal %d bytes, cap %d; %d bytes free, minimum %d)", cause,
                        self.journal_bytes, self.file_cap, free, self.min_free_disk)
        elif cause and self.hold and self.hold["cause"] != "disk_full":
            self.hold["cause"] = cause
        elif not cause and self.hold:
            self._end_hold()

    def _end_hold(self):
        self.hold_incidents.append({**self.hold, "ended_ns": time.time_ns()})
        del self.hold_incidents[:-100]
        log.warning("journal hold lifted (%s)", self.hold["cause"])
        self.hold = None

    def refuse_unsaved(self, err, batches):
        """ENOSPC while saving a tick: the writer cut the journal back to its durable end. Nothing
        unsaved survives, so rebuild the tables from what is saved, hold, and refuse every
        admission of the unsaved batches; their other replies are answered from the saved state."""
        log.warning("journal write failed (%s); rebuilding from the saved state and holding", err)
        if self.runner is not None:  # their unsaved outputs are gone: stop them, they end at the next boot
            for rrow in self.executions:
                self.runner.cancel(("input", rrow))
        self.writer.close()
        self.runtime = runtime_file.RuntimeFile.open(self.runtime.path, verify=False)
        self._open_writer(self._load())
        self.hold = {"cause": "disk_full", "since_ns": time.time_ns(), "disk_error": f"ENOSPC: {err}"}
        refusal = DeviceError(429, "journal_hold", "the journal cannot save new operations right now "
                                                   "(no space left on device); retry later", **self._hold_details())
        replies = []
        for batch in batches:
            batch.replies.extend((conn, reply(req_id, refusal.status, refusal.body()))
                                 for conn, req_id, _, _ in batch.waiting)
            batch.waiting = []
            replies.extend(self.answer(batch))
        return replies

    def _hold_details(self):
        return {"cause": self.hold["cause"], "disk_error": self.hold["disk_error"],
                "pending_bytes": self.writer.queued_bytes}

    def checkpoint(self):
        """Fold the journal into the runtime file now (between ticks)."""
        try:
            result = checkpoint.write(self)
        except OSError as exc:
            log.warning("checkpoint failed: %s", exc)
            raise DeviceError(507, "checkpoint_failed", f"checkpoint failed: {exc}") from None
        if result and self.hold and self.hold["cause"] == "disk_full":
            self._end_hold()  # the checkpoint wrote its extents and freed the folded journal: space is back
        self.check_hold()
        return result

    def after_checkpoint(self, generation, last_seq, last_digest):
        self.tables.mark_folded(generation)
        self.generation = self._save_generation = generation
        self.checkpoint_seq, self.checkpoint_digest = last_seq, last_digest
        self._journal_base = self.writer.durable_bytes - self.writer.offset
        self.runtime = runtime_file.RuntimeFile.open(self.runtime.path, verify=False)

    def idle(self):
        """Between ticks: hold state, deadlines, and the automatic checkpoint past its journal size."""
        self.check_hold()
        self.check_deadlines()
        if self.journal_bytes >= self.checkpoint_bytes and not self.writer.queued_records:
            try:
                self.checkpoint()
            except DeviceError:
                pass

    # ---- the tick ------------------------------------------------------------------------

    def tick(self, inbox):
        """One tick, synchronously (boot, tests, offline commands): gather, commit, answer.
        Returns [(conn, reply)]."""
        batch = self.gather(inbox)
        try:
            self._commit()
        except JournalIOError as err:
            if err.errno != errno.ENOSPC:
                raise  # EIO and the like: stop admitting; the process exits and a restart recovers
            return self.refuse_unsaved(err, [batch])
        return self.answer(batch)

    def gather(self, inbox):
        """Handle commands from the front of inbox (a deque of (conn, msg)) until this tick's
        record budget is used; what is left stays queued for the next tick. Admissions are
        applied and appended to the journal; every reply waits in the returned Batch until the
        batch is saved (answer()), so a mutation reply reports a saved admission and a read
        never sees unsaved state: a read is answered at once only while nothing is unsaved."""
        try:
            self.grants.reload()
            self._grant_problem = None
        except GrantFileError as exc:  # a bad rewrite must not stop the device; say so once
            if str(exc) != self._grant_problem:
                self._grant_problem = str(exc)
                log.warning("grant reload failed, keeping previous grants: %s", exc)
        self.check_hold()
        self.check_deadlines()
        batch = Batch()
        replies, waiting = batch.replies, batch.waiting
        budget = MAX_RECORDS_PER_TICK
        if not self._admission_deferred:  # engine work first, but never starving a big admission
            budget -= self.journal_engine_work(ENGINE_RECORDS_PER_TICK)
        self._admission_deferred = False
        while inbox:
            conn, msg = inbox[0]
            op = msg.get("op")
            handler = MUTATIONS.get(op)
            if handler is None:
                inbox.popleft()
                if op == "checkpoint":  # folds saved state only: runs once nothing is queued
                    self.checkpoint_waiters.append((conn, msg))
                elif op == "chat.completions":  # answered later, from the engine's events
                    refusal = self.start_chat(conn, msg)
                    if refusal is not None:
                        replies.append((conn, refusal))
                elif op == "media.put":
                    budget -= self._gather_media(conn, msg, batch)
                elif self.writer.queued_records:
                    batch.reads.append((conn, msg))
                else:
                    replies.append((conn, self._read(msg)))
                continue
            if budget <= 0:  # a full tick: every mutation needs a record (a retry waits a tick too)
                self._admission_deferred = True
                break
            try:
                outcome = self._admit(msg, handler, budget)
            except DeviceError as err:
                inbox.popleft()
                replies.append((conn, reply(msg.get("id"), err.status, err.body())))
                continue
            if outcome is None:  # does not fit this tick's record budget
                self._admission_deferred = True
                break
            inbox.popleft()
            status, rrow, records = outcome
            budget -= records
            waiting.append((conn, msg.get("id"), status, rrow))
        batch.last_seq = self.writer.next_seq - 1
        return batch

    def _gather_media(self, conn, msg, batch):
        """A media upload in a tick: refused, already there, or appended. Returns records used."""
        try:
            outcome = self.put_media(conn, msg)
        except DeviceError as err:
            batch.replies.append((conn, reply(msg.get("id"), err.status, err.body())))
            return 0
        if isinstance(outcome, tuple):
            batch.replies.append((conn, reply(msg.get("id"), outcome[0], dumps(outcome[1]))))
            return 0
        seq = self.writer.append(TransferKind.MEDIA, outcome)
        self._on_saved[seq] = lambda transfer, p=outcome: self.apply_media(p, transfer)
        batch.media.append((conn, msg.get("id"), msg["args"]["sha256"]))
        return record_count(len(outcome))

    def answer(self, batch):
        """The replies of a batch whose transfers are all saved (or refused: refuse_unsaved)."""
        replies = batch.replies
        for conn, req_id, status, rrow in batch.waiting:
            replies.append((conn, self._receipt_reply(req_id, status, rrow)))
        for conn, req_id, sha in batch.media:
            if sha in self.media:
                replies.append((conn, reply(req_id, 201, dumps(self._media_view(sha)))))
            else:  # the tick was refused (ENOSPC): nothing saved
                refusal = DeviceError(429, "journal_hold", "the journal cannot save new operations right now")
                replies.append((conn, reply(req_id, 429, refusal.body())))
        for conn, msg in batch.reads:
            replies.append((conn, self._read(msg)))
        replies.extend(self.run_checkpoints())
        return replies

    def run_checkpoints(self):
        """Answer the waiting checkpoint commands if nothing is queued for the journal now."""
        if not self.checkpoint_waiters or self.writer.queued_records:
            return []
        waiters, self.checkpoint_waiters = self.checkpoint_waiters, []
        return [(conn, self._read(msg)) for conn, msg in waiters]

    def _commit(self):
        """One fdatasync per tick (more only for a transfer larger than a tick's 16 records)."""
        while self.writer.queued_records:
            self.saved(self.writer.commit_tick())

    def saved(self, transfers):
        """Transfers just made durable, oldest first: their admissions and results are saved."""
        for transfer in transfers:
            self.free_receipts.extend(self._release_on_save.pop(transfer.seq, ()))
            pending = self._pending.pop(transfer.seq, None)
            if pending is not None:
                rrow, kind = pending
                self._mark_saved(rrow, transfer, kind)
                if kind == _INPUT:
                    self.to_lease.append(rrow)
            callback = self._on_saved.pop(transfer.seq, None)
            if callback is not None:
                callback(transfer)

    @property
    def internal_work(self):
        return self.engine_work()

    def _read(self, msg):
        req_id = msg.get("id")
        handler = READS.get(msg.get("op"))
        try:
            if handler is None:
                raise DeviceError(400, "unknown_command", f"unknown device command {msg.get('op')!r}")
            status, body = handler(self, msg)
            return reply(req_id, status, dumps(body))
        except DeviceError as err:
            return reply(req_id, err.status, err.body())

    # ---- principals, grants, participants ----------------------------------------------

    def _principal(self, msg, action):
        hexid = msg.get("principal")
        if type(hexid) is not str or not HEX32_MATCH(hexid):
            raise DeviceError(400, "bad_principal", "command lacks a principal id")
        if not self.grants.allows(hexid, action):
            raise DeviceError(403, "grant_missing", f"principal has no current {action} grant")
        return bytes.fromhex(hexid)

    def _lineage(self, principal):
        lineage = self._lineages.get(principal)
        if lineage is None:
            lineage = self._lineages[principal] = ids.lineage(self.incarnation, principal)
        return lineage

    def _participant_view(self, prow, *, own):
        _, _, _, lineage_hex, par_id = self.participant_ids[prow]
        row = self.tables.row(self.tables.participants, prow)
        return {"id": par_id, "registered": True, "lineage": lineage_hex,
                "next_sequence": str(row[P.NEXT_SEQUENCE]) if own else None,
                "retry_floor": str(row[P.RETRY_FLOOR]) if own else None}

    def live_sequences(self, prow):
        """The sequences of a participant's live receipts, ascending: every sequence from the retry
        floor up, since sequences are admitted one after another and a retirement frees exactly
        those below its floor (a range, so the device keeps no list per participant)."""
        row = self.tables.row(self.tables.participants, prow)
        return range(row[P.RETRY_FLOOR], row[P.NEXT_SEQUENCE])

    def _caller_row(self, principal):
        prow = self.by_principal.get(principal)
        if prow is None:
            raise DeviceError(409, "participant_not_registered", "register the participant first (POST /participant)")
        return prow

    @staticmethod
    def _args(msg):
        args = msg.get("args")
        return args if isinstance(args, dict) else {}

    # ---- the mutation protocol (SPEC "Mutations and retries") --------------------------

    def _admit(self, msg, handler, budget):
        """Every mutation: envelope, retry and sequence rules, then the kind's own checks.
        Returns (status, rrow, records) or None when it does not fit the tick's budget.
        (The busiest path of a device: see bench/tick_cpu.py before making it slower.)"""
        kind, action, prepare = handler
        principal = self._principal(msg, action)
        args = msg.get("args")
        if not isinstance(args, dict):
            args = {}
        lineage, key, sequence, canonical = (args.get("lineage"), args.get("operation_key"),
                                             args.get("sequence"), args.get("canonical"))
        if not (type(lineage) is str and type(key) is str and HEX32_MATCH(key)
                and type(sequence) is int and type(canonical) is bytes):
            raise DeviceError(400, "bad_command", "mutation lacks lineage, operation_key, sequence or canonical bytes")
        if len(canonical) > self._command_bytes:
            raise DeviceError(400, "command_too_large",
                              f"canonical operation is {len(canonical)} bytes; the limit is {self._command_bytes}")
        prow = self.by_principal.get(principal)
        if prow is None:
            expected, floor, next_seq = self._lineage(principal).hex(), 1, 1
        else:
            row = self.tables.row(self.tables.participants, prow)
            expected, floor, next_seq = self.participant_ids[prow][3], row[P.RETRY_FLOOR], row[P.NEXT_SEQUENCE]
        if lineage != expected:
            raise DeviceError(409, "stale_lineage", "lineage is not the participant's current lineage",
                              lineage=expected)
        if sequence < floor:
            raise DeviceError(410, "below_retry_floor", f"sequence {sequence} is below the retry floor {floor}",
                              retry_floor=str(floor))
        rrow = self.by_sequence.get((prow, sequence)) if prow is not None else None
        if rrow is not None:
            n = self.tables.value(self.tables.receipts, rrow, R.COMMAND_LEN)
            if self.tables.get_bytes(self.tables.command_bytes, rrow, n) != canonical:
                raise DeviceError(409, "operation_changed",
                                  f"sequence {sequence} was admitted with different operation bytes")
            return 200, rrow, 0
        if sequence > next_seq:
            raise DeviceError(409, "future_sequence", f"sequence {sequence} is ahead of the next sequence {next_seq}",
                              next_sequence=str(next_seq))
        key_raw = bytes.fromhex(key)
        if prow is not None and (prow, key_raw) in self.by_key:
            raise DeviceError(409, "operation_key_in_use",
                              "operation key belongs to another live operation of this participant")
        if kind != _REGISTER and prow is None:
            raise DeviceError(409, "participant_not_registered", "register the participant first (POST /participant)")
        if self.hold:
            raise DeviceError(429, "journal_hold", f"persistent admission is paused ({self.hold['cause']}); "
                                                   "reads, receipts and save status stay available",
                              **self._hold_details())
        # one receipt slot stays in reserve so that a full table can always record a retirement
        if len(self.free_receipts) < (1 if kind == _RETIREMENT else 2):
            raise DeviceError(507, "receipt_table_full",
                              "the receipt table is full; record a retirement (POST /retirements) to free receipts")
        extra = prepare(self, principal, prow, args, key_raw, sequence)
        admission = Admission(kind, principal, sequence, key_raw, ids.operation(self.incarnation, self.admissions + 1),
                              canonical, extra)
        payload = admission.encode()
        records = record_count(len(payload))
        if records > budget and budget < MAX_RECORDS_PER_TICK:
            return None
        seq = self.writer.append(_ADMISSION_TRANSFER, payload)
        rrow = self._apply_admission(admission, seq)
        self._pending[seq] = (rrow, kind)
        return 202, rrow, records

    def _apply_admission(self, a, transfer_seq):
        """Apply one admission to the tables, live (transfer_seq: its journal transfer, not yet
        saved) and at replay (transfer_seq None: saved)."""
        self.admissions += 1
        t = self.tables
        rrow = self.free_receipts.pop()
        if a.kind == _REGISTER:
            prow = self.free_participants.pop()
            hi, lo = split16(a.principal)
            t.put_cols(t.participants, prow, 0, [1, a.sequence + 1, 1, hi, lo, rrow])
            self._index_participant(prow, a.principal)
            target = prow
        else:
            prow = self.by_principal[a.principal]
            apply = APPLY.get(a.kind)
            if apply is None:
                raise DeviceBootError(f"unknown admission kind {a.kind}")
            target = apply(self, a, prow, transfer_seq, rrow)
            t.write_row(t.participants, prow, {P.NEXT_SEQUENCE: a.sequence + 1})
        row = [0] * _RECEIPT_WIDTH  # the whole row is written: a reused slot starts clean
        row[R.STATE] = 1
        row[R.PARTICIPANT] = prow
        row[R.SEQUENCE] = a.sequence
        row[R.KIND] = a.kind
        row[R.KEY_HI], row[R.KEY_LO] = split16(a.key)
        row[R.OP_HI], row[R.OP_LO] = split16(a.op)
        row[R.TARGET] = target
        row[R.CREATED] = self.admissions
        row[R.COMMAND_LEN] = len(a.canonical)
        row[R.TERMINAL] = _SUCCEEDED
        if a.kind in _KIND_COLUMNS:
            for col, value in _KIND_COLUMNS[a.kind](self, a).items():
                row[col] = value
        t.put_cols(t.receipts, rrow, 0, row)
        t.put_bytes(t.command_bytes, rrow, a.canonical)
        self._index_receipt(rrow, prow, a.sequence, a.key, a.op)
        return rrow

    def _cancellation_columns(self, a):
        target = self.tables.row(self.tables.receipts,
                                 self.by_sequence[(self.by_principal[a.principal], a.extra["target_sequence"])])
        return {R.TARGET_OP_HI: target[R.OP_HI], R.TARGET_OP_LO: target[R.OP_LO]}

    def _mark_saved(self, rrow, transfer, kind):
        """Record the save fields of the transfer that saved this receipt's admission. Every
        kind but an input finishes at admission: the same transfer saves its terminal result."""
        self._record_save(rrow, transfer, _ADMISSION_ONLY if kind == _INPUT else _ADMISSION_AND_TERMINAL)

    def _mark_terminal_saved(self, rrow, transfer):
        self._record_save(rrow, transfer, (1,))

    def _record_save(self, rrow, transfer, which):
        """Save fields of a transfer into the admission (0) and/or terminal (1) columns."""
        t = self.tables
        fields = (transfer.seq, self.boot, self._save_generation, _JOURNAL)
        if which is _ADMISSION_AND_TERMINAL:  # adjacent columns and digests: one write each
            t.put_cols(t.receipts, rrow, SAVE_COLUMNS[0][0], fields + fields)
            t.put_digests(rrow, transfer.digest)
            return
        for w in which:
            t.put_cols(t.receipts, rrow, SAVE_COLUMNS[w][0], fields)
            t.put_digest(rrow, w, transfer.digest)

    # ---- retirements (SPEC: retirement advances the persisted floor before reuse) ------

    def _prepare_retirement(self, principal, prow, args, key, sequence):
        floor = args.get("retry_floor")
        if not isinstance(floor, int) or floor < 1:
            raise DeviceError(400, "bad_field", "retry_floor must be a positive decimal counter")
        current = self.tables.value(self.tables.participants, prow, P.RETRY_FLOOR)
        if floor <= current:
            raise DeviceError(409, "retry_floor_not_advanced", f"the retry floor is already {current}",
                              retry_floor=str(current))
        if floor > sequence:
            raise DeviceError(409, "retry_floor_ahead",
                              f"retry_floor {floor} is above this retirement's own sequence {sequence}")
        t = self.tables
        seqs = self.live_sequences(prow)
        for seq in seqs[:bisect.bisect_left(seqs, floor)]:
            rrow = self.by_sequence[(prow, seq)]
            if not t.value(t.receipts, rrow, R.TERM_TRANSFER):
                raise DeviceError(409, "unfinished_operations",
                                  f"operation at sequence {seq} has no saved terminal result yet", sequence=str(seq))
        return {"retry_floor": floor}

    def _apply_retirement(self, a, prow, transfer_seq, rrow):
        floor = a.extra["retry_floor"]
        t = self.tables
        seqs = self.live_sequences(prow)
        freed = []
        for seq in seqs[:bisect.bisect_left(seqs, floor)]:
            freed_row = self.by_sequence.pop((prow, seq))
            row = t.row(t.receipts, freed_row)
            del self.by_key[(prow, join16(row[R.KEY_HI], row[R.KEY_LO]))]
            del self.by_op[join16(row[R.OP_HI], row[R.OP_LO])]
            if row[R.KIND] == Kind.INPUT:
                self.conversation_inputs[row[R.TARGET]].remove(freed_row)
            t.write_row(t.receipts, freed_row, {R.STATE: 0})
            freed.append(freed_row)
        t.write_row(t.participants, prow, {P.RETRY_FLOOR: floor})
        if transfer_seq is None:
            self.free_receipts.extend(freed)
        else:  # reusable only once the floor that retired them is saved
            self._release_on_save[transfer_seq] = freed
        return prow

    # ---- receipts ----------------------------------------------------------------------

    def _save_json(self, rrow, row, which):
        transfer_col, boot_col, gen_col, source_col = SAVE_COLUMNS[which]
        if not row[transfer_col]:
            return "null"
        return (f'{{"boot":"{row[boot_col]}","commit_digest":"{self.tables.get_digest(rrow, which).hex()}",'
                f'"file_incarnation":"{self._incarnation_hex}","generation":"{row[gen_col]}",'
                f'"source":"{SOURCE_NAMES[row[source_col]]}"}}')

    def operation_id(self, rrow, row=None):
        row = row or self.tables.row(self.tables.receipts, rrow)
        return ids.operation_id(self.participant_ids[row[R.PARTICIPANT]][1], join16(row[R.OP_HI], row[R.OP_LO]))

    def receipt_bytes(self, rrow, *, own=True):
        """A receipt as canonical JSON (sorted keys, compact), read from its tensor row."""
        return self._render_receipt(rrow, own)[1]

    def _render_receipt(self, rrow, own):
        """(operation ID, receipt bytes). Rendered from a fixed template because every value is a
        hex ID, a decimal counter or a fixed word (nothing to escape); test_device checks the
        output is canonical JSON."""
        t = self.tables
        row = t.row(t.receipts, rrow)
        _, lineage, _, _, par_id = self.participant_ids[row[R.PARTICIPANT]]
        kind = row[R.KIND]
        op_id = ids.operation_id(lineage, join16(row[R.OP_HI], row[R.OP_LO]))
        admission = self._save_json(rrow, row, 0)
        # the same transfer saved both (every kind but an input): the same fields and digest
        terminal = (admission if row[_ADM_SAVE] == row[_TERM_SAVE] else self._save_json(rrow, row, 1))
        saved = admission != "null"
        ended = terminal != "null"
        status = f'"{TERMINAL_NAMES[row[R.TERMINAL]]}"' if ended else "null"
        sequence = f'"{row[R.SEQUENCE]}"' if own else "null"
        if kind == _INPUT:
            effective = f'{{"model_digest":"{self.model_digest}","page_limit":"{row[R.PAGE_LIMIT]}"}}'
            finish = FINISH_NAMES.get(Finish(row[R.FINISH])) if ended else None
            tokens_in, tokens_out = (row[R.INPUT_TOKENS], row[R.OUTPUT_TOKENS]) if ended else ("null", "null")
        else:
            effective, finish, tokens_in, tokens_out = '{"model_digest":null,"page_limit":null}', None, "null", "null"
        finish = f'"{finish}"' if finish else "null"
        return op_id, (
            f'{{"admission":{{"save":{admission},"saved":{"true" if saved else "false"}}},'
            f'"device":{{"committed":true}},"disk_error":null,'
            f'"effective":{effective},"journal_hold":null,'
            f'"kind":"{KIND_NAMES[kind]}",'
            f'"operation":"{op_id}",'
            f'"operation_key":"{join16(row[R.KEY_HI], row[R.KEY_LO]).hex()}",'
            f'"participant":"{par_id}",'
            f'"pending_bytes":{0 if saved else row[R.COMMAND_LEN]},'
            f'"result":{{"finish":{finish},"input_tokens":{tokens_in},"length":{row[R.RESULT_LEN]},'
            f'"output_tokens":{tokens_out}}},'
            f'"schema":"{RECEIPT_SCHEMA}",'
            f'"sequence":{sequence},'
            f'"target":"{self._target_id(kind, row, lineage)}",'
            f'"terminal":{{"save":{terminal},"saved":{"true" if ended else "false"},"status":{status}}},'
            f'"transport":{{"accepted":true}}}}'
        ).encode()

    def _target_id(self, kind, row, lineage):
        target = row[R.TARGET]
        if kind in _PARTICIPANT_TARGETS:
            return self.participant_ids[target][4]
        if kind in _CONVERSATION_TARGETS:
            return self.conversation_id(target)
        if kind == _CANCELLATION:
            return ids.operation_id(lineage, join16(row[R.TARGET_OP_HI], row[R.TARGET_OP_LO]))
        return self.space_id(target)

    def receipt_json(self, rrow):
        """The owner's view of a receipt (bytes), with the current journal hold spliced in while
        there is one. Rendered from its row at every read: no cache to keep in step with the row
        (and none to grow by a kilobyte per receipt)."""
        return self.with_hold(self.receipt_bytes(rrow))

    def with_hold(self, body):
        if not self.hold:
            return body
        hold = dumps({k: self.hold[k] for k in ("cause", "since_ns", "disk_error")})
        return body.replace(b'"journal_hold":null', b'"journal_hold":' + hold, 1)

    def _receipt_reply(self, req_id, status, rrow):
        op_id, body = self._render_receipt(rrow, True)
        body = self.with_hold(body)
        if status != 202:
            return reply(req_id, status, body)
        return reply(req_id, status, body, {"Location": f"{BASE}/operations/{op_id}"})

    # ---- reads -------------------------------------------------------------------------

    def capabilities(self, msg):
        hexid = msg.get("principal")
        self._principal(msg, "shared_read")
        runtime = self.runtime
        card = runtime.json("gen/card")
        profile = runtime.runtime_profile
        models = [{"name": card["name"], "digest": runtime.model_digest("gen"),
                   "media_types": card["capabilities"]["media_types"],
                   "automatic_memory": card["capabilities"]["automatic_memory"]}]
        embedding = runtime.json("emb/card") if runtime.has("emb/card") else None
        return 200, {
            "schema": "aotx.shared.capabilities.v1",
            "schemas": {"mutation": MUTATION_SCHEMA, "receipt": RECEIPT_SCHEMA},
            "models": models,
            "embedding_model": ({"name": embedding["name"], "digest": runtime.model_digest("emb")}
                                if embedding else None),
            "limits": {**{k: str(v) for k, v in self.capacities.items()},
                       "input_bytes": "2048", "media_link_bytes": "73", "media_rows": "8",
                       "max_output_tokens": str(profile["max_output_tokens"])},
            "page_size": str(profile["page_size"]),
            "page_grant": str(profile["page_grant"]),
            "grants": sorted(self.grants.actions(hexid)),
            "journal": self.journal_state(),
            "runtime": {"file_incarnation": self.incarnation.hex(), "generation": str(self.generation),
                        "boot": str(self.boot)},
        }

    def get_participant(self, msg):
        principal = self._principal(msg, "shared_read")
        prow = self.by_principal.get(principal)
        if prow is None:
            return 200, {"id": None, "registered": False, "lineage": self._lineage(principal).hex(),
                         "next_sequence": "1", "retry_floor": "1"}
        return 200, self._participant_view(prow, own=True)

    def get_other_participant(self, msg):
        principal = self._principal(msg, "shared_read")
        m = ids.PARTICIPANT_ID.match(str(self._args(msg).get("participant", "")))
        prow = self.by_participant.get(bytes.fromhex(m.group(1))) if m else None
        if prow is None:
            raise DeviceError(404, "participant_not_found", "no such registered participant")
        return 200, self._participant_view(prow, own=self.by_principal.get(principal) == prow)

    def list_operations(self, msg):
        principal = self._principal(msg, "shared_read")
        cursor, limit = self.page_args(msg)
        prow = self.by_principal.get(principal)
        seqs = self.live_sequences(prow) if prow is not None else range(0)
        start = bisect.bisect_right(seqs, cursor) if cursor is not None else 0
        page = seqs[start:start + limit]
        items = [RawJSON(self.receipt_json(self.by_sequence[(prow, s)])) for s in page]
        more = start + limit < len(seqs)
        return 200, {"items": items, "next_cursor": str(page[-1]) if more and page else None}

    def visible_receipt(self, principal, op):
        """(receipt row, own) of an operation the principal may read; 410 once retired, else 404."""
        m = ids.OPERATION_ID.match(op)
        if not m:
            raise DeviceError(404, "operation_not_found", f"no operation {op} visible to this principal")
        raw = bytes.fromhex(m.group(2))
        rrow = self.by_op.get(raw)
        caller = self.by_principal.get(principal)
        if rrow is not None:
            t = self.tables
            row = t.row(t.receipts, rrow)
            if self.participant_ids[row[R.PARTICIPANT]][1].hex() == m.group(1):
                if row[R.PARTICIPANT] == caller:
                    return rrow, True
                if self.receipt_visible_to(principal, caller, row):
                    return rrow, False
        elif (caller is not None and self.participant_ids[caller][1].hex() == m.group(1)
              and ids.operation_counter(self.incarnation, raw) is not None):
            raise DeviceError(410, "operation_retired", f"operation {op} was retired")
        raise DeviceError(404, "operation_not_found", f"no operation {op} visible to this principal")

    def get_operation(self, msg):
        principal = self._principal(msg, "shared_read")
        rrow, own = self.visible_receipt(principal, str(self._args(msg).get("operation", "")))
        if own:
            return 200, RawJSON(self.receipt_json(rrow))
        return 200, RawJSON(self.with_hold(self.receipt_bytes(rrow, own=False)))

    def journal_state(self):
        hold = self.hold or {}
        return {"hold": bool(self.hold), "cause": hold.get("cause"), "since_ns": hold.get("since_ns"),
                "pending_bytes": self.writer.queued_bytes, "disk_error": hold.get("disk_error"),
                "bytes": str(self.journal_bytes), "file_cap_bytes": str(self.file_cap),
                "checkpoint_seq": str(self.checkpoint_seq)}

    def ping(self, msg):
        """Ops status (no principal: the socket is local and mode 0660)."""
        return 200, {"ok": True, "boot": str(self.boot), "generation": str(self.generation),
                     "usage": self.tables.usage(), "capacities": self.capacities,
                     "journal": self.journal_state(), "hold_incidents": self.hold_incidents}

    def checkpoint_command(self, msg):
        return 200, self.checkpoint() or {"generation": self.generation, "folded": 0}

    def page_args(self, msg):
        """(cursor int | None, limit) of a list read; the gateway already checked the syntax."""
        args = self._args(msg)
        cursor, limit = args.get("cursor"), args.get("limit", DEFAULT_LIMIT)
        if not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
            raise DeviceError(400, "bad_limit", f"limit must be 1..{MAX_LIMIT}")
        if cursor is not None:
            if not isinstance(cursor, str) or not cursor.isdigit():
                raise DeviceError(400, "bad_cursor", "cursor must be a decimal string")
            cursor = int(cursor)
        return cursor, limit

    # ---- registration ------------------------------------------------------------------

    def _prepare_register(self, principal, prow, args, key, sequence):
        if prow is not None:
            raise DeviceError(409, "already_registered", "the participant is already registered")
        if not self.free_participants:
            raise DeviceError(507, "participant_capacity", "the participant table is full")
        return {}


READS = {
    "ping": Device.ping,
    "checkpoint": Device.checkpoint_command,
    "capabilities": Device.capabilities,
    "participant.get": Device.get_participant,
    "participants.get": Device.get_other_participant,
    "operations.list": Device.list_operations,
    "operations.get": Device.get_operation,
    "operations.result": Device.read_result,
    "models.list": Device.list_models,
    "spaces.list": Device.list_spaces,
    "spaces.get": Device.get_space,
    "members.list": Device.list_members,
    "conversations.list": Device.list_conversations,
    "conversations.get": Device.get_conversation,
}
# op -> (kind, gateway action the principal needs, prepare(device, principal, prow, args, key, sequence))
MUTATIONS = {
    "participant.register": (Kind.PARTICIPANT_REGISTER, "shared_write", Device._prepare_register),
    "spaces.create": (Kind.SPACE_CREATE, "shared_write", Device._prepare_space),
    "members.set": (Kind.MEMBER_SET, "shared_manage", Device._prepare_member),
    "conversations.create": (Kind.CONVERSATION_CREATE, "shared_write", Device._prepare_conversation),
    "retirements.record": (Kind.RETIREMENT, "shared_write", Device._prepare_retirement),
    "cancellations.record": (Kind.CANCELLATION, "shared_write", Device._prepare_cancellation),
    "conversations.input": (Kind.INPUT, "shared_write", Device._prepare_input),
}
# kinds whose receipt rows carry columns of their own: kind -> (device, admission) -> {column: value}
_KIND_COLUMNS = {
    int(Kind.INPUT): Device._input_columns,
    int(Kind.CANCELLATION): Device._cancellation_columns,
}
APPLY = {
    Kind.SPACE_CREATE: Device._apply_space,
    Kind.MEMBER_SET: Device._apply_member,
    Kind.CONVERSATION_CREATE: Device._apply_conversation,
    Kind.RETIREMENT: Device._apply_retirement,
    Kind.INPUT: Device._apply_input,
    Kind.CANCELLATION: Device._apply_cancellation,
}
