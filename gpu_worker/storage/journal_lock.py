"""One device per journal: an exclusive flock on the journal directory's lock file (docs/journal.md,
"Locking"), held by a device for its life, and by a standby for its copy of the primary's journal.
"""

from __future__ import annotations

import fcntl
import os

from gpu_worker.storage.journal import JournalError

LOCK_NAME = "lock"


class JournalLocked(JournalError):
    pass


class JournalLock:
    """An exclusive flock on DIR/lock, held for the life of the device.

    flock belongs to the open file description, so a second JournalLock conflicts even inside
    the same process. The lock file is never removed: removing it would let two processes lock
    two different inodes.
    """

    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise JournalLocked(
                f"journal {directory} is locked by another device (pid {holder})"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> JournalLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
