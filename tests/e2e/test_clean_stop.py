"""A clean stop of `make run` (scripts/run_local.sh, scripts/run_procfile.py) is quiet and exits 0:
Ctrl-C stops Celery and the gateway, then the device (the one they are clients of), each by a
SIGTERM to the process itself; nothing logs an error (Celery used to be SIGKILLed after 5 s with its
pool process's death logged as an ERROR, and make said `Error 130`), and Celery's first scheduled
runs wait for the device instead of logging that they skipped. A stop where a process had to be
killed is not clean: it exits non-zero and names it."""
import json
import os
import re
import signal
import sqlite3
import subprocess

import pytest

from tests.conftest import PYTHON, ROOT, free_port, wait_for
from tests.e2e.test_make_run import local, process_groups, read, start  # noqa: F401 (local: the fixture)

pytestmark = pytest.mark.e2e
ALARMING = re.compile(r"ERROR|Traceback|Error [0-9]|skipped")


def running_in(pgids):
    """Processes of these process groups that still run (a zombie has ended: where no init reaps
    orphans, as in some containers, Celery's beat process lingers as one)."""
    running = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) in pgids and fields[0] != "Z":
                running.append(int(entry))
    return running


def capacity_samples(var):
    """Capacity samples Celery has stored (the gateway's SQLite database, read only)."""
    with sqlite3.connect(f"file:{var / 'gateway.sqlite3'}?mode=ro", uri=True, timeout=10) as db:
        return db.execute("SELECT COUNT(*) FROM shared_api_capacitysample").fetchone()[0]


def test_ctrl_c_stops_make_run_cleanly_with_status_0_and_no_error_line(local):
    var, env, config, started = local
    # beat's tasks come due a second after it starts, while the device is still booting: they
    # wait for it (before: "hold detection skipped: the device did not answer its ping")
    env.update(AOTX_SAMPLE_INTERVAL="1", AOTX_HOLD_CHECK_INTERVAL="1")
    log = var.parent / "run.log"
    shell, _, groups = start(env, log, started, through_tee=False)
    wait_for(lambda: capacity_samples(var) >= 2, 120, what="Celery's capacity samples")
    os.killpg(shell.pid, signal.SIGINT)  # the terminal's Ctrl-C: the launcher's whole process group
    assert shell.wait(60) == 0, read(log)[-3000:]
    assert running_in(set(groups.values())) == []
    text = read(log)
    assert [line for line in text.splitlines() if ALARMING.search(line)] == []
    for name in ("device", "gateway", "celery"):
        assert f"{name}.1 stopped (rc=0)" in text, text[-3000:]
    # the device, whose clients the others are, is asked to stop once they have ended
    assert text.index("sending SIGTERM to device.1") > max(text.index("celery.1 stopped"),
                                                             text.index("gateway.1 stopped"))


def launch(tmp_path, procfile):
    """scripts/run_procfile.py on a Procfile of stubs (no device: its banner never comes)."""
    (tmp_path / "Procfile").write_text(procfile)
    (tmp_path / "gateway.json").write_text(json.dumps({"listen": f"127.0.0.1:{free_port()}",
                                                       "socket": str(tmp_path / "none.sock")}))
    (tmp_path / "token").write_text("aotx_x\n")
    log = tmp_path / "run.log"
    with open(log, "wb") as out:
        launcher = subprocess.Popen([PYTHON, "scripts/run_procfile.py", "--procfile", str(tmp_path / "Procfile"),
                                     "--config", str(tmp_path / "gateway.json"), "--token-file",
                                     str(tmp_path / "token")], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    return launcher, log


def stub(name, on_sigterm):
    """A Procfile process that says when its SIGTERM handler is set, then waits for signals."""
    return (f"{name}: exec {PYTHON} -c 'import signal, sys; signal.signal(signal.SIGTERM, {on_sigterm}); "
            f"print(\"{name} ready\", flush=True); [signal.pause() for _ in iter(int, 1)]'\n")


def end(launcher, log):
    """Whatever a failing test leaves: the launcher's group and each process's."""
    for pgid in [launcher.pid, *process_groups(read(log)).values()]:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


CLEAN = "lambda *_: sys.exit(0)"
STUBBORN = "signal.SIG_IGN"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_asked_for_exits_0_when_every_process_ends_cleanly_and_stops_the_first_last(tmp_path, sig):
    launcher, log = launch(tmp_path, stub("first", CLEAN) + stub("second", CLEAN) + stub("third", CLEAN))
    try:
        wait_for(lambda: all(f"{n} ready" in read(log) for n in ("first", "second", "third")), 60,
                 what="the three processes ready")
        launcher.send_signal(sig)
        assert launcher.wait(60) == 0, read(log)
        text = read(log)
        assert [line for line in text.splitlines() if ALARMING.search(line)] == []
        assert text.index("sending SIGTERM to first.1") > max(text.index("second.1 stopped (rc=0)"),
                                                                text.index("third.1 stopped (rc=0)"))
        assert "first.1 stopped (rc=0)" in text
    finally:
        end(launcher, log)


def test_a_process_that_has_to_be_killed_makes_the_stop_unclean(tmp_path):
    launcher, log = launch(tmp_path, stub("first", CLEAN) + stub("second", STUBBORN))
    try:
        wait_for(lambda: all(f"{n} ready" in read(log) for n in ("first", "second")), 60,
                 what="both processes ready")
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(60) == 1, read(log)
        text = read(log)
        assert "second.1 did not stop within" in text and "first.1 stopped (rc=0)" in text
        assert re.search(r"did not stop cleanly: second\.1 \(rc=-9\)$", text, re.M), text
    finally:
        end(launcher, log)
