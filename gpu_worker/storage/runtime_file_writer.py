"""Writing a runtime file (docs/runtime-file.md, "Writing"): `create` makes a new one, `append` adds
components as the file's next generation. The layout is runtime_file.py's.

Writers never touch bytes that the current superblock reaches: they write new extents where nothing
it reaches lies — the space of extents it superseded (an older state, an older directory), or after
the last byte it reaches — make them durable, and only then write the *other* slot. A crash at any
point therefore leaves the previous generation readable, and the file grows only by what the current
generation holds, not by every generation it replaced. Both take the one writer's lock
(runtime_file_lock.py) or go ahead under the one their process holds.
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
from dataclasses import replace
from typing import Iterable, TypeAlias, Union

import torch

from ..contract.wire import JSON
from .filelayer import FileLayer, OsFileLayer, RandomAccessFile
from .runtime_file import (ALIGN, DATA_START, DIRECTORY_SCHEMA, DTYPE_SIZES, FEATURE_BASE, KNOWN_REQUIRED, SLOT_OFFSETS,
                           Component, RuntimeFile, Superblock, canonical_json)
from .runtime_file_lock import lock_for_write


# a tensor's dtype as the file's directory names it
DTYPE_NAMES = {getattr(torch, name): name for name in DTYPE_SIZES}

# A component's content, by its kind: "tensor" a torch.Tensor; "json" a JSON value, or its text or
# bytes as written; "text" a str; "bytes" a buffer.
Payload: TypeAlias = Union[torch.Tensor, bytes, bytearray, memoryview, JSON]
Part: TypeAlias = tuple[str, str, Payload]  # a component to write: (name, kind, payload)
Stored: TypeAlias = tuple[str, str, bytes]  # a component already as its bytes (a checkpoint's, a copy's)


def _encode(name: str, kind: str, payload: Payload) -> tuple[memoryview | bytes, str | None, tuple | None]:
    """The extent bytes for one component, with the tensor dtype and shape when it is a tensor."""
    if not isinstance(name, str) or not name or "\n" in name:
        raise ValueError(f"invalid component name {name!r}")
    if kind == "tensor":
        if not isinstance(payload, torch.Tensor):
            raise TypeError(f"component {name!r}: tensor payload must be a torch.Tensor")
        tensor = payload.detach().cpu().contiguous()
        if tensor.dtype not in DTYPE_NAMES:
            raise ValueError(f"component {name!r}: dtype {tensor.dtype} is not storable")
        # numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12
        raw: memoryview | bytes = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        return raw, DTYPE_NAMES[tensor.dtype], tuple(tensor.shape)
    if kind == "json":
        if isinstance(payload, (str, bytes, bytearray)):
            raw = payload.encode("utf-8") if isinstance(payload, str) else bytes(payload)
            json.loads(raw)  # stored as given (tokenizer JSON stays as the library wrote it), but valid
            return raw, None, None
        return canonical_json(payload), None, None
    if kind == "text":
        if not isinstance(payload, str):
            raise TypeError(f"component {name!r}: text payload must be a str")
        return payload.encode("utf-8"), None, None
    if kind == "bytes":
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TypeError(f"component {name!r}: bytes payload must be bytes, a bytearray or a memoryview")
        return memoryview(payload).cast("B"), None, None
    raise ValueError(f"component {name!r}: unknown kind {kind!r}")


def _align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


class _Writer(abc.ABC):
    """Writes extents where `_put` places them, hashing each one as it is written."""

    @abc.abstractmethod
    def _put(self, raw: bytes | memoryview) -> tuple[int, int, str]:
        """Write `raw` where this writer places extents: (offset, length, sha256 hex)."""

    def put(self, name: str, kind: str, payload: Payload) -> Component:
        raw, dtype, shape = _encode(name, kind, payload)
        offset, length, digest = self._put(raw)
        return Component(name, kind, offset, length, digest, dtype, shape)

    def put_directory(self, components: dict[str, Component]) -> tuple[int, int, bytes]:
        directory = {"schema": DIRECTORY_SCHEMA,
                     "components": [components[name].to_json() for name in sorted(components)]}
        offset, length, digest = self._put(canonical_json(directory))
        return offset, length, bytes.fromhex(digest)


class _ExtentWriter(_Writer):
    """Appends aligned extents to a new file, after its first `end` bytes (the padding before each
    one written as zeros)."""

    def __init__(self, f: RandomAccessFile, end: int) -> None:
        self.f = f
        self.end = end

    def _put(self, raw: bytes | memoryview) -> tuple[int, int, str]:
        offset = _align(self.end)
        if offset > self.end:
            self.f.pwrite(bytes(offset - self.end), self.end)
        if len(raw):
            self.f.pwrite(raw, offset)
        self.end = offset + len(raw)
        return offset, len(raw), hashlib.sha256(raw).hexdigest()


def _collect(writer: _Writer, components: Iterable[Part]) -> dict[str, Component]:
    written: dict[str, Component] = {}
    for name, kind, payload in components:
        if name in written:
            raise ValueError(f"component {name!r} given twice")
        written[name] = writer.put(name, kind, payload)
    return written


def create(path: str | os.PathLike[str], components: Iterable[Part], *, required: int = FEATURE_BASE,
           optional: int = 0, fs: FileLayer | None = None) -> None:
    """Write a brand-new file from (name, kind, payload) triples, consumed one at a time, as
    path + ".tmp", and put it in place durably (`FileLayer.atomic_writer`: fsynced, renamed over
    `path`, the directory fsynced). `fs` is the file layer (tests inject crashes and power cuts)."""
    path = os.fspath(path)
    if not required & FEATURE_BASE:
        raise ValueError("every runtime file requires FEATURE_BASE")
    # Replacing a file in use would leave its device on an unlinked inode: refuse (FileLock).
    existing = None
    if os.path.exists(path):
        existing = open(path, "rb")
        try:
            lock_for_write(path, existing.fileno())
        except BaseException:
            existing.close()
            raise
    try:
        _create(path, components, required, optional, fs or OsFileLayer())
    finally:
        if existing is not None:
            existing.close()


def _create(path: str, components: Iterable[Part], required: int, optional: int, fs: FileLayer) -> None:
    with fs.atomic_writer(path, mode=0o666, tmp=path + ".tmp") as f:
        f.pwrite(bytes(DATA_START), 0)  # both slots; slot B stays zero (invalid) until the first append
        writer = _ExtentWriter(f, DATA_START)
        written = _collect(writer, components)
        dir_offset, dir_length, dir_digest = writer.put_directory(written)
        superblock = Superblock(required, optional, os.urandom(16), 1, dir_offset, dir_length, dir_digest)
        f.pwrite(superblock.pack(), SLOT_OFFSETS[0])


class _FreeSpace:
    """Where an append may write: the aligned ranges of the data area that the current superblock
    reaches through nothing — extents of superseded generations, the tail of an append that
    crashed — up to the last byte it reaches, then everything after that byte (whatever the file
    holds there is unreachable too). `take` is first fit, lowest offset first, so what a
    generation supersedes is what the next ones fill, and the file grows only when nothing free
    fits."""

    def __init__(self, reachable: Iterable[tuple[int, int]]) -> None:
        self.gaps: list[list[int]] = []  # [start, end) free ranges, ascending
        at = DATA_START
        for start, end in sorted(reachable):
            if start > at:
                self.gaps.append([at, start])
            at = max(at, end)
        self.end = at  # the last byte the current generation reaches: all after it is free

    def take(self, length: int) -> int:
        if length == 0:
            return DATA_START  # an empty extent occupies nothing and always lies inside the file
        for gap in self.gaps:
            start = _align(gap[0])
            if start + length <= gap[1]:
                gap[0] = start + length
                return start
        offset = _align(self.end)
        self.end = offset + length
        return offset


# An append writes and syncs at most this much at a time. A checkpoint's append is the whole state
# (hundreds of MB at scale) on the journal's disk: flushed by one fsync at its end, it held up the
# journal's own fdatasync, and with it every reply, for as long as the disk took to write all of it
# (docs/checkpoint.md). In slices, the journal's sync waits for one slice at most.
SYNC_SLICE = 4 << 20


class _PlacedWriter(_Writer):
    """Writes each extent in place at the offset `_FreeSpace` gives it, syncing every SYNC_SLICE
    bytes (an extent larger than that is written in pieces)."""

    def __init__(self, out: RandomAccessFile, space: _FreeSpace) -> None:
        self.out = out
        self.space = space
        self.unsynced = 0  # bytes written since the last sync

    def _put(self, raw: bytes | memoryview) -> tuple[int, int, str]:
        offset = self.space.take(len(raw))
        view = memoryview(raw).cast("B")
        for at in range(0, len(view), SYNC_SLICE):
            piece = view[at:at + SYNC_SLICE]
            self.out.pwrite(piece, offset + at)
            self.unsynced += len(piece)
            if self.unsynced >= SYNC_SLICE:
                self.out.fsync()
                self.unsynced = 0
        return offset, len(raw), hashlib.sha256(raw).hexdigest()


def _wipe(out: RandomAccessFile, free: _FreeSpace) -> None:
    """Zeros over every range `free` holds, and over the file's end past what it reaches, synced
    every SYNC_SLICE bytes."""
    ranges = [(start, end) for start, end in free.gaps] + [(free.end, out.size())]
    zeros = bytes(SYNC_SLICE)
    for start, end in ranges:
        at = start
        while at < end:
            n = min(SYNC_SLICE, end - at)
            out.pwrite(memoryview(zeros)[:n], at)
            out.fsync()
            at += n


def append(path: str | os.PathLike[str], components: Iterable[Part], *,
           set_required: int = 0, drop: Iterable[str] = (), fs: FileLayer | None = None,
           generation: int | None = None, wipe: bool = False) -> int:
    """Add components (replacing same-named ones), leave out those named in `drop`, and publish
    the result in the other slot; returns the generation: the next one, or `generation` when
    given (above the current one: a standby's copy catching up to its primary's file, which went
    on through generations the copy never saw, docs/replication.md "Catch-up").

    The new extents and directory go where the current generation reaches nothing (`_FreeSpace`):
    the space its predecessors' superseded extents held, else after the last byte it reaches. Steps:
    an fsync (the winner may be an append whose process died before its last fsync: it is made
    durable before the space its predecessor needs as a fallback is written over), the writes (an
    fsync after every SYNC_SLICE bytes of them), an fsync, the other slot's superblock, an fsync. A crash before the last fsync completes leaves the
    current generation the winner, whole (none of its bytes was written); after it, the new one.
    `fs` is the file layer (tests inject crashes and power cuts).

    `wipe` (a checkpoint after a memory object was forgotten: memory/forgetting.py): once the new
    generation has won, every byte of the data area it does not reach is overwritten with zeros
    and synced — what the superseded generations held, which the next appends would only have
    overwritten as they needed the space. The new generation's bytes are never touched, so a
    crash in the middle leaves it whole; the previous generation was given up by the flip."""
    path = os.fspath(path)
    if set_required & ~KNOWN_REQUIRED:
        raise ValueError(f"unknown required feature bits {set_required:#x}")
    with open(path, "r+b") as f:
        lock_for_write(path, f.fileno())
        with RuntimeFile.open(path, verify=False) as current:
            entries, slot, superblock = dict(current.components), current.slot, current._superblock
            reachable = [(c.offset, c.offset + c.length) for c in entries.values()]
        if generation is None:
            generation = superblock.generation + 1
        elif generation <= superblock.generation:
            raise ValueError(f"{path} is at generation {superblock.generation}: an append cannot make it {generation}")
        reachable.append((superblock.directory_offset, superblock.directory_offset + superblock.directory_length))
        for name in drop:
            entries.pop(name, None)
        out = (fs or OsFileLayer()).open_rw(path)
        try:
            out.fsync()
            writer = _PlacedWriter(out, _FreeSpace(reachable))
            entries.update(_collect(writer, components))
            dir_offset, dir_length, dir_digest = writer.put_directory(entries)
            out.fsync()  # the new extents are durable before any superblock names them
            successor = replace(superblock, generation=generation,
                                required_features=superblock.required_features | set_required,
                                directory_offset=dir_offset, directory_length=dir_length,
                                directory_sha256=dir_digest)
            out.pwrite(successor.pack(), SLOT_OFFSETS[1 - slot])
            out.fsync()
            if wipe:
                kept = [(c.offset, c.offset + c.length) for c in entries.values()]
                _wipe(out, _FreeSpace([*kept, (dir_offset, dir_offset + dir_length)]))
        finally:
            out.close()
    return successor.generation
