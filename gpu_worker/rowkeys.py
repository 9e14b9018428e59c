"""The keys of the host indexes' FixedMaps (gpu_worker/fixedmap.py), packed from a table's rows in
whole-column passes, and the maps of IDs to rows built from the tables at a load (`build_maps`):
what the indexes (gpu_worker/state/indexes.py) put in and take out, and what a boot's preload child
builds in shared memory before torch is imported (gpu_worker/recovery/preload.py). Nothing here
imports torch."""
from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

import numpy as np

from .columns import LIVE, C, M, R, S

if TYPE_CHECKING:
    from .participant_index import ParticipantIndex

ROW32 = struct.Struct("<I")  # by_key's key: the operation key, then the participant row in 4 bytes
_HALVES = struct.Struct("<qq")

# The maps of IDs to rows a load builds from the tables (`build_maps`), by index and map name:
# each one's key layout (gpu_worker/native/fixedmap.cpp) and the table whose rows it indexes
MAPS = {"receipts.by_sequence": ("ii", "receipts"), "receipts.by_key": ("b20", "receipts"),
        "receipts.by_op": ("b16", "receipts"), "spaces.by_id": ("b16b16", "spaces"),
        "members.rows": ("ii", "members"), "conversations.by_id": ("b16b16", "conversations")}


def split16(b: bytes) -> tuple[int, int]:
    """16 bytes -> two signed int64 halves (how identifiers live in int64 tensors)."""
    halves: tuple[int, int] = _HALVES.unpack(b)
    return halves


def join16(hi: int, lo: int) -> bytes:
    return _HALVES.pack(hi, lo)


def free_rows(values: np.ndarray) -> list[int]:
    """The free rows of a table (`values`, as numpy: column 0 zero), highest first, so that pop()
    hands out the lowest."""
    free: list[int] = np.flatnonzero(values[:, 0] == 0)[::-1].tolist()
    return free


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


# the spaces' and conversations' columns their maps are keyed from: owner, when made, the ID's first half
OWNED = {"spaces": (S.OWNER, S.CREATED, S.ID_HI), "conversations": (C.CREATOR, C.CREATED, C.ID_HI)}


def put_owned(by_id: Any, participants: ParticipantIndex, table: str, values: np.ndarray, at: np.ndarray,
              rows: np.ndarray) -> None:
    """Rows values[at] of the spaces or conversations `table` into its map of (lineage, id) to row
    (as `rows`): the lineage each ID carries, its owner's when the row was made
    (`ParticipantIndex.lineages_at`), and the ID."""
    owner, created, hi = OWNED[table]
    lineages = participants.lineages_at(values[at, owner], values[at, created])
    by_id.put_packed(owned_ids(lineages, packed16(values, at, hi)), np.ascontiguousarray(rows, dtype=np.int64))


def build_maps(maps: dict[str, Any], tables: dict[str, np.ndarray], participants: ParticipantIndex) -> None:
    """The rows of a table just loaded into the (empty) maps of IDs to rows (`MAPS`' names; the
    tables as numpy, by columns.table_shapes' names; `participants` rebuilt from them): every live
    receipt by sequence, by operation key and by operation ID, every live space and conversation
    (not a deleted one's tombstone) by (lineage, id), every member row by (space row, participant
    row)."""
    receipts = tables["receipts"]
    live = np.flatnonzero(receipts[:, R.STATE])
    rows = live.astype(np.int64)
    maps["receipts.by_sequence"].put_packed(sequence_keys(receipts, live), rows)
    maps["receipts.by_key"].put_packed(keyed(receipts, live), rows)
    maps["receipts.by_op"].put_packed(packed16(receipts, live, R.OP_HI), rows)
    for name, state in (("spaces", S.STATE), ("conversations", C.STATE)):
        values = tables[name]
        live = np.flatnonzero(values[:, state] == LIVE)  # (not a TOMBSTONE)
        put_owned(maps[f"{name}.by_id"], participants, name, values, live, live)
    members = tables["members"]
    live = np.flatnonzero(members[:, M.STATE])
    keys = np.ascontiguousarray(members[live][:, [M.SPACE, M.PARTICIPANT]], dtype="<i8")  # FixedMap's "ii"
    maps["members.rows"].put_packed(keys, live.astype(np.int64))
