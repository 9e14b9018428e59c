"""Who shares the engine now (docs/grants.md, "Shares under contention").

The fair shares of the KV pool (scheduler.py) and a default output-token rate (pacing.py) bind only
among the *active* tenants: those with a request waiting or running in the engine, or that had one
within the last ACTIVE_SECONDS. A tenant alone is given the whole pool and every step, as an
unlimited one would be; once another tenant has work, each gets its share.

Why a window rather than "waiting or running this instant": a client thinks between requests (reads
its answer, builds the next turn). Counted only while it has work, it would leave the engine between
turns, a flooding neighbour would take every page and step meanwhile, and its next request would wait
behind whatever that neighbour started (never preempted). Two seconds holds a tenant's place across
such pauses and gives a principal that really left its pages back soon after.
"""
from __future__ import annotations

import time
from typing import Callable, Hashable, Iterable

from ..contract.rates import ACTIVE_SECONDS


class Activity:
    """The tenants seen with work in the engine, and when last (the engine's thread only)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window: float = ACTIVE_SECONDS) -> None:
        self.clock = clock
        self.window = window
        self.last: dict[Hashable, float] = {}

    def saw(self, tenants: Iterable[Hashable]) -> frozenset[Hashable]:
        """`tenants` have work now: the active tenants, these included (older ones dropped)."""
        now = self.clock()
        last = self.last
        for tenant in tenants:
            last[tenant] = now
        cutoff = now - self.window
        for tenant in [t for t, at in last.items() if at < cutoff]:
            del last[tenant]
        return frozenset(last)
