"""The file operations the journal uses, behind one small interface.

The journal never calls `os` for its segment files directly: it asks a `FileLayer`. Production
uses `OsFileLayer`; tests use `FaultyFileLayer`, which runs on real files but can run out of
space, fail an fdatasync, and lose everything that was never made durable, as a power cut would.
"""

from __future__ import annotations

import errno
import os
import random
from typing import Protocol


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


class FileLayer(Protocol):
    """Every file operation the journal performs. Errors are `OSError` with an errno."""

    def open_append(self, path: str) -> AppendFile:
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


class OsFileLayer(FileLayer):
    def open_append(self, path: str) -> OsAppendFile:
        # O_APPEND: every write lands at the current end, also after an ftruncate.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        return OsAppendFile(path, fd)

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


class FaultyFileLayer(FileLayer):
    """Real files with injectable faults and a model of what a power cut keeps.

    It tracks, per file opened through it, the length last made durable by fdatasync, and which
    new files still wait for a directory sync. fdatasync itself does not reach the disk: the
    durability is simulated, which keeps fault tests fast.

    - `space`: bytes left on the "disk" (None: unlimited). A write past it stores what fits and
      raises ENOSPC; truncating gives bytes back.
    - `write_errors` / `fdatasync_errors`: errnos that the next calls raise, one each.
    - `lose_unsynced(mode)`: the power cut. Every tracked file loses what was never durable.
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
        self._random = random.Random(seed)

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

    def remove(self, path: str) -> None:
        path = os.path.abspath(path)
        self._os.remove(path)
        self.durable.pop(path, None)
        self._undurable_entries.discard(path)

    def statvfs(self, directory: str) -> tuple[int, int]:
        free, total = self._os.statvfs(directory)
        return (free if self.space is None else self.space), total

    def lose_unsynced(self, mode: str = "cut") -> None:
        """Simulate a power cut; the process that held the files is gone.

        cut: each file ends at its durable length. zeros / garbage: the undurable tail keeps its
        length but is overwritten with zero bytes / random bytes. prefix: a random part of the
        undurable tail survives intact (pages written back before the cut), the rest is gone.
        Files created since their directory's last sync disappear.
        """
        if mode not in self.LOSS_MODES:
            raise ValueError(f"unknown loss mode {mode!r}")
        for handle in self._open:
            handle.close()
        self._open.clear()
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


def _os_error(err: int, path: str) -> OSError:
    return OSError(err, os.strerror(err), path)
