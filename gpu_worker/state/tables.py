"""The authoritative shared-state tables: fixed-capacity torch tensors on the device.

Rows are int64 columns numbered by the plain classes P, S, M, C and R of gpu_worker/columns.py
(imported here, where the rest of the device takes them from); 16-byte identifiers are stored as two
signed int64 halves. Host-side dicts in the device only index IDs to rows; every value a reply
shows is read back from these tensors. Capacities come from the runtime file's shared profile.
"""
from __future__ import annotations

import struct
import sys
from enum import IntEnum
from typing import Any

import numpy as np
import torch

from .. import native, packing
from ..columns import TOMBSTONE, C, M, P, R, S, table_shapes, width
from ..rowkeys import free_rows, join16, packed16, split16


class Scope(IntEnum):
    PRIVATE = 1
    ROOM = 2
    INSTANCE = 3


class Right(IntEnum):
    READ = 1
    WRITE = 2
    MANAGE = 4


class Terminal(IntEnum):
    NONE = 0
    SUCCEEDED = 1
    FAILED = 2
    CANCELLED = 3
    INTERRUPTED = 4
    DEADLINE_EXCEEDED = 5


class Finish(IntEnum):
    NONE = 0
    STOP = 1
    LENGTH = 2
    CANCELLED = 3
    DEADLINE = 4
    INTERRUPTED = 5
    FAILED = 6


class NotRetained(IntEnum):
    """Why an input's memory row was not written (its receipt's memory.not_retained)."""
    NONE = 0
    MEMORY_FULL = 1     # the memory table had no free row
    QUOTA_EXCEEDED = 2  # its principal's memory_rows quota was used up
    NO_ROOM = 3         # the interpretation prompt did not fit the input's page limit


class Source(IntEnum):
    NONE = 0
    JOURNAL = 1
    FILE = 2


# Bits beside a save's Source in the same column: whether a standby held the transfer when it was
# saved (a sync primary's acknowledged transfer: HELD; one saved alone, async or without a standby:
# ALONE; neither: not known, as for a transfer a restart replayed). A checkpoint keeps them.
SOURCE_MASK, HELD, ALONE = 3, 4, 8


_gather = native.load("jcodec").gather
assert sys.byteorder == "little"  # the tensors' int64s are written as little-endian bytes (put_struct)
_INT64S: dict[int, struct.Struct] = {}  # n -> struct of n native int64 (the tensors' own layout), for run writes


def _int64s(n: int) -> struct.Struct:
    s = _INT64S.get(n)
    if s is None:
        s = _INT64S[n] = struct.Struct(f"={n}q")
    return s


def mark_folded(receipts: torch.Tensor | np.ndarray, generation: int, through_seq: int | None = None) -> None:
    """Tables.mark_folded on rows of the receipts table (or a copy of them: a checkpoint's state
    extent saves its receipts marked, so a boot from it need not mark them)."""
    live = receipts[:, R.STATE] != 0
    for transfer_col, source_col, generation_col in ((R.ADM_TRANSFER, R.ADM_SOURCE, R.ADM_GENERATION),
                                                     (R.TERM_TRANSFER, R.TERM_SOURCE, R.TERM_GENERATION)):
        seqs = receipts[:, transfer_col]
        marked = live & (seqs != 0)
        if through_seq is not None:
            marked &= seqs <= through_seq
        # (whether a standby held it stays)
        receipts[marked, source_col] = (receipts[marked, source_col] & ~SOURCE_MASK) | int(Source.FILE)
        receipts[marked, generation_col] = generation


class Tables:
    def __init__(self, capacities: dict[str, int], device: str | torch.device = "cpu",
                 arrays: dict[str, np.ndarray] | None = None) -> None:
        """Each table at its capacity, zeros; `arrays`: on the CPU, their memory, filled already
        (recovery/preload.py), by name in columns.table_shapes' shapes."""
        self.device = torch.device(device)
        self.capacities = dict(capacities)
        shapes = table_shapes(capacities)
        if arrays is not None:  # filled already (recovery/preload.py): their memory, as it is
            if any(arrays[name].shape != shape or arrays[name].dtype != dtype
                   for name, (shape, dtype) in shapes.items()):
                raise ValueError("tables made beforehand do not have this device's shapes")
            made = {name: torch.from_numpy(arrays[name]) for name in shapes}
        else:
            made = {name: torch.zeros(shape, dtype=torch.int64 if dtype == "<i8" else torch.uint8, device=self.device)
                    for name, (shape, dtype) in shapes.items()}
        self.participants, self.spaces, self.members = made["participants"], made["spaces"], made["members"]
        self.conversations, self.receipts = made["conversations"], made["receipts"]
        # [row, 0] admission commit digest, [row, 1] terminal commit digest
        self.receipt_digests = made["receipt_digests"].view(capacities["receipts"], 2, 32)
        self.command_bytes, self.result_bytes = made["command_bytes"], made["result_bytes"]
        # each conversation's retired turns, what its context keeps once receipts go (kinds/history.py)
        self.history = made["history"]
        # On the CPU, flat memoryviews share the tensors' memory: a scalar read or write through one
        # is far cheaper than a torch dispatch or a numpy element (docs/performance.md).
        # id(table) -> (element view, columns, byte view)
        self._flat: dict[int, tuple[Any, int, memoryview]] | None = None
        if self.device.type == "cpu":
            self._flat = {}
            for t in (self.participants, self.spaces, self.members, self.conversations, self.receipts,
                      self.command_bytes, self.result_bytes, self.history):
                # numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12
                raw = memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]
                self._flat[id(t)] = (raw.cast("q") if t.dtype == torch.int64 else raw, t.shape[1], raw)
            self._digests = memoryview(self.receipt_digests.numpy()).cast("B")  # type: ignore[arg-type]

    def named(self) -> dict[str, torch.Tensor]:
        """The tables by columns.table_shapes' names, in its shapes (receipt digests as one 64-byte
        row): what storage/state_extent.py `fill_tables` fills."""
        return {"participants": self.participants, "spaces": self.spaces, "members": self.members,
                "conversations": self.conversations, "receipts": self.receipts,
                "receipt_digests": self.receipt_digests.view(-1, 64), "command_bytes": self.command_bytes,
                "result_bytes": self.result_bytes, "history": self.history}

    def raw(self, table: torch.Tensor) -> memoryview | None:
        """The table's memory as writable bytes (receipt_digests too), for the native writers of
        a replay (pipeline/admission.py `replay_stretch`); None off the CPU."""
        if self._flat is None:
            return None
        return self._digests if table is self.receipt_digests else self._flat[id(table)][2]

    def write_row(self, table: torch.Tensor, row: int, values: dict[int, int]) -> None:
        """values: {column: int}."""
        if self._flat is not None:
            flat, cols, _ = self._flat[id(table)]
            base = row * cols
            for col, v in values.items():
                flat[base + col] = v
            return
        columns = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        table[row, columns] = torch.tensor(list(values.values()), dtype=torch.int64, device=self.device)

    def put_value(self, table: torch.Tensor, row: int, col: int, value: int) -> None:
        if self._flat is not None:
            flat, cols, _ = self._flat[id(table)]
            flat[row * cols + col] = value
        else:
            table[row, col] = value

    def put_cols(self, table: torch.Tensor, row: int, first: int, values: list[int] | tuple[int, ...]) -> None:
        """Write consecutive columns first, first + 1, ... of a row in one step (a whole row:
        first 0 and width() values, so nothing of a reused row's old content stays)."""
        if self._flat is not None:
            _, cols, raw = self._flat[id(table)]
            _int64s(len(values)).pack_into(raw, (row * cols + first) * 8, *values)
        else:
            table[row, first:first + len(values)] = torch.tensor(values, dtype=torch.int64, device=self.device)

    def put_struct(self, table: torch.Tensor, row: int, first: int, layout: struct.Struct, *values: int | bytes) -> None:
        """Write columns from `first` on in one step, as `layout` packs `values`: little-endian
        int64s ("q"), 16-byte identifiers as the two halves they become ("16s", split16's
        layout), zero columns ("8x" each). A whole row is one call (the busiest writes: a
        receipt, a space)."""
        if self._flat is not None:
            _, cols, raw = self._flat[id(table)]
            layout.pack_into(raw, (row * cols + first) * 8, *values)
        else:
            data = layout.pack(*values)
            table[row, first:first + len(data) // 8] = torch.frombuffer(bytearray(data), dtype=torch.int64).to(
                self.device)

    def row(self, table: torch.Tensor, row: int) -> list[int]:
        if self._flat is not None:
            flat, cols, _ = self._flat[id(table)]
            return flat[row * cols:(row + 1) * cols].tolist()
        return table[row].tolist()

    def value(self, table: torch.Tensor, row: int, col: int) -> int:
        if self._flat is not None:
            flat, cols, _ = self._flat[id(table)]
            return flat[row * cols + col]
        return int(table[row, col].item())

    def put_bytes(self, table: torch.Tensor, row: int, data: bytes | memoryview, offset: int = 0) -> None:
        if not data:
            return
        if self._flat is not None:
            flat, cols, _ = self._flat[id(table)]
            start = row * cols + offset
            flat[start:start + len(data)] = data
        else:
            table[row, offset:offset + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)

    def put_column(self, table: torch.Tensor, rows: list[int], col: int, value: int) -> None:
        """put_value of each of `rows` in one write (a retirement frees hundreds of receipts)."""
        if self._flat is not None:
            table.numpy()[rows, col] = value
        else:
            table[torch.tensor(rows, dtype=torch.int64, device=self.device), col] = value

    def put_rows(self, table: torch.Tensor, rows: np.ndarray, values: np.ndarray) -> None:
        """values[i] into the first columns of row rows[i] (ascending), for whole tables at boot:
        one block copy where the rows are consecutive (a table filled from its first row)."""
        n, width = values.shape
        if self._flat is None:
            table[torch.from_numpy(rows.copy()).to(self.device), :width] = torch.from_numpy(values.copy()).to(self.device)
            return
        array = table.numpy()
        if n and 0 <= rows[0] and rows[-1] - rows[0] == n - 1 and bool((np.diff(rows) > 0).all()):
            array[rows[0]:rows[0] + n, :width] = values
        else:
            array[rows, :width] = values

    def put_digest_block(self, rows: np.ndarray, digests: np.ndarray) -> None:
        """rows[i]'s admission and terminal commit digests: digests[i], (n, 2, 32) uint8 (a replay's
        run of admissions, put_digests for each)."""
        if self._flat is not None:
            self.receipt_digests.numpy()[rows] = digests
        else:
            self.receipt_digests[torch.from_numpy(rows).to(self.device)] = torch.from_numpy(
                np.ascontiguousarray(digests)).to(self.device)

    def put_packed(self, table: torch.Tensor, rows: np.ndarray, lengths: np.ndarray, blob: bytes | memoryview) -> None:
        """Each of `rows` gets its `lengths` bytes at its start, taken one row after another from
        `blob` (how a checkpoint keeps receipts' command and result bytes and conversations'
        histories): `put_packed`, every byte of the blob used."""
        if packing.put_packed(table, rows, lengths, blob) != len(blob):
            raise ValueError(f"{len(blob)} bytes given for rows holding {sum(lengths.tolist())}")

    def get_bytes(self, table: torch.Tensor, row: int, length: int, offset: int = 0) -> bytes:
        if length <= 0:
            return b""
        if self._flat is not None:
            flat, cols, _ = self._flat[id(table)]
            start = row * cols + offset
            return flat[start:start + length].tobytes()
        return table[row, offset:offset + length].cpu().numpy().tobytes()

    def put_digest(self, row: int, which: int, digest: bytes) -> None:
        if self._flat is not None:
            start = row * 64 + which * 32
            self._digests[start:start + 32] = digest
        else:
            self.receipt_digests[row, which] = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(self.device)

    def put_digests(self, row: int, digest: bytes) -> None:
        """The same digest as both the admission's (0) and the terminal's (1)."""
        if self._flat is not None:
            self._digests[row * 64:row * 64 + 64] = digest + digest
        else:
            self.receipt_digests[row] = torch.frombuffer(bytearray(digest * 2), dtype=torch.uint8).view(2, 32).to(
                self.device)

    def get_digest(self, row: int, which: int) -> bytes:
        if self._flat is not None:
            start = row * 64 + which * 32
            return self._digests[start:start + 32].tobytes()
        return self.receipt_digests[row, which].cpu().numpy().tobytes()

    def mark_held(self, start: int, end: int, held: bool) -> None:
        """The saves of transfers start..end-1 were held by a standby (or alone): a replayed
        REPLICATION transfer's correction (gpu_worker/recovery/replay.py `Replay._replication`)."""
        bit, other = (HELD, ALONE) if held else (ALONE, HELD)
        for transfer_col, source_col in ((R.ADM_TRANSFER, R.ADM_SOURCE), (R.TERM_TRANSFER, R.TERM_SOURCE)):
            seqs = self.receipts[:, transfer_col]
            rows = (self.receipts[:, R.STATE] != 0) & (seqs >= start) & (seqs < end)
            self.receipts[rows, source_col] = (self.receipts[rows, source_col] & ~other) | bit

    def mark_folded(self, generation: int, through_seq: int | None = None, rows: slice = slice(None)) -> None:
        """The saves of live receipts by transfers through `through_seq` (None: every saved one)
        are now in the runtime file, at this generation (a checkpoint folded them). A checkpoint
        folds while admissions go on (gpu_worker/recovery/fold.py): what was saved after its fold point
        stays in the journal, its save fields as they were given. `rows`: those of the receipts
        table only (a served device marks a fold in slices between its ticks: MARK_ROWS)."""
        # (a view: the writes below go to the table). On the CPU through numpy: this runs on the
        # tick thread, and torch runs element-wise passes on its intra-op threads, whose barrier
        # waits for a core the fold process or the clients hold (docs/performance.md, "A
        # checkpoint beside the ticks").
        mark_folded(self.receipts.numpy()[rows] if self.receipts.device.type == "cpu" else self.receipts[rows],
                    generation, through_seq)

    @staticmethod
    def array(table: torch.Tensor) -> np.ndarray:
        """The table as a numpy array (the tensor's own memory on the CPU; a copy from a GPU): for
        whole-table passes at boot, which go column by column rather than row by row."""
        return table.numpy() if table.device.type == "cpu" else table.cpu().numpy()

    def take(self, table: torch.Tensor, rows: np.ndarray) -> np.ndarray:
        """Those rows of the table, as a numpy array (a copy; on the CPU natively, each row's cache
        lines fetched ahead of its copy: jcodec.cpp `gather`)."""
        if self._flat is not None and id(table) in self._flat:
            _, cols, raw = self._flat[id(table)]
            dtype = np.int64 if table.dtype == torch.int64 else np.uint8
            data = _gather(raw, cols * table.element_size(), np.ascontiguousarray(rows, dtype=np.int64))
            return np.frombuffer(data, dtype=dtype).reshape(len(rows), cols)
        if table.device.type == "cpu":
            return table.numpy()[rows]
        return table[torch.from_numpy(rows).to(table.device)].cpu().numpy()

    @staticmethod
    def ids16(values: np.ndarray, rows: np.ndarray, hi: int, lo: int) -> list[bytes]:
        """join16 of columns hi, lo (= hi + 1: an identifier's halves are adjacent) at each of
        `rows`, in one pass."""
        assert lo == hi + 1
        data = packed16(values, rows, hi)
        return np.frombuffer(data.tobytes(), dtype="V16").tolist()

    @staticmethod
    def unused_rows(table: torch.Tensor, fresh: bool = False) -> list[int]:
        """Free rows of a table, highest first, so pop() hands out the lowest free row. `fresh`:
        the table was just made (all zero): every row, without reading a column of it."""
        if fresh:
            return list(range(len(table) - 1, -1, -1))
        if table.device.type == "cpu":
            return free_rows(table.numpy())
        return torch.nonzero(table[:, 0] == 0).flatten().flip(0).tolist()

    def usage(self) -> dict[str, int]:
        tables = {"participants": self.participants, "spaces": self.spaces, "members": self.members,
                  "conversations": self.conversations, "receipts": self.receipts}
        return {name: int((t[:, 0] != 0).sum()) for name, t in tables.items()}
