"""Output-token pacing per tenant: the grant file's `output_tokens_per_second` (docs/grants.md, "Rates").

The quotas bound how many chats and inputs a principal runs at once, not how fast they decode: two
chats of an untrusted tenant keep the model busy every step, and on a small machine every other
tenant's latency goes with it (docs/performance.md, "Hostile neighbours"). A paced tenant's running
sequences join a decode step only while its bucket holds a token; each token it is given (decoded or
the first of a prefill) is taken out, into debt when several of its sequences step together. A paused
sequence keeps its pages and goes on when the bucket refills; when every sequence with work is
paused, `wait` says how long the engine thread may sleep. Unpaced tenants (no rate, or no tenant)
are never held.

A rate is a `Pace`. One the grant file sets binds always (`always`: the operator's cap). The
default rate binds only under contention (shares.py): while the tenant is the only active one it is
not paced and its bucket is dropped, so it starts full the moment another tenant arrives.
"""
from __future__ import annotations

import time
from typing import Callable, Collection, Hashable, Iterable

from ..contract.rates import Bucket, Pace


RateOf = Callable[[Hashable], "Pace | float | None"]  # a tenant's pace (a plain number binds always), None: unpaced


class TokenPacer:
    def __init__(self, rate_of: RateOf | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate_of = rate_of
        self.clock = clock
        self.buckets: dict[Hashable, Bucket] = {}

    def _bucket(self, tenant: Hashable, now: float, active: Collection[Hashable]) -> Bucket | None:
        """The tenant's bucket, refilled, when a rate binds it now (None: it goes unpaced)."""
        pace = None if self.rate_of is None or tenant is None else self.rate_of(tenant)
        if pace is not None and not isinstance(pace, Pace):
            pace = Pace(float(pace), True)
        if pace is None or (not pace.always and not any(other != tenant for other in active)):
            self.buckets.pop(tenant, None)
            return None
        bucket = self.buckets.get(tenant)
        if bucket is None or bucket.rate != pace.rate:  # (a changed grant starts the bucket over)
            bucket = self.buckets[tenant] = Bucket(float(pace.rate), now)
        bucket.refill(now)
        return bucket

    def held(self, tenants: Iterable[Hashable], active: Collection[Hashable] = ()) -> set[Hashable]:
        """The tenants among `tenants` that may not be given a token now (their bucket holds less
        than one). `active`: the tenants sharing the engine (shares.Activity)."""
        if self.rate_of is None:
            return set()
        now = self.clock()
        return {t for t in set(tenants) if (b := self._bucket(t, now, active)) is not None and b.level < 1}

    def charge(self, tenants: Iterable[Hashable], active: Collection[Hashable] = ()) -> None:
        """One token given to each of `tenants` (repeated: one each time); only a rate that binds
        now counts it."""
        if self.rate_of is None:
            return
        now = self.clock()
        buckets: dict[Hashable, Bucket | None] = {}
        for tenant in tenants:
            if tenant not in buckets:
                buckets[tenant] = self._bucket(tenant, now, active)
            bucket = buckets[tenant]
            if bucket is not None:
                bucket.level -= 1

    def wait(self, tenants: Iterable[Hashable]) -> float:
        """Seconds until the first of these held tenants may be given a token again."""
        waits = [b.wait(1) for t in set(tenants) if (b := self.buckets.get(t)) is not None]
        return max(0.001, min(waits)) if waits else 0.0
