"""A device's state rebuilt from what is saved (docs/checkpoint.md, "Restart and restore"): the
runtime file's checkpoint, then the journal's transfers after it, each through the same apply
function it went through when it was saved, so a receipt read after a restart is rebuilt from the
same values and renders to the same bytes. `Replay` is the device's part that does it
(gpu_worker/device.py holds it): at boot, for a hot standby's following, and after ENOSPC."""
from __future__ import annotations

import functools
import gc
import os
from typing import Any, Callable, Protocol

import msgpack

from ..kinds import media
from ..kinds.kind import ADMISSION_VERSION, HEAD_ARRAY, KIND_AT, PRINCIPAL_AT, PRINCIPAL_BIN, Admission, Kind
from ..kinds.kind import OperationKind
from ..memory import expiry
from ..pipeline import admission, execution, retention
from ..state import DeviceState, holds
from ..storage import checkpoint
from ..storage.journal import JournalCorrupt, Transfer, TransferKind, segment_name
from ..storage.journal_reader import ReadAhead, RecoveryResult
from . import DeviceBootError
from .checkpoints import Checkpoints
from .preload import Filled
from .reading import EarlyRead, read_saved

_INPUT = int(Kind.INPUT)
_MEMORY = (TransferKind.MEMORY,)
_ENDS = (TransferKind.OUTPUT, TransferKind.COMPLETION)


def _run_end(piece: list[Transfer], start: int, kinds: tuple[TransferKind, ...]) -> int:
    """Where the run of transfers of those kinds that starts at piece[start] ends."""
    end = start + 1
    while end < len(piece) and piece[end].kind in kinds:
        end += 1
    return end


class Replayed(admission.Admitter, Protocol):
    """What a replay reads and rebuilds of the device: its state (replaced whole), and what sizes it."""

    state: DeviceState
    capacities: dict[str, int]
    table_device: str
    embedding_dim: int

    @property
    def checkpoints(self) -> Checkpoints: ...

    def fresh_tick_state(self) -> None: ...


class Replay:
    """Loads a device's state and replays journal transfers into it, by transfer kind."""

    def __init__(self, device: Replayed) -> None:
        self.d = device
        d = device
        # what a load on the CPU replays its stretches of admissions through (`_replay_piece`)
        self._stretching: admission.StretchContext | None = None
        self.by_kind: dict[int, Callable[[Transfer], None]] = {
            TransferKind.BOOT: self._boot,
            TransferKind.ADMISSION: self._admission,
            TransferKind.LEASE: functools.partial(execution.replay_lease, d),
            TransferKind.OUTPUT: lambda transfer: execution.apply_output(d, transfer.payload, transfer),
            TransferKind.COMPLETION: lambda transfer: execution.apply_completion(d, transfer.payload, transfer,
                                                                                 d.state.replay_source),
            TransferKind.MEDIA: lambda transfer: media.apply(d, transfer.payload, transfer),
            TransferKind.HOLD: self.hold,
            TransferKind.MEMORY: functools.partial(retention.replay_memory, d),
            TransferKind.EXPIRY: functools.partial(expiry.replay, d),
            TransferKind.CHECKPOINT: self._checkpoint,
            TransferKind.REPLICATION: self._replication,
        }

    def load(self, early: EarlyRead | None = None) -> RecoveryResult:
        """(Re)build the state from the runtime file's checkpoint plus the journal, with the
        cyclic GC paused: what a load makes (a million transfers, rows' index entries) is acyclic
        and lives on, so the collections its allocations would trigger only rescan it (a third of
        reading a 1M-transfer journal; docs/performance.md, "Replay"). `early`: the checkpoint's
        head and the journal's reading, started by boot before torch was imported."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._load_state(early)
        finally:
            if collecting:
                gc.enable()

    def _load_state(self, early: EarlyRead | None) -> RecoveryResult:
        # the journal is read on another thread from the start (where the checkpoint's state ends),
        # while the tables are made and loaded here, then replayed here piece by piece as it is read
        d = self.d
        saved, reading, preloading = (early.saved, early.reading, early.tables) if early else \
            read_saved(d.runtime, d.journal_dir, d.fs)
        try:
            # the tables (and maps) a child filled, or backed, while boot imported torch (recovery/preload.py)
            filled = preloading.take() if preloading is not None and d.table_device == "cpu" else None
            return self._replay_after(reading, saved, filled)
        finally:
            reading.close()
            if preloading is not None:
                preloading.close()

    def _replay_after(self, reading: ReadAhead, saved: dict[str, Any] | None,
                      filled: Filled | None = None) -> RecoveryResult:
        """The state: the checkpoint's, `saved` (decoded; None: none yet; `filled`: its tables,
        filled and partly indexed already), then the journal's transfers after it as `reading`
        hands them over."""
        d = self.d
        state = DeviceState(d.capacities, d.table_device, d.runtime.incarnation, d.runtime.generation,
                            d.embedding_dim, tables=filled.tables if filled else None)
        media_sources: dict[str, Any] = {}
        if saved is not None:
            media_sources = checkpoint.load_saved(state, saved, _INPUT, filled=filled is not None)
        state.rebuild_indexes(_INPUT, media_sources, empty=saved is None,
                              built=filled.maps if filled else None)
        d.state = state
        d.fresh_tick_state()
        deferred = (state.receipts, state.spaces)  # indexed in whole-column passes (state/indexes.py)
        for index in deferred:
            index.defer(state.tables)
        self._stretching = admission.stretch_context(d)
        try:
            for piece in reading:
                self._replay_piece(piece)
        finally:
            self._stretching = None
        for index in deferred:
            index.settle()
        return reading.result()

    def _replay_piece(self, piece: list[Transfer]) -> None:
        """Transfers of a load, in order. On the CPU, each stretch of admissions of the kinds that
        create rows (spaces, conversations, member rows: admission.STRETCH_KINDS) by participants
        already registered natively (`admission.replay_stretch`, which finds them itself), every
        other transfer one at a time between them, but for runs of MEMORY transfers, whose rows go
        into the memory table at once (`retention.replay_memory_run`), and runs of OUTPUT and
        COMPLETION transfers, applied in one loop (`execution.replay_ends`). On an accelerator, each run
        of admissions of one kind with runs as columns (`admission.replay_run`), every other
        transfer one at a time: a transfer's kind and principal are read at the head of its payload
        (kinds/kind.py HEAD_ARRAY) without decoding it."""
        context = self._stretching
        if context is not None:
            done, n = 0, len(piece)
            while done < n:
                # (only an admission starts a stretch: an input's lease, memory, output and completion
                # come one after another, and a native call for each, applying none, cost 0.17 s of
                # a 1M load: docs/performance.md, "Replay")
                if piece[done].kind is TransferKind.ADMISSION:
                    done += admission.replay_stretch(self.d, piece, done, context)
                if done < n and piece[done].kind is TransferKind.MEMORY:  # (a run of them: written at once)
                    end = _run_end(piece, done, _MEMORY)
                    retention.replay_memory_run(self.d, piece[done:end])
                    done = end
                elif done < n and piece[done].kind in _ENDS:  # (inputs' outputs and completions: in one loop)
                    end = _run_end(piece, done, _ENDS)
                    execution.replay_ends(self.d, piece[done:end], self.d.state.replay_source)
                    done = end
                elif done < n:  # (any other transfer, or one in another layout: the Python path)
                    self.transfer(piece[done])
                    done += 1
            return
        registered = self.d.state.participants.by_principal
        batched = {code: kind for code, kind in self.d.kinds.items() if kind.apply_run is not None}
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
                self.transfer(transfer)
            else:
                run_kind = kind
                run.append(transfer)
                prows.append(prow)
        if run:
            self._replay_run(run_kind, run, prows)

    def _replay_run(self, kind: OperationKind | None, run: list[Transfer], prows: list[int]) -> None:
        assert kind is not None
        if not admission.replay_run(self.d, kind, run, prows):  # (a payload in another layout)
            for transfer in run:
                self._admission(transfer)

    def transfer(self, transfer: Transfer) -> None:
        """Apply one saved transfer to the state, by its kind."""
        replay = self.by_kind.get(transfer.kind)
        if replay is None:
            raise DeviceBootError(f"journal transfer {transfer.seq} has kind {transfer.kind} this device cannot replay")
        replay(transfer)

    def _boot(self, transfer: Transfer) -> None:
        info = msgpack.unpackb(transfer.payload, raw=False)
        state = self.d.state
        state.boot = info["boot"]
        state.save_generation = info["generation"]
        # a takeover's boot made its generation (recovery/succession.py `failover_generation`): a hot
        # standby's state, loaded from its copy before that, knows the file is there now
        state.generation = max(state.generation, info["generation"])
        state.last_boot_ns = info.get("at_ns", 0)
        state.replicated = False  # a boot saves alone until a REPLICATION transfer says a standby holds them
        if "takeover" in info:  # this boot took a standby's journal over (a failover)
            state.failovers.append({"boot": info["boot"], "at_ns": info.get("at_ns", 0), **info["takeover"]})
        if "lineage" in info:  # this boot started a line of history (a first boot, or a restore)
            first, nonce = info["lineage"]
            state.participants.start_lineage(first, nonce)

    def _admission(self, transfer: Transfer) -> None:
        d = self.d
        a = Admission.decode(transfer.payload)
        if a.kind not in d.kinds:
            raise JournalCorrupt(os.path.join(d.journal_dir, segment_name(transfer.segment)), transfer.offset,
                                 f"admission transfer seq {transfer.seq} has unknown kind {a.kind}")
        admission.apply(d, a, None, transfer)

    def hold(self, transfer: Transfer) -> None:
        """A hold's start or end (state/holds.py), saved or replayed: the incident is saved state."""
        holds.apply(self.d.state.hold_incidents, msgpack.unpackb(transfer.payload, raw=False))

    def _replication(self, transfer: Transfer) -> None:
        """Transfers from `from` on were saved held (or alone); those before this one already
        replayed under the other mode get this one's (the mode changed while they waited)."""
        info = msgpack.unpackb(transfer.payload, raw=False)
        held, start = bool(info["held"]), int(info["from"])
        state = self.d.state
        if state.replicated is not held and start < transfer.seq:
            state.tables.mark_held(start, transfer.seq, held)
        state.replicated = held

    def _checkpoint(self, transfer: Transfer) -> None:
        info = msgpack.unpackb(transfer.payload, raw=False)
        if info["generation"] > self.d.state.generation:
            self.d.checkpoints.folded(info["generation"], info["last_seq"], info["last_digest"])
        else:  # a state loaded from that checkpoint holds it; saves after this carry its generation
            self.d.state.save_generation = info["generation"]
