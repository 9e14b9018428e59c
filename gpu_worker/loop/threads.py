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

The CPU affinity is copied the same way. With `--tick-cpu` the tick loop has a CPU of its own, so
a background thread the tick loop starts (an off-tick job, and the processes it runs: a
checkpoint's fold) would otherwise share that CPU with it: `enter_background` moves the calling
thread to the other CPUs (`keep_off_the_tick_cpu`, set by boot).
"""
from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("gpu_worker.threads")

DEFAULT_NICE = 10

_other_cpus: set[int] = set()  # --tick-cpu: the CPUs every background thread keeps to (empty: any)


def keep_off_the_tick_cpu(cpus: set[int]) -> None:
    """Boot's --tick-cpu: background threads keep to `cpus` (all but the tick loop's)."""
    _other_cpus.clear()
    _other_cpus.update(cpus)


def enter_background(name: str, nice: int) -> None:
    """Name the calling thread (at most 15 bytes: the kernel's limit) and raise its nice value to
    `nice` (never lower it: an unprivileged process may not, and the tick loop must stay first);
    with --tick-cpu, move it off the tick loop's CPU (a thread the tick loop starts inherits it)."""
    tid = threading.get_native_id()
    if _other_cpus:
        os.sched_setaffinity(0, _other_cpus)  # 0: the calling thread (Linux: affinity is per thread)
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
