"""The device's tick (storage/committer.py runs it): the commands a tick gathers in arrival order
until its 16-record journal budget is used (engine work first, never starving a mutation that did
not fit the last tick), the replies of a batch once its transfers are saved, what a save makes
true, and what is answered when a save fails (ENOSPC: the state rebuilt from what is saved) or
cannot be confirmed (a sync standby's, a lapsed leadership's). `Tick` is the device's part that
does it (gpu_worker/device.py holds it)."""
from __future__ import annotations

import logging
from collections import deque
from typing import Callable, Protocol

from ..contract.errors import ServiceError
from ..contract.wire import Answer, Message, Reply, reply
from ..kinds import chat, events, media, receipts
from ..kinds.registry import LATER, MUTATIONS
from ..storage import runtime_file
from ..storage.committer import Batch
from ..storage.journal import Transfer
from ..storage.journal_reader import RecoveryResult
from ..storage.journal_writer import MAX_RECORDS_PER_TICK, JournalIOError, JournalWriter
from ..storage.runtime_file import RuntimeFile
from ..kinds.kind import OperationKind
from ..memory import expiry
from . import admission, execution, preparing

log = logging.getLogger("gpu_worker.device")


class Ticking(admission.Admitter, Protocol):
    """What a tick reads and changes of the device beyond admission's context."""

    runtime: RuntimeFile
    prepared: deque[preparing.Prepared]
    on_saved: dict[int, Callable[[Transfer], None]]

    def read(self, msg: Message) -> Reply: ...

    def reload_grants(self) -> None: ...

    def check_hold(self) -> None: ...

    def load(self) -> RecoveryResult: ...

    def open_writer(self, recovery: RecoveryResult) -> JournalWriter: ...


class Tick:
    """Gathers, answers and saves the device's ticks; `deferred`: a mutation did not fit the last
    tick (the next one admits before engine work)."""

    def __init__(self, device: Ticking) -> None:
        self.d = device
        self.deferred = False

    def gather(self, inbox: deque[tuple[object, Message]], batch: Batch) -> None:
        """Handle commands from the front of inbox until this tick's record budget is used; what
        is left stays queued for the next tick. Engine work goes first, but never starves a
        mutation that did not fit the last tick."""
        d = self.d
        d.reload_grants()
        d.check_hold()
        execution.check_deadlines(d)
        chat.check_deadlines(d)
        replies = batch.replies
        budget = MAX_RECORDS_PER_TICK
        if not self.deferred:
            budget -= execution.journal_work(d, execution.ENGINE_RECORDS_PER_TICK)
        budget -= expiry.journal(d, budget)  # (memory rows past their time to live: one transfer a batch)
        self.deferred = False
        writer = d.committer.writer
        budget = self._admit_prepared(budget, batch)  # their work done, they go first
        if self.deferred:
            return
        while inbox:
            conn, msg = inbox[0]
            op = msg.get("op", "")
            kind = MUTATIONS.get(op)
            if kind is None:
                inbox.popleft()
                later = LATER.get(op)
                if later is not None:
                    budget -= later(d, conn, msg, batch)
                elif writer.queued_records:
                    batch.reads.append((conn, msg))
                else:
                    replies.append((conn, d.read(msg)))
                continue
            if budget <= 0:  # a full tick: every mutation needs a record (a retry waits a tick too)
                self.deferred = True
                break
            used = self._admit(conn, msg, kind, budget, batch)
            if used is None:  # does not fit this tick's record budget
                self.deferred = True
                break
            inbox.popleft()
            budget -= used
        self._admit_prepared(budget, batch)  # (a helper thread's work done meanwhile: without a loop, at once)

    def _admit_prepared(self, budget: int, batch: Batch) -> int:
        """The mutations whose work before admission is done (pipeline/preparing.py), in the order
        it finished, while the budget lasts (`deferred` when it does not); the budget left."""
        prepared = self.d.prepared
        while prepared and not self.deferred:
            conn, msg, value = prepared[0]
            used = self._admit(conn, msg, MUTATIONS[msg["op"]], budget, batch, value) if budget > 0 else None
            if used is None:
                self.deferred = True
                break
            prepared.popleft()
            budget -= used
        return budget

    def _admit(self, conn: object, msg: Message, kind: OperationKind, budget: int, batch: Batch,
               prepared: bytes | None = None) -> int | None:
        """One mutation admitted (its reply waits for the save) or refused (answered now): the
        journal records it used; None when it does not fit what is left of the budget."""
        try:
            outcome = admission.admit(self.d, msg, kind, budget, prepared)
        except ServiceError as err:
            batch.replies.append((conn, reply(msg.get("id"), err.status, err.body())))
            return 0
        if outcome is None:
            return None
        if outcome is admission.UNPREPARED:  # its envelope is fine: its work before admission now
            preparing.start(self.d, conn, msg, kind, batch)
            return 0
        status, rrow, records = outcome
        batch.waiting.append((conn, msg.get("id"), status, rrow))
        return records

    def answer(self, batch: Batch) -> list[Answer]:
        """The replies of a batch whose transfers are all saved (or refused: refuse_unsaved)."""
        d = self.d
        replies = batch.replies
        for conn, req_id, status, rrow in batch.waiting:
            replies.append((conn, receipts.receipt_reply(d, req_id, status, rrow)))
        reads, batch.reads = batch.reads, []
        for conn, msg in reads:
            later = LATER.get(msg.get("op", ""))
            if later is None:
                replies.append((conn, d.read(msg)))
            else:  # a subscription that waited for these saves opens now (its frames: the outbox)
                later(d, conn, msg, batch)
        if batch.reads:  # deferred again, behind transfers a save callback queued since: wait for those
            behind = Batch()
            behind.reads, batch.reads = batch.reads, []
            behind.last_seq = d.committer.writer.next_seq - 1
            d.committer.batches.append(behind)
        return replies

    def saved(self, transfers: list[Transfer]) -> None:
        """Transfers just made durable, oldest first: their admissions and results are saved."""
        d = self.d
        receipts_index = d.state.receipts
        for transfer in transfers:
            seq = transfer.seq
            freed = receipts_index.release_on_save.pop(seq, None)
            if freed:
                receipts_index.free.extend(freed)
            pending = d.pending_admissions.pop(seq, None)
            if pending is not None:
                rrow, code = pending
                kind = d.kinds[code]
                admission.mark_saved(d, rrow, transfer, kind)
                if kind.saved is not None:
                    kind.saved(d, rrow)
            callback = d.on_saved.pop(seq, None)
            if callback is not None:
                callback(transfer)

    def refuse_unsaved(self, err: JournalIOError, batches: list[Batch]) -> list[Answer]:
        """ENOSPC while saving a tick: the writer cut the journal back to its durable end. Nothing
        unsaved survives, so rebuild the state from what is saved, hold, and refuse every
        admission of the unsaved batches; their other replies are answered from the saved state.
        Every input left unfinished ends `interrupted` once the journal takes writes again
        (execution.interrupt_after_failure), and each operation stream finds its receipt again
        (events.state_rebuilt)."""
        d = self.d
        log.warning("journal write failed (%s); rebuilding from the saved state and holding", err)
        execution.stop_all(d)  # their unsaved leases and outputs are gone
        media.refuse_waiting(d)  # uploads whose owner was not saved
        d.committer.writer.close()
        d.runtime = runtime_file.RuntimeFile.open(d.runtime.path, verify=False)
        d.committer.writer = d.open_writer(d.load())
        media.recover_bytes(d)
        d.holds.disk_full(str(err))
        execution.interrupt_after_failure(d)
        events.state_rebuilt(d)
        refusal = d.holds.refusal(d.committer.writer.queued_bytes,
                                     "the journal cannot save new operations right now (no space left on device); "
                                     "retry later")
        replies: list[Answer] = []
        for batch in batches:
            batch.replies.extend((conn, reply(req_id, refusal.status, refusal.body()))
                                 for conn, req_id, _, _ in batch.waiting)
            batch.waiting = []
            replies.extend(self.answer(batch))
        return replies

    def unconfirmed(self, batches: list[Batch]) -> list[Answer]:
        """After refuse_unsaved, with a sync standby: batches whose transfers were durable here but
        not yet acknowledged by the standby. The rebuilt state holds them, so they are not refused;
        whether the standby holds them is not known, so they are not answered saved either: 503
        `standby_unconfirmed`, and the exact retry answers the receipt once it is saved on both."""
        return self._unanswered(batches, ServiceError(
            503, "standby_unconfirmed", "admitted here, not yet confirmed by the standby when the journal failed: "
                                        "retry exactly (the exact retry answers the receipt)"), reads=False)

    def not_primary(self, batches: list[Batch], why: str) -> list[Answer]:
        """With a sync standby, once fenced (Committer.fence): what waited for the standby is not
        saved here and never will be; neither its admissions nor the reads behind them are answered
        from this state: 503 `not_primary`."""
        return self._unanswered(batches, ServiceError(503, "not_primary", f"{why}: send it to the current primary"),
                                reads=True)

    def _unanswered(self, batches: list[Batch], err: ServiceError, reads: bool) -> list[Answer]:
        """`err` for each batch's admissions (and, with `reads`, its deferred reads); the rest of
        each batch answered as usual."""
        replies: list[Answer] = []
        for batch in batches:
            batch.replies.extend((conn, reply(req_id, err.status, err.body())) for conn, req_id, _, _ in batch.waiting)
            batch.waiting = []
            if reads:
                batch.replies.extend((conn, reply(msg.get("id"), err.status, err.body())) for conn, msg in batch.reads)
                batch.reads = []
            replies.extend(self.answer(batch))
        return replies
