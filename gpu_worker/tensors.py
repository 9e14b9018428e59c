"""Fixed-capacity tensors made zero, as the device's tables are (state/tables.py, memory/table.py)."""
from __future__ import annotations

import numpy as np
import torch

_HOST_DTYPES = {torch.int64: np.int64, torch.uint8: np.uint8, torch.float32: np.float32}


def zeros(shape: tuple[int, ...] | int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros(shape, dtype, device). On the CPU the tensor shares a numpy array's memory
    (torch.from_numpy), numpy's zeros, which is calloc: a large block is fresh pages from the
    kernel, already zero, each backed only once a row on it is written. torch.zeros writes every
    byte of the capacity first, and a booting device's tables are mostly rows no one has used yet
    (docs/performance.md, "Recovery")."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(shape, dtype=_HOST_DTYPES[dtype]))
