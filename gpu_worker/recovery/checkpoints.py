"""A device's checkpoints (SPEC "Recorded state and recovery", docs/checkpoint.md): the journal
folded into the runtime file, here between ticks (an offline command's, a test's) or beside the
ticks (a served device's: gpu_worker/recovery/fold.py), and what the state, the journal's size, the
standby and the receipts the fold saved say after it. `Checkpoints` is the device's part that does
it (gpu_worker/device.py holds it)."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Mapping, NotRequired, Protocol, TypedDict

import msgpack

from ..contract.errors import ServiceError
from ..contract.wire import Message, Reply, dumps, reply
from ..kinds import media
from ..kinds.kind import Context
from ..memory.forgetting import redactor
from ..storage import checkpoint, runtime_file
from ..storage.journal import JournalError, Transfer, TransferKind
from ..storage.runtime_file import RuntimeFile
from . import fold

if TYPE_CHECKING:
    from ..loop.runner import Event
    from ..storage.checkpoint import CheckpointSummary
    from ..storage.runtime_file_writer import Stored

log = logging.getLogger("gpu_worker.device")
# receipts rows a loop step marks after a fold beside the ticks (`Checkpoints._mark_folded`): a slice
# short enough that the tick loop answers between two (docs/performance.md, "A checkpoint beside the ticks")
MARK_ROWS = 65536
# who asked for a checkpoint: (connection, request id); (None, None) for the device's own automatic one
Waiter = tuple[object, int | None]


class FoldBeside(TypedDict):
    """A checkpoint folding beside the ticks (`Checkpoints.begin`): who waits for it, what it
    folds, and the times of its steps as they pass."""
    waiters: list[Waiter]
    generation: int
    last_seq: int
    last_digest: bytes
    through: int
    folded_bytes: int
    folded: int
    forgotten: int  # the memory objects forgotten before it began: their bytes are erased with it
    started: float
    folded_at: NotRequired[float]
    published_at: NotRequired[float]
    state_bytes: NotRequired[int]


class Checkpointed(Context, checkpoint.Folding, Protocol):
    """What a checkpoint reads and changes of the device beyond an operation's context: the
    runtime file it reopens, the loop it hands work to, and the reads it answers once drained."""

    runtime: RuntimeFile
    background_nice: int
    deliver: Callable[[list[Event]], None] | None

    def check_hold(self) -> None: ...

    def read(self, msg: Message) -> Reply: ...


class Checkpoints:
    """The device's checkpoints: the one folding beside the ticks (`folding`), and where the
    active journal starts in the writer's byte count (`journal_base`)."""

    def __init__(self, device: Checkpointed) -> None:
        self.d = device
        self.folding: FoldBeside | None = None  # a checkpoint folding beside the ticks (`begin`)
        self.journal_base = 0  # bytes before the active journal (since the last checkpoint trimmed it)

    @property
    def journal_bytes(self) -> int:
        """Bytes of the active journal (since the last checkpoint trimmed it)."""
        return self.d.committer.writer.durable_bytes - self.journal_base

    def write(self) -> CheckpointSummary | None:
        """Fold the journal into the runtime file now (between ticks)."""
        d = self.d
        forgotten = d.state.memory.forgotten
        try:
            result = checkpoint.write(d, media.checkpoint_components(d), redactor(forgotten))
        except OSError as exc:
            log.warning("checkpoint failed: %s", exc)
            raise ServiceError(507, "checkpoint_failed", f"checkpoint failed: {exc}") from None
        if result:
            forgotten.clear()  # (the device was idle: every one of them is folded and erased)
            media.remove_forgotten(d, d.state.memory.forgotten_media)
            d.state.memory.forgotten_media.clear()
        if result and d.holds.current and d.holds.current["cause"] == "disk_full":
            d.holds.end()  # the checkpoint wrote its extents and freed the folded journal: space is back
        d.check_hold()
        return result

    def drained(self, conn: object, msg: Message) -> Reply | None:
        """A command that waited for every transfer to be saved (Committer.when_drained): its
        answer now, or None when it comes later (a served device's checkpoint folds beside its
        ticks: `begin`)."""
        if msg.get("op") == "checkpoint" and self.d.deliver is not None:
            self.begin(conn, msg.get("id"))
            return None
        return self.d.read(msg)

    def begin(self, conn: object, req_id: int | None) -> None:
        """Fold the journal into the runtime file beside the ticks (gpu_worker/recovery/fold.py): a
        new segment now, the fold of the ones before it in another process
        (gpu_worker/fold_cli.py), its append on a thread of this one (and the removal of the folded
        segments), then `_folded_beside` here. Every transfer is saved (the drained point), so the
        segments folded hold exactly the saved state through the last transfer. A request while
        one folds is answered with that one's result. conn None: the automatic one."""
        d = self.d
        folding = self.folding
        if folding is not None:
            folding["waiters"].append((conn, req_id))
            return
        writer, state = d.committer.writer, d.state
        last_seq, last_digest = writer.next_seq - 1, writer.last_digest
        if last_seq <= state.checkpoint_seq:
            self._answer([(conn, req_id)], 200, {"generation": state.generation, "folded": 0})
            return
        through, folded_bytes = writer.segment, writer.durable_bytes
        try:
            writer.start_new_segment()  # admissions go on in it; the fold reads those before it
            work = fold.prepare(d.journal_dir, through, d.fs)
        except (OSError, JournalError) as exc:
            self._failed([(conn, req_id)], exc)
            return
        folding = self.folding = {"waiters": [(conn, req_id)], "generation": state.generation + 1,
                                  "last_seq": last_seq, "last_digest": last_digest, "through": through,
                                  "folded_bytes": folded_bytes, "folded": last_seq - state.checkpoint_seq,
                                  "forgotten": len(state.memory.forgotten), "started": time.perf_counter()}
        runtime_path, nice = d.runtime.path, d.background_nice

        def fold_and_publish() -> fold.Output:
            output = fold.run(runtime_path, work, last_seq, nice)
            folding["folded_at"] = time.perf_counter()
            try:
                checkpoint.publish(d, output.components, output.drop, folding["generation"],
                                   wipe=folding["forgotten"] > 0)
            except BaseException:
                output.memory.free()  # (here, not where the exception's frames are dropped: the tick thread)
                raise
            folding["published_at"] = time.perf_counter()
            try:  # (unlinking large files takes a while: not on the tick thread)
                checkpoint.trim(d, through)
            except OSError as exc:  # (the file holds them: recovery skips what the state folded)
                log.warning("checkpoint: the folded segments could not all be removed: %s", exc)
            return output
        d.off_thread(fold_and_publish, lambda result, error: self._folded_beside(folding, result, error))

    def _folded_beside(self, folding: FoldBeside, result: fold.Output | None, error: BaseException | None) -> None:
        """The fold is in the runtime file and its segments are gone (or it failed: the segments
        stay, nothing is lost): the standby gets the components, the receipts it saved say so (in
        slices between ticks: `_mark_folded`), and then whoever asked is answered. The output's
        memory is freed on a helper thread (fold.Memory), unless a standby's link still sends it."""
        d = self.d
        if error is not None:
            self.folding = None
            self._failed(folding["waiters"], error)
            return
        assert result is not None  # (fold_and_publish returns its components or raises)
        made, drop, memory = result
        del d.state.memory.forgotten[:folding["forgotten"]]  # (erased: the fold redacted the audit, the append wiped)
        media.remove_forgotten(d, d.state.memory.forgotten_media)
        d.state.memory.forgotten_media.clear()
        sent = self.after_checkpoint(folding["generation"], folding["last_seq"], folding["last_digest"], made, drop,
                                     folding["through"], folding["folded_bytes"], mark=False)
        folding["state_bytes"] = len(made[0][2])
        if sent:
            memory.close()
        else:
            d.off_thread(memory.free, _freed)
        if d.holds.current and d.holds.current["cause"] == "disk_full":
            d.holds.end()  # the checkpoint wrote its extents and freed the folded journal: space is back
        d.check_hold()
        self._mark_folded(folding, 0)

    def _mark_folded(self, folding: FoldBeside, start: int) -> None:
        """Mark the receipts the fold saved (Tables.mark_folded) MARK_ROWS rows at a time, one
        slice a loop step (the whole table at once held the tick loop for as long as it is large); a
        receipt not yet marked shows its save as the journal's, which is true too. The checkpoint
        ends, and is answered, with the last slice (a checkpoint asked meanwhile gets this one's
        answer: `folding` stays set until then)."""
        d = self.d
        tables = d.state.tables
        end = start + MARK_ROWS
        tables.mark_folded(folding["generation"], folding["last_seq"], slice(start, end))
        if end < tables.receipts.shape[0] and d.deliver is not None:
            d.deliver([(("thread", lambda: self._mark_folded(folding, end)), None, b"", None, None)])
            return
        if end < tables.receipts.shape[0]:  # (no loop: the rest at once)
            tables.mark_folded(folding["generation"], folding["last_seq"], slice(end, None))
        self.folding = None
        generation, started = folding["generation"], folding["started"]
        seconds = time.perf_counter() - started
        log.info("checkpoint: generation %d folds %d transfers through seq %d (%d state bytes) beside the ticks in "
                 "%.3fs (the fold process %.3fs, the append %.3fs)", generation, folding["folded"], folding["last_seq"],
                 folding["state_bytes"], seconds, folding["folded_at"] - started,
                 folding["published_at"] - folding["folded_at"])
        self._answer(folding["waiters"], 200, {"generation": generation, "folded": folding["folded"],
                                               "last_seq": folding["last_seq"],
                                               "state_bytes": folding["state_bytes"], "seconds": seconds})

    def _failed(self, waiters: list[Waiter], error: BaseException) -> None:
        log.warning("checkpoint failed: %s", error)
        self._answer(waiters, 507, ServiceError(507, "checkpoint_failed", f"checkpoint failed: {error}").body())

    def _answer(self, waiters: list[Waiter], status: int, body: Mapping[str, object] | bytes) -> None:
        payload = body if isinstance(body, bytes) else dumps(body)
        for conn, req_id in waiters:
            if conn is not None:  # (None: the device's own automatic checkpoint)
                self.d.subscriptions.outbox.append((conn, reply(req_id, status, payload)))

    def after_checkpoint(self, generation: int, last_seq: int, last_digest: bytes,
                         components: list[Stored], drop: list[str], through_segment: int,
                         folded_bytes: int, mark: bool = True) -> bool:
        """The runtime file holds generation `generation` now, every transfer through `last_seq`
        (the journal segments through `through_segment`, `folded_bytes` of the writer's count: the
        journal's size counts from there) folded in (written with `components`,
        `drop`: storage/checkpoint.write, or gpu_worker/recovery/fold.py beside the ticks). On a
        primary that replicates, a CHECKPOINT transfer says so in the journal and the standby gets
        the same components for its copy of the file (docs/replication.md, "Checkpoints"): a state
        that replays the journal from an older checkpoint (a hot standby's, a takeover's) folds
        where this one did, so every receipt renders the same save fields on both. `mark` False:
        the caller marks the receipts the fold saved (`_mark_folded`). Whether a standby's link took
        the components to send (it holds them until it has)."""
        d = self.d
        state = d.state
        saving_under = state.save_generation
        self.folded(generation, last_seq, last_digest, mark)
        self.journal_base = folded_bytes
        d.runtime = runtime_file.RuntimeFile.open(d.runtime.path, verify=False)
        sent = False
        if d.committer.replica is not None:  # (a standby connecting later has a copy made after it)
            sent = d.committer.replica.checkpoint(generation, components, drop, through_segment)
        if d.deliver is not None:  # a served device (an offline checkpoint's state: every save after it carries it)
            # The transfers after this one carry the new generation, those before it (saved while
            # the checkpoint folded, or still waiting to be) the one they were appended under: as
            # a replay has them (recovery/replay.py `_checkpoint`), whenever each is saved.
            state.save_generation = saving_under

            def now_saved(_: Transfer) -> None:
                state.save_generation = generation
            d.append(TransferKind.CHECKPOINT, msgpack.packb({"generation": generation, "last_seq": last_seq,
                                                             "last_digest": last_digest}), on_saved=now_saved)
        return sent

    def folded(self, generation: int, last_seq: int, last_digest: bytes, mark: bool = True) -> None:
        """The state holds the checkpoint `generation` through `last_seq` (its receipts marked, unless `mark` False)."""
        state = self.d.state
        if mark:
            state.tables.mark_folded(generation, last_seq)
        state.generation = state.save_generation = generation
        state.checkpoint_seq, state.checkpoint_digest = last_seq, last_digest


def _freed(_: None, error: BaseException | None) -> None:
    """A fold's output freed (fold.Memory.free): only a failure is news (its pages then go with the mapping)."""
    if error is not None:
        log.warning("checkpoint: %s", error)
