"""The file operations the journal and the runtime file's writer use, behind one small interface.

The journal never calls `os` for its segment files directly: it asks a `FileLayer`, and neither
does an append to the runtime file (storage/runtime_file_writer.py, which writes in place at given
offsets: `open_rw`), nor any writer that puts a finished file in place whole (`atomic_writer`,
`write_atomically`: a temporary file beside the target, written and fsynced, renamed over the
target, the directory fsynced: the runtime file's creation, the owner marker, media sources, the
standby's marker, audit exports, the grant file, the local token). Production uses `OsFileLayer`;
tests use `FaultyFileLayer`, which runs on real files but can run out of space, fail an fdatasync,
stop ("crash") before any chosen write, sync, rename or directory sync, and lose everything that
was never made durable, as a power cut would.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
from typing import Iterator, Protocol


class AppendFile(Protocol):
    """An open segment file: appends only, plus the truncate that cuts a failed tail.

    `native_io` True says write and fdatasync are nothing but write(2) and fdatasync(2) on
    fileno(), so the device's native tick I/O thread (sockio.Syncer) may make them instead; a
    file that must see its bytes (a test's faulty file) says False and its ticks run here."""

    native_io: bool

    def write(self, data: bytes) -> None:
        ...

    def fdatasync(self) -> None:
        ...

    def truncate(self, length: int) -> None:
        ...

    def size(self) -> int:
        ...

    def fileno(self) -> int:
        """The descriptor, for the tick I/O made by the device's native thread (native_io)."""
        ...

    def close(self) -> None:
        ...


class RandomAccessFile(Protocol):
    """An existing file written in place at given offsets (the runtime file's appends): what a
    write puts there is durable only after the next fsync."""

    def pwrite(self, data: bytes | memoryview, offset: int) -> None:
        ...

    def fsync(self) -> None:
        ...

    def size(self) -> int:
        ...

    def fileno(self) -> int:
        ...

    def close(self) -> None:
        ...


class FileLayer(Protocol):
    """Every file operation the journal performs, and the durable replacement of a whole file
    (`atomic_writer`, `write_atomically`) that other writers use. Errors are `OSError` with an
    errno."""

    def open_append(self, path: str) -> AppendFile:
        ...

    def open_rw(self, path: str) -> RandomAccessFile:
        """An existing file, to write in place (the runtime file)."""
        ...

    def read_file(self, path: str) -> bytes:
        ...

    def listdir(self, directory: str) -> list[str]:
        ...

    def exists(self, path: str) -> bool:
        ...

    def fsync_dir(self, directory: str) -> None:
        ...

    def remove(self, path: str) -> None:
        ...

    def statvfs(self, directory: str) -> tuple[int, int]:
        """(free bytes available to this process, total bytes) of the file system."""
        ...

    def open_new(self, path: str, mode: int = 0o600, *, exclusive: bool = False) -> RandomAccessFile:
        """A file to write from empty: created with `mode` (less the umask), or an old one at
        `path` truncated (`exclusive`: refused with FileExistsError instead). What is written is
        durable only after its fsync, and its name only after its directory's."""
        ...

    def replace(self, src: str, target: str) -> None:
        """Rename `src` over `target` (a reader sees the old file or the new one, never a part),
        then fsync target's directory, so that the rename survives a power cut."""
        ...

    @contextlib.contextmanager
    def atomic_writer(self, path: str, *, mode: int = 0o600, tmp: str | None = None,
                      exclusive: bool = False) -> Iterator[RandomAccessFile]:
        """Put a finished file in place durably: the block writes a new temporary file beside
        `path` (`tmp`, default path + ".tmp"; `open_new` with `mode` and `exclusive`); when it
        ends, the file is fsynced, closed and renamed over `path`, and the directory fsynced
        (`replace`). `path` holds its old content, or nothing, until the rename, and the new
        content, whole, after it. An error removes the temporary file and is raised again; a
        simulated `Crash` leaves everything as the process left it."""
        tmp = path + ".tmp" if tmp is None else tmp
        f = self.open_new(tmp, mode, exclusive=exclusive)
        try:
            try:
                yield f
                f.fsync()
            finally:
                f.close()
            self.replace(tmp, path)
        except Crash:
            raise
        except BaseException:
            with contextlib.suppress(FileNotFoundError):  # (the rename done, its directory sync failed)
                self.remove(tmp)
            raise

    def write_atomically(self, path: str, data: bytes | memoryview, *, mode: int = 0o600,
                         tmp: str | None = None, exclusive: bool = False) -> None:
        """`data` as the whole content of `path`, put in place durably (`atomic_writer`)."""
        with self.atomic_writer(path, mode=mode, tmp=tmp, exclusive=exclusive) as f:
            f.pwrite(data, 0)


class OsAppendFile(AppendFile):
    native_io = True

    def __init__(self, path: str, fd: int):
        self.path = path
        self._fd = fd

    def write(self, data: bytes) -> None:
        # One os.write is the common case; the loop covers short writes (signals, pipes, some
        # file systems near full), where the next os.write reports the real error.
        written = os.write(self._fd, data)
        if written == len(data):
            return
        view = memoryview(data)[written:]
        while view:
            view = view[os.write(self._fd, view):]

    def fdatasync(self) -> None:
        os.fdatasync(self._fd)

    def truncate(self, length: int) -> None:
        os.ftruncate(self._fd, length)

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


class OsRandomAccessFile(RandomAccessFile):
    def __init__(self, path: str, fd: int):
        self.path = path
        self._fd = fd

    def pwrite(self, data: bytes | memoryview, offset: int) -> None:
        view = memoryview(data).cast("B")
        while view:  # a short write is followed by another, which reports the real error
            written = os.pwrite(self._fd, view, offset)
            view, offset = view[written:], offset + written

    def fsync(self) -> None:
        os.fsync(self._fd)

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


class OsFileLayer(FileLayer):
    def open_append(self, path: str) -> OsAppendFile:
        # O_APPEND: every write lands at the current end, also after an ftruncate.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        return OsAppendFile(path, fd)

    def open_rw(self, path: str) -> OsRandomAccessFile:
        return OsRandomAccessFile(path, os.open(path, os.O_RDWR | os.O_CLOEXEC))

    def open_new(self, path: str, mode: int = 0o600, *, exclusive: bool = False) -> OsRandomAccessFile:
        return OsRandomAccessFile(path, os.open(path, _new_flags(exclusive), mode))

    def replace(self, src: str, target: str) -> None:
        os.replace(src, target)
        self.fsync_dir(os.path.dirname(os.path.abspath(target)))

    def read_file(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def listdir(self, directory: str) -> list[str]:
        return os.listdir(directory)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def fsync_dir(self, directory: str) -> None:
        # A new file's directory entry is durable only once the directory itself is synced.
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self, path: str) -> None:
        os.remove(path)

    def statvfs(self, directory: str) -> tuple[int, int]:
        st = os.statvfs(directory)
        return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


class FaultyAppendFile(OsAppendFile):
    native_io = False  # its faults live in write and fdatasync below

    def __init__(self, layer: FaultyFileLayer, path: str, fd: int):
        super().__init__(path, fd)
        self._layer = layer

    def write(self, data: bytes) -> None:
        layer = self._layer
        if layer.write_errors:
            raise _os_error(layer.write_errors.pop(0), self.path)
        if layer.space is not None and len(data) > layer.space:
            # A full disk accepts what fits, then refuses the rest, like a short write.
            fits = layer.space
            if fits:
                super().write(data[:fits])
            layer.space = 0
            raise _os_error(errno.ENOSPC, self.path)
        super().write(data)
        if layer.space is not None:
            layer.space -= len(data)

    def fdatasync(self) -> None:
        layer = self._layer
        if layer.fdatasync_errors:
            # Like Linux after a failed writeback: nothing new became durable.
            raise _os_error(layer.fdatasync_errors.pop(0), self.path)
        layer.fdatasync_calls += 1
        layer.durable[self.path] = self.size()

    def truncate(self, length: int) -> None:
        before = self.size()
        super().truncate(length)
        if self._layer.space is not None and before > length:
            self._layer.space += before - length
        # A cut is treated as durable at once; the journal only ever cuts undurable tails or
        # syncs right after cutting, so a resurrected tail would only repeat a torn one.
        layer = self._layer
        layer.durable[self.path] = min(layer.durable.get(self.path, 0), length)


class Crash(Exception):
    """A FaultyFileLayer's simulated crash: the process stops before the write, sync, rename or
    directory sync it was told to stop at (then `lose_unsynced` is the power cut that follows)."""


class FaultyRandomAccessFile(OsRandomAccessFile):
    """A file written in place whose writes are durable only once fsynced: each write since the
    last fsync is remembered with what it overwrote, so a power cut can undo it."""

    def __init__(self, layer: FaultyFileLayer, path: str, fd: int):
        super().__init__(path, fd)
        self._layer = layer

    def pwrite(self, data: bytes | memoryview, offset: int) -> None:
        data = bytes(memoryview(data).cast("B"))
        torn = self._layer.step(self.path)  # a crash here writes nothing, or (torn) a prefix first
        size = self.size()
        before = os.pread(self._fd, len(data), offset) if offset < size else b""
        self._layer.unsynced.setdefault(self.path, []).append((offset, before, len(data), size))
        if torn is not None:
            super().pwrite(data[:torn * len(data) // 2], offset)
            raise Crash(f"crashed writing {len(data)} bytes at {self.path} offset {offset}")
        super().pwrite(data, offset)

    def fsync(self) -> None:
        layer = self._layer
        if layer.step(self.path) is not None:
            raise Crash(f"crashed before fsync of {self.path}")
        if layer.fdatasync_errors:
            raise _os_error(layer.fdatasync_errors.pop(0), self.path)
        layer.fdatasync_calls += 1
        layer.unsynced.pop(self.path, None)


class FaultyFileLayer(FileLayer):
    """Real files with injectable faults and a model of what a power cut keeps.

    It tracks, per file opened through it, the length last made durable by fdatasync, and which
    new files still wait for a directory sync; for a file written in place (`open_rw`, `open_new`),
    every write since its last fsync and the bytes it overwrote; for a rename (`replace`) whose
    directory was not synced since, what its target and its source held before. fdatasync itself does not reach
    the disk: the durability is simulated, which keeps fault tests fast.

    - `space`: bytes left on the "disk" (None: unlimited). A write past it stores what fits and
      raises ENOSPC; truncating gives bytes back.
    - `write_errors` / `fdatasync_errors`: errnos that the next calls raise, one each.
    - `crash_at(n, torn=)`: the n-th step from now (0: the next) raises `Crash` instead of
      running (torn: a write puts half its bytes there first). A step is a write or fsync of a
      file written in place (`open_rw`, `open_new`), or one of the two halves of `replace`: the
      rename, the directory sync after it. `steps` counts them, so a test can run an operation
      once to learn how many there are (`write_atomically`: write, fsync, rename, directory sync).
    - `lose_unsynced(mode)`: the power cut. Every tracked file loses what was never durable; a
      rename not followed by a sync of its directory is undone (the file it replaced comes back,
      or the name is gone if it replaced none; the source is back under its name).
    """

    LOSS_MODES = ("cut", "zeros", "garbage", "prefix")

    def __init__(self, *, space: int | None = None, seed: int = 0):
        self._os = OsFileLayer()
        self.space = space
        self.write_errors: list[int] = []
        self.fdatasync_errors: list[int] = []
        self.fdatasync_calls = 0
        self.durable: dict[str, int] = {}
        self._undurable_entries: set[str] = set()
        self._open: list[FaultyAppendFile] = []
        self._open_rw: list[FaultyRandomAccessFile] = []
        # path -> writes in place since its last fsync: (offset, bytes overwritten, length, file size before)
        self.unsynced: dict[str, list[tuple[int, bytes, int, int]]] = {}
        # a name a rename changed since its directory's last sync (the target, the source) -> what
        # it held before (None: no file), which a power cut brings back
        self.renamed: dict[str, bytes | None] = {}
        self.steps = 0  # writes and fsyncs of files written in place, renames and their directory syncs, so far
        self._crash_step: int | None = None
        self._crash_torn = False
        self._random = random.Random(seed)

    def crash_at(self, n: int, *, torn: bool = False) -> None:
        self._crash_step, self._crash_torn = self.steps + n, torn

    def step(self, path: str) -> int | None:
        """Count one step (a write or fsync of a file written in place, a rename, a rename's
        directory sync); not None when it is to crash (1: torn, the write puts half its bytes
        first; 0: nothing)."""
        step, self.steps = self.steps, self.steps + 1
        if step != self._crash_step:
            return None
        self._crash_step = None
        return 1 if self._crash_torn else 0

    def open_rw(self, path: str) -> FaultyRandomAccessFile:
        path = os.path.abspath(path)
        handle = FaultyRandomAccessFile(self, path, os.open(path, os.O_RDWR | os.O_CLOEXEC))
        self._open_rw.append(handle)
        return handle

    def open_new(self, path: str, mode: int = 0o600, *, exclusive: bool = False) -> FaultyRandomAccessFile:
        """As the OS layer's; a file it creates disappears in a power cut until its directory is
        synced, and its writes are undone until it is fsynced (an old file it truncates is not
        modelled: what it held is gone)."""
        path = os.path.abspath(path)
        created = not os.path.exists(path)
        handle = FaultyRandomAccessFile(self, path, os.open(path, _new_flags(exclusive), mode))
        self.unsynced.pop(path, None)
        if created:
            self._undurable_entries.add(path)
        self._open_rw.append(handle)
        return handle

    def replace(self, src: str, target: str) -> None:
        src, target = os.path.abspath(src), os.path.abspath(target)
        if self.step(target) is not None:
            raise Crash(f"crashed before renaming {src} to {target}")
        # what a power cut before the directory sync brings back: the target's old content (or no
        # file), and the source under its name (unless it is new since that directory's last sync)
        before = self._os.read_file(target) if os.path.exists(target) else None
        source = None if src in self._undurable_entries else self._os.read_file(src)
        os.replace(src, target)
        self.renamed.setdefault(target, before)
        self.renamed.setdefault(src, source)
        self._undurable_entries.discard(src)
        self.unsynced.pop(target, None)
        writes = self.unsynced.pop(src, None)
        if writes:  # renamed before its fsync: a power cut may keep the name, not the bytes
            self.unsynced[target] = writes
        if self.step(target) is not None:
            raise Crash(f"crashed before syncing the directory of {target} after renaming {src} over it")
        self.fsync_dir(os.path.dirname(target))

    def fail_fdatasync(self, err: int, times: int = 1) -> None:
        self.fdatasync_errors.extend([err] * times)

    def fail_write(self, err: int, times: int = 1) -> None:
        self.write_errors.extend([err] * times)

    def open_append(self, path: str) -> FaultyAppendFile:
        path = os.path.abspath(path)
        if path not in self.durable:
            if os.path.exists(path):
                self.durable[path] = os.path.getsize(path)
            else:
                self.durable[path] = 0
                self._undurable_entries.add(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        handle = FaultyAppendFile(self, path, fd)
        self._open.append(handle)
        return handle

    def read_file(self, path: str) -> bytes:
        return self._os.read_file(path)

    def listdir(self, directory: str) -> list[str]:
        return self._os.listdir(directory)

    def exists(self, path: str) -> bool:
        return self._os.exists(path)

    def fsync_dir(self, directory: str) -> None:
        directory = os.path.abspath(directory)
        self._undurable_entries = {
            p for p in self._undurable_entries if os.path.dirname(p) != directory
        }
        self.renamed = {p: old for p, old in self.renamed.items() if os.path.dirname(p) != directory}

    def remove(self, path: str) -> None:
        path = os.path.abspath(path)
        self._os.remove(path)
        self.durable.pop(path, None)
        self.unsynced.pop(path, None)
        self._undurable_entries.discard(path)

    def statvfs(self, directory: str) -> tuple[int, int]:
        free, total = self._os.statvfs(directory)
        return (free if self.space is None else self.space), total

    def lose_unsynced(self, mode: str = "cut") -> None:
        """Simulate a power cut; the process that held the files is gone.

        cut: each file ends at its durable length. zeros / garbage: the undurable tail keeps its
        length but is overwritten with zero bytes / random bytes. prefix: a random part of the
        undurable tail survives intact (pages written back before the cut), the rest is gone.
        Renames since their directory's last sync are undone, and files created since then
        disappear.
        """
        if mode not in self.LOSS_MODES:
            raise ValueError(f"unknown loss mode {mode!r}")
        for handle in self._open:
            handle.close()
        self._open.clear()
        for rw in self._open_rw:
            rw.close()
        self._open_rw.clear()
        for path, writes in self.unsynced.items():
            if os.path.exists(path):
                self._lose_in_place(path, writes, mode)
        self.unsynced.clear()
        for path, old in self.renamed.items():
            if old is None:
                if os.path.exists(path):
                    os.remove(path)
            else:
                with open(path, "wb") as f:
                    f.write(old)
        self.renamed.clear()
        for path in self._undurable_entries:
            if os.path.exists(path):
                os.remove(path)
            self.durable.pop(path, None)
        self._undurable_entries.clear()
        for path, durable in self.durable.items():
            if not os.path.exists(path):
                continue
            size = os.path.getsize(path)
            if size <= durable:
                continue
            tail = size - durable
            if mode == "cut":
                keep, fill = durable, b""
            elif mode == "zeros":
                keep, fill = durable, bytes(tail)
            elif mode == "garbage":
                keep, fill = durable, self._random.randbytes(tail)
            else:
                keep, fill = durable + self._random.randrange(tail + 1), b""
            with open(path, "r+b") as f:
                f.truncate(keep)
                f.seek(keep)
                f.write(fill)
            self.durable[path] = keep + len(fill)


    def _lose_in_place(self, path: str, writes: list[tuple[int, bytes, int, int]], mode: str) -> None:
        """A file written in place loses its unsynced writes. cut: each is undone (what it
        overwrote comes back, the file its old size); zeros / garbage: its range holds zero /
        random bytes; prefix: the first writes (a random number of them) stay, the rest are undone."""
        keep = self._random.randrange(len(writes) + 1) if mode == "prefix" else 0
        with open(path, "r+b") as f:
            if mode in ("zeros", "garbage"):
                for offset, _, length, _ in writes:
                    f.seek(offset)
                    f.write(bytes(length) if mode == "zeros" else self._random.randbytes(length))
                return
            for offset, before, _, size in reversed(writes[keep:]):
                f.seek(offset)
                f.write(before)
                f.truncate(size)  # undone in reverse: the size before this write


def _new_flags(exclusive: bool) -> int:
    # O_RDWR: FaultyRandomAccessFile reads what a write overwrites
    return os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (os.O_EXCL if exclusive else os.O_TRUNC)


def _os_error(err: int, path: str) -> OSError:
    return OSError(err, os.strerror(err), path)
