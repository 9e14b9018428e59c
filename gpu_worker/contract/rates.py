"""The bucket behind the grant file's rates (docs/grants.md, "Rates"), shared by the gateway (requests
and body bytes, shared_api/http/rates.py) and the engine (output tokens, gpu_worker/engine/pacing.py).

A bucket refills at its rate and holds one second's worth. Whoever uses it takes costs out after a
check of their own, and may take it into debt (a cost larger than what is left): the average over
time stays within the rate whatever the sizes, and debt is waited out before the next pass."""
from __future__ import annotations

from typing import NamedTuple

# A principal stays counted among the active ones this long after its last request (the gateway's
# rates) or engine work (gpu_worker/engine/shares.py): the defaults that bind under contention only
# bind while another principal is active (docs/grants.md, "Shares under contention").
ACTIVE_SECONDS = 2.0


class Pace(NamedTuple):
    """A principal's output-token rate as the engine applies it (engine/pacing.py)."""
    rate: float    # output tokens per second
    always: bool   # True: the grant file sets it (binds always); False: the default, which binds
    #                only while another principal is active (engine/shares.py)


class Bucket:
    __slots__ = ("rate", "level", "at")

    def __init__(self, rate: float, now: float) -> None:
        self.rate = rate
        self.level = rate  # full: one second's worth
        self.at = now

    def refill(self, now: float) -> float:
        """The level now (refilled for the time since the last look)."""
        self.level = min(self.rate, self.level + (now - self.at) * self.rate)
        self.at = now
        return self.level

    def wait(self, level: float) -> float:
        """Seconds from the last refill until the bucket holds `level` (0 when it does)."""
        return max(0.0, (level - self.level) / self.rate)
