"""The whole path with real processes: gateway (granian) + device on loopback, kill -9, reboot."""
import json
import os
import secrets
import signal
import subprocess

from pathlib import Path

import pytest

from tests.conftest import PYTHON, ROOT
from tests.harness import Stack

pytestmark = pytest.mark.e2e
BASE = "/aotx/v1/shared"


@pytest.fixture
def stack(tiny_runtime, tmp_path):
    s = Stack(tmp_path, tiny_runtime)
    yield s
    s.stop()


def envelope(participant, key=None, sequence=None):
    return {"schema": "aotx.shared.mutation.v1", "lineage": participant["lineage"],
            "operation_key": key or secrets.token_hex(16), "sequence": sequence or participant["next_sequence"]}


def test_register_kill_dash_nine_and_read_the_same_receipt(stack):
    token = stack.principal("alice")
    stack.boot_device()
    stack.serve()
    status, headers, body = stack.http("GET", f"{BASE}/capabilities", token=token)
    assert status == 200 and headers["Cache-Control"] == "no-store"
    caps = json.loads(body)
    assert caps["schemas"]["mutation"] == "aotx.shared.mutation.v1" and "shared_write" in caps["grants"]
    status, _, body = stack.http("GET", f"{BASE}/participant", token=token)
    participant = json.loads(body)
    assert status == 200 and participant["registered"] is False and participant["next_sequence"] == "1"

    request = envelope(participant)
    status, headers, receipt_bytes = stack.http("POST", f"{BASE}/participant", request, token=token)
    assert status == 202, receipt_bytes
    receipt = json.loads(receipt_bytes)
    assert headers["Location"] == f"{BASE}/operations/{receipt['operation']}"
    assert receipt["admission"]["saved"] and receipt["terminal"]["status"] == "succeeded"

    stack.device.kill()  # kill -9: no chance to flush anything
    status, _, body = stack.http("GET", f"{BASE}/participant", token=token)
    assert status == 503 and json.loads(body)["error"]["code"] == "device_unavailable"

    stack.boot_device()
    status, _, again = stack.http("GET", f"{BASE}/operations/{receipt['operation']}", token=token)
    assert status == 200 and again == receipt_bytes
    status, _, retry = stack.http("POST", f"{BASE}/participant", request, token=token)
    assert status == 200 and retry == receipt_bytes
    status, _, body = stack.http("GET", f"{BASE}/operations", token=token)
    assert [r["operation"] for r in json.loads(body)["items"]] == [receipt["operation"]]
    status, _, body = stack.http("GET", f"{BASE}/capabilities", token=token)
    assert json.loads(body)["runtime"]["boot"] == "2"


def test_the_gateway_refuses_bad_requests_before_the_device(stack):
    token = stack.principal("bob")
    stack.boot_device()
    stack.serve()
    participant = json.loads(stack.http("GET", f"{BASE}/participant", token=token)[2])
    good = envelope(participant)
    cases = [
        (None, b'{"schema": "aotx.shared.mutation.v1"', "invalid_json"),
        (None, b'\xff\xfe{}', "invalid_utf8"),
        (None, json.dumps(good)[:-1].encode() + b', "sequence": "1"}', "duplicate_key"),
        (dict(good, extra=1), None, "unknown_field"),
        (dict(good, sequence=1), None, "bad_field"),
        (dict(good, sequence="01"), None, "bad_field"),
        (dict(good, operation_key="0" * 32), None, "bad_field"),
        (dict(good, lineage="ABC"), None, "bad_field"),
        ({k: v for k, v in good.items() if k != "sequence"}, None, "missing_field"),
    ]
    for body, raw, code in cases:
        status, headers, out = stack.http("POST", f"{BASE}/participant", body, token=token, raw=raw)
        assert status == 400, (code, out)
        assert json.loads(out)["error"]["code"] == code
        assert headers["Cache-Control"] == "no-store"
    assert json.loads(stack.http("GET", f"{BASE}/participant", token=token)[2])["registered"] is False
    assert stack.http("GET", f"{BASE}/operations/op-nothex", token=token)[0] == 400

    status, headers, body = stack.http("GET", f"{BASE}/capabilities")
    assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
    assert stack.http("GET", f"{BASE}/capabilities", token="aotx_wrong")[0] == 401
    status, headers, body = stack.http("GET", "/aotx/v1/shared/nowhere", token=token)
    assert status == 404 and headers["Cache-Control"] == "no-store" and json.loads(body)["error"]["code"] == "not_found"


def test_revoking_a_grant_denies_the_next_request(stack):
    token = stack.principal("carol")
    stack.boot_device()
    stack.serve()
    assert stack.http("GET", f"{BASE}/participant", token=token)[0] == 200
    stack.manage("principal", "revoke", "carol", "--actions", "shared_read", "--config", str(stack.config))
    status, _, body = stack.http("GET", f"{BASE}/participant", token=token)
    assert status == 403 and json.loads(body)["error"]["code"] == "grant_missing"


def test_boot_refuses_a_missing_grant_file_and_a_second_device(stack, tmp_path):
    out = subprocess.run([PYTHON, "-m", "gpu_worker", "boot", "--ccir", stack.runtime, "--journal",
                          str(tmp_path / "j2"), "--service-grants", str(tmp_path / "missing.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "missing.json" in out.stderr
    stack.principal("dave")
    stack.boot_device()
    out = subprocess.run([PYTHON, "-m", "gpu_worker", "boot", "--ccir", stack.runtime, "--journal",
                          str(stack.journal), "--service-grants", str(stack.grants)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    # the runtime file's lock refuses it first (the journal's: tests/gpu_worker/test_device.py)
    assert out.returncode == 3 and len(out.stderr.strip().splitlines()) == 1
    assert f"runtime file {stack.runtime} is in use by another process (pid {stack.device.proc.pid}" in out.stderr


def test_tick_cpu_gives_the_tick_loop_a_cpu_of_its_own(stack):
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs two CPUs")
    tick_cpu = min(allowed)
    token = stack.principal("frank")
    device = stack.boot_device("--tick-cpu", str(tick_cpu))
    assert f"tick loop on CPU {tick_cpu}" in device.output()
    pid = device.proc.pid
    threads = {int(tid): (Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip(), os.sched_getaffinity(int(tid)))
               for tid in os.listdir(f"/proc/{pid}/task")}
    assert threads.pop(pid)[1] == {tick_cpu}  # the tick loop (the main thread) alone on its CPU
    names = {name for name, _ in threads.values()}
    assert {"aotx-tick-io", "aotx-sockets"} <= names
    assert all(cpus == allowed - {tick_cpu} for _, cpus in threads.values()), threads
    stack.serve()  # and the pinned device serves a mutation to its saved receipt
    participant = json.loads(stack.http("GET", f"{BASE}/participant", token=token)[2])
    status, _, body = stack.http("POST", f"{BASE}/participant", envelope(participant), token=token)
    assert status == 202 and json.loads(body)["admission"]["saved"]


def _threads(pid):
    """{thread id: (name, nice)} of a process (/proc/PID/task/TID/stat: field 19 is the nice value)."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        found[int(tid)] = (name, int(stat[stat.rindex(")") + 2:].split()[16]))
    return found


def _one_chat(stack, token):
    status, _, body = stack.http("POST", "/v1/chat/completions", {
        "model": "tiny-llama", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]}, token=token)
    assert status == 200, body


@pytest.mark.parametrize("option, nice", [((), 10), (("--background-nice", "0"), 0), (("--background-nice", "19"), 19)])
def test_the_engine_and_its_torch_workers_run_below_the_tick_loop(stack, option, nice):
    """A forward pass fills the cores: the scheduler must run the tick loop (and the gateway) first."""
    token = stack.principal("gina")
    device = stack.boot_device(*option)
    stack.serve()
    _one_chat(stack, token)  # the engine's first forward starts torch's workers from its thread
    threads = _threads(device.proc.pid)
    assert threads.pop(device.proc.pid)[1] == 0  # the tick loop
    engine = [n for name, n in threads.values() if name == "aotx-engine"]
    assert len(engine) >= min(2, len(os.sched_getaffinity(0))), threads  # the engine and torch's workers
    assert engine == [nice] * len(engine)
    assert {n for name, n in threads.values() if name in ("aotx-sockets", "aotx-tick-io")} == {0}


def test_background_nice_out_of_range_is_refused_with_one_line(stack, tmp_path):
    out = subprocess.run([PYTHON, "-m", "gpu_worker", "boot", "--ccir", stack.runtime, "--journal",
                          str(tmp_path / "j4"), "--service-grants", str(stack.grants), "--background-nice", "20"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--background-nice 20" in out.stderr and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("one_cpu, tick_cpu, message", [
    (False, "4096", "--tick-cpu 4096 is not among the CPUs"),
    (True, "{cpu}", "--tick-cpu needs at least two CPUs"),  # the process may use only that CPU
])
def test_tick_cpu_refuses_a_cpu_it_cannot_have_with_one_line(stack, tmp_path, one_cpu, tick_cpu, message):
    cpu = min(os.sched_getaffinity(0))
    out = subprocess.run([PYTHON, "-m", "gpu_worker", "boot", "--ccir", stack.runtime, "--journal",
                          str(tmp_path / "j3"), "--service-grants", str(stack.grants),
                          "--tick-cpu", tick_cpu.format(cpu=cpu)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60,
                         preexec_fn=(lambda: os.sched_setaffinity(0, {cpu})) if one_cpu else None)
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "j3").exists()  # refused before anything was made


def test_serve_refuses_a_bad_config_with_one_line(tmp_path):
    bad = tmp_path / "gateway.json"
    bad.write_text('{"listen": "nowhere"}')
    out = subprocess.run([PYTHON, "manage.py", "serve", "--config", str(bad)], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "gateway config" in out.stderr


def test_sigterm_stops_the_device_cleanly(stack):
    stack.principal("erin")
    device = stack.boot_device()
    code = device.kill(signal.SIGTERM)
    assert code == 0, device.output()[-3000:]
    assert not (stack.journal / "service.sock").exists()
