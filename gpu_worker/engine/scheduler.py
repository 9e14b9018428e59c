"""Admission of requests into the KV pool: FIFO groups within a conservative page budget, no preemption.

A waiting request joins the group being admitted only if

    pages owned by running requests + pages reserved by this group so far + its own page limit <= pool pages

and at most `max_running` sequences run at once. The first request that does not fit ends the
group: later, smaller requests do not overtake it, so a large request cannot starve. Admitted
requests receive their whole page limit at once, so a running request can always finish and none
is ever evicted. A request that could never fit (page limit above the pool or the page grant) is
refused when it is submitted rather than left waiting forever.
"""

from __future__ import annotations

from collections import deque

from gpu_worker.engine.block_manager import BlockManager
from gpu_worker.engine.sequence import Sequence, Status


class EngineRefusal(Exception):
    """A request the engine will not take; `code` is stable for callers, `message` is one line for people."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, page_grant: int, max_running: int):
        self.block_manager = block_manager
        self.page_grant = page_grant
        self.max_running = max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def check(self, seq: Sequence) -> None:
        pool = self.block_manager.num_pages
        if seq.page_limit > pool:
            raise EngineRefusal("page_limit_exceeds_pool",
                                f"page limit {seq.page_limit} exceeds the KV pool of {pool} pages")
        if seq.page_limit > self.page_grant:
            raise EngineRefusal("page_limit_exceeds_grant",
                                f"page limit {seq.page_limit} exceeds the page grant of {self.page_grant} pages")

    def add(self, seq: Sequence) -> None:
        self.check(seq)
        self.waiting.append(seq)

    @property
    def pending_pages(self) -> int:
        return sum(seq.page_limit for seq in self.waiting)

    def admit(self) -> list[Sequence]:
        """The next admission group, with pages allocated and status RUNNING."""
        owned = self.block_manager.num_allocated
        group: list[Sequence]
        reserved, group = 0, []
        while self.waiting and len(self.running) + len(group) < self.max_running:
            seq = self.waiting[0]
            if owned + reserved + seq.page_limit > self.block_manager.num_pages:
                break
            self.waiting.popleft()
            reserved += seq.page_limit
            group.append(seq)
        for seq in group:
            seq.pages = self.block_manager.allocate(seq.page_limit)
            seq.status = Status.RUNNING
        self.running.extend(group)
        return group

    def release(self, seq: Sequence) -> None:
        """Take a finished or cancelled sequence out of the queue or the running set, freeing its pages."""
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.free(seq.pages)
            seq.pages = []
        elif seq in self.waiting:
            self.waiting.remove(seq)
