"""Admission of requests into the KV pool: fair groups within a conservative page budget, no preemption.

Waiting requests queue per tenant (the principal a request is for; requests without one share one
queue): FIFO within a tenant, round-robin across tenants. The tenant whose turn it is offers the
head of its queue; once admitted, that tenant goes to the back of the turn order. So a tenant that
floods the queue holds one turn in each round, and another tenant's request waits behind at most
one request of each other tenant with work, never behind a whole flood.

A request joins the group being admitted only if

    page limits of running requests + pages reserved by this group so far + its own page limit <= pool pages

(page limits, not the pages held: a cached page shared by several requests counts in each, so the
budget stays as conservative as without sharing, and evictable cached pages count as free).

and at most `max_running` sequences run at once. The first request offered that does not fit ends
the group: no later request overtakes it (within its tenant or across), so a large request cannot
starve. Admitted requests receive their whole page limit at once, so a running request can always
finish and none is ever evicted. A request that could never fit (page limit above the pool or the
page grant) is refused when it is submitted rather than left waiting forever.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Collection, Hashable

from gpu_worker.engine.block_manager import BlockManager
from gpu_worker.engine.sequence import Sequence, Status


class EngineRefusal(Exception):
    """A request the engine will not take; `code` is stable for callers, `message` is one line for people."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, page_grant: int, max_running: int, page_size: int = 16):
        self.block_manager = block_manager
        self.page_size = page_size
        self.page_grant = page_grant
        self.max_running = max_running
        # tenant -> its waiting requests, FIFO; the dict's order is the turn order (first: next)
        self.queues: dict[Hashable, deque[Sequence]] = {}
        self.running: list[Sequence] = []
        # kept as plain counts, so another thread (the device's ping) reads them without
        # iterating structures this thread changes
        self.num_waiting = 0
        self.pending_pages = 0
        self.budgeted = 0  # the page limits of the running requests (cached pages they share count in each)
        self.budgeted_by: Counter[Hashable] = Counter()  # the same, per tenant

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
        queue = self.queues.get(seq.tenant)
        if queue is None:
            queue = self.queues[seq.tenant] = deque()  # a tenant with nothing waiting joins at the back
        queue.append(seq)
        self.num_waiting += 1
        self.pending_pages += seq.page_limit

    def admit(self, active: Collection[Hashable] = ()) -> list[Sequence]:
        """The next admission group, with pages allocated and status RUNNING. `active`: the tenants
        sharing the engine now (shares.Activity); with two or more, each has its share of the pool."""
        pool = self.block_manager.num_pages
        owned = self.budgeted  # every running request's whole page limit, shared pages or not
        share = pool // len(active) if len(active) > 1 else None
        taken: Counter[Hashable] = Counter()  # page limits this group gives each tenant
        group: list[Sequence]
        reserved, group = 0, []
        queues = self.queues
        while queues and len(self.running) + len(group) < self.max_running:
            tenant = next(iter(queues)) if share is None else self._below_share(share, taken)
            queue = queues.pop(tenant)
            seq = queue[0]
            if owned + reserved + seq.page_limit > pool:
                self.queues = queues = {tenant: queue, **queues}  # its turn stays first
                break
            queue.popleft()
            self.num_waiting -= 1
            self.pending_pages -= seq.page_limit
            if queue:
                queues[tenant] = queue  # to the back of the turn order
            reserved += seq.page_limit
            taken[tenant] += seq.page_limit
            group.append(seq)
        for seq in group:
            # its cached prefix (full pages before its last prompt token, which must be prefilled for
            # its logits; none without page hashes: the prefix cache is off), then fresh pages
            reusable = (len(seq.prompt_ids) - 1) // self.page_size
            cached = self.block_manager.match(seq.page_hashes[:reusable])
            seq.pages = cached + self.block_manager.allocate(seq.page_limit - len(cached))
            seq.cached_tokens = len(cached) * self.page_size
            seq.status = Status.RUNNING
        self.budgeted += reserved
        self.budgeted_by.update(taken)
        self.running.extend(group)
        return group

    def _below_share(self, share: int, taken: Counter[Hashable]) -> Hashable:
        """The first tenant in turn order whose next request keeps it within `share` (or that has
        nothing running); the first of all when every waiting tenant is at its share."""
        for tenant, queue in self.queues.items():
            mine = self.budgeted_by[tenant] + taken[tenant]
            if mine == 0 or mine + queue[0].page_limit <= share:
                return tenant
        return next(iter(self.queues))

    def release(self, seq: Sequence) -> None:
        """Take a finished or cancelled sequence out of the queue or the running set, freeing its pages."""
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.free(seq.pages)
            self.budgeted -= seq.page_limit
            self.budgeted_by[seq.tenant] -= seq.page_limit
            if not self.budgeted_by[seq.tenant]:
                del self.budgeted_by[seq.tenant]
            seq.pages = []
        else:
            queue = self.queues.get(seq.tenant)
            if queue is not None and seq in queue:
                queue.remove(seq)
                self.num_waiting -= 1
                self.pending_pages -= seq.page_limit
                if not queue:
                    del self.queues[seq.tenant]
