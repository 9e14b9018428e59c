"""A boot's tables from its checkpoint, filled by a child process while the boot imports torch, and
the indexes' maps of IDs to rows built from them (docs/checkpoint.md, "Replaying a mixed journal";
docs/performance.md, "Replay").

A cold boot spends 1.5-2 s importing torch before it can make a tensor, on one CPU, and then zeroed
the tables (1.3 GB at 1M receipts), put the checkpoint's rows into them and indexed them, one after
the other. A thread beside the imports would share their GIL and their address space's page
faults; a process shares neither. So `start`, called once the state extent is decoded and before
the boot starts any thread, makes each table, and the table of each FixedMap of IDs to rows
(rowkeys.MAPS: receipts by sequence, operation key and ID, spaces and conversations by lineage and
ID, members), as a shared anonymous mapping (zero until written) and forks: the child puts the
saved rows in (storage/state_extent.py `fill_tables`, as every load does: numpy and jcodec.scatter,
no torch), derives the participants' lineages (participant_index.py) and indexes the live rows into
the maps (rowkeys.py `build_maps`, as every load does; the child hashes with the parent's hash seed,
which it inherited) and exits, while the parent goes on to its imports. With no checkpoint (a
replay of the whole journal) the child backs every page of the empty tables and maps instead
(`populate`), the zeroing and first faults the replay would otherwise take after the imports. The
device wraps the mappings as its tables' tensors (torch.from_numpy, no copy) and its maps
(fixedmap.py `fixed_map(memory=...)`), and loads the rest of the checkpoint as before
(storage/checkpoint.py `load_saved`, `filled=True`); a child that failed or ran past its bound
leaves the device loading as without one. Nothing here imports torch."""
from __future__ import annotations

import logging
import mmap
import os
import select
import signal
import threading
from typing import Any, NamedTuple

import numpy as np

from ..columns import table_shapes
from ..fixedmap import FixedMap, fixed_map, table_bytes
from ..participant_index import ParticipantIndex
from ..rowkeys import MAPS, build_maps
from ..storage.state_extent import fill_tables

log = logging.getLogger("gpu_worker.device")
# how long a device waits for the child once it needs the tables: far past what filling and indexing
# them takes (about 1 s at 1M receipts); past it the child is killed and the device loads them itself
PRELOAD_SECONDS = 300.0
# madvise(2)'s MADV_POPULATE_WRITE and MADV_POPULATE_READ (Linux 5.14; Python 3.11's mmap names
# neither): back or map a mapping's pages now, in one call, as its accesses would one fault at a time
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23


def populate(memory: mmap.mmap, advice: int = MADV_POPULATE_WRITE) -> bool:
    """Back every page of a shared mapping now: in the child (MADV_POPULATE_WRITE), each page is
    allocated and zeroed. The parent, once the child has, only maps them (MADV_POPULATE_READ): a
    read fault on a backed shared page maps the 15 beside it too (the kernel's fault-around), and
    maps them writable (shared anonymous memory asks for no write notice), so the writes after it
    fault no more. 1.6 GB: 0.13 s and 25.6k faults, against 0.34 s and 410k faults written
    (docs/performance.md, "Replay"). False where the kernel has no such advice."""
    try:
        memory.madvise(advice)
        return True
    except OSError:
        return False


class Filled(NamedTuple):
    """What the child made: the tables (columns.table_shapes' names), filled, and the maps of IDs
    to rows (rowkeys.MAPS' names), every live row in them (with no checkpoint: zeros and empty maps,
    their pages backed)."""
    tables: dict[str, np.ndarray]
    maps: dict[str, FixedMap[Any]]


class Preload:
    """The tables and maps a child process fills (`start`), and the child."""

    def __init__(self, tables: dict[str, np.ndarray], maps: dict[str, mmap.mmap], used: np.ndarray,
                 capacities: dict[str, int], pid: int, ended: int, backed: list[mmap.mmap]) -> None:
        self.tables = tables
        self.maps = maps  # the maps' tables, by name
        self.used = used  # the entries the child put in each (shared), in `maps`' order
        self.capacities = capacities
        self.backed = backed  # mappings whose every page the child backed (no checkpoint: all of them)
        self.pid: int | None = pid
        self.ended = ended  # the read end of a pipe whose only write end the child holds

    def take(self) -> Filled | None:
        """The filled tables and maps once the child has exited 0 (its waker: the child's exit,
        which closes its end of the pipe; its bound: PRELOAD_SECONDS), or None: the child failed,
        or ran past the bound and was killed. Once only."""
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
        for memory in self.backed:  # (this process's mapping of the pages the child backed: no fault on each)
            populate(memory, MADV_POPULATE_READ)
        return Filled(self.tables, {name: fixed_map(MAPS[name][0], self.capacities[MAPS[name][1]], memory, used)
                                    for (name, memory), used in zip(self.maps.items(), self.used.tolist())})

    def close(self) -> None:
        """A boot that stops before its device took the tables: the child is stopped and reaped."""
        pid, self.pid = self.pid, None
        if pid is not None:
            os.close(self.ended)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def start(capacities: dict[str, int], incarnation: bytes, saved: dict[str, Any] | None,
          nice: int = 0) -> Preload | None:
    """Fork a child that fills the tables of a checkpoint's state (`saved`, decoded; of the runtime
    file of that incarnation) into shared memory and builds the maps of IDs to rows of them, or,
    with no checkpoint (`saved` None: a replay of the whole journal), backs every page of the empty
    tables and maps (`populate`), which the replay would otherwise zero or fault in one by one after
    the imports. None (nothing started) when this process already runs other Python threads (a fork
    copies only the calling one, and a lock another held would stay held in the child: boot calls
    this before it starts any). The threads native libraries start as they load are there already
    (numpy's BLAS pool): the child calls nothing of theirs. The child runs at nice value `nice`
    (boot's background one): the parent's imports, which it waits for first, keep their CPU; the
    child takes what they leave, and the parent's wait for it."""
    if threading.active_count() > 1:
        return None
    tables, memories = {}, []
    for name, (shape, dtype) in table_shapes(capacities).items():
        count = shape[0] * shape[1]
        memory = mmap.mmap(-1, max(count * np.dtype(dtype).itemsize, 1))  # shared, anonymous: zeros until written
        tables[name] = np.frombuffer(memory, dtype=dtype, count=count).reshape(shape)
        memories.append(memory)
    maps = {name: mmap.mmap(-1, table_bytes(layout, capacities[table])) for name, (layout, table) in MAPS.items()}
    memories.extend(maps.values())
    used = np.frombuffer(mmap.mmap(-1, 8 * len(maps)), dtype=np.int64)
    ended, end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: fill, index, leave at once (no atexit, no flush of the parent's buffers)
        code = 1
        try:
            os.close(ended)
            os.nice(max(nice - os.nice(0), 0))  # (raised only: an unprivileged process may not lower it)
            if saved is None:
                for memory in memories:
                    if not populate(memory):  # (an older kernel: a write to each page backs it)
                        np.frombuffer(memory, dtype=np.uint8)[::mmap.PAGESIZE] = 0
            else:
                fill_tables(saved, tables)
                participants = ParticipantIndex(incarnation, capacities["participants"])
                participants.load_lineages(saved.get("lineages", []))  # (as load_saved: before any lineage)
                participants.rebuild(tables["participants"])
                built = {name: fixed_map(MAPS[name][0], capacities[MAPS[name][1]], memory)
                         for name, memory in maps.items()}
                build_maps(built, tables, participants)
                used[:] = [len(made) for made in built.values()]
            code = 0
        except BaseException as exc:  # (said on stderr, where boot's own messages go)
            os.write(2, f"boot: the tables' preload failed: {exc!r}\n".encode())
        finally:
            os._exit(code)
    os.close(end)  # (the child's exit closes the last write end: the parent's poll wakes)
    return Preload(tables, maps, used, capacities, pid, ended, memories if saved is None else [])
