"""Journal holds (SPEC "Recorded state and recovery"): file-cap or disk pressure pauses persistent
admission. While a hold lasts, new mutations answer 429 without changing anything; reads,
receipts and save status stay available.

Each hold is an incident the device journals (HOLD transfers: its start, then its end), so ops
staff see them after restarts too; the incidents are part of the saved state (DeviceState
`hold_incidents`, the newest MAX_INCIDENTS). A hold on a full disk (ENOSPC) cannot journal its
start: its end records the whole incident once there is room again."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, TypedDict

from ..contract.errors import ServiceError
from ..storage.filelayer import FileLayer

log = logging.getLogger("gpu_worker.holds")
DISK_FULL_MARGIN = 4 << 20
MAX_INCIDENTS = 1000



class Incident(TypedDict):
    """A saved hold, as its HOLD transfers said (`ended_ns` None while it lasts)."""
    cause: str | None
    since_ns: int | None
    ended_ns: int | None
    disk_error: str | None
    pending_bytes: int | None


class Hold(TypedDict):
    """The hold that lasts now (Holds.current)."""
    cause: str
    since_ns: int
    disk_error: str | None


class Holds:
    def __init__(self, fs: FileLayer, journal_dir: str, file_cap: int, min_free_disk: int,
                 journal: Callable[[dict[str, object]], None]) -> None:
        self.fs = fs
        self.journal_dir = journal_dir
        self.file_cap = file_cap
        self.min_free_disk = min_free_disk
        self.journal = journal  # records a hold event: {"event": "start" | "end", ...the incident}
        # the hold while one lasts (read by the device as a plain map)
        self.current: Hold | None = None

    def check(self, journal_bytes: int) -> None:
        """Hold on file-cap or disk pressure; lift the hold once both clear."""
        error: str | None
        try:
            free, _ = self.fs.statvfs(self.journal_dir)
        except OSError as exc:
            free, error = 0, f"statvfs: {exc.strerror}"
        else:
            error = None
        cause = ("file_cap" if journal_bytes >= self.file_cap else
                 "low_disk" if free < self.min_free_disk else None)
        held = self.current
        if (cause is None and held and held["cause"] == "disk_full"
                and free < max(self.min_free_disk, DISK_FULL_MARGIN)):
            cause = "disk_full"  # after an ENOSPC, wait for real room, not for the bytes the cut gave back
        if cause and not held:
            self.current = {"cause": cause, "since_ns": time.time_ns(), "disk_error": error}
            log.warning("journal hold: %s (journal %d bytes, cap %d; %d bytes free, minimum %d)", cause,
                        journal_bytes, self.file_cap, free, self.min_free_disk)
            self.journal({"event": "start", **self.current, "ended_ns": None})
        elif cause and held and held["cause"] != "disk_full":
            held["cause"] = cause
        elif not cause and held:
            self.end()

    @property
    def writable(self) -> bool:
        """Whether the journal may be written: not while a `disk_full` hold lasts (the write
        that failed with ENOSPC would fail again; engine transfers wait for it to lift). Under
        `file_cap` and `low_disk` it takes what admitted work still writes."""
        return self.current is None or self.current["cause"] != "disk_full"

    def disk_full(self, error: str) -> None:
        self.current = {"cause": "disk_full", "since_ns": time.time_ns(), "disk_error": f"ENOSPC: {error}"}

    def end(self) -> None:
        held = self.current
        if held is None:
            return
        log.warning("journal hold lifted (%s)", held["cause"])
        self.current = None
        self.journal({"event": "end", **held, "ended_ns": time.time_ns()})

    def refusal(self, pending_bytes: int, message: str | None = None) -> ServiceError:
        """The 429 a mutation gets while a hold lasts."""
        held = self.current
        cause, error = (held["cause"], held["disk_error"]) if held is not None else ("disk_full", None)
        return ServiceError(429, "journal_hold", message or f"persistent admission is paused ({cause}); "
                                                            "reads, receipts and save status stay available",
                            cause=cause, disk_error=error, pending_bytes=str(pending_bytes))


def apply(incidents: list[Incident], event: dict[str, Any]) -> None:
    """A saved HOLD transfer into the saved incidents (live once saved, and at replay); `event` is
    the transfer's map as msgpack decoded it."""
    incident: Incident = {"cause": event.get("cause"), "since_ns": event.get("since_ns"),
                          "ended_ns": event.get("ended_ns"), "disk_error": event.get("disk_error"),
                          "pending_bytes": event.get("pending_bytes")}
    for known in reversed(incidents):
        if known["since_ns"] == incident["since_ns"]:
            known.update(incident)  # its end
            return
    incidents.append(incident)
    del incidents[:-MAX_INCIDENTS]
