"""Checkpoints: the journal folded into state extents of the runtime file (docs/checkpoint.md).

A checkpoint writes these components to the runtime file and flips its superblock:
  "state/current"       msgpack: counters, the last folded transfer (seq + commit digest), the
                        lines of history, and the live rows of every table (row indices + raw
                        little-endian values)
  "audit/<generation>"  msgpack: every transfer folded by this checkpoint, [seq, kind, payload,
                        digest] ([..., true]: redacted, a forgotten memory object's bytes taken
                        out), so the file keeps its logical audit prefix
  "media/<sha256>"      the bytes of each media source the state lists, added once
                        (kinds/media.checkpoint_components)
The runtime file reuses the space of the extents a checkpoint supersedes (the previous state and
directory; runtime_file_writer.append), so checkpoints do not grow the file by a state each.
Then the journal moves to a new segment and the old segments are removed. A crash anywhere in
between is safe: until the superblock flip the old state + the whole journal hold everything;
after it, recovery skips the transfers the checkpoint already holds (seq <= last_seq).
"""
from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable, NotRequired, Protocol, TypedDict

import msgpack
import numpy as np
import torch

from ..columns import ROW_TABLES, table_shapes
from ..state.tables import C, R, mark_folded
from . import runtime_file_writer
from .journal import TRIMMED, list_segments, segment_name
from .journal_reader import recover
from .runtime_file import AUDIT
from .state_extent import STATE, Spill, decode_state, fill_tables, fold_point, narrow_tables

if TYPE_CHECKING:
    from ..state import DeviceState
    from .committer import Committer
    from .filelayer import FileLayer
    from .runtime_file import RuntimeFile
    from .runtime_file_writer import Stored

log = logging.getLogger("gpu_worker.checkpoint")


class CheckpointSummary(TypedDict):
    """What a checkpoint reports: the file's generation and the transfers it folded (none: the
    generation only), and for one that folded, through which seq, its state's size and its time."""
    generation: int
    folded: int
    last_seq: NotRequired[int]
    state_bytes: NotRequired[int]
    seconds: NotRequired[float]

STATE_VERSION = 2
def encode_state(state: DeviceState, last_seq: int, last_digest: bytes, generation: int,
                 save_generation: int | None = None) -> bytes:
    """The state extent of a checkpoint that makes `generation`, folding every transfer through
    `last_seq`. `save_generation`: the generation the save fields of the journal's transfers after
    `last_seq` carry until the checkpoint's CHECKPOINT transfer (None: this one; a checkpoint
    folded beside the ticks: the one before, under which the device saved them meanwhile)."""
    t = state.tables
    spill = Spill()
    tables = {}
    for name in ROW_TABLES:
        table = getattr(t, name)
        rows = torch.nonzero(table[:, 0] != 0).flatten()
        values = table[rows].cpu().numpy()  # (a copy)
        if name == "receipts":  # saved as a boot from it has them: in the file, at this generation
            mark_folded(values, generation)
        tables[name] = [spill(rows.cpu().numpy().astype("<i8").tobytes()), spill(values.astype("<i8").tobytes())]
    live = torch.nonzero(t.receipts[:, R.STATE] != 0).flatten()
    lengths = t.receipts[live, R.COMMAND_LEN].tolist()
    commands = b"".join(t.get_bytes(t.command_bytes, r, n) for r, n in zip(live.tolist(), lengths))
    results = b"".join(t.get_bytes(t.result_bytes, r, n)
                       for r, n in zip(live.tolist(), t.receipts[live, R.RESULT_LEN].tolist()))
    digests = t.receipt_digests[live].cpu().numpy().tobytes()
    raw = state.participants.raw
    head: bytes = msgpack.packb({
        "version": STATE_VERSION, "generation": generation, "last_seq": last_seq, "last_digest": last_digest,
        "save_generation": generation if save_generation is None else save_generation,
        "admissions": state.admissions, "boot": state.boot, "last_boot_ns": state.last_boot_ns,
        "lineages": state.participants.saved_lineages(),
        "tables": tables, "digests": spill(digests), "commands": spill(commands), "results": spill(results),
        "media": {sha: [source.length, source.type, [raw[p] for p in sorted(source.owners)]]
                  for sha, source in state.media.items()},
        "holds": state.hold_incidents,
        "failovers": state.failovers,
        "replicated": state.replicated,
        "memory": state.memory.encode(),
        "history": spill(_history(state)),
        "marked": True,  # its receipts' saves say the file and this generation (a load need not mark them)
        "written_ns": time.time_ns(),
    }, use_bin_type=True)
    return spill.extent(head)


def folded_generation(runtime: RuntimeFile) -> int:
    """The generation of the runtime file's newest checkpoint (0: none), read from its directory:
    each checkpoint adds its `audit/<generation>` component. The file's own generation may be past
    it: a takeover makes a generation that folds nothing (docs/replication.md, "Failover
    generations")."""
    return max((int(name[len(AUDIT):]) for name in runtime.names(AUDIT)), default=0)


def load_state(state: DeviceState, blob: bytes | memoryview, input_kind: int) -> dict[str, Any]:
    """`load_saved` of a state blob."""
    return load_saved(state, decode_state(blob), input_kind)


def load_saved(state: DeviceState, saved: dict[str, Any], input_kind: int, filled: bool = False) -> dict[str, Any]:
    """Fill the (empty) state's tables and counters from a decoded state extent (`decode_state`:
    a boot reads its last_seq and last_digest first, to start reading the journal); returns its
    media sources ({sha256: [length, type, [participant raw ids]]}) for the indexes. `filled`: the
    tables hold the extent's rows, digests and bytes already (recovery/preload.py's child ran
    `fill_tables` into them).

    A table saved with fewer columns (written before those columns existed) loads with the new
    columns zero; event orders, the one such column with a meaning of its own, are then derived
    (`_derive_event_orders`)."""
    if saved.get("version") not in (1, STATE_VERSION):
        raise ValueError(f"state extent version {saved.get('version')} is not supported")
    t = state.tables
    tables = t.named()
    if filled:
        narrow = narrow_tables(saved, tables)
    elif t.device.type == "cpu":
        narrow = fill_tables(saved, {name: table.numpy() for name, table in tables.items()})
    else:  # an accelerator's tables: filled on the host, then copied over
        host = {name: np.zeros(shape, dtype=dtype) for name, (shape, dtype) in table_shapes(t.capacities).items()}
        narrow = fill_tables(saved, host)
        for name, table in tables.items():
            table.copy_(torch.from_numpy(host[name]))
    if not saved.get("marked"):  # (a checkpoint written before its receipts were saved marked)
        t.mark_folded(saved["generation"])
    state.admissions = saved["admissions"]
    state.participants.load_lineages(saved.get("lineages", []))  # before the indexes derive any lineage
    state.boot = saved["boot"]
    state.last_boot_ns = saved["last_boot_ns"]
    state.checkpoint_seq, state.checkpoint_digest = saved["last_seq"], saved["last_digest"]
    state.save_generation = saved.get("save_generation", saved["generation"])  # (a CHECKPOINT transfer ends it)
    state.hold_incidents = saved.get("holds", [])
    state.failovers = saved.get("failovers", [])  # (none in a checkpoint from before replication)
    state.replicated = saved.get("replicated")  # whether a standby holds what is saved after it (None: unknown)
    if "memory" in saved:  # a checkpoint from before memory has none
        state.memory.load(saved["memory"])
    if narrow:
        _derive_event_orders(state, input_kind)
    media: dict[str, Any] = saved.get("media", {})
    return media


def _history(state: DeviceState) -> bytes:
    """The conversations' history bytes, concatenated in row order (lengths in their rows)."""
    t = state.tables
    rows = torch.nonzero(t.conversations[:, C.HISTORY_LEN] != 0).flatten().tolist()
    return b"".join(t.get_bytes(t.history, r, t.value(t.conversations, r, C.HISTORY_LEN)) for r in rows)


def _derive_event_orders(state: DeviceState, input_kind: int) -> None:
    """A checkpoint from before event orders: number each conversation's live inputs 1, 2, ... in
    admission order (inputs retired before it are not counted: their events are gone anyway)."""
    t = state.tables
    receipts = t.receipts.tolist()
    live = sorted((row[R.CREATED], rrow, row[R.TARGET]) for rrow, row in enumerate(receipts)
                  if row[R.STATE] and row[R.KIND] == input_kind)
    counts: dict[int, int] = {}
    for _, rrow, crow in live:
        counts[crow] = counts.get(crow, 0) + 1
        t.write_row(t.receipts, rrow, {R.ORDER: counts[crow]})
    for crow, count in counts.items():
        t.write_row(t.conversations, crow, {C.INPUTS: count})


class Folding(Protocol):
    """What a checkpoint reads and tells of the device whose journal it folds."""

    @property
    def state(self) -> DeviceState: ...

    @property
    def committer(self) -> Committer: ...

    @property
    def runtime(self) -> RuntimeFile: ...

    @property
    def runtime_fs(self) -> FileLayer: ...

    @property
    def journal_dir(self) -> str: ...

    @property
    def fs(self) -> FileLayer: ...

    def after_checkpoint(self, generation: int, last_seq: int, last_digest: bytes,
                         components: list[Stored], drop: list[str], through_segment: int,
                         folded_bytes: int) -> None: ...


# redact(transfer kind, payload) -> the payload without a forgotten object's bytes, or None to keep
# it (memory/forgetting.Redactor: called in seq order over the whole audit)
Redact = Callable[[int, bytes], "bytes | None"]


def components(device: Folding, last_seq: int, last_digest: bytes, media_added: list[tuple[str, str, bytes]],
               beside: bool = False, redact: Redact | None = None) -> list[Stored]:
    """A checkpoint's components for the device's state, which holds every transfer through
    `last_seq` and none after: the state, the audit of the transfers it folds (read from the
    journal after the previous checkpoint), and `media_added`. `beside`: folded beside the ticks
    (gpu_worker/recovery/fold.py), the device saving under the current generation meanwhile.
    `redact`: objects were forgotten since the last checkpoint, so the earlier audit components
    that held their bytes are written again, redacted, with the new one."""
    current = device.state
    folded = recover(device.journal_dir, device.fs, current.incarnation, start_digest=current.checkpoint_digest,
                     after_seq=current.checkpoint_seq).transfers
    generation = current.generation + 1
    state = encode_state(current, last_seq, last_digest, generation,
                         save_generation=current.save_generation if beside else None)
    entries = [[t.seq, int(t.kind), t.payload, t.digest] for t in folded if t.seq <= last_seq]
    rewritten: list[Stored] = []
    if redact is not None:
        for name in sorted(n for n in device.runtime.components if n.startswith(AUDIT)):
            earlier = msgpack.unpackb(device.runtime.read_verified(name), raw=False)
            if _redacted(earlier, redact):
                rewritten.append((name, "bytes", msgpack.packb(earlier, use_bin_type=True)))
        _redacted(entries, redact)
    return [(STATE, "bytes", state), *rewritten,
            (f"{AUDIT}{generation:08d}", "bytes", msgpack.packb(entries, use_bin_type=True)), *media_added]


def _redacted(entries: list[list[Any]], redact: Redact) -> bool:
    """Redact audit entries in place ([seq, kind, payload, digest], then True once redacted: the
    digest is the original payload's, storage/audit.py); whether one changed."""
    changed = False
    for entry in entries:
        payload = redact(entry[1], entry[2])
        if payload is not None:
            entry[2] = payload
            del entry[4:]
            entry.append(True)
            changed = True
    return changed


def publish(device: Folding, made: list[Stored], drop: list[str], generation: int, wipe: bool = False) -> None:
    """Append a checkpoint's components to the runtime file: it is at `generation` after (any
    thread: the device's writer lock covers it; the superblock flip makes it the winner).
    `wipe`: then zero every byte the new generation does not reach (a forgotten object's)."""
    new_generation = runtime_file_writer.append(device.runtime.path, made, drop=drop, fs=device.runtime_fs,
                                                wipe=wipe)
    if new_generation != generation:
        raise RuntimeError(f"runtime file moved to generation {new_generation}, expected {generation}")


TRIM_SLICE = 16 << 20  # bytes a folded segment is cut by at a time before it is removed (`trim`)


def trim(device: Folding, through_segment: int) -> None:
    """The runtime file holds every transfer of the segments through `through_segment`: remove
    them. Each is renamed out of the segments first (TRIMMED, the directory synced: no reader takes
    it for one again, and a boot removes what a stop left), then cut TRIM_SLICE bytes at a time from
    its end and removed: a whole segment of hundreds of MB removed at once held the journal's
    fdatasync while the file system freed its blocks (a 109 ms gap between replies as a 1M-transfer
    checkpoint ended)."""
    directory, fs = device.journal_dir, device.fs
    trimmed = []
    for number in list_segments(directory, fs):
        if number <= through_segment:
            trimmed.append(os.path.join(directory, TRIMMED + segment_name(number)))
            fs.replace(os.path.join(directory, segment_name(number)), trimmed[-1])
    for path in trimmed:
        cut = fs.open_append(path)
        try:
            for length in range(cut.size() - TRIM_SLICE, 0, -TRIM_SLICE):
                cut.truncate(length)
        finally:
            cut.close()
        fs.remove(path)


def write(device: Folding, media: tuple[list[tuple[str, str, bytes]], list[str]],
          redact: Redact | None = None) -> CheckpointSummary | None:
    """Fold the device's journal into the runtime file here, now (the device idle: every transfer
    saved, here and on a sync standby: Committer.all_saved), with `media` (components to add,
    component names to drop: kinds/media.checkpoint_components). An offline command's and a test's;
    a served device folds beside its ticks (gpu_worker/recovery/fold.py)."""
    started = time.perf_counter()
    writer = device.committer.writer
    if not device.committer.all_saved:
        raise RuntimeError("checkpoint with unsaved transfers (queued, or not yet held by the sync standby)")
    last_seq, last_digest = writer.next_seq - 1, writer.last_digest
    current = device.state
    if last_seq <= current.checkpoint_seq:
        return None
    generation, folded = current.generation + 1, last_seq - current.checkpoint_seq
    media_added, media_dropped = media
    made = components(device, last_seq, last_digest, media_added, redact=redact)
    publish(device, made, list(media_dropped), generation, wipe=redact is not None)
    # from here on the file holds every folded transfer: trim the journal
    through, folded_bytes = writer.segment, writer.durable_bytes
    writer.start_new_segment()
    trim(device, through)
    device.after_checkpoint(generation, last_seq, last_digest, made, list(media_dropped), through, folded_bytes)
    seconds = time.perf_counter() - started
    log.info("checkpoint: generation %d folds through seq %d (%d state bytes) in %.3fs",
             generation, last_seq, len(made[0][2]), seconds)
    return {"generation": generation, "folded": folded, "last_seq": last_seq,
            "state_bytes": len(made[0][2]), "seconds": seconds}


def stored_extent(blob: bytes | memoryview) -> dict[str, int]:
    """What a state blob needs of the capacities (pack refuses to shrink below it): for each row
    table the highest stored row index + 1 (rows load at their index), and the longest stored
    receipt command and result ("command_bytes", "result_bytes")."""
    saved = decode_state(blob)
    needs: dict[str, int] = {}
    for name in ROW_TABLES:
        rows_raw, data = saved["tables"][name]
        rows = np.frombuffer(rows_raw, dtype="<i8")
        needs[name] = int(rows.max()) + 1 if len(rows) else 0
        if name == "receipts" and len(rows):
            values = np.frombuffer(data, dtype="<i8").reshape(len(rows), -1)
            needs["command_bytes"] = int(values[:, R.COMMAND_LEN].max())
            needs["result_bytes"] = int(values[:, R.RESULT_LEN].max())
        if name == "conversations" and len(rows):
            values = np.frombuffer(data, dtype="<i8").reshape(len(rows), -1)
            if values.shape[1] > C.HISTORY_LEN:
                needs["history_bytes"] = int(values[:, C.HISTORY_LEN].max())
    if "memory" in saved:
        slots = np.frombuffer(saved["memory"]["slots"], dtype="<i8")
        needs["memory"] = int(slots.max()) + 1 if len(slots) else 0
    return needs
