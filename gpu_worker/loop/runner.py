"""The engine's own thread: the device's tick loop never waits on a forward pass.

The tick loop hands requests over with submit/cancel (a queue); this thread runs engine steps
while any request is waiting or running and delivers each step's events back to the tick loop
with `deliver(events)` (the server passes loop.call_soon_threadsafe), so shared state is only
ever touched on the tick loop's thread. Events are (request_id, token_id, bytes, finish, logprobs)
as the engine yields them; a refusal or a cancellation becomes an event with its finish reason too, so
the tick loop learns every end in one place.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING, Any, Callable

from ..engine.scheduler import EngineRefusal
from .threads import DEFAULT_NICE, enter_background

if TYPE_CHECKING:
    from ..engine.engine import Engine, TokenLogprobs

# A command on the queue: ("submit", request_id, prompt_ids, settings) or ("cancel", request_id, reason).
Command = tuple[Any, ...]
# (request_id, token_id, released bytes, finish reason or None, token logprobs or None): the engine's
# StepEvent, or an end without a token (token_id None) for a refusal, a cancellation or the engine's failure.
Event = tuple[object, int | None, bytes, str | None, "TokenLogprobs | None"]

log = logging.getLogger("gpu_worker.runner")


class Runner:
    def __init__(self, engine: Engine, deliver: Callable[[list[Event]], object], nice: int = DEFAULT_NICE) -> None:
        self.engine = engine
        self.deliver = deliver
        self.nice = nice  # the engine thread's and its torch workers' (loop/threads.py)
        self.commands: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.failure: BaseException | None = None

    def start(self) -> None:
        self.thread.start()

    def submit(self, request_id: object, prompt_ids: list[int], **settings: object) -> None:
        self.commands.put(("submit", request_id, prompt_ids, settings))

    def cancel(self, request_id: object, reason: str = "cancelled") -> None:
        self.commands.put(("cancel", request_id, reason))

    def stop(self) -> None:
        self.commands.put(None)
        self.thread.join(timeout=30)

    def _apply(self, command: Command, events: list[Event]) -> None:
        kind, request_id = command[0], command[1]
        if kind == "submit":
            try:
                self.engine.submit(request_id, command[2], **command[3])
            except EngineRefusal as refusal:
                log.warning("engine refused %r: %s", request_id, refusal)
                events.append((request_id, None, b"", f"failed:{refusal.code}", None))
        elif self.engine.cancel(request_id):
            events.append((request_id, None, b"", command[2], None))

    def _run(self) -> None:
        enter_background("aotx-engine", self.nice)
        try:
            while True:
                events: list[Event] = []
                if self.engine.has_work:  # (every tenant with work paced and held: sleep until one may go on)
                    command = self._poll() if not self.engine.idle_for else self._wait(self.engine.idle_for)
                else:
                    command = self.commands.get()
                    command = _STOP if command is None else command
                while command is not None:
                    if command is _STOP:
                        return
                    self._apply(command, events)
                    command = self._poll()
                if self.engine.has_work:
                    events += self.engine.step()
                if events:
                    self.deliver(events)
        except BaseException as exc:  # the device stops: a restart marks unfinished inputs interrupted
            log.exception("engine failed")
            self.failure = exc
            self.deliver([(None, None, b"", "engine_failed", None)])

    def _poll(self) -> Command | None:
        try:
            command = self.commands.get_nowait()
        except queue.Empty:
            return None
        return _STOP if command is None else command

    def _wait(self, seconds: float) -> Command | None:
        """The next command within `seconds` (a submit or a cancel wakes a held engine at once)."""
        try:
            command = self.commands.get(timeout=seconds)
        except queue.Empty:
            return None
        return _STOP if command is None else command


_STOP: Any = object()  # a sentinel command, compared by identity only
