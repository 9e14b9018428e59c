"""A supervisor restart loop recovers a killed device with no operator step (docs/checkpoint.md,
"Restart and restore"): the device is killed with SIGKILL several times, and each time the
supervisor runs the very same command line again — no grant file rewrite, nothing else — and
the device serves again; every receipt saved before a kill reads back byte for byte through the
gateway afterwards."""
import json
import os
import signal
import subprocess
import threading

import pytest

from gpu_worker.pack import pack_tiny
from tests.conftest import PYTHON, ROOT, wait_for
from tests.harness import Stack

pytestmark = pytest.mark.e2e
BASE = "/aotx/v1/shared"
KILLS = 5


class Supervisor(threading.Thread):
    """systemd's Restart=always, reduced to its core: run the command; when it exits, run it
    again. A device that exits by itself (a refused boot) ends the loop instead of spinning, and
    the test fails on its exit code."""

    def __init__(self, argv, env, log_path):
        super().__init__(daemon=True)
        self.argv, self.env, self.log_path = argv, env, log_path
        self.runs = []  # every process started, in order
        self.exits = []  # their exit codes, in order
        self.stopping = threading.Event()

    def run(self):
        while not self.stopping.is_set():
            with open(self.log_path, "ab") as log:
                proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
            self.runs.append(proc)
            self.exits.append(proc.wait())
            if self.exits[-1] != -signal.SIGKILL:
                break

    def kill_current(self):
        proc = self.runs[-1]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)

    def stop(self):
        self.stopping.set()
        if self.runs and self.runs[-1].poll() is None:
            self.kill_current()
        self.join(60)


def without_save_place(raw):
    """A receipt without the save fields a checkpoint changes (source, generation); the commit
    digests stay."""
    receipt = json.loads(raw)
    for part in ("admission", "terminal"):
        for key in ("source", "generation"):
            (receipt[part].get("save") or {}).pop(key, None)
    return receipt


@pytest.fixture
def stack(tmp_path):
    runtime = tmp_path / "own.aotxccir"  # checkpointed into below: its own file
    pack_tiny(str(runtime), shared=True)
    s = Stack(tmp_path, str(runtime))
    yield s
    s.stop()


def test_a_supervisor_restart_loop_recovers_a_killed_device_with_the_same_command_line(stack):
    token = stack.principal("alice")  # the one grant file write of this test
    grants_written = os.stat(stack.grants).st_mtime_ns
    argv = [PYTHON, "-m", "gpu_worker", "boot", "--ccir", stack.runtime, "--journal", str(stack.journal),
            "--service-grants", str(stack.grants), "--device", "cpu"]
    supervisor = Supervisor(argv, stack.env, stack.base / "device.log")
    supervisor.start()
    try:
        stack.serve()
        lineage = None
        saved = {}  # operation id -> receipt bytes answered 202

        def serving_boot(boot):
            if supervisor.exits and supervisor.exits[-1] != -signal.SIGKILL:
                raise AssertionError(f"the device exited {supervisor.exits[-1]}: "
                                     f"{(stack.base / 'device.log').read_text()[-2000:]}")
            status, _, body = stack.http("GET", f"{BASE}/capabilities", token=token)
            return status == 200 and json.loads(body)["runtime"]["boot"] == str(boot)

        for kill in range(1, KILLS + 1):
            wait_for(lambda: serving_boot(kill), 120, what=f"the device serving boot {kill}")
            if lineage is None:
                lineage = json.loads(stack.http("GET", f"{BASE}/participant", token=token)[2])["lineage"]
            sequence = len(saved) + 1
            path, fields = ("/participant", {}) if sequence == 1 else ("/spaces", {"scope": "room"})
            body = {"schema": "aotx.shared.mutation.v1", "lineage": lineage, "operation_key": f"{sequence:032x}",
                    "sequence": str(sequence), **fields}
            status, _, receipt = stack.http("POST", BASE + path, body, token=token)
            assert status == 202, receipt
            saved[json.loads(receipt)["operation"]] = receipt
            if kill == 3:  # one restart right after a checkpoint trimmed the journal
                out = subprocess.run([PYTHON, "-m", "gpu_worker", "checkpoint", "--ccir", stack.runtime,
                                      "--journal", str(stack.journal)], cwd=ROOT, capture_output=True, text=True,
                                     timeout=120)
                assert out.returncode == 0 and "running device" in out.stdout, out.stderr
            supervisor.kill_current()  # kill -9; the supervisor runs the same command again
        wait_for(lambda: serving_boot(KILLS + 1), 120, what="the device serving after the last kill")
        for n, (operation, receipt) in enumerate(saved.items(), 1):
            status, _, again = stack.http("GET", f"{BASE}/operations/{operation}", token=token)
            assert status == 200
            if n > 3:  # saved after the checkpoint: byte for byte
                assert again == receipt
            else:  # folded by it: the same receipt, its save now in the file (docs/checkpoint.md)
                assert without_save_place(again) == without_save_place(receipt)
                assert json.loads(again)["admission"]["save"]["source"] == "file"
        assert supervisor.exits == [-signal.SIGKILL] * KILLS
        assert os.stat(stack.grants).st_mtime_ns == grants_written  # no step between the runs
    finally:
        supervisor.stop()
