"""Byte rows packed one after another: how a checkpoint keeps receipts' command and result bytes,
conversations' histories and memory payloads (each row's length kept beside it), and how a boot
puts them back into their uint8 tables (gpu_worker/state/tables.py, gpu_worker/memory/table.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import native

if TYPE_CHECKING:
    import torch

_scatter = native.load("jcodec").scatter


def scatter_rows(array: np.ndarray, rows: np.ndarray, lengths: np.ndarray, blob: bytes | memoryview) -> int:
    """`put_packed` into a host array (uint8, C-contiguous rows), without torch: what a boot's
    preload child fills its tables with (storage/state_extent.py `fill_tables`). Returns the bytes
    used. ValueError: a row outside the array, a length past a row, a blob too short."""
    rows, lengths = np.ascontiguousarray(rows, dtype=np.int64), np.ascontiguousarray(lengths, dtype=np.int64)
    # (numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12)
    return int(_scatter(memoryview(array).cast("B"), array.shape[1], rows, lengths, blob))  # type: ignore[arg-type]


def put_packed(table: torch.Tensor, rows: np.ndarray, lengths: np.ndarray, blob: bytes | memoryview) -> int:
    """Each of `rows` of a uint8 table gets its `lengths` bytes at its start, taken one row after
    another from `blob`: one native call rather than a copy per row (a boot from a checkpoint of
    1M receipts made 2M of them); returns the bytes used. The rest of a row is left as it was (on
    an accelerator, through host blocks of rows, it is zeroed: what is past a row's length is never
    read). ValueError: a row outside the table, a length past a row, a blob too short."""
    if table.device.type == "cpu":
        return scatter_rows(table.numpy(), rows, lengths, blob)
    import torch  # (an accelerator's tables: torch is loaded by then; this module is imported before it)
    rows, lengths = np.ascontiguousarray(rows, dtype=np.int64), np.ascontiguousarray(lengths, dtype=np.int64)
    cols = table.shape[1]
    used, chunk = 0, max(1, (32 << 20) // cols)
    for start in range(0, len(rows), chunk):
        block = np.zeros((len(rows[start:start + chunk]), cols), dtype=np.uint8)
        used += _scatter(block, cols, np.arange(len(block), dtype=np.int64), lengths[start:start + chunk],
                         memoryview(blob)[used:])
        table[torch.from_numpy(rows[start:start + chunk]).to(table.device)] = torch.from_numpy(block).to(table.device)
    return used
