"""The packed keys of the host indexes' FixedMaps (gpu_worker/fixedmap.py), made from a table's rows
in whole-column passes, and the receipts' maps built from the receipts table: what the indexes
(gpu_worker/state/indexes.py) put in and take out, and what a boot's preload child builds in shared
memory before torch is imported (gpu_worker/recovery/preload.py). Nothing here imports torch."""
from __future__ import annotations

import struct
from typing import Any

import numpy as np

from .columns import R

ROW32 = struct.Struct("<I")  # by_key's key: the operation key, then the participant row in 4 bytes

# ReceiptIndex's maps, by name: their key layouts (gpu_worker/native/fixedmap.cpp)
RECEIPT_MAPS = {"by_sequence": "ii", "by_key": "b20", "by_op": "b16"}


def packed16(values: np.ndarray, rows: np.ndarray, hi: int) -> np.ndarray:
    """Columns hi, hi + 1 (an identifier's two halves) at each of `rows`, as one contiguous (n, 2)
    little-endian int64 array: each row's join16 bytes back to back (a FixedMap's packed keys)."""
    return np.ascontiguousarray(values[rows, hi:hi + 2], dtype="<i8")


def keyed(values: np.ndarray, at: np.ndarray) -> np.ndarray:
    """by_key's keys of receipt rows values[at], packed: each one's operation key bytes, then its
    participant row in 4 bytes (as `ROW32`)."""
    keys = np.empty((len(at), 20), dtype=np.uint8)
    keys[:, :16] = packed16(values, at, R.KEY_HI).view(np.uint8)
    keys[:, 16:] = np.asarray(values[at, R.PARTICIPANT], dtype="<u4").reshape(-1, 1).view(np.uint8)
    return keys


def sequence_keys(values: np.ndarray, at: np.ndarray) -> np.ndarray:
    """by_sequence's keys of receipt rows values[at]: (participant row, sequence), packed as "ii"."""
    keys = np.empty((len(at), 2), dtype="<i8")
    keys[:, 0], keys[:, 1] = values[at, R.PARTICIPANT], values[at, R.SEQUENCE]
    return keys


def owned_ids(lineages: np.ndarray, packed: np.ndarray) -> np.ndarray:
    """(lineage, id) keys packed as a FixedMap "b16b16" takes them: each lineage's 16 bytes
    (`lineages`: ParticipantIndex.lineages_at), then the id's (`packed`: `packed16`)."""
    keys = np.empty((len(lineages), 4), dtype=np.uint64)  # (copied in 8-byte words)
    keys[:, :2] = lineages.view(np.uint64)
    keys[:, 2:] = packed.view(np.uint64)
    return keys.view(np.uint8)


def index_receipts(maps: dict[str, Any], values: np.ndarray) -> None:
    """Every live row of the receipts table `values` into its maps (`RECEIPT_MAPS`' names): by
    sequence, by operation key and by operation ID."""
    live = np.flatnonzero(values[:, R.STATE])
    rows = live.astype(np.int64)
    maps["by_sequence"].put_packed(sequence_keys(values, live), rows)
    maps["by_key"].put_packed(keyed(values, live), rows)
    maps["by_op"].put_packed(packed16(values, live, R.OP_HI), rows)
