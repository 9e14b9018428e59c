"""A checkpoint's state extent ("state/current", docs/checkpoint.md), read without torch: a boot
decodes its head, and so where the journal after it begins (`fold_point`), while torch is still
being imported (recovery/reading.py), and gpu_worker/storage/checkpoint.py encodes and loads it."""
from __future__ import annotations

import struct
from typing import Any

import msgpack
import numpy as np

from ..columns import ROW_TABLES, C, R
from ..packing import scatter_rows
from .journal import ZERO_DIGEST

STATE = "state/current"
# A state extent of version 2 (docs/checkpoint.md): _MAGIC, the head's length (u64 LE), the head (a
# msgpack map), then the large byte strings the head names, back to back. The head names each by
# an ext value of code _SPILLED: its offset and length (u64 LE each) in what follows the head, so
# a boot reads them where the runtime file maps them instead of copying them out of a msgpack
# map (version 1: the whole extent one msgpack map; still read).
_MAGIC = b"AOTXST\x00\x02"
_HEAD = struct.Struct("<8sQ")
_SPILLED = 1
_SPAN = struct.Struct("<QQ")


class Spill:
    """The large byte strings of a state being encoded, and the ext values that name them."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0

    def __call__(self, data: bytes) -> msgpack.ExtType:
        ext = msgpack.ExtType(_SPILLED, _SPAN.pack(self.size, len(data)))
        self.parts.append(data)
        self.size += len(data)
        return ext

    def extent(self, head: bytes) -> bytes:
        """The whole extent: its packed head (naming these strings), then the strings."""
        return b"".join([_HEAD.pack(_MAGIC, len(head)), head, *self.parts])


def decode_state(blob: bytes | memoryview) -> dict[str, Any]:
    """A state extent's map (either version); version 2's large byte strings come back as
    memoryviews of `blob`, not copies (a boot from a 600 MiB state spent a fifth of its time
    copying them)."""
    view = memoryview(blob)
    if view[:len(_MAGIC)] != _MAGIC:  # version 1: one msgpack map
        saved: dict[str, Any] = msgpack.unpackb(view, raw=False)
        return saved
    _, length = _HEAD.unpack_from(view)
    if _HEAD.size + length > len(view):
        raise ValueError("state extent: its head runs past its end")
    data = view[_HEAD.size + length:]

    def spilled(code: int, span: bytes) -> memoryview:
        if code != _SPILLED or len(span) != _SPAN.size:
            raise ValueError(f"state extent: an ext value of code {code} and {len(span)} bytes")
        at, n = _SPAN.unpack(span)
        if at + n > len(data):
            raise ValueError("state extent: a value runs past its end")
        return data[at:at + n]

    saved = msgpack.unpackb(view[_HEAD.size:_HEAD.size + length], raw=False, ext_hook=spilled)
    return saved


def fold_point(saved: dict[str, Any] | None) -> tuple[int, bytes]:
    """(last_seq, last_digest) of a decoded state extent (None: no checkpoint yet): where the
    journal after it begins."""
    return (saved["last_seq"], saved["last_digest"]) if saved is not None else (0, ZERO_DIGEST)


def fill_tables(saved: dict[str, Any], tables: dict[str, np.ndarray]) -> bool:
    """Put a decoded state extent's rows into zero tables (columns.table_shapes, by name): each
    table's saved rows, the live receipts' digests, command and result bytes, the conversations'
    histories. The one way a load puts them in (storage/checkpoint.py `load_saved`, the child of
    recovery/preload.py). Returns whether a table was saved with fewer columns than it has now
    (`narrow_tables`). ValueError: rows wider than their table, bytes past their rows."""
    def put(table: np.ndarray, rows: np.ndarray, lengths: np.ndarray, blob: bytes) -> None:
        if scatter_rows(table, rows, lengths, blob) != len(blob):
            raise ValueError(f"state extent: {len(blob)} bytes given for rows holding fewer")
    narrow = narrow_tables(saved, tables)
    for name in ROW_TABLES:
        rows_raw, data = saved["tables"][name]
        rows = np.frombuffer(rows_raw, dtype="<i8")
        if len(rows):
            width = len(data) // 8 // len(rows)
            tables[name][rows, :width] = np.frombuffer(data, dtype="<i8").reshape(len(rows), width)
    receipts = tables["receipts"]
    live = np.flatnonzero(receipts[:, R.STATE])
    if len(live):
        tables["receipt_digests"][live] = np.frombuffer(saved["digests"], dtype=np.uint8).reshape(len(live), 64)
    for name, key, col in (("command_bytes", "commands", R.COMMAND_LEN), ("result_bytes", "results", R.RESULT_LEN)):
        put(tables[name], live, receipts[live, col], saved[key])
    conversations = tables["conversations"]
    talked = np.flatnonzero(conversations[:, C.HISTORY_LEN])
    put(tables["history"], talked, conversations[talked, C.HISTORY_LEN], saved.get("history", b""))
    return narrow


def narrow_tables(saved: dict[str, Any], tables: dict[str, Any]) -> bool:
    """Whether a table of the extent has rows of fewer columns than `tables` (by name, anything
    with a shape) has (saved before those columns existed). ValueError: more columns."""
    narrow = False
    for name in ROW_TABLES:
        rows_raw, data = saved["tables"][name]
        rows = len(rows_raw) // 8
        if rows:
            width, have = len(data) // 8 // rows, tables[name].shape[1]
            if width > have or width * 8 * rows != len(data):
                raise ValueError(f"state extent: table {name} has rows of {width} columns; this device knows {have}")
            narrow = narrow or width < have
    return narrow
