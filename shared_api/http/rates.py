"""Per-principal rates (docs/grants.md): how fast one principal may send, checked by the HTTP front
from a request's headers, after its token and before its body is read.

The quotas bound what a principal holds at the device; they cannot bound how fast it asks. A
tenant that sends 1 MB prompts or 8 MiB uploads in a loop, each refused or admitted in turn,
spends the gateway's and the device's CPU on reading, hashing and parsing bytes, and on a small
machine every other tenant's latency goes with it (docs/performance.md, "Hostile neighbours").
So a principal's grant may set

  requests_per_second    requests (every shared and /v1 route)
  body_bytes_per_second  request body bytes (Content-Length, or what a chunked body turned out to be)

(the third rate, `output_tokens_per_second`, is the engine's: gpu_worker/engine/pacing.py);
one its grant leaves out has the default (DEFAULT_RATES, gpu_worker/contract/vocabulary.py), one
set to null none (auth.effective_rates). Each is a bucket that refills at its rate and holds one second's worth. A request passes when every
bucket of its principal holds its cost (one request, its body's bytes), or is full where the cost
is more than a second's worth, and then takes its cost out — into debt in that case: an 8 MiB
upload under a 2 MiB/s rate passes once the bucket is full, and the next request waits until the
debt is paid. Whatever the sizes, a principal's average stays within its rate, and no body is
refused for being larger than a second's worth. A request that does not pass is refused (429
`rate_limited`, naming the rate, with when it would pass) and changes nothing: no bucket is
charged, the body is not read.

A rate the grant file sets binds always. A default rate binds only under contention (docs/grants.md,
"Shares under contention"): while no other principal has sent a request to this process within
ACTIVE_SECONDS, a principal at its default is not limited (and its bucket is dropped, so it is full
the moment another principal arrives).

Each gateway process holds its own buckets and allows 1/workers of each rate (gateway.json
"workers"; a principal's connections spread over the processes), so the gateway as a whole
stays within the rate. Buckets of principals unseen for a while are forgotten (a full bucket is
the same as none).
"""
from __future__ import annotations

import math
import time
from typing import Callable

from django.conf import settings

from gpu_worker.contract.errors import ServiceError
from gpu_worker.contract.rates import ACTIVE_SECONDS, Bucket

REQUESTS = "requests_per_second"
BODY_BYTES = "body_bytes_per_second"
MAX_TRACKED = 4096  # principals' buckets held at once (the least recently used go first)


class RateLimited(ServiceError):
    """429 `rate_limited`, knowing whose (the refusal backoff counts it for that principal)."""

    def __init__(self, principal_id: str, name: str, limit: int, wait: float) -> None:
        super().__init__(429, "rate_limited", f"this principal's {name} is {limit}; the next request can pass in "
                                              f"{wait:.3f}s", quota=name, limit=str(limit), retry_after=f"{wait:.3f}")
        self.principal_id = principal_id


class RateLimiter:
    def __init__(self, share: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.share = share  # this process's part of each rate (1 / the gateway's processes)
        self.clock = clock
        self.buckets: dict[tuple[str, str], Bucket] = {}
        self.seen: dict[str, float] = {}  # principal -> its last request, the most recent last

    def _bucket(self, principal_id: str, name: str, limit: int, now: float) -> Bucket:
        key = (principal_id, name)
        rate = limit * self.share
        bucket = self.buckets.pop(key, None)
        if bucket is None or bucket.rate != rate:  # (a changed grant starts the bucket over)
            bucket = Bucket(rate, now)
        if len(self.buckets) >= MAX_TRACKED:
            del self.buckets[next(iter(self.buckets))]  # (dicts keep insertion order: the least recent)
        self.buckets[key] = bucket
        return bucket

    def _alone(self, principal_id: str, now: float) -> bool:
        """Note the principal's request; whether no other principal sent one within ACTIVE_SECONDS
        (the entries are kept in order of their last request: the one before this principal's is
        the most recent other)."""
        seen = self.seen
        seen.pop(principal_id, None)
        if len(seen) >= MAX_TRACKED:
            del seen[next(iter(seen))]
        other = next(reversed(seen.values()), None)
        seen[principal_id] = now
        return other is None or other < now - ACTIVE_SECONDS

    def admit(self, principal_id: str, rates: dict[str, int], body_bytes: int,
              shared: frozenset[str] = frozenset()) -> None:
        """Take one request and `body_bytes` from the principal's buckets, or refuse (429
        `rate_limited`) with nothing taken. `rates`: the principal's {name: limit per second};
        `shared`: those at their default, which bind only while another principal is active."""
        now = self.clock()
        alone = self._alone(principal_id, now)
        if not rates:
            return
        if alone and shared:
            for name in shared:
                self.buckets.pop((principal_id, name), None)
            rates = {name: limit for name, limit in rates.items() if name not in shared}
            if not rates:
                return
        costs = ((REQUESTS, 1), (BODY_BYTES, body_bytes))
        buckets = [(name, self._bucket(principal_id, name, rates[name], now), cost)
                   for name, cost in costs if name in rates]
        for name, bucket, cost in buckets:
            bucket.refill(now)
            wait = bucket.wait(min(cost, bucket.rate))
            if wait > 0:
                raise RateLimited(principal_id, name, rates[name], max(0.001, wait))
        for _, bucket, cost in buckets:
            bucket.level -= cost

    def charge(self, principal_id: str, rates: dict[str, int], body_bytes: int,
               shared: frozenset[str] = frozenset()) -> None:
        """Take body bytes that were not declared before the body was read (a chunked body); a
        default rate only while another principal is active, as `admit`."""
        if BODY_BYTES in shared and (principal_id, BODY_BYTES) not in self.buckets:
            return  # (admit dropped it: this principal was alone)
        if body_bytes > 0 and BODY_BYTES in rates:
            now = self.clock()
            bucket = self._bucket(principal_id, BODY_BYTES, rates[BODY_BYTES], now)
            bucket.refill(now)
            bucket.level -= body_bytes


_limiter: RateLimiter | None = None


def limiter() -> RateLimiter:
    """This process's buckets (the HTTP front's routes and the event streams share them)."""
    global _limiter
    if _limiter is None:
        _limiter = RateLimiter(1 / settings.AOTX_GATEWAY_WORKERS)
    return _limiter


def retry_headers(err: ServiceError) -> list[tuple[str, str]]:
    """Retry-After (whole seconds, at least 1, as HTTP has it) and Retry-After-Ms (what OpenAI's
    SDKs read first) of a `rate_limited` refusal."""
    wait = float(str(err.details["retry_after"]))  # (RateLimited writes it as a decimal string)
    return [("retry-after", str(max(1, math.ceil(wait)))), ("retry-after-ms", str(max(1, math.ceil(wait * 1000))))]
