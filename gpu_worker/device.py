"""The device: its state, the journal it commits to, and the dispatch of every command.

`Device` owns the parts and nothing else: the state (gpu_worker/state/), the committer that runs
the tick pipeline (storage/committer.py), the grants, the holds, the inputs in execution
(pipeline/execution.py), the chats and the engine runner. What each command does lives in its operation
kind's module (gpu_worker/ops/), found through the one registry (ops/registry.py); the mutation
protocol common to them all is pipeline/admission.py.

Everything here runs on the device's one tick thread (loop/server.py). A tick gathers commands in
arrival order until its 16-record journal budget is used (the rest wait for the next tick): reads
are answered at once only while nothing is unsaved, otherwise once the saves before them are done;
admissions are applied and their replies wait for their save. Boot replays the runtime file's
checkpoint and the journal through the same apply functions, so a receipt read after a restart is
rebuilt from the same values and renders to the same bytes.
"""
from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, cast

import msgpack

from .pipeline import admission, execution, retention
from .recovery import fold
from .contract.commands import TYPES, A, parse
from .contract.errors import ServiceError
from .contract.grantfile import GrantFileError, Grants
from .contract.ids import HEX32
from .contract.rates import Pace
from .contract.vocabulary import COMMANDS, DEFAULT_RATES, OUTPUT_TOKENS_RATE
from .contract.wire import Message, dumps, reply
from .ops import chat, events, media, quotas, receipts
from .loop.subscriptions import Subscriptions
from .loop.threads import DEFAULT_NICE, enter_background
from .ops.kind import (ADMISSION_VERSION, HEAD_ARRAY, KIND_AT, PRINCIPAL_AT, PRINCIPAL_BIN, Admission, Kind,
                       OperationKind)
from .ops.registry import KINDS, LATER, MUTATIONS, READS
from .pipeline.prompt import ControlTokens
from .state import DeviceState
from .state import holds
from .state.executions import Executions
from .state.holds import Holds
from .state.usage import Chats, Usage
from .storage import checkpoint, runtime_file, runtime_file_writer
from .storage.committer import Batch, Committer, Reply
from .storage.filelayer import FileLayer, OsFileLayer
from .storage.journal import JournalCorrupt, JournalError, Transfer, TransferKind, segment_name
from .storage.journal_lock import JournalLock
from .storage.journal_reader import ReadAhead, RecoveryResult, Tail
from .storage.journal_writer import MAX_RECORDS_PER_TICK, JournalIOError, JournalWriter
from .storage.runtime_file import RuntimeFile

if TYPE_CHECKING:
    from .engine.embedding import EmbeddingModel
    from .loop.runner import Runner

log = logging.getLogger("gpu_worker.device")
REGISTRATION_RESERVE_SHARE = 64
# the device's own checkpoint past checkpoint_journal_bytes, when it must wait for saves (idle)
AUTOMATIC_CHECKPOINT: Message = {"v": 1, "id": None, "op": "checkpoint", "principal": None, "args": {}}
HEX32_MATCH = HEX32.match
# receipts rows a loop step marks after a fold beside the ticks (`Device._mark_folded`): ~6 ms here
MARK_ROWS = 65536
_INPUT = int(Kind.INPUT)


class DeviceBootError(Exception):
    pass


class Device:
    def __init__(self, runtime: RuntimeFile, journal_dir: str, grants: Grants | None, *, device: str = "cpu",
                 fs: FileLayer | None = None, serve: bool = True, takeover: bool = False,
                 leadership: Any = None, following: bool = False) -> None:
        """serve=False opens the state for an offline command (checkpoint): no grant check, no
        boot recorded. takeover: this journal is a sync standby's copy of the primary's
        (docs/replication.md): its boot continues the primary's line of history, as a restart
        would, instead of being a restore. following: a hot standby's device (its tables follow the
        journal copy until `take_over`: docs/replication.md)."""
        self.takeover = takeover
        self.took_over = False  # this boot is a takeover (set by _check_fresh_grants)
        # the primary's etcd lease (replication/lease.py Leadership, boot --etcd), held before this
        # boot: admissions stop once it may have lapsed; a takeover records its generation
        self.leadership: Any = leadership
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
        self.capacities: dict[str, int] = {**runtime_file.DEFAULT_CAPACITIES, **profile["capacities"]}
        self.command_bytes = self.capacities["command_bytes"]
        # receipt slots only a registration may take (admission.py), so a new principal can always
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
        self.usage = Usage()  # what quotas count beyond the tables (ops/quotas.py)
        # the operation kinds, by the code the journal records: an operation looks others up here
        self.kinds: dict[int, OperationKind] = KINDS
        self.runner: Runner | None = None  # set by boot (or a test) when an engine runs
        # hands events from other threads to the tick thread (the server's `deliver`; set by boot)
        self.deliver: Callable[[list[Any]], None] | None = None
        # the loop's pipeline and stall watchdog state for `ping` (the server's `pipeline_state`)
        self.pipeline_state: Callable[[], dict[str, Any]] | None = None
        self._folding: dict[str, Any] | None = None  # a checkpoint folding beside the ticks (begin_checkpoint)
        self.background_nice = DEFAULT_NICE  # off_thread's threads (loop/threads.py); boot --background-nice
        # a hot standby's reader of its journal copy (`follow`), until it takes over; None otherwise
        self.following: Tail | None = None
        if following:  # no lock: the standby's Mirror holds the journal's (`take_over` is handed it)
            self.refollow()
            return
        started = time.perf_counter()
        self.lock = JournalLock(journal_dir)
        fold.clear(journal_dir)  # (the links of a fold a stop cut short: gpu_worker/recovery/fold.py)
        try:
            recovery = self._load()
        except BaseException:
            self.lock.release()
            raise
        self._begin(recovery, serve)
        self._loaded(recovery, started)

    def _loaded(self, recovery: RecoveryResult, started: float) -> None:
        self.recovered = len(recovery.transfers) + recovery.handed_on
        self.dropped = recovery.dropped
        if recovery.dropped:
            log.warning("%s", recovery.dropped)
        self.boot_seconds = time.perf_counter() - started

    def _begin(self, recovery: RecoveryResult, serve: bool) -> None:
        """Continue the journal after `recovery` (the state holds everything before it): the
        writer, and for a device that serves its boot transfer. Releases the lock if it fails."""
        journal_dir, leadership = self.journal_dir, self.leadership
        try:
            new_lineage = self._check_fresh_grants() if serve else False
            media.recover_bytes(self)  # a restore finds the media bytes in the checkpoint (ops/media.py)
            self.committer = Committer(self, self._open_writer(recovery))
            failover: dict[str, Any] | None = None
            booted_ns = time.time_ns()
            if self.took_over:  # where this primary's part of the journal begins (a rejoin cuts back to it)
                from .replication.marker import record_takeover
                writer = self.committer.writer
                record_takeover(journal_dir, (writer.segment, writer.offset))
                failover = {"position": [writer.segment, writer.offset],
                            "generation": leadership.generation if leadership is not None else None,
                            "file_generation": self.runtime.generation + 1}
                self._failover_generation(failover, booted_ns)
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

    def _failover_generation(self, failover: dict[str, Any], at_ns: int) -> None:
        """A takeover makes the runtime file's next generation, `failover["file_generation"]`, the
        one every receipt it saves carries in its save fields (SPEC: they identify the file
        generation): the file gets the failover component (replication FAILOVER: the failover
        incident this boot records, msgpack) in place of the last one. A rejoining old primary's
        copy differs from this file in that component only, and adopts it without its journal
        being sent again (docs/replication.md, "Failover generations")."""
        from .replication import FAILOVER
        incident = msgpack.packb({"boot": self.state.boot + 1, "at_ns": at_ns, **failover})
        generation = runtime_file_writer.append(self.runtime.path, [(FAILOVER, "bytes", incident)], fs=self.runtime_fs,
                                         generation=failover["file_generation"])
        self.runtime = runtime_file.RuntimeFile.open(self.runtime.path, verify=False)
        self.state.generation = generation
        log.info("takeover: runtime file %s is at generation %d (the failover's)", self.runtime.path, generation)

    # ---- a hot standby (docs/replication.md, "A hot standby") ----------------------------

    def follow(self, until: tuple[int, int]) -> int:
        """Apply the transfers the journal copy gained before `until` (its durable end): how many."""
        assert self.following is not None
        transfers = self.following.read(until)
        for transfer in transfers:
            self._replay(transfer)
        self.recovered += len(transfers)
        return len(transfers)

    def refollow(self) -> None:
        """Build the state from the runtime file's newest generation (a checkpoint or a catch-up
        from the link may have advanced the copy) and the journal as it is now, and follow it from
        there: a hot standby's start, again when its copy was cut back before what was applied (a
        rewind to a takeover point, a failed tick on the primary), and after a catch-up."""
        started = time.perf_counter()
        self.runtime = runtime_file.RuntimeFile.open(self.runtime.path, verify=False)
        recovery = self._load()
        self.following = Tail(self.journal_dir, self.runtime.incarnation, recovery)
        self._loaded(recovery, started)

    def take_over(self, lock: JournalLock, leadership: Any, until: tuple[int, int]) -> None:
        """This hot standby becomes the primary's successor: it applies what its journal copy holds
        before `until` and boots as `boot --takeover` would (the same checks, the same boot
        transfer), without reading the journal again. `lock` is the journal's, handed over by the
        standby's Mirror (closed by now); `leadership` the etcd lease taken for this boot, if any."""
        started = time.perf_counter()
        tail = self.following
        assert tail is not None
        applied = self.follow(until)
        self.lock, self.leadership, self.takeover, self.following = lock, leadership, True, None
        self.runtime = runtime_file.RuntimeFile.open(self.runtime.path, verify=False)  # the link may have advanced it
        # a checkpoint whose CHECKPOINT transfer did not follow in time (a copy ahead of the state by
        # a failover component only folded nothing: checkpoint.folded_generation)
        folded = checkpoint.folded_generation(self.runtime)
        if folded > self.state.generation:
            self._folded(folded, tail.next_seq - 1, tail.last_digest)
        segment, offset = tail.position
        self._begin(RecoveryResult([], tail.next_seq, tail.last_digest, segment, offset, None, tail.durable_bytes),
                    True)
        self.boot_seconds = time.perf_counter() - started
        log.info("takeover: %d transfers applied at the end of following, %d in all; serving after %.3fs",
                 applied, self.recovered, self.boot_seconds)

    # ---- boot and replay ---------------------------------------------------------------

    def _load(self) -> RecoveryResult:
        """(Re)build the state from the runtime file's checkpoint plus the journal, with the
        cyclic GC paused: what a load makes (a million transfers, rows' index entries) is acyclic
        and lives on, so the collections its allocations would trigger only rescan it (a third of
        reading a 1M-transfer journal; docs/performance.md, "Replay")."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._load_state()
        finally:
            if collecting:
                gc.enable()

    def _load_state(self) -> RecoveryResult:
        # the journal is read on another thread from the start (where the checkpoint's state ends),
        # while the tables are made and loaded here, then replayed here piece by piece as it is read
        has = self.runtime.has(checkpoint.STATE)
        saved = checkpoint.decode_state(self.runtime.bytes(checkpoint.STATE)) if has else None
        after_seq, start_digest = checkpoint.fold_point(saved)
        reading = ReadAhead(self.journal_dir, self.fs, self.runtime.incarnation, start_digest=start_digest,
                            after_seq=after_seq)
        try:
            return self._replay_after(reading, saved)
        finally:
            reading.close()

    def _replay_after(self, reading: ReadAhead, saved: dict[str, Any] | None) -> RecoveryResult:
        """The state: the checkpoint's, `saved` (decoded; None: none yet), then the journal's
        transfers after it as `reading` hands them over."""
        state = DeviceState(self.capacities, self.table_device, self.runtime.incarnation, self.runtime.generation,
                            self.embedding_dim)
        media_sources: dict[str, Any] = {}
        if saved is not None:
            media_sources = checkpoint.load_saved(state, saved, _INPUT)
        state.rebuild_indexes(_INPUT, media_sources)
        self.state = state
        self.executions = Executions()
        self.pending_admissions: dict[int, tuple[int, int]] = {}  # transfer seq -> (receipt row, kind code)
        self.on_saved: dict[int, Callable[[Transfer], None]] = {}  # transfer seq -> what to apply once saved
        # MEDIA transfer seq -> the upload to answer: (connection, request id, sha256, participant row, bytes)
        self.media_waiting: dict[int, tuple[Any, Any, str, int, int]] = {}
        self._admission_deferred = False
        deferred = (state.receipts, state.spaces)  # indexed in whole-column passes (state/indexes.py)
        for index in deferred:
            index.defer(state.tables)
        for piece in reading:
            self._replay_piece(piece)
        for index in deferred:
            index.settle()
        return reading.result()

    def _replay_piece(self, piece: list[Transfer]) -> None:
        """Transfers of a load, in order: each run of admissions of a kind with runs (spaces.create),
        by participants already registered, as columns (`admission.replay_run`); every other
        transfer one at a time, after the run before it. A transfer's kind and principal are read
        at the head of its payload (ops/kind.py HEAD_ARRAY) without decoding it."""
        registered = self.state.participants.by_principal
        batched = {code: kind for code, kind in self.kinds.items() if kind.apply_run is not None}
        (i, j, bin8, sixteen), principal_at = PRINCIPAL_BIN, PRINCIPAL_AT
        run_kind: OperationKind | None = None
        run: list[Transfer] = []
        prows: list[int] = []
        for transfer in piece:
            kind = prow = None
            if transfer.kind is TransferKind.ADMISSION:
                p = transfer.payload
                if (len(p) > principal_at.stop and p[0] == HEAD_ARRAY and p[1] == ADMISSION_VERSION
                        and p[i] == bin8 and p[j] == sixteen):
                    kind = batched.get(p[KIND_AT])
                    prow = registered.get(p[principal_at]) if kind is not None else None
            if run and (prow is None or kind is not run_kind):
                self._replay_run(run_kind, run, prows)
                run, prows = [], []
            if prow is None:
                self._replay(transfer)
            else:
                run_kind = kind
                run.append(transfer)
                prows.append(prow)
        if run:
            self._replay_run(run_kind, run, prows)

    def _replay_run(self, kind: OperationKind | None, run: list[Transfer], prows: list[int]) -> None:
        assert kind is not None
        if not admission.replay_run(self, kind, run, prows):  # (a payload in another layout)
            for transfer in run:
                self._replay_admission(transfer)

    def _open_writer(self, recovery: RecoveryResult) -> JournalWriter:
        writer = JournalWriter(self.journal_dir, self.fs, self.state.incarnation, recovery)
        self._journal_base = writer.durable_bytes - recovery.durable_bytes  # bytes before the active journal
        return writer

    def _replay(self, transfer: Transfer) -> None:
        replay = _REPLAY.get(transfer.kind)
        if replay is None:
            raise DeviceBootError(f"journal transfer {transfer.seq} has kind {transfer.kind} this device cannot replay")
        replay(self, transfer)

    def _replay_boot(self, transfer: Transfer) -> None:
        info = msgpack.unpackb(transfer.payload, raw=False)
        state = self.state
        state.boot = info["boot"]
        state.save_generation = info["generation"]
        # a takeover's boot made its generation (`_failover_generation`): a hot standby's state,
        # loaded from its copy before that, knows the file is there now
        state.generation = max(state.generation, info["generation"])
        state.last_boot_ns = info.get("at_ns", 0)
        state.replicated = False  # a boot saves alone until a REPLICATION transfer says a standby holds them
        if "takeover" in info:  # this boot took a standby's journal over (a failover)
            state.failovers.append({"boot": info["boot"], "at_ns": info.get("at_ns", 0), **info["takeover"]})
        if "lineage" in info:  # this boot started a line of history (a first boot, or a restore)
            first, nonce = info["lineage"]
            state.participants.start_lineage(first, nonce)

    def _replay_admission(self, transfer: Transfer) -> None:
        a = Admission.decode(transfer.payload)
        if a.kind not in self.kinds:
            raise JournalCorrupt(os.path.join(self.journal_dir, segment_name(transfer.segment)), transfer.offset,
                                 f"admission transfer seq {transfer.seq} has unknown kind {a.kind}")
        admission.apply(self, a, None, transfer)

    def _journal_hold(self, event: dict[str, Any]) -> None:
        """A hold started or ended (state/holds.py): journal it; the incident is saved state."""
        if event.get("pending_bytes") is None:
            event["pending_bytes"] = self.committer.writer.queued_bytes
        payload = msgpack.packb(event)
        self.append(TransferKind.HOLD, payload, self._replay_hold)

    def _replay_hold(self, transfer: Transfer) -> None:
        holds.apply(self.state.hold_incidents, msgpack.unpackb(transfer.payload, raw=False))

    def _check_fresh_grants(self) -> bool:
        """SPEC: restore requires fresh deployment grants. A restart (this runtime file on its own
        journal directory, storage/owner.py) needs none, as long as the grant file is not older
        than the one its last boot accepted; a restore (any other journal directory, or a copy of
        the file) needs a grant file written after the file's last boot. Then the journal's owner
        marker names this file and this boot (docs/checkpoint.md, "Restart and restore").

        Whether this boot starts a new line of history (True): the first boot of a state, and
        every restore — the journal it continues may have lost a tail whose operation IDs and
        sequences clients hold, so every participant gets a new lineage (docs/checkpoint.md,
        "Lineages after a restore"); and a restart after a boot that started a line but stopped
        before recording it (the marker counts one line more than the saved state)."""
        from .storage import owner  # imported here: this method is the one owner of the rule

        state, grants, directory = self.state, self.grants, self.journal_dir
        if self.takeover:
            from .replication.marker import read_mark
            kept = read_mark(directory)
            if kept == "catch-up":  # (replication/standby.py, Standby._catch_up)
                raise DeviceBootError(
                    f"--takeover: {directory} is a standby's journal stopped while it caught up to its primary's "
                    "checkpoint (its journal or its copy of the runtime file is not whole): follow the primary "
                    "again (--standby-of) to finish the catch-up")
            if kept == "catching-up":  # (replication/standby.py, Standby._linked)
                raise DeviceBootError(
                    f"--takeover: {directory} is a standby's journal that had not yet acknowledged everything its "
                    "primary had saved when it connected (or was cut back since): it may lack saved transfers. "
                    "Follow the primary again (--standby-of) until it is in sync, or boot it as a restore "
                    "(without --takeover, with a fresh grant file)")
            if kept != "sync":
                raise DeviceBootError(
                    f"--takeover needs a journal a standby kept in sync replication; {directory} was kept "
                    f"{kept or 'by no standby'}: a failover from it may have lost saved transfers, so boot it "
                    "as a restore (without --takeover, with a fresh grant file: every participant gets a new "
                    "lineage)")
            self.took_over = True
        marker = owner.read(directory)
        lines = len(state.participants.starts)
        new_lineage = not state.last_boot_ns  # a state never booted: its first line
        if state.last_boot_ns:  # booted before: a restart or a restore
            why = owner.why_not_own(marker, directory, self.incarnation_hex, self.runtime.inode, state.boot)
            if why is None:
                assert isinstance(marker, owner.Owner)  # why_not_own: only a marker can be own
                if grants.written_at_ns < marker.grants_written_at_ns:
                    raise DeviceBootError(
                        f"grant file {grants.path} is older than the one this device accepted at its last boot "
                        f"(written_at_ns {grants.written_at_ns} < {marker.grants_written_at_ns}); run "
                        "`python manage.py write_grants --config gateway.json`, then boot again")
                new_lineage = marker.lineages > lines
            elif self.takeover:  # a sync standby holds every saved transfer: nothing a client saw is lost
                log.info("takeover: journal %s continues the primary's line of history (%s)", directory, why)
            elif grants.written_at_ns <= state.last_boot_ns:
                raise DeviceBootError(
                    f"restore requires fresh deployment grants: {why}, so this boot is a restore, and "
                    f"{grants.path} was written before this runtime file's last boot; run "
                    "`python manage.py write_grants --config gateway.json`, then boot again")
            else:
                new_lineage = True
        owner.write(directory, owner.Owner(self.incarnation_hex, self.runtime.inode, state.boot + 1,
                                           grants.written_at_ns, lines + new_lineage))
        return new_lineage

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

    def gather(self, inbox: deque[tuple[Any, Message]], batch: Batch) -> None:
        """Handle commands from the front of inbox until this tick's record budget is used; what
        is left stays queued for the next tick. Engine work goes first, but never starves a
        mutation that did not fit the last tick."""
        self._reload_grants()
        self.check_hold()
        execution.check_deadlines(self)
        chat.check_deadlines(self)
        replies, waiting = batch.replies, batch.waiting
        budget = MAX_RECORDS_PER_TICK
        if not self._admission_deferred:
            budget -= execution.journal_work(self, execution.ENGINE_RECORDS_PER_TICK)
        self._admission_deferred = False
        writer = self.committer.writer
        while inbox:
            conn, msg = inbox[0]
            op = msg.get("op", "")
            kind = MUTATIONS.get(op)
            if kind is None:
                inbox.popleft()
                later = LATER.get(op)
                if later is not None:
                    budget -= later(self, conn, msg, batch)
                elif writer.queued_records:
                    batch.reads.append((conn, msg))
                else:
                    replies.append((conn, self.read(msg)))
                continue
            if budget <= 0:  # a full tick: every mutation needs a record (a retry waits a tick too)
                self._admission_deferred = True
                break
            try:
                outcome = admission.admit(self, msg, kind, budget)
            except ServiceError as err:
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

    def answer(self, batch: Batch) -> list[Reply]:
        """The replies of a batch whose transfers are all saved (or refused: refuse_unsaved)."""
        replies = batch.replies
        for conn, req_id, status, rrow in batch.waiting:
            replies.append((conn, receipts.receipt_reply(self, req_id, status, rrow)))
        reads, batch.reads = batch.reads, []
        for conn, msg in reads:
            later = LATER.get(msg.get("op", ""))
            if later is None:
                replies.append((conn, self.read(msg)))
            else:  # a subscription that waited for these saves opens now (its frames: the outbox)
                later(self, conn, msg, batch)
        if batch.reads:  # deferred again, behind transfers a save callback queued since: wait for those
            behind = Batch()
            behind.reads, batch.reads = batch.reads, []
            behind.last_seq = self.committer.writer.next_seq - 1
            self.committer.batches.append(behind)
        return replies

    def saved(self, transfers: list[Transfer]) -> None:
        """Transfers just made durable, oldest first: their admissions and results are saved."""
        receipts_index = self.state.receipts
        for transfer in transfers:
            seq = transfer.seq
            freed = receipts_index.release_on_save.pop(seq, None)
            if freed:
                receipts_index.free.extend(freed)
            pending = self.pending_admissions.pop(seq, None)
            if pending is not None:
                rrow, code = pending
                kind = self.kinds[code]
                admission.mark_saved(self, rrow, transfer, kind)
                if kind.saved is not None:
                    kind.saved(self, rrow)
            callback = self.on_saved.pop(seq, None)
            if callback is not None:
                callback(transfer)

    def refuse_unsaved(self, err: JournalIOError, batches: list[Batch]) -> list[Reply]:
        """ENOSPC while saving a tick: the writer cut the journal back to its durable end. Nothing
        unsaved survives, so rebuild the state from what is saved, hold, and refuse every
        admission of the unsaved batches; their other replies are answered from the saved state.
        Every input left unfinished ends `interrupted` once the journal takes writes again
        (execution.interrupt_after_failure), and each operation stream finds its receipt again
        (events.state_rebuilt)."""
        log.warning("journal write failed (%s); rebuilding from the saved state and holding", err)
        execution.stop_all(self)  # their unsaved leases and outputs are gone
        media.refuse_waiting(self)  # uploads whose owner was not saved
        self.committer.writer.close()
        self.runtime = runtime_file.RuntimeFile.open(self.runtime.path, verify=False)
        self.committer.writer = self._open_writer(self._load())
        media.recover_bytes(self)
        self.holds.disk_full(str(err))
        execution.interrupt_after_failure(self)
        events.state_rebuilt(self)
        refusal = self.holds.refusal(self.committer.writer.queued_bytes,
                                     "the journal cannot save new operations right now (no space left on device); "
                                     "retry later")
        replies = []
        for batch in batches:
            batch.replies.extend((conn, reply(req_id, refusal.status, refusal.body()))
                                 for conn, req_id, _, _ in batch.waiting)
            batch.waiting = []
            replies.extend(self.answer(batch))
        return replies

    def fenced(self) -> str | None:
        """Why this device must admit nothing (its leadership lease may have lapsed), else None."""
        return self.leadership.fenced() if self.leadership is not None else None

    def unconfirmed(self, batches: list[Batch]) -> list[Reply]:
        """After refuse_unsaved, with a sync standby: batches whose transfers were durable here but
        not yet acknowledged by the standby. The rebuilt state holds them, so they are not refused;
        whether the standby holds them is not known, so they are not answered saved either: 503
        `standby_unconfirmed`, and the exact retry answers the receipt once it is saved on both."""
        return self._unanswered(batches, ServiceError(
            503, "standby_unconfirmed", "admitted here, not yet confirmed by the standby when the journal failed: "
                                        "retry exactly (the exact retry answers the receipt)"), reads=False)

    def not_primary(self, batches: list[Batch], why: str) -> list[Reply]:
        """With a sync standby, once fenced (Committer.fence): what waited for the standby is not
        saved here and never will be; neither its admissions nor the reads behind them are answered
        from this state: 503 `not_primary`."""
        return self._unanswered(batches, ServiceError(503, "not_primary", f"{why}: send it to the current primary"),
                                reads=True)

    def _unanswered(self, batches: list[Batch], err: ServiceError, reads: bool) -> list[Reply]:
        """`err` for each batch's admissions (and, with `reads`, its deferred reads); the rest of
        each batch answered as usual."""
        replies = []
        for batch in batches:
            batch.replies.extend((conn, reply(req_id, err.status, err.body())) for conn, req_id, _, _ in batch.waiting)
            batch.waiting = []
            if reads:
                batch.replies.extend((conn, reply(msg.get("id"), err.status, err.body())) for conn, msg in batch.reads)
                batch.reads = []
            replies.extend(self.answer(batch))
        return replies

    def read(self, msg: Message) -> Message:
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
        if not self.grants.allows(hexid, action):
            raise ServiceError(403, "grant_missing", f"principal has no current {action} grant")
        return bytes.fromhex(hexid)

    def caller_row(self, principal: bytes) -> int:
        prow = self.state.participants.by_principal.get(principal)
        if prow is None:
            raise ServiceError(409, "participant_not_registered", "register the participant first (POST /participant)")
        return prow

    def quota_defaults(self) -> dict[str, int]:
        """The table quotas of a principal whose grant leaves them out, for this runtime file and
        journal file cap (ops/quotas.py `defaults`), kept until a checkpoint reopens the file."""
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

    def _reload_grants(self) -> None:
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

    def engine_events(self, events: list[tuple[Any, int | None, bytes, str | None, Any]]) -> None:
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

    def off_thread(self, work: Callable[[], Any], then: Callable[[Any, BaseException | None], None]) -> None:
        """Run `work` (proportional to the data, not one tick's) on a thread of its own; `then`
        runs on the tick thread with its result or its exception. Without a server loop (tests,
        offline commands), both run here."""
        def run() -> None:
            if self.deliver is not None:
                enter_background("aotx-off-tick", self.background_nice)
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

    def take_outbox(self) -> list[Reply]:
        """Frames made outside a batch's answers (subscriptions: events, output, chat tokens), for
        the server to send after the step that made them."""
        return self.subscriptions.take_outbox()

    def connection_closed(self, conn: Any) -> None:
        chat.connection_closed(self, conn)

    @property
    def internal_work(self) -> bool:
        """Something to journal that no client asked for in a tick: engine work, or transfers
        appended between ticks (a hold's start, an upload whose bytes are written)."""
        return execution.has_work(self) or self.committer.writer.untaken_records > 0

    # ---- holds and checkpoints (SPEC "Recorded state and recovery") --------------------

    @property
    def journal_bytes(self) -> int:
        """Bytes of the active journal (since the last checkpoint trimmed it)."""
        return self.committer.writer.durable_bytes - self._journal_base

    def check_hold(self) -> None:
        self.holds.check(self.journal_bytes)

    def journal_state(self) -> dict[str, Any]:
        held = self.holds.current or {}
        since = held.get("since_ns")
        return {"hold": bool(held), "cause": held.get("cause"), "since_ns": None if since is None else str(since),
                "pending_bytes": str(self.committer.writer.queued_bytes), "disk_error": held.get("disk_error"),
                "bytes": str(self.journal_bytes), "file_cap_bytes": str(self.holds.file_cap),
                "checkpoint_seq": str(self.state.checkpoint_seq)}

    def checkpoint(self) -> dict[str, Any] | None:
        """Fold the journal into the runtime file now (between ticks)."""
        try:
            result = checkpoint.write(self, media.checkpoint_components(self))
        except OSError as exc:
            log.warning("checkpoint failed: %s", exc)
            raise ServiceError(507, "checkpoint_failed", f"checkpoint failed: {exc}") from None
        if result and self.holds.current and self.holds.current["cause"] == "disk_full":
            self.holds.end()  # the checkpoint wrote its extents and freed the folded journal: space is back
        self.check_hold()
        return result

    def drained(self, conn: Any, msg: Message) -> Message | None:
        """A command that waited for every transfer to be saved (Committer.when_drained): its
        answer now, or None when it comes later (a served device's checkpoint folds beside its
        ticks: `begin_checkpoint`)."""
        if msg.get("op") == "checkpoint" and self.deliver is not None:
            self.begin_checkpoint(conn, msg.get("id"))
            return None
        return self.read(msg)

    def begin_checkpoint(self, conn: Any, req_id: Any) -> None:
        """Fold the journal into the runtime file beside the ticks (gpu_worker/recovery/fold.py): a new
        segment now, the fold of the ones before it in another process (gpu_worker/fold_cli.py), its append on a thread of
        this one (and the removal of the folded segments), then `_checkpoint_folded` here. Every transfer is saved (the drained point), so
        the segments folded hold exactly the saved state through the last transfer. A request
        while one folds is answered with that one's result. conn None: the automatic one."""
        folding = self._folding
        if folding is not None:
            folding["waiters"].append((conn, req_id))
            return
        writer, state = self.committer.writer, self.state
        last_seq, last_digest = writer.next_seq - 1, writer.last_digest
        if last_seq <= state.checkpoint_seq:
            self._answer_checkpoint([(conn, req_id)], 200, {"generation": state.generation, "folded": 0})
            return
        through, folded_bytes = writer.segment, writer.durable_bytes
        try:
            writer.start_new_segment()  # admissions go on in it; the fold reads those before it
            work = fold.prepare(self.journal_dir, through, self.fs)
        except (OSError, JournalError) as exc:
            self._checkpoint_failed([(conn, req_id)], exc)
            return
        folding = self._folding = {"waiters": [(conn, req_id)], "generation": state.generation + 1,
                                   "last_seq": last_seq, "last_digest": last_digest, "through": through,
                                   "folded_bytes": folded_bytes, "folded": last_seq - state.checkpoint_seq,
                                   "started": time.perf_counter()}
        runtime_path, nice = self.runtime.path, self.background_nice

        def fold_and_publish() -> tuple[list[tuple[str, str, Any]], list[str]]:
            made, drop = fold.run(runtime_path, work, last_seq, nice)
            folding["folded_at"] = time.perf_counter()
            checkpoint.publish(self, made, drop, folding["generation"])
            folding["published_at"] = time.perf_counter()
            try:  # (unlinking large files takes a while: not on the tick thread)
                checkpoint.trim(self, through)
            except OSError as exc:  # (the file holds them: recovery skips what the state folded)
                log.warning("checkpoint: the folded segments could not all be removed: %s", exc)
            return made, drop
        self.off_thread(fold_and_publish, lambda result, error: self._checkpoint_folded(folding, result, error))

    def _checkpoint_folded(self, folding: dict[str, Any], result: Any, error: BaseException | None) -> None:
        """The fold is in the runtime file and its segments are gone (or it failed: the segments
        stay, nothing is lost): the standby gets the components, the receipts it saved say so (in
        slices between ticks: `_mark_folded`), and then whoever asked is answered."""
        if error is not None:
            self._folding = None
            self._checkpoint_failed(folding["waiters"], error)
            return
        made, drop = result
        self.after_checkpoint(folding["generation"], folding["last_seq"], folding["last_digest"], made, drop,
                              folding["through"], folding["folded_bytes"], mark=False)
        if self.holds.current and self.holds.current["cause"] == "disk_full":
            self.holds.end()  # the checkpoint wrote its extents and freed the folded journal: space is back
        self.check_hold()
        folding["state_bytes"] = len(made[0][2])
        self._mark_folded(folding, 0)

    def _mark_folded(self, folding: dict[str, Any], start: int) -> None:
        """Mark the receipts the fold saved (Tables.mark_folded) MARK_ROWS rows at a time, one
        slice a loop step (the whole table at once held the tick loop 171 ms at 1.85M rows); a
        receipt not yet marked shows its save as the journal's, which is true too. The checkpoint
        ends, and is answered, with the last slice (a checkpoint asked meanwhile gets this one's
        answer: `_folding` stays set until then)."""
        tables = self.state.tables
        end = start + MARK_ROWS
        tables.mark_folded(folding["generation"], folding["last_seq"], slice(start, end))
        if end < tables.receipts.shape[0] and self.deliver is not None:
            self.deliver([(("thread", lambda: self._mark_folded(folding, end)), None, b"", None, None)])
            return
        if end < tables.receipts.shape[0]:  # (no loop: the rest at once)
            tables.mark_folded(folding["generation"], folding["last_seq"], slice(end, None))
        self._folding = None
        generation, started = folding["generation"], folding["started"]
        seconds = time.perf_counter() - started
        log.info("checkpoint: generation %d folds %d transfers through seq %d (%d state bytes) beside the ticks in "
                 "%.3fs (the fold process %.3fs, the append %.3fs)", generation, folding["folded"], folding["last_seq"],
                 folding["state_bytes"], seconds, folding["folded_at"] - started,
                 folding["published_at"] - folding["folded_at"])
        self._answer_checkpoint(folding["waiters"], 200, {"generation": generation, "folded": folding["folded"],
                                                          "last_seq": folding["last_seq"],
                                                          "state_bytes": folding["state_bytes"], "seconds": seconds})

    def _checkpoint_failed(self, waiters: list[tuple[Any, Any]], error: BaseException) -> None:
        log.warning("checkpoint failed: %s", error)
        self._answer_checkpoint(waiters, 507, ServiceError(507, "checkpoint_failed", f"checkpoint failed: {error}").body())

    def _answer_checkpoint(self, waiters: list[tuple[Any, Any]], status: int, body: dict[str, Any] | bytes) -> None:
        payload = body if isinstance(body, bytes) else dumps(body)
        for conn, req_id in waiters:
            if conn is not None:  # (None: the device's own automatic checkpoint)
                self.subscriptions.outbox.append((conn, reply(req_id, status, payload)))

    def after_checkpoint(self, generation: int, last_seq: int, last_digest: bytes,
                         components: list[tuple[str, str, Any]], drop: list[str], through_segment: int,
                         folded_bytes: int, mark: bool = True) -> None:
        """The runtime file holds generation `generation` now, every transfer through `last_seq`
        (the journal segments through `through_segment`, `folded_bytes` of the writer's count: the
        journal's size counts from there) folded in (written with `components`,
        `drop`: storage/checkpoint.write, or gpu_worker/recovery/fold.py beside the ticks). On a primary that
        replicates, a CHECKPOINT transfer says so in the journal and the standby gets the same
        components for its copy of the file (docs/replication.md, "Checkpoints"): a state that
        replays the journal from an older checkpoint (a hot standby's, a takeover's) folds where
        this one did, so every receipt renders the same save fields on both. `mark` False: the
        caller marks the receipts the fold saved (`_mark_folded`)."""
        state = self.state
        saving_under = state.save_generation
        self._folded(generation, last_seq, last_digest, mark)
        self._journal_base = folded_bytes
        self.runtime = runtime_file.RuntimeFile.open(self.runtime.path, verify=False)
        if self.committer.replica is not None:  # (a standby connecting later has a copy made after it)
            self.committer.replica.checkpoint(generation, components, drop, through_segment)
        if self.deliver is not None:  # a served device (an offline checkpoint's state: every save after it carries it)
            # The transfers after this one carry the new generation, those before it (saved while
            # the checkpoint folded, or still waiting to be) the one they were appended under: as
            # a replay has them (`_replay_checkpoint`), whenever each is saved.
            state.save_generation = saving_under

            def now_saved(_: Transfer) -> None:
                state.save_generation = generation
            self.append(TransferKind.CHECKPOINT, msgpack.packb({"generation": generation, "last_seq": last_seq,
                                                                "last_digest": last_digest}), on_saved=now_saved)

    def _folded(self, generation: int, last_seq: int, last_digest: bytes, mark: bool = True) -> None:
        state = self.state
        if mark:
            state.tables.mark_folded(generation, last_seq)
        state.generation = state.save_generation = generation
        state.checkpoint_seq, state.checkpoint_digest = last_seq, last_digest

    def replication_marked(self, held: bool, start: int) -> int:
        """Journal that transfers from `start` on are saved held by a standby (or alone): what their
        save fields say after a replay (storage/committer.py appends it; docs/journal.md). Its seq."""
        self.state.replicated = held
        return self.append(TransferKind.REPLICATION, msgpack.packb({"held": held, "from": start}))

    def _replay_replication(self, transfer: Transfer) -> None:
        """Transfers from `from` on were saved held (or alone); those before this one already
        replayed under the other mode get this one's (the mode changed while they waited)."""
        info = msgpack.unpackb(transfer.payload, raw=False)
        held, start = bool(info["held"]), int(info["from"])
        state = self.state
        if state.replicated is not held and start < transfer.seq:
            state.tables.mark_held(start, transfer.seq, held)
        state.replicated = held

    def _replay_checkpoint(self, transfer: Transfer) -> None:
        info = msgpack.unpackb(transfer.payload, raw=False)
        if info["generation"] > self.state.generation:
            self._folded(info["generation"], info["last_seq"], info["last_digest"])
        else:  # a state loaded from that checkpoint holds it; saves after this carry its generation
            self.state.save_generation = info["generation"]

    def idle(self) -> None:
        """Between ticks: grants (a revoked reader's stream ends within this period, loop/server.py
        IDLE_SECONDS, even on a quiet device), hold state, deadlines, and the automatic checkpoint
        past its journal size."""
        self._reload_grants()
        self.check_hold()
        execution.check_deadlines(self)
        if self.journal_bytes >= self.checkpoint_bytes and self._folding is None:
            if self.committer.all_saved:
                self.drained(None, AUTOMATIC_CHECKPOINT)
            elif not self.committer.drain_waiters:  # under load something is always being saved: gathering
                self.committer.when_drained(None, AUTOMATIC_CHECKPOINT)  # pauses until nothing is, then it runs


_REPLAY: dict[int, Callable[[Device, Transfer], None]] = {
    TransferKind.BOOT: Device._replay_boot,
    TransferKind.ADMISSION: Device._replay_admission,
    TransferKind.LEASE: execution.replay_lease,
    TransferKind.OUTPUT: lambda d, transfer: execution.apply_output(d, transfer.payload, transfer),
    TransferKind.COMPLETION: lambda d, transfer: execution.apply_completion(d, transfer.payload, transfer,
                                                                            d.state.replay_source),
    TransferKind.MEDIA: lambda d, transfer: media.apply(d, transfer.payload, transfer),
    TransferKind.HOLD: Device._replay_hold,
    TransferKind.MEMORY: retention.replay_memory,
    TransferKind.CHECKPOINT: Device._replay_checkpoint,
    TransferKind.REPLICATION: Device._replay_replication,
}
