"""A checkpoint folded beside the ticks (docs/checkpoint.md, "Folding beside the ticks").

A served device does not fold on its tick thread: at the fold point (every transfer saved, as
before) it starts a new journal segment and hands the old ones to another process, which builds
the state they make (the runtime file's checkpoint, then those segments replayed: a hot standby's
code, `Device(following=True)`) and encodes the checkpoint's components (the state, the audit of
the folded transfers, the media sources new to the file) to its standard output. A thread of the
device appends them to the runtime file (storage/runtime_file_writer.append: the writes, fsyncs and the
superblock flip), and the tick thread, told it is done, removes the folded segments and marks the
receipts the fold saved. Admissions and commits go on meanwhile, into the new segment: the tick
thread's part is the segment switch at the start and the bookkeeping at the end.

Crash safety is a checkpoint's as ever: until the superblock flip the old state and every segment
hold everything (the new segment too); after it, recovery skips what the state folded. The fold
writes nothing to disk itself (its output goes to a file in memory, `Memory`): a disk that filled up still has
room for what the append needs.

The process is gpu_worker/fold_cli.py (`python -m gpu_worker.fold_cli`, run by the device, not by
hand).
"""
from __future__ import annotations

import ctypes
import json
import mmap
import os
import shutil
import struct
import subprocess
import sys
from typing import Any, NamedTuple

from ..storage.journal import TRIMMED, list_segments, segment_name

_HEAD = struct.Struct("<Q")  # the output: the JSON head's length, the head, then the components' bytes
_WORK = ".fold-"  # the directory of a fold's links, beside the journal's segments

FOLD_TIMEOUT = 3600  # seconds: a fold past it is killed and the checkpoint fails (its segments stay)

Components = list[tuple[str, str, Any]]
_PUNCH_HOLE = 0x01 | 0x02  # fallocate's FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE (linux/falloc.h)


class Memory:
    """The file in memory (a memfd) a fold's output is mapped from, and that mapping. The mapping
    goes when the last view of it goes (and this), and with it, if it is the file's last user, every
    page of the output: hundreds of MB at a million transfers, whose unmapping and freeing held the
    thread that dropped the last view (the tick thread, at a checkpoint's end) 0.39 s at 1M. `free`
    unmaps and frees the pages first, on the thread that calls it, without the GIL (while this still
    holds the mapping: whoever drops the last view later has nothing left to free); `close` leaves
    them to the last view (a standby's link, which still sends them)."""

    def __init__(self, fd: int, size: int, mapping: mmap.mmap | None = None) -> None:
        self.fd, self.size, self.mapping = fd, size, mapping

    def free(self) -> None:
        """Punch the output's pages out of the file, which unmaps them from every mapping too (the
        mapping reads zeros from here on), then close it."""
        if self.fd < 0:
            return
        libc = ctypes.CDLL(None, use_errno=True)  # (a foreign call: the GIL is released while the kernel frees)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        try:
            if libc.fallocate(self.fd, _PUNCH_HOLE, 0, self.size) != 0:
                errno = ctypes.get_errno()
                raise OSError(errno, f"the fold's output was not freed: {os.strerror(errno)}")
        finally:
            self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.mapping = None


class Output(NamedTuple):
    """A fold's components (views of `memory`), and the component names to drop."""
    components: Components
    drop: list[str]
    memory: Memory


def prepare(journal_dir: str, through_segment: int, fs: Any) -> str:
    """A directory beside the journal holding links to its segments through `through_segment`
    (closed now: the writer went on to the next) and to its media sources: what the fold reads."""
    clear(journal_dir)  # (a fold a crash left behind)
    work = os.path.join(journal_dir, f"{_WORK}{through_segment}")
    os.makedirs(work, mode=0o700)
    for number in list_segments(journal_dir, fs):
        if number <= through_segment:
            os.link(os.path.join(journal_dir, segment_name(number)), os.path.join(work, segment_name(number)))
    media = os.path.join(journal_dir, "media")
    if os.path.isdir(media):
        os.symlink(media, os.path.join(work, "media"))
    return work


def clear(journal_dir: str) -> None:
    """Remove the links of folds that did not finish (a crash, a stop): they hold no data of
    their own; and the folded segments a checkpoint's trim did not finish removing (the runtime
    file holds their transfers: storage/checkpoint.py `trim`)."""
    if os.path.isdir(journal_dir):
        for name in os.listdir(journal_dir):
            if name.startswith(_WORK):
                shutil.rmtree(os.path.join(journal_dir, name), ignore_errors=True)
            elif name.startswith(TRIMMED):
                os.remove(os.path.join(journal_dir, name))


def run(runtime_path: str, work: str, through_seq: int, nice: int) -> Output:
    """Fold in another process (at `nice`, and idle I/O priority where `ionice` exists): the
    components it made, the component names to drop and the memory holding them (the caller frees
    or closes it: `Memory`)."""
    argv = [sys.executable, "-m", "gpu_worker.fold_cli", "--ccir", runtime_path, "--journal", work,
            "--through", str(through_seq)]
    # the fold builds its state on the CPU, from this code whatever the working directory
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    prefix = (["ionice", "-c", "3"] if shutil.which("ionice") else []) + (["nice", "-n", str(nice)] if nice else [])
    # Its output (the whole state: hundreds of MB at a million transfers) goes to a file in memory that
    # is then mapped: read from a pipe it was joined into one bytes object, a copy made holding the
    # GIL while the tick thread waited for it (the longest gaps at a checkpoint's end).
    out = os.memfd_create("aotx-fold", os.MFD_CLOEXEC)
    try:
        try:
            done = subprocess.run([*prefix, *argv], stdout=out, stderr=subprocess.PIPE, timeout=FOLD_TIMEOUT,
                                  env=env)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if done.returncode != 0:
            raise RuntimeError(f"the fold failed ({done.returncode}): "
                               f"{done.stderr.decode(errors='replace').strip()[-2000:]}")
        size = os.fstat(out).st_size
        if size == 0:
            raise RuntimeError("the fold wrote nothing")
        mapping = mmap.mmap(out, size, access=mmap.ACCESS_READ)
        components, drop = decode(mapping)
    except BaseException:
        os.close(out)
        raise
    return Output(components, drop, Memory(out, size, mapping))


def encode(components: Components, drop: list[str]) -> list[bytes | memoryview]:
    head = json.dumps({"components": [[name, kind, len(data)] for name, kind, data in components],
                       "drop": drop}).encode()
    return [_HEAD.pack(len(head)), head, *(data for _, _, data in components)]


def decode(data: bytes | mmap.mmap) -> tuple[Components, list[str]]:
    view = memoryview(data)
    (length,) = _HEAD.unpack_from(view)
    at = _HEAD.size + length
    head = json.loads(bytes(view[_HEAD.size:at]))
    components = []
    for name, kind, n in head["components"]:
        components.append((name, kind, view[at:at + n]))
        at += n
    if at != len(view):
        raise RuntimeError(f"the fold's output is {len(view)} bytes, its head says {at}")
    return components, head["drop"]
