"""A boot's reading of what is saved, started before torch is imported (docs/checkpoint.md,
"Restart and restore"): the journal's lock, the checkpoint's head decoded (where the journal
after it begins), its tables filled by a child process (recovery/preload.py) and the journal's
reader thread (storage/journal_reader.py ReadAhead) going, so
that checking and decoding the journal runs on another CPU while the main thread imports torch,
the model code and the tables' modules, not beside the replay (its work beside the replay cost the
replay's thread as much as a second of a 1M-transfer boot: docs/performance.md, "Replay"). The
Device takes it over (`Device(early=...)`, `Replay.load`). Nothing here imports torch."""
from __future__ import annotations

from typing import Any, NamedTuple

from ..storage.filelayer import FileLayer, OsFileLayer
from ..storage.journal_lock import JournalLock
from ..storage.journal_reader import ReadAhead
from ..storage.runtime_file import RuntimeFile
from ..storage.state_extent import STATE, decode_state, fold_point
from . import fold, preload


class EarlyRead(NamedTuple):
    """The journal's lock (held from here on: its holder is the device), the runtime file's
    decoded state extent (None: no checkpoint yet), the journal's reading from its fold point and
    the checkpoint's tables being filled (None: the device fills them itself)."""
    lock: JournalLock
    saved: dict[str, Any] | None
    reading: ReadAhead
    tables: preload.Preload | None = None

    def close(self) -> None:
        """A boot that stops before its device took these over: the reader stops at its next
        piece, the child filling the tables is stopped, the lock goes."""
        self.reading.close()
        if self.tables is not None:
            self.tables.close()
        self.lock.release()


def read_saved(runtime: RuntimeFile, journal_dir: str, fs: FileLayer | None = None, fill: bool = False,
               nice: int = 0) -> tuple[dict[str, Any] | None, ReadAhead, preload.Preload | None]:
    """The runtime file's decoded state extent (None: no checkpoint yet), the journal's reading
    from where it ends, started, and with `fill` its tables being filled by a child
    (`preload.start`, forked before the reader's thread starts, at nice value `nice`): what every
    load of the state begins with (a boot's here, before torch; a rebuild's in Replay.load)."""
    saved = decode_state(runtime.bytes(STATE)) if runtime.has(STATE) else None
    tables = preload.start(runtime.capacities, runtime.incarnation, saved, nice) if fill else None
    try:
        after_seq, start_digest = fold_point(saved)
        reading = ReadAhead(journal_dir, fs or OsFileLayer(), runtime.incarnation, start_digest=start_digest,
                            after_seq=after_seq)
    except BaseException:
        if tables is not None:
            tables.close()
        raise
    return saved, reading, tables


def start(runtime: RuntimeFile, journal_dir: str, fs: FileLayer | None = None, fill: bool = False,
          nice: int = 0) -> EarlyRead:
    """Lock the journal (JournalLocked: another device holds it), clear what an unfinished fold
    left, then `read_saved` (`fill`: a boot on the CPU, which has started no thread yet). The
    reading begins only with the lock held: no other device appends while it reads."""
    lock = JournalLock(journal_dir)
    try:
        fold.clear(journal_dir)  # (the links of a fold a stop cut short: gpu_worker/recovery/fold.py)
        saved, reading, tables = read_saved(runtime, journal_dir, fs, fill, nice)
    except BaseException:
        lock.release()
        raise
    return EarlyRead(lock, saved, reading, tables)
