"""Output-token pacing per tenant: the grant file's `output_tokens_per_second` (docs/grants.md, "Rates").

The quotas bound how many chats and inputs a principal runs at once, not how fast they decode: two
chats of an untrusted tenant, within their quota, keep the model busy every step, and on a small
machine every other tenant's latency goes with it (docs/performance.md, "Hostile neighbours"). A
paced tenant's running sequences join a decode step only while its bucket holds a token; each
token it is given (decoded or the first of a prefill) is taken out, into debt when several of its
sequences step together. A paused sequence keeps its pages (its reservation is its own quota's)
and goes on when the bucket refills; when every sequence with work is paused, `wait` says how long
the engine thread may sleep. Unpaced tenants (no rate, or no tenant) are never held.
"""
from __future__ import annotations

import time
from typing import Callable, Hashable, Iterable

from ..contract.rates import Bucket

RateOf = Callable[[Hashable], "float | None"]  # a tenant's output tokens per second, None: unpaced


class TokenPacer:
    def __init__(self, rate_of: RateOf | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate_of = rate_of
        self.clock = clock
        self.buckets: dict[Hashable, Bucket] = {}

    def _bucket(self, tenant: Hashable, now: float) -> Bucket | None:
        rate = None if self.rate_of is None or tenant is None else self.rate_of(tenant)
        if rate is None:
            self.buckets.pop(tenant, None)
            return None
        bucket = self.buckets.get(tenant)
        if bucket is None or bucket.rate != rate:  # (a changed grant starts the bucket over)
            bucket = self.buckets[tenant] = Bucket(float(rate), now)
        bucket.refill(now)
        return bucket

    def held(self, tenants: Iterable[Hashable]) -> set[Hashable]:
        """The tenants among `tenants` that may not be given a token now (their bucket holds less than one)."""
        if self.rate_of is None:
            return set()
        now = self.clock()
        return {t for t in set(tenants) if (b := self._bucket(t, now)) is not None and b.level < 1}

    def charge(self, tenants: Iterable[Hashable]) -> None:
        """One token given to each of `tenants` (repeated: one each time)."""
        if self.rate_of is None:
            return
        now = self.clock()
        for tenant in tenants:
            bucket = self.buckets.get(tenant) or self._bucket(tenant, now)
            if bucket is not None:
                bucket.level -= 1

    def wait(self, tenants: Iterable[Hashable]) -> float:
        """Seconds until the first of these held tenants may be given a token again."""
        waits = [b.wait(1) for t in set(tenants) if (b := self.buckets.get(t)) is not None]
        return max(0.001, min(waits)) if waits else 0.0
