"""Run the Procfile's processes (device, gateway, Celery) with honcho's process manager until
Ctrl-C or SIGTERM (`make run` through scripts/run_local.sh), and print the URL and the local
principal's token once the device answers a ping and the gateway listens.

    .venv/bin/python scripts/run_procfile.py --procfile Procfile --config var/gateway.json \\
        --token-file var/local_token

Why not `honcho start`: with its output in a pipe (`make run | tee log`), Ctrl-C reaches the whole
foreground job, so the reader (tee) dies with it. honcho's SIGINT handler first writes "SIGINT
received" to its stdout; the write fails with BrokenPipeError, which escapes the handler before it
has stopped anything, and honcho is left waiting, at exit, on its per-process reader processes:
those ignore SIGINT and SIGTERM and end only when their process ends, and the processes (each in a
session of its own, where the terminal's Ctrl-C never arrives) run on. Every later signal fails
the same way, so nothing stops. Here honcho's Printer writes through `PipeSafeOutput`, which drops
the output once its reader is gone instead of raising: the signal then always stops every process
(SIGTERM to each process, the device last; SIGKILL to a process group still running STOP_SECONDS
after its SIGTERM: _Manager says why). A stop asked for that ends every process cleanly exits 0, as
a clean stop should (honcho exits 130 after Ctrl-C, which `make run` reported as `Error 130`).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # gpu_worker.contract, for the device ping

from honcho.environ import expand_processes, parse_procfile  # noqa: E402
from honcho.manager import Manager  # noqa: E402
from honcho.printer import Printer  # noqa: E402

POLL_SECONDS = 0.2
STOP_SECONDS = 10.0  # from a process's SIGTERM to SIGKILL to its process group (_Manager)
STOP_POLL_SECONDS = 0.05
CLEAN_STOP = (0, -signal.SIGTERM)  # a process's status after a clean stop: its own exit, or the signal's


class PipeSafeOutput:
    """A text stream for honcho's Printer (and the banner) that survives its reader: once a write
    or flush fails with EPIPE (or any other OSError), output is dropped from then on, and the
    descriptor is pointed at /dev/null so that nothing flushed later (at exit) fails either."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.broken = False
        self._lock = threading.Lock()  # the manager's loop and the banner thread both write

    def _drop(self) -> None:
        self.broken = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass

    def write(self, text: str) -> int:
        with self._lock:
            if not self.broken:
                try:
                    self.stream.write(text)
                except OSError:
                    self._drop()
        return len(text)

    def flush(self) -> None:
        with self._lock:
            if not self.broken:
                try:
                    self.stream.flush()
                except OSError:
                    self._drop()

    def isatty(self) -> bool:
        return not self.broken and self.stream.isatty()

    def say(self, text: str) -> None:
        self.write(text if text.endswith("\n") else text + "\n")
        self.flush()


def device_answers(socket_path: str) -> bool:
    from gpu_worker.contract.client import Connection
    try:
        with Connection(socket_path, connect_timeout=1, timeout=5) as connection:
            return connection.call("ping", None).status == 200
    except (OSError, ValueError):
        return False


def gateway_listens(listen: str) -> bool:
    try:  # the admin's login page: public, and an answer logs no warning
        urllib.request.urlopen(f"http://{listen}/admin/login/", timeout=2).close()
    except urllib.error.HTTPError:  # any answer: it serves
        return True
    except OSError:
        return False
    return True


def banner(listen: str, token: str, token_file: str) -> str:
    return (f"\n  AOTX Shared (embedded default) is ready\n"
            f"  API:    http://{listen}/aotx/v1/shared/\n"
            f"  Admin:  http://{listen}/admin/  (user admin; new password: "
            f".venv/bin/python manage.py changepassword admin)\n"
            f"  Token for principal \"local\" (kept in {token_file}, the same at every start):\n"
            f"  export TOKEN={token}\n"
            f"  curl -H \"Authorization: Bearer $TOKEN\" http://{listen}/aotx/v1/shared/capabilities\n")


def announce(out: PipeSafeOutput, config_path: str, token_file: str) -> None:
    """Wait for the device (a ping on its socket) and the gateway (an HTTP answer), then print
    the banner with the token. Runs on a daemon thread: it ends with the manager."""
    config: dict[str, Any] = json.loads(Path(config_path).read_text())
    listen, socket_path = config["listen"], config["socket"]
    out.say(f"run: waiting for the device ({socket_path}) and the gateway (http://{listen}) to answer")
    while not (device_answers(socket_path) and gateway_listens(listen)):
        time.sleep(POLL_SECONDS)
    token = Path(token_file).read_text(encoding="ascii").strip()
    out.say(banner(listen, token, token_file))


class _Manager(Manager):
    """honcho's Manager, which starts the thread `after_start` once it has started the processes (its
    multiprocessing forks come first, so no thread of ours is running when they happen), and stops
    them its own way, in a thread of its own (`_stop_in_order`):

    - SIGTERM goes to each process itself, not to its process group: a program stops its own
      children (granian its workers, Celery its pool and its beat, which, signalled directly, died
      under a running worker that logged it as an ERROR). Each Procfile line `exec`s its program so
      that the process honcho started is the program, not a shell in front of it.
    - In order: the first process of the Procfile (the device) is the one the others are clients of,
      so it stops last, once they have ended: a Celery task or a request in flight at the stop still
      finds the device up, and nothing logs that it went away.
    - Bounded: a stage's process groups still running STOP_SECONDS after its SIGTERM get SIGKILL
      (honcho alone sends SIGKILL only to the processes it counts as running, KILL_WAIT seconds after
      a first one has stopped: a stop where none ends on SIGTERM, or where a process's children
      outlive it in its group, never ended). Celery's warm shutdown on its filesystem broker takes
      a few seconds (its loop notices the signal between 2 s broker polls, then joins its threads):
      the bound leaves it room.

    `exit_status` is 0 after a stop that was asked for (SIGINT, SIGTERM, SIGHUP) when every process
    ended cleanly; otherwise non-zero, as honcho says (a process that ended by itself: its status)."""

    def __init__(self, printer: Printer, after_start: threading.Thread) -> None:
        super().__init__(printer)
        self._after_start = after_start
        self.stop_requested = False
        self.killed: list[str] = []  # processes whose group had to be killed

    def _start(self) -> None:
        super()._start()
        # loop() has installed honcho's SIGINT and SIGTERM handlers: note that a stop was asked for
        for sig in (signal.SIGINT, signal.SIGTERM):
            honchos = signal.getsignal(sig)

            def asked(signum: int, frame: Any, honchos: Any = honchos) -> None:
                self.stop_requested = True
                honchos(signum, frame)
            signal.signal(sig, asked)
        self._after_start.start()

    def terminate(self) -> None:
        """Stop every process (a signal, or one process ended): in order, in a thread (waits)."""
        if self._terminating:
            return
        self._terminating = True
        threading.Thread(target=self._stop_in_order, name="stop", daemon=True).start()

    def kill(self) -> None:
        """honcho's loop calls this KILL_WAIT seconds after a first process stopped: the bound is
        `_stop_in_order`'s instead."""

    def _stop_in_order(self) -> None:
        names = list(self._processes)
        for stage in (names[1:], names[:1]):  # the clients, then the first process (the device)
            signalled: set[str] = set()
            deadline = time.monotonic() + STOP_SECONDS
            while True:
                running = [name for name in stage if "returncode" not in self._processes[name]]
                for name in running:
                    pid = self._processes[name].get("pid")
                    if pid and name not in signalled:  # (a process that has not started yet: once it has)
                        signalled.add(name)
                        self._system_print(f"sending SIGTERM to {name} (pid {pid})\n")
                        try:
                            os.kill(pid, signal.SIGTERM)
                        except ProcessLookupError:
                            pass
                if not running:
                    break
                if time.monotonic() >= deadline:
                    for name in running:
                        self._kill_group(name)
                    break
                time.sleep(STOP_POLL_SECONDS)

    def _kill_group(self, name: str) -> None:
        pid = self._processes[name].get("pid")
        self._system_print(f"{name} did not stop within {STOP_SECONDS:g}s of its SIGTERM: sending SIGKILL to its "
                           f"process group (pid {pid})\n")
        self.killed.append(name)
        if pid:
            try:
                os.killpg(pid, signal.SIGKILL)  # (each process leads a session, and so a group, of its own)
            except OSError:
                pass  # already gone

    def exit_status(self) -> int:
        """0 after an asked-for stop where every process ended with status 0 (or by the SIGTERM it was
        sent) and none had to be killed; 1 when one did not stop cleanly (a line names it); after a
        process ended by itself, honcho's status (the first one to end: its exit status)."""
        if not self.stop_requested:
            return int(self.returncode or 0)
        unclean = [f"{name} (rc={p.get('returncode')})" for name, p in self._processes.items()
                   if name in self.killed or p.get("returncode") not in CLEAN_STOP]
        if unclean:
            self._system_print(f"did not stop cleanly: {', '.join(unclean)}\n")
            return 1
        return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scripts/run_procfile.py")
    parser.add_argument("--procfile", default=str(ROOT / "Procfile"))
    parser.add_argument("--config", required=True, help="gateway.json: the device socket and the listen address")
    parser.add_argument("--token-file", required=True, help="the local principal's token (manage.py local_setup)")
    args = parser.parse_args(argv)
    out = PipeSafeOutput(sys.stdout)
    announcer = threading.Thread(target=announce, args=(out, args.config, args.token_file), daemon=True)
    manager = _Manager(Printer(out), announcer)
    procfile = parse_procfile(Path(args.procfile).read_text())
    for process in expand_processes(procfile.processes):
        manager.add_process(process.name, process.cmd, quiet=process.quiet, env={**os.environ, **process.env})
    # A closed terminal stops everything too (honcho itself handles SIGINT and SIGTERM only).
    signal.signal(signal.SIGHUP, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    manager.loop()
    return manager.exit_status()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
