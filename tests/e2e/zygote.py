"""A fork server for device boots in the kill -9 test: torch is imported once here, then each
boot is a fork whose child runs the real `gpu_worker boot` entry point. The child is a real
process; SIGKILL on it is a real crash. (Importing torch takes seconds on these machines, and
the test needs more than a hundred boots.) Protocol: one JSON line in {"argv": [...], "log": path},
one line out: the child's pid."""
import json
import os
import signal
import sys

import torch  # noqa: F401  -- the expensive import, done once before any fork

from gpu_worker import boot


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
            try:
                code = boot.main(request["argv"])
            finally:
                sys.stdout.flush()
                os._exit(code)
        print(pid, flush=True)


if __name__ == "__main__":
    main()
