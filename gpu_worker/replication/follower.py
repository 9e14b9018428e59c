"""A hot standby's applier (docs/replication.md, "A hot standby"): `Follower` keeps a standby's
device applying what its journal copy gains (boot --standby-of), so that a takeover serves at once
(Device.take_over). standby.py's `Standby` tells it each durable position and each cut.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gpu_worker.storage.journal_reader import Tail

log = logging.getLogger("gpu_worker.replication")


class Hot(Protocol):
    """What the follower needs of a hot standby's device (gpu_worker/device.py)."""
    following: Tail | None  # its journal reader, while it follows

    def follow(self, until: tuple[int, int]) -> int: ...

    def refollow(self) -> None: ...


class Follower:
    """A hot standby's applier (`aotx-follow`): after each batch the standby made durable, the
    device (gpu_worker/device.py, `following`) applies what its journal copy gained to its tables,
    off the link's thread (acknowledgements never wait for it). Its waker is `durable`/`cut`/`stop`;
    it also looks every second. A cut before what was applied (a rewind, a primary's failed tick)
    builds the tables again from the journal. An error stops the applying (`error`): the takeover
    then boots from the journal instead."""

    LOOK_SECONDS = 1.0

    def __init__(self, device: Hot, position: tuple[int, int]) -> None:
        self.device = device
        self.error: str | None = None
        self.refollowed = 0
        self._cond = threading.Condition()
        self._durable = position
        self._cut: tuple[int, int] | None = None
        self._reload = False  # a catch-up replaced the runtime file copy's state and emptied the journal
        # held while the device reads the journal copy: a catch-up empties it only in between (`paused`)
        self._reading = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="aotx-follow", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def durable(self, position: tuple[int, int]) -> None:
        with self._cond:
            self._durable = position
            self._cond.notify()

    def cut(self, position: tuple[int, int]) -> None:
        with self._cond:
            self._cut = position if self._cut is None else min(self._cut, position)
            self._durable = min(self._durable, position)
            self._cond.notify()

    def paused(self) -> threading.Lock:
        """Held, the device reads nothing of the journal copy (a catch-up empties it meanwhile)."""
        return self._reading

    def reload(self) -> None:
        """The copy of the runtime file is at a new generation and the journal copy begins again:
        the device builds its tables from them again (its next step)."""
        with self._cond:
            self._reload = True
            self._cut = None
            self._durable = (0, 0)  # (what the emptied copy held counts for nothing: acknowledgements say anew)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._reload and self._cut is None and self._durable <= self._applied():
                    self._cond.wait(self.LOOK_SECONDS)
                if self._stop:
                    return
            if not self._stepped():
                return

    def _applied(self) -> tuple[int, int]:
        following = self.device.following
        assert following is not None  # (a hot standby follows from its start: refollow sets it)
        return following.position

    def applied_segment(self) -> int:
        """The segment the device reads now (the ones before it are applied: a checkpoint may trim them)."""
        return max(self._applied()[0], 1)

    def _step(self) -> None:
        with self._reading:
            self._read()

    def _read(self) -> None:
        with self._cond:
            cut, self._cut = self._cut, None
            reload, self._reload = self._reload, False
            until = self._durable
        if reload:
            log.info("standby: building the tables again from the runtime file copy the catch-up made")
            self.device.refollow()
            self.refollowed += 1
        elif cut is not None and cut < self._applied():
            log.warning("standby: the journal was cut back to %s, before what its tables hold (%s): building them "
                        "again", cut, self._applied())
            self.device.refollow()
            self.refollowed += 1
        if until > self._applied():
            self.device.follow(until)

    def finish(self, until: tuple[int, int]) -> bool:
        """Stop following (the standby stopped: nothing more arrives) and apply a last cut: whether
        the device's tables are good to take over from (`Device.take_over` applies up to `until`)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join()
        return self.error is None and self._stepped()

    def _stepped(self) -> bool:
        """`_step`, or False once it failed (`error`: the takeover boots from the journal instead)."""
        try:
            self._step()
        except Exception as exc:
            log.exception("standby: applying the journal copy failed; a takeover will boot from the journal")
            self.error = f"{type(exc).__name__}: {exc}"
            return False
        return True
