"""The runtime file's one writer: an exclusive flock on the file itself, held by whatever writes it
(docs/runtime-file.md, "One writer: the file's lock"). A device holds it for its whole life, `pack`
and the offline `checkpoint` for their run; the writes of runtime_file_writer.py go ahead under the
lock their own process holds, and take it for themselves otherwise.
"""

from __future__ import annotations

import fcntl
import os

from .runtime_file import RuntimeFileError


class RuntimeFileLocked(RuntimeFileError):
    """Another process holds the file's lock: a device serving it, a pack or a checkpoint."""


# (st_dev, st_ino) of the runtime files whose lock this process holds: its own appends (a running
# device's checkpoints) go ahead under that lock instead of taking a second, conflicting one.
_HELD: dict[tuple[int, int], "FileLock"] = {}


def _lock_holder(st: os.stat_result) -> str:
    """The pid holding a flock on the file, from /proc/locks (Linux), or "unknown"."""
    wanted = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 6 or fields[1] != "FLOCK":  # "->" marks a waiter
                    continue
                major, minor, inode = fields[5].split(":")
                if (int(major, 16), int(minor, 16), int(inode)) == wanted:
                    return fields[4]
    except (OSError, ValueError):
        pass
    return "unknown"


def _in_use(path: str, st: os.stat_result) -> RuntimeFileLocked:
    return RuntimeFileLocked(f"runtime file {path} is in use by another process (pid {_lock_holder(st)}: a device "
                             "serving it, a pack or a checkpoint); stop it first")


class FileLock:
    """An exclusive advisory flock on the runtime file itself, held by its one writer for as long
    as it writes: a device for its whole life (boot), `pack` and the offline `checkpoint` for
    their run. A second one refuses at once (RuntimeFileLocked, one line). flock belongs to the
    open file description, so the lock ends with the holder, however it ends (kill -9 included),
    and a second FileLock conflicts even inside the same process; `append` and `create` in the
    process that holds it go ahead under it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise RuntimeFileError(f"{self.path}: cannot open: {exc.strerror or exc}") from None
        try:
            st = os.fstat(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise _in_use(self.path, st) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.key = (st.st_dev, st.st_ino)
        _HELD[self.key] = self

    @property
    def inode(self) -> int:
        return self.key[1]

    def release(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            if _HELD.get(self.key) is self:
                del _HELD[self.key]
            os.close(fd)  # closing the last descriptor of the description drops the flock

    def __enter__(self) -> "FileLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _held(st: os.stat_result) -> bool:
    return (st.st_dev, st.st_ino) in _HELD


def lock_for_write(path: str, fd: int) -> None:
    """Before a write to an existing file: go ahead under this process's FileLock, else take the
    flock on fd (released when fd closes) or refuse in one line."""
    st = os.fstat(fd)
    if _held(st):
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use(path, st) from None
