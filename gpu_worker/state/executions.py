"""The inputs in execution, host side (their saved bytes are in the tables): each leased input's
live state (`Execution`), the saved admissions awaiting their lease in conversation order and fair
per principal (`LeaseQueue`), and all of them together (`Executions`). gpu_worker/pipeline/execution.py moves
inputs through them; a rebuild of the tables after an ENOSPC keeps them."""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from ..storage import leases
from .tables import Finish

# a principal's inputs leased and not yet generating, at most (its others wait for their lease):
# enough to keep its next input's embedding and prompt ready while one starts in the engine
LEASE_AHEAD = 2


class Phase(IntEnum):
    """Where a leased input is in its life (gpu_worker/pipeline/execution.py moves it, only through
    `Execution.move` and `Execution.end`; MOVES says where each phase may go)."""
    MEMORY = 1        # its lease is saved: its query is embedded, memory recalled and its source
    #                   retained, its prompt built (helper threads between tick-thread steps)
    QUEUED = 2        # the engine has its prompt and has given no token yet
    GENERATING = 3    # the engine is giving its tokens
    INTERPRETING = 4  # retention mode 2, its turn generated: the model's interpretation is being written
    ENDED = 5         # its end is known (`finish`): its output flushes, then its completion is appended
    CONTROLLED = 6    # revision 5: its control record is appended, its completion next
    COMPLETING = 7    # its COMPLETION is appended; it leaves `Executions.live` when that is saved


MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.MEMORY: frozenset({Phase.QUEUED, Phase.ENDED}),
    Phase.QUEUED: frozenset({Phase.GENERATING, Phase.ENDED}),
    Phase.GENERATING: frozenset({Phase.INTERPRETING, Phase.ENDED}),
    Phase.INTERPRETING: frozenset({Phase.ENDED}),
    # ENDED again: a deadline overtakes a generated turn whose output is still to be journaled
    Phase.ENDED: frozenset({Phase.ENDED, Phase.CONTROLLED, Phase.COMPLETING}),
    Phase.CONTROLLED: frozenset({Phase.COMPLETING}),
    Phase.COMPLETING: frozenset(),
}
# not yet generating: what LEASE_AHEAD bounds per principal
BEFORE_THE_ENGINE = frozenset({Phase.MEMORY, Phase.QUEUED})
# its engine request may still be running (a cancellation or deadline stops it)
IN_THE_ENGINE = frozenset({Phase.MEMORY, Phase.QUEUED, Phase.GENERATING})
# its completion is to be appended once its output is journaled
READY_TO_COMPLETE = frozenset({Phase.ENDED, Phase.CONTROLLED})


class IllegalMove(AssertionError):
    """An input moved where its phase does not lead: a bug in the device, never the caller's."""


@dataclass
class Execution:
    """Live state of one leased input (host side; its saved bytes are in the tables)."""
    rrow: int
    deadline_ns: int
    phase: Phase = Phase.MEMORY
    finish: Finish = Finish.NONE   # why it ended (the engine, a cancellation, the deadline, a failure):
    #                                its COMPLETION records it; set from INTERPRETING on
    buffered: bytearray = field(default_factory=bytearray)
    offset: int = 0                # result bytes journaled so far (saved or in flight)
    flushed_at: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    mode: int = leases.RETAIN_SOURCE  # its lease's retention mode and revision
    revision: int = leases.COMPACT
    interpretation: bytearray = field(default_factory=bytearray)
    settings: dict[str, Any] = field(default_factory=dict)  # what the engine got (mode 2 reuses it)
    participant: int = -1          # its participant's row (whose lease turn it took)

    def move(self, phase: Phase, finish: Finish | None = None) -> None:
        """The one place an input's phase changes (and, with it, why it ended)."""
        if phase not in MOVES[self.phase]:
            raise IllegalMove(f"input at receipt row {self.rrow}: {self.phase.name} -> {phase.name}")
        self.phase = phase
        if finish is not None:
            self.finish = finish

    def end(self, finish: Finish | None = None) -> None:
        """Its end is known: `finish` says why (None keeps the one it has)."""
        self.move(Phase.ENDED, finish)

    def prompted(self, ids: list[int] | None, error: BaseException | None, settings: dict[str, Any]) -> bool:
        """Its prompt is built (or failed): True when the engine is to get it now. One that ended
        meanwhile (cancelled, past its deadline) stays as it is; a prompt that failed, or that does
        not fit, ends it `failed`."""
        if self.phase is not Phase.MEMORY:
            return False
        if error is not None or ids is None:
            self.end(Finish.FAILED)
            return False
        self.input_tokens = len(ids)
        self.settings = settings
        self.move(Phase.QUEUED)
        return True


class LeaseQueue:
    """Receipt rows whose admission is saved, awaiting a lease.

    One conversation, one input at a time (DESIGN §8): the input whose turn it is in its
    conversation (`turn`) keeps it from its saved admission through its lease and its run until
    its terminal is saved (`finished`); the inputs behind it wait per conversation, in conversation
    order (`waiting`), unleased, so their deadlines have not started (SPEC: the deadline starts
    when the lease is applied). An input whose turn it is is ready: ready inputs wait per
    participant row, FIFO within one (in the order they became ready) and round-robin across them
    (the dict's order is the turn order: the first is next; one that is given a lease goes to the
    back)."""

    def __init__(self) -> None:
        self.queues: dict[int, deque[int]] = {}   # participant row -> its ready inputs
        self.owner: dict[int, int] = {}           # receipt row (ready or waiting) -> its participant row
        self.conversation: dict[int, int] = {}    # receipt row (ready or waiting) -> its conversation row
        self.turn: dict[int, int] = {}            # conversation row -> its input whose turn it is
        self.waiting: dict[int, deque[int]] = {}  # conversation row -> its inputs behind that one

    def append(self, rrow: int, prow: int, crow: int) -> None:
        """A saved admission (admissions are saved in conversation order)."""
        self.owner[rrow] = prow
        self.conversation[rrow] = crow
        if crow in self.turn:
            self.waiting.setdefault(crow, deque()).append(rrow)
        else:
            self.turn[crow] = rrow
            self._ready(rrow, prow)

    def _ready(self, rrow: int, prow: int) -> None:
        queue = self.queues.get(prow)
        if queue is None:
            queue = self.queues[prow] = deque()  # one with nothing ready joins at the back
        queue.append(rrow)

    def __len__(self) -> int:
        return len(self.owner)

    def __contains__(self, rrow: object) -> bool:
        return rrow in self.owner

    def remove(self, rrow: int) -> None:
        """A cancelled input leaves the queue before its lease; one whose turn it was keeps the
        turn until its terminal (`cancelled`) is saved."""
        prow = self.owner.pop(rrow)
        crow = self.conversation.pop(rrow)
        if self.turn.get(crow) == rrow:
            queue = self.queues[prow]
            queue.remove(rrow)
            if not queue:
                del self.queues[prow]
        else:
            waiting = self.waiting[crow]
            waiting.remove(rrow)
            if not waiting:
                del self.waiting[crow]

    def take(self, prow: int) -> int:
        """The head of this participant's ready inputs, which goes to the back of the turn order
        (and keeps its conversation's turn)."""
        queue = self.queues.pop(prow)
        rrow = queue.popleft()
        del self.owner[rrow]
        del self.conversation[rrow]
        if queue:
            self.queues[prow] = queue
        return rrow

    def finished(self, crow: int, rrow: int) -> None:
        """An input's terminal is saved: if it held its conversation's turn, the next input of
        the conversation is ready (nothing, for one that never held it: cancelled while waiting,
        or replayed)."""
        if self.turn.get(crow) != rrow:
            return
        waiting = self.waiting.get(crow)
        if not waiting:
            del self.turn[crow]
            return
        following = self.turn[crow] = waiting.popleft()
        if not waiting:
            del self.waiting[crow]
        self._ready(following, self.owner[following])


class Executions:
    """Inputs between their saved admission and their saved completion."""

    def __init__(self) -> None:
        self.live: dict[int, Execution] = {}      # receipt row -> leased, not yet completed
        self.to_lease = LeaseQueue()              # saved admissions awaiting a lease, in conversation order
        self.leasing: dict[int, int] = {}         # receipt row -> participant row: lease appended, not saved
        self.cancel_when_leased: set[int] = set()  # cancelled before their lease was saved
        # unfinished inputs an ENOSPC stopped: each ends `interrupted` once the journal takes writes
        self.to_interrupt: list[int] = []

    def ahead(self) -> Counter[int]:
        """Per participant row: its inputs leased (or being leased) that have not started generating."""
        ahead = Counter(self.leasing.values())
        for execution in self.live.values():
            if execution.phase in BEFORE_THE_ENGINE:
                ahead[execution.participant] += 1
        return ahead

    def leasable(self) -> list[int]:
        """The participants whose turn may come now, in turn order (fewer than LEASE_AHEAD ahead)."""
        if not self.to_lease:
            return []
        ahead = self.ahead()
        return [prow for prow in self.to_lease.queues if ahead[prow] < LEASE_AHEAD]
