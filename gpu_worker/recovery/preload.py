"""A boot's tables from its checkpoint, filled by a child process while the boot imports torch
(docs/checkpoint.md, "Replaying a mixed journal"; docs/performance.md, "Replay").

A cold boot spends 1.5-2 s importing torch before it can make a tensor, on one CPU, and then zeroed
the tables (1.3 GB at 1M receipts) and put the checkpoint's rows into them, one after the other. A
thread beside the imports would share their GIL and their address space's page faults; a process
shares neither. So `start`, called once the state extent is decoded and before the boot starts any
thread, makes each table as a shared anonymous mapping (zero until written) and forks: the child
puts the saved rows in (storage/state_extent.py `fill_tables`, as every load does: numpy and
jcodec.scatter, no torch) and exits, while the parent
goes on to its imports. The device wraps the filled mappings as its tables' tensors
(torch.from_numpy, no copy) and loads the rest of the checkpoint as before
(storage/checkpoint.py `load_saved`, `filled=True`); a child that failed or ran past its bound
leaves the device loading as without one. Nothing here imports torch."""
from __future__ import annotations

import logging
import mmap
import os
import select
import signal
import threading
from typing import Any

import numpy as np

from .. import native
from ..columns import table_shapes
from ..storage.state_extent import fill_tables

log = logging.getLogger("gpu_worker.device")
# how long a device waits for the child once it needs the tables: far past what filling them takes
# (about 0.5 s at 1M receipts); past it the child is killed and the device loads them itself
PRELOAD_SECONDS = 300.0


class Preload:
    """The tables a child process fills (`start`), and the child."""

    def __init__(self, tables: dict[str, np.ndarray], pid: int, ended: int) -> None:
        self.tables = tables
        self.pid: int | None = pid
        self.ended = ended  # the read end of a pipe whose only write end the child holds

    def take(self) -> dict[str, np.ndarray] | None:
        """The filled tables once the child has exited 0 (its waker: the child's exit, which
        closes its end of the pipe; its bound: PRELOAD_SECONDS), or None: the child failed, or ran
        past the bound and was killed. Once only."""
        pid, self.pid = self.pid, None
        if pid is None:
            return None
        timeout = PRELOAD_SECONDS
        try:
            waiting = select.poll()
            waiting.register(self.ended, select.POLLIN)
            if not waiting.poll(timeout * 1000):
                os.kill(pid, signal.SIGKILL)
                log.warning("the tables' preload ran past %g s: killed; the device loads them itself", timeout)
        finally:
            os.close(self.ended)
        _, status = os.waitpid(pid, 0)
        if status:
            log.warning("the tables' preload ended with status %#x; the device loads them itself", status)
            return None
        return self.tables

    def close(self) -> None:
        """A boot that stops before its device took the tables: the child is stopped and reaped."""
        pid, self.pid = self.pid, None
        if pid is not None:
            os.close(self.ended)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def start(capacities: dict[str, int], saved: dict[str, Any] | None) -> Preload | None:
    """Fork a child that fills the tables of a checkpoint's state (`saved`, decoded) into shared
    memory; None (nothing started) without a checkpoint, or when this process already runs other
    Python threads (a fork copies only the calling one, and a lock another held would stay held in
    the child: boot calls this before it starts any). The threads native libraries start as they
    load are there already (numpy's BLAS pool): the child calls nothing of theirs."""
    if saved is None or threading.active_count() > 1:
        return None
    native.load("jcodec")  # (imported here: the child imports nothing)
    tables = {}
    for name, (shape, dtype) in table_shapes(capacities).items():
        count = shape[0] * shape[1]
        memory = mmap.mmap(-1, max(count * np.dtype(dtype).itemsize, 1))  # shared, anonymous: zeros until written
        tables[name] = np.frombuffer(memory, dtype=dtype, count=count).reshape(shape)
    ended, end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: fill, then leave at once (no atexit, no flush of the parent's buffers)
        code = 1
        try:
            os.close(ended)
            fill_tables(saved, tables)
            code = 0
        except BaseException as exc:  # (said on stderr, where boot's own messages go)
            os.write(2, f"boot: the tables' preload failed: {exc!r}\n".encode())
        finally:
            os._exit(code)
    os.close(end)  # (the child's exit closes the last write end: the parent's poll wakes)
    return Preload(tables, pid, ended)
