"""Over-quota refusals answered later the more often a principal gets them (the HTTP front).

A principal over one of its quotas is answered 429 `quota_exceeded` with nothing changed; a client
that retries at once, in a loop, without reading the answer's advice, keeps the gateway and the
device busy refusing it — on a small machine, at the expense of every other tenant's latency
(docs/performance.md, "Hostile neighbours": fourteen such loops beside two chats). So within a
gateway process, a principal's second refusal within a second is answered after 10 ms, the third
after 20 ms, doubling to at most 1 s; a second without a refusal starts it over. The first refusal
is never delayed, a client that backs off never waits, and the answer itself is unchanged, with
`Retry-After: 1` added. Refusals for a rate (429 `rate_limited`, shared_api/http/rates.py) count in the
same streak and wait the same way. The delay holds a coroutine and the client's connection, nothing
else.
"""
from __future__ import annotations

import time
from typing import Callable

FIRST_DELAY = 0.01   # seconds, for the second refusal in a row
MAX_DELAY = 1.0
QUIET = 1.0          # seconds without a refusal that end a principal's streak
MAX_TRACKED = 4096   # principals remembered at once (the oldest streaks are forgotten first)


class RefusalBackoff:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:  # (a clock of their own: tests)
        self.clock = clock
        self.streaks: dict[str, tuple[int, float]] = {}  # principal -> (refusals in a row, the last one's time)

    def delay(self, principal_id: str) -> float:
        """Seconds to wait before answering this principal's refusal (counted now)."""
        now = self.clock()
        count, last = self.streaks.pop(principal_id, (0, 0.0))
        count = count + 1 if now - last < QUIET else 1
        if len(self.streaks) >= MAX_TRACKED:
            del self.streaks[next(iter(self.streaks))]  # (dicts keep insertion order: the least recent)
        self.streaks[principal_id] = (count, now)
        return 0.0 if count == 1 else min(MAX_DELAY, FIRST_DELAY * 2 ** (count - 2))


def is_quota_refusal(status: int, body: bytes) -> bool:
    return status == 429 and b'"quota_exceeded"' in body
