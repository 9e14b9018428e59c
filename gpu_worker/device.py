"""The device: its state, the journal it commits to, and the dispatch of every command.

`Device` is an assembly of parts and the glue between them: the state (gpu_worker/state/), the
committer that runs the tick pipeline (storage/committer.py), the grants, the holds, the inputs in
execution (pipeline/execution.py), the chats and the engine runner; the replay that (re)builds the
state (`replay`: recovery/replay.py), the checkpoints (`checkpoints`: recovery/checkpoints.py) and
the boot's place in the line of history with a hot standby's following (`succession`:
recovery/succession.py). What each command does lives in its operation kind's module
(gpu_worker/kinds/), found through the one registry (kinds/registry.py); the mutation protocol common
to them all is pipeline/admission.py.

Everything here runs on the device's one tick thread (loop/server.py). A tick gathers commands in
arrival order until its 16-record journal budget is used (the rest wait for the next tick): reads
are answered at once only while nothing is unsaved, otherwise once the saves before them are done;
admissions are applied and their replies wait for their save. Boot replays the runtime file's
checkpoint and the journal through the same apply functions, so a receipt read after a restart is
rebuilt from the same values and renders to the same bytes.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, TypeVar, cast

import msgpack

from .contract.commands import TYPES, A, Mutation, parse
from .contract.errors import ServiceError
from .contract.grantfile import GrantFileError, Grants
from .contract.ids import HEX32
from .contract.rates import Pace
from .contract.vocabulary import COMMANDS, DEFAULT_RATES, OUTPUT_TOKENS_RATE
from .contract.wire import Answer, Message, Reply, dumps, reply
from .loop.subscriptions import Subscriptions
from .loop.threads import DEFAULT_NICE, enter_background
from .kinds import chat, events, media, quotas
from .kinds.kind import MediaWaiting, OperationKind
from .kinds.registry import KINDS, READS
from .pipeline import admission, execution, retention
from .pipeline.preparing import Prepared
from .pipeline.prompt import ControlTokens
from .pipeline.tick import Tick
from .recovery import DeviceBootError, reading
from .recovery.checkpoints import Checkpoints
from .recovery.replay import Replay
from .recovery.succession import Failover, Succession
from .state import DeviceState
from .state.executions import Executions
from .derived import operator_hex
from .state.holds import Holds
from .state.usage import Chats, Usage
from .storage.committer import Batch, Committer
from .storage.filelayer import FileLayer, OsFileLayer
from .storage.journal import Transfer, TransferKind
from .storage.journal_lock import JournalLock
from .storage.journal_reader import RecoveryResult, Tail
from .storage.journal_writer import MAX_RECORDS_PER_TICK, JournalIOError, JournalWriter
from .storage.runtime_file import RuntimeFile

if TYPE_CHECKING:
    from .engine.embedding import EmbeddingModel
    from .engine.engine import TokenLogprobs
    from .loop.runner import Event, Runner
    from .replication.lease import Leadership
    from .storage.checkpoint import CheckpointSummary
    from .storage.runtime_file_writer import Stored

log = logging.getLogger("gpu_worker.device")
REGISTRATION_RESERVE_SHARE = 64
# the device's own checkpoint past checkpoint_journal_bytes, when it must wait for saves (idle)
AUTOMATIC_CHECKPOINT: Message = {"v": 1, "id": None, "op": "checkpoint", "principal": None, "args": {}}
HEX32_MATCH = HEX32.match
T = TypeVar("T")


class Device:
    state: DeviceState  # what is true, (re)built by the replay (recovery/replay.py)

    def __init__(self, runtime: RuntimeFile, journal_dir: str, grants: Grants | None, *, device: str = "cpu",
                 fs: FileLayer | None = None, serve: bool = True, takeover: bool = False,
                 leadership: Leadership | None = None, following: bool = False,
                 early: reading.EarlyRead | None = None) -> None:
        """serve=False opens the state for an offline command (checkpoint): no grant check, no
        boot recorded. takeover: this journal is a sync standby's copy of the primary's
        (docs/replication.md): its boot continues the primary's line of history, as a restart
        would, instead of being a restore. following: a hot standby's device (its tables follow the
        journal copy until `take_over`: docs/replication.md). early: the journal's lock and its
        reading, started by boot before torch was imported (recovery/reading.py); this device
        takes them over (and releases them if it fails)."""
        self.takeover = takeover
        self.took_over = False  # this boot is a takeover (set by Succession.check_fresh_grants)
        # the primary's etcd lease (replication/lease.py Leadership, boot --etcd), held before this
        # boot: admissions stop once it may have lapsed; a takeover records its generation
        self.leadership: Leadership | None = leadership
        self.runtime = runtime
        self.incarnation_hex = runtime.incarnation.hex()
        self.model_digest = runtime.model_digest("gen")
        # the packed model's control tokens: refused in an input's text and a chat's messages
        self.control_tokens = ControlTokens(runtime.bytes("gen/tokenizer").tobytes().decode("utf-8"))
        profile = runtime.shared_profile
        if profile is None:
            raise DeviceBootError(f"runtime file {runtime.path} has no shared profile; enable shared operation with "
                                  f"`python -m gpu_worker pack --runtime {runtime.path} --shared`, then boot again")
        runtime.check_bootable()
        # a profile packed before memory and history existed gets their default capacities
        self.capacities: dict[str, int] = runtime.capacities
        self.command_bytes = self.capacities["command_bytes"]
        # receipt slots only a registration may take (pipeline/admission.py), so a new principal can always
        # register however full other principals made the table: 1/64 of it
        self.registration_reserve = self.capacities["receipts"] // REGISTRATION_RESERVE_SHARE
        self.checkpoint_bytes = profile["checkpoint_journal_bytes"]
        self.table_device = device
        # the embedding model memory is written and recalled with (docs/memory.md); an offline
        # command only needs its width
        self.embedding_dim: int = runtime.json("emb/card")["embedding_dim"]
        # (None only for an offline command, which embeds nothing)
        self.embedder: EmbeddingModel = cast("EmbeddingModel", None)
        if serve:
            from .engine.embedding import EmbeddingModel as Model  # loads the model's code only to serve
            self.embedder = Model.from_runtime(runtime, device)
        # None only for an offline command (serve=False), which admits and reads nothing
        self.grants: Grants = cast(Grants, grants)
        self.grant_problem: str | None = None  # why the last grant-file reload failed, while it does
        self.fs = fs or OsFileLayer()
        # the runtime file's writes in place (its checkpoints: storage/runtime_file_writer.append); tests inject crashes
        self.runtime_fs: FileLayer = OsFileLayer()
        self.journal_dir = journal_dir
        self.holds = Holds(self.fs, journal_dir, profile["journal_file_cap_bytes"],
                           runtime.runtime_profile["min_free_disk_bytes"], self._journal_hold)
        # pushes, chats and the engine runner are not state: a rebuild of the tables keeps them
        self.subscriptions = Subscriptions()
        self.chats = Chats()
        self.usage = Usage()  # what quotas count beyond the tables (kinds/quotas.py)
        # the operation kinds, by the code the journal records: an operation looks others up here
        self.kinds: dict[int, OperationKind] = KINDS
        self.runner: Runner | None = None  # set by boot (or a test) when an engine runs
        # hands events from other threads to the tick thread (the server's `deliver`; set by boot)
        self.deliver: Callable[[list[Event]], None] | None = None
        # the loop's pipeline and stall watchdog state for `ping` (the server's `pipeline_state`)
        self.pipeline_state: Callable[[], dict[str, object]] | None = None
        self.background_nice = DEFAULT_NICE  # off_thread's threads (loop/threads.py); boot --background-nice
        # a hot standby's reader of its journal copy (`follow`), until it takes over; None otherwise
        self.following: Tail | None = None
        # its parts: the replay that (re)builds the state, the checkpoints, the boot's succession, the tick
        self.replay = Replay(self)
        self.checkpoints = Checkpoints(self)
        self.succession = Succession(self)
        self.tick = Tick(self)
        if following:  # no lock: the standby's Mirror holds the journal's (`take_over` is handed it)
            self.refollow()
            return
        started = time.perf_counter()
        early = early or reading.start(runtime, journal_dir, self.fs)
        self.lock = early.lock
        try:
            try:
                recovery = self.replay.load(early)
            finally:  # (a file that fails its check explains a load that failed: that error first)
                runtime.verified()  # a check boot runs beside the load: answered before anything is journaled
        except BaseException:
            self.lock.release()
            raise
        self.start_journal(recovery, serve)
        self.loaded(recovery, started)

    def loaded(self, recovery: RecoveryResult, started: float) -> None:
        self.recovered = len(recovery.transfers) + recovery.handed_on
        self.dropped = recovery.dropped
        if recovery.dropped:
            log.warning("%s", recovery.dropped)
        self.boot_seconds = time.perf_counter() - started

    def start_journal(self, recovery: RecoveryResult, serve: bool) -> None:
        """Continue the journal after `recovery` (the state holds everything before it): the
        writer, and for a device that serves its boot transfer. Releases the lock if it fails."""
        journal_dir, leadership = self.journal_dir, self.leadership
        try:
            new_lineage = self.succession.check_fresh_grants() if serve else False
            media.recover_bytes(self)  # a restore finds the media bytes in the checkpoint (kinds/media.py)
            self.committer = Committer(self, self.open_writer(recovery))
            failover: Failover | None = None
            booted_ns = time.time_ns()
            if self.took_over:  # where this primary's part of the journal begins (a rejoin cuts back to it)
                from .replication.marker import record_takeover
                writer = self.committer.writer
                record_takeover(journal_dir, (writer.segment, writer.offset), self.fs)
                failover = {"position": [writer.segment, writer.offset],
                            "generation": leadership.generation if leadership is not None else None,
                            "file_generation": self.runtime.generation + 1}
                self.succession.failover_generation(failover, booted_ns)
        except BaseException:
            self.lock.release()
            raise
        if serve:
            state = self.state
            state.boot += 1
            state.last_boot_ns = booted_ns
            state.save_generation = state.generation
            state.replicated = False  # (as its replay says: a boot saves alone until a REPLICATION transfer)
            boot: dict[str, Any] = {"boot": state.boot, "generation": state.generation, "at_ns": state.last_boot_ns}
            if failover is not None:  # an incident of the saved state (docs/replication.md)
                boot["takeover"] = failover
                state.failovers.append({"boot": state.boot, "at_ns": state.last_boot_ns, **failover})
            if new_lineage:  # docs/checkpoint.md, "Lineages after a restore"
                boot["lineage"] = [state.admissions + 1, os.urandom(16)]
                state.participants.start_lineage(*boot["lineage"])
                log.info("boot %d starts line of history %d at admission %d: every participant has a new lineage",
                         state.boot, len(state.participants.starts), state.admissions + 1)
            self.append(TransferKind.BOOT, msgpack.packb(boot))
            execution.interrupt_unfinished(self)
            for incident in state.hold_incidents:  # a hold still open when the device stopped
                if incident["ended_ns"] is None:
                    self._journal_hold({"event": "end", **incident, "ended_ns": state.last_boot_ns})
            self.committer.commit()

    # ---- a hot standby (docs/replication.md, "A hot standby"): recovery/succession.py --------

    def follow(self, until: tuple[int, int]) -> int:
        """Apply the transfers the journal copy gained before `until` (its durable end): how many."""
        return self.succession.follow(until)

    def refollow(self) -> None:
        """Build the state again and follow the journal copy from there (Succession.refollow)."""
        self.succession.refollow()

    def take_over(self, lock: JournalLock, leadership: Leadership | None, until: tuple[int, int]) -> None:
        """This hot standby becomes the primary's successor (Succession.take_over)."""
        self.succession.take_over(lock, leadership, until)

    # ---- boot and replay: recovery/replay.py ------------------------------------------------

    def load(self) -> RecoveryResult:
        """(Re)build the state from the runtime file's checkpoint plus the journal (Replay.load)."""
        return self.replay.load()

    def fresh_tick_state(self) -> None:
        """What the ticks keep beside a state that is (re)built: nothing in execution, unsaved or waiting."""
        self.executions = Executions()
        self.pending_admissions: dict[int, tuple[int, int]] = {}  # transfer seq -> (receipt row, kind code)
        self.prepared: deque[Prepared] = deque()  # mutations whose work before admission is done (preparing.py)
        self.on_saved: dict[int, Callable[[Transfer], None]] = {}  # transfer seq -> what to apply once saved
        # MEDIA transfer seq -> the upload to answer: (connection, request id, sha256, participant row, bytes)
        self.media_waiting: dict[int, MediaWaiting] = {}
        self.tick.deferred = False


    def open_writer(self, recovery: RecoveryResult) -> JournalWriter:
        writer = JournalWriter(self.journal_dir, self.fs, self.state.incarnation, recovery)
        self.checkpoints.journal_base = writer.durable_bytes - recovery.durable_bytes  # bytes before the active journal
        return writer

    def _journal_hold(self, event: dict[str, object]) -> None:
        """A hold started or ended (state/holds.py): journal it; the incident is saved state."""
        if event.get("pending_bytes") is None:
            event["pending_bytes"] = self.committer.writer.queued_bytes
        payload = msgpack.packb(event)
        self.append(TransferKind.HOLD, payload, self.replay.hold)

    def close(self) -> None:
        self.committer.writer.close()
        self.lock.release()

    # ---- the tick (the committer runs it: storage/committer.py) --------------------------

    def append(self, kind: int, payload: bytes, on_saved: Callable[[Transfer], None] | None = None) -> int:
        """Queue a journal transfer; on_saved runs once it is saved. Its seq."""
        seq = self.committer.writer.append(kind, payload)
        if on_saved is not None:
            self.on_saved[seq] = on_saved
        return seq

    def gather(self, inbox: deque[tuple[object, Message]], batch: Batch) -> None:
        """Handle commands from the front of inbox until this tick's record budget is used (Tick.gather)."""
        self.tick.gather(inbox, batch)

    def answer(self, batch: Batch) -> list[Answer]:
        """The replies of a batch whose transfers are all saved (or refused: refuse_unsaved): Tick.answer."""
        return self.tick.answer(batch)

    def saved(self, transfers: list[Transfer]) -> None:
        """Transfers just made durable, oldest first: their admissions and results are saved (Tick.saved)."""
        self.tick.saved(transfers)

    def refuse_unsaved(self, err: JournalIOError, batches: list[Batch]) -> list[Answer]:
        """ENOSPC while saving a tick: rebuild from what is saved, hold, refuse (Tick.refuse_unsaved)."""
        return self.tick.refuse_unsaved(err, batches)

    def unconfirmed(self, batches: list[Batch]) -> list[Answer]:
        """Batches durable here but not yet acknowledged by the sync standby (Tick.unconfirmed)."""
        return self.tick.unconfirmed(batches)

    def not_primary(self, batches: list[Batch], why: str) -> list[Answer]:
        """Once fenced with a sync standby: what waited for the standby (Tick.not_primary)."""
        return self.tick.not_primary(batches, why)

    def fenced(self) -> str | None:
        """Why this device must admit nothing (its leadership lease may have lapsed), else None."""
        return self.leadership.fenced() if self.leadership is not None else None

    def read(self, msg: Message) -> Reply:
        """Answer a read from the current (saved) state."""
        req_id = msg.get("id")
        op = msg.get("op", "")
        handler = READS.get(op)
        try:
            if handler is None:
                raise ServiceError(400, "unknown_command", f"unknown device command {op!r}")
            action = COMMANDS[op].action
            principal = self.principal(msg, action) if action is not None else None
            status, body = handler(self, principal, parse(TYPES[op], msg.get("args")))
            return reply(req_id, status, dumps(body))
        except ServiceError as err:
            return reply(req_id, err.status, err.body())

    # ---- callers -------------------------------------------------------------------------

    def principal(self, msg: Message, action: str) -> bytes:
        """The command's principal, which must hold `action` in the current grant file."""
        hexid = msg.get("principal")
        if type(hexid) is not str or not HEX32_MATCH(hexid):
            raise ServiceError(400, "bad_principal", "command lacks a principal id")
        if not self.grants.allows(hexid, action) or hexid == operator_hex(self.state.incarnation):
            # (the operator's principal is the device's own: derived.operator)
            raise ServiceError(403, "grant_missing", f"principal has no current {action} grant")
        return bytes.fromhex(hexid)

    def caller_row(self, principal: bytes) -> int:
        prow = self.state.participants.by_principal.get(principal)
        if prow is None:
            raise ServiceError(409, "participant_not_registered", "register the participant first (POST /participant)")
        return prow

    def quota_defaults(self) -> dict[str, int]:
        """The table quotas of a principal whose grant leaves them out, for this runtime file and
        journal file cap (kinds/quotas.py `defaults`), kept until a checkpoint reopens the file."""
        cached, runtime = self.usage.defaults, self.runtime
        if cached is None or cached[0] is not runtime:  # (a reopened file: the same numbers)
            cached = self.usage.defaults = (runtime, quotas.defaults(self.state.capacities, runtime.runtime_profile,
                                                                     self.holds.file_cap))
        return cached[1]

    def chat_pages(self, principal: bytes) -> list[int]:
        """The page limits of the principal's running chats."""
        return [sub.data["pages"] for sub in self.subscriptions.all()
                if sub.topic[0] == "chat" and sub.principal == principal]

    @staticmethod
    def args(msg: Message, kind: type[A]) -> A:
        """The command's arguments as its declared type (contract/commands.py), or a ServiceError."""
        return parse(kind, msg.get("args"))

    def token_rate(self, tenant: object) -> Pace | None:
        """A tenant's (principal's) output-token pace, None: unpaced. The grant file's setting binds
        always; the default (DEFAULT_RATES) only under contention (engine/shares.py). The engine
        thread asks (engine/pacing.py): a grant reload replaces the quotas' dictionary whole."""
        if not isinstance(tenant, bytes):
            return None
        found, rate = self.grants.setting(tenant.hex(), OUTPUT_TOKENS_RATE)
        if found:
            return None if rate is None else Pace(rate, True)
        return Pace(DEFAULT_RATES[OUTPUT_TOKENS_RATE], False)

    def reload_grants(self) -> None:
        try:
            changed = self.grants.reload()
            self.grant_problem = None
            if changed:
                events.recheck(self)  # open streams of principals who lost a grant end now
        except GrantFileError as exc:  # a bad rewrite must not stop the device; say so once
            if str(exc) != self.grant_problem:
                self.grant_problem = str(exc)
                log.warning("grant reload failed, keeping previous grants: %s", exc)

    # ---- the engine -------------------------------------------------------------------------

    def engine_events(self, events: list[tuple[Any, int | None, bytes, str | None, TokenLogprobs | None]]) -> None:
        """The engine thread's events, on the tick thread: chat tokens or an input's output (and
        the results of other helper threads: `off_thread`)."""
        for request_id, token, data, finish, logprobs in events:
            if request_id is None:
                raise RuntimeError("the engine thread failed; restart the device")
            if request_id[0] == "thread":  # a helper thread's result: run its continuation here
                request_id[1]()
            elif request_id[0] == "chat":
                chat.event(self, request_id, token, data, finish, logprobs)
            elif request_id[0] == "interpret":
                retention.interpretation_event(self, request_id[1], data, finish)
            else:
                execution.engine_event(self, request_id[1], token, data, finish)

    def stop_input(self, rrow: int) -> None:
        """Stop an input in execution (a saved cancellation): execution.cancel."""
        execution.cancel(self, rrow)

    def off_thread(self, work: Callable[[], T], then: Callable[[T | None, BaseException | None], None]) -> None:
        """Run `work` (proportional to the data, not one tick's) on a thread of its own; `then`
        runs on the tick thread with its result or its exception. Without a server loop (tests,
        offline commands), both run here."""
        def run() -> None:
            if self.deliver is not None:
                enter_background("aotx-off-tick", self.background_nice)
            result: T | None
            error: Exception | None
            try:
                result, error = work(), None
            except Exception as exc:  # reported to `then`, not lost with the thread
                result, error = None, exc
            if self.deliver is None:
                then(result, error)
            else:
                self.deliver([(("thread", lambda: then(result, error)), None, b"", None, None)])
        if self.deliver is None:
            run()
        else:
            threading.Thread(target=run, name="aotx-off-tick", daemon=True).start()

    def take_outbox(self) -> list[Answer]:
        """Frames made outside a batch's answers (subscriptions: events, output, chat tokens), for
        the server to send after the step that made them."""
        return self.subscriptions.take_outbox()

    def connection_closed(self, conn: object) -> None:
        chat.connection_closed(self, conn)

    @property
    def internal_work(self) -> bool:
        """Something to journal that no client asked for in a tick: engine work, transfers
        appended between ticks (a hold's start, an upload whose bytes are written), or mutations
        whose work before admission is done."""
        return execution.has_work(self) or self.committer.writer.untaken_records > 0 or bool(self.prepared)

    # ---- holds and checkpoints (SPEC "Recorded state and recovery") --------------------

    @property
    def journal_bytes(self) -> int:
        """Bytes of the active journal (since the last checkpoint trimmed it)."""
        return self.checkpoints.journal_bytes

    def check_hold(self) -> None:
        self.holds.check(self.journal_bytes)

    def journal_state(self) -> dict[str, str | bool | None]:
        held = self.holds.current
        return {"hold": held is not None, "cause": held["cause"] if held else None,
                "since_ns": str(held["since_ns"]) if held else None,
                "pending_bytes": str(self.committer.writer.queued_bytes),
                "disk_error": held["disk_error"] if held else None,
                "bytes": str(self.journal_bytes), "file_cap_bytes": str(self.holds.file_cap),
                "checkpoint_seq": str(self.state.checkpoint_seq)}

    def checkpoint(self) -> CheckpointSummary | None:
        """Fold the journal into the runtime file now (between ticks): Checkpoints.write."""
        return self.checkpoints.write()

    def admit_as(self, principal: bytes, code: int, args: Mutation) -> tuple[int, int, int]:
        """An admission the device makes on its own behalf (the operator's, for the console's
        staff: memory/ops.py): the admission protocol of a command (admission.admit_as) with its
        principal and typed arguments given, past the grant check. (status, receipt row, journal
        records), or a ServiceError. It is never deferred to the next tick: its few records may
        pass this tick's budget (the journal writer takes them with the next tick's)."""
        outcome = admission.admit_as(self, principal, args, self.kinds[code], MAX_RECORDS_PER_TICK)
        assert outcome is not None  # (a full budget admits whatever its size)
        return outcome

    def drained(self, conn: object, msg: Message) -> Reply | None:
        """A command that waited for every transfer to be saved (Committer.when_drained): its
        answer now, or None when it comes later (Checkpoints.drained)."""
        return self.checkpoints.drained(conn, msg)

    def begin_checkpoint(self, conn: object, req_id: int | None) -> None:
        """Fold the journal into the runtime file beside the ticks (Checkpoints.begin)."""
        self.checkpoints.begin(conn, req_id)

    def after_checkpoint(self, generation: int, last_seq: int, last_digest: bytes,
                         components: list[Stored], drop: list[str], through_segment: int,
                         folded_bytes: int, mark: bool = True) -> None:
        """The runtime file holds generation `generation` now (Checkpoints.after_checkpoint)."""
        self.checkpoints.after_checkpoint(generation, last_seq, last_digest, components, drop, through_segment,
                                          folded_bytes, mark)

    def replication_marked(self, held: bool, start: int) -> int:
        """Journal that transfers from `start` on are saved held by a standby (or alone): what their
        save fields say after a replay (storage/committer.py appends it; docs/journal.md). Its seq."""
        self.state.replicated = held
        return self.append(TransferKind.REPLICATION, msgpack.packb({"held": held, "from": start}))

    def idle(self) -> None:
        """Between ticks: grants (a revoked reader's stream ends within this period, loop/server.py
        IDLE_SECONDS, even on a quiet device), hold state, deadlines, and the automatic checkpoint
        past its journal size."""
        self.reload_grants()
        self.check_hold()
        execution.check_deadlines(self)
        if self.journal_bytes >= self.checkpoint_bytes and self.checkpoints.folding is None:
            if self.committer.all_saved:
                self.drained(None, AUTOMATIC_CHECKPOINT)
            elif not self.committer.drain_waiters:  # under load something is always being saved: gathering
                self.committer.when_drained(None, AUTOMATIC_CHECKPOINT)  # pauses until nothing is, then it runs

