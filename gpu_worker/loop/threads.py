"""The device's background threads: named for `top -H`, and at a lower CPU priority than the tick
loop.

The tick loop only admits and commits; the engine's forward passes and the helper threads' work
(tokenizing, prompt building, media writes) grow with what a tenant sends. On a machine whose cores
that work fills — a CPU device with a gateway beside it — the kernel would otherwise share the
cores out evenly, and every other client's admission and reads would wait behind one tenant's
forward pass. A nice value above the tick loop's (boot's `--background-nice`, default 10) makes
the scheduler run the tick loop (and the gateway, which is another process at nice 0) first
whenever both want a core; with the cores free it changes nothing. Linux keeps the name and the
nice value per thread and a new thread copies both from the thread that makes it, so torch's
worker threads, created by the engine thread for its first parallel operation, carry them too.
"""
from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("gpu_worker.threads")

DEFAULT_NICE = 10


def enter_background(name: str, nice: int) -> None:
    """Name the calling thread (at most 15 bytes: the kernel's limit) and raise its nice value to
    `nice` (never lower it: an unprivileged process may not, and the tick loop must stay first)."""
    tid = threading.get_native_id()
    try:
        with open(f"/proc/self/task/{tid}/comm", "w") as comm:
            comm.write(name[:15])
    except OSError:  # not Linux, or /proc not mounted: the name is only for operators
        pass
    if nice <= 0:
        return
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)  # PRIO_PROCESS with a thread id: that thread only (Linux)
        if nice > current:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as exc:
        log.warning("cannot set thread %s to nice %d: %s", name, nice, exc)
