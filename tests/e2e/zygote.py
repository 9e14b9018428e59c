"""A fork server for device boots in the kill -9 test: torch is imported once here, then each
boot is a fork whose child runs the real `gpu_worker boot` entry point. The child is a real
process; SIGKILL on it is a real crash. (Importing torch takes seconds on these machines, and
the test needs more than a hundred boots.) Protocol: one JSON line in {"argv": [...], "log": path},
one line out: the child's pid. With "netns": NAME, the child enters that network namespace
(/var/run/netns/NAME, made by `ip netns add`) before it boots: a device of one "machine" of the
replication fault harness (tests/cluster.py)."""
import json
import os
import signal
import sys

import torch  # noqa: F401  -- the expensive import, done once before any fork

from gpu_worker.recovery import boot


def _enter(netns):
    """This process (one thread: a fork's child) into the network namespace `netns`."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into {netns}")
    finally:
        os.close(fd)


def main():
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped automatically
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(0)
            code = 1
            if request.get("netns"):
                _enter(request["netns"])
            try:
                code = boot.main(request["argv"])
            finally:
                sys.stdout.flush()
                os._exit(code)
        print(pid, flush=True)


if __name__ == "__main__":
    main()
