"""The ops tasks as production runs them: a real `celery -A aotx_site worker -B` on Redis (broker
and result backend, REDIS_URL) against a real device. Beat's samples land in the gateway
database; checkpoint, hold detection and audit export called through Redis (send_task, results
read back from Redis) do what their device commands do, and the export verifies against the
runtime file and journal (`manage.py verify_audit`, which runs `python -m gpu_worker audit
verify`) — a tampered copy does not."""
import json
import shutil
import sqlite3
import subprocess

import pytest
from celery import Celery

from tests.conftest import PYTHON, wait_for
from tests.e2e.test_streams import mutate
from tests.e2e.test_streams_redis import redis_up
from tests.harness import Process, Stack

pytestmark = pytest.mark.e2e
DB = 13  # a Redis database of its own: nothing else on this Redis is touched
REDIS_URL = f"redis://127.0.0.1:6379/{DB}"


@pytest.fixture(scope="module")
def ops_stack(tiny_runtime, tmp_path_factory):
    if not redis_up():
        pytest.fail("redis-server is not running on 127.0.0.1:6379 (.ci/run starts it); these tests need a real Redis")
    subprocess.run(["redis-cli", "-n", str(DB), "FLUSHDB"], check=True, capture_output=True)
    base = tmp_path_factory.mktemp("ops-celery")
    runtime = base / "ops.aotxccir"
    shutil.copy(tiny_runtime, runtime)  # checkpoints write to it: not the session's shared file
    stack = Stack(base, str(runtime))
    stack.env.update(REDIS_URL=REDIS_URL, AOTX_SAMPLE_INTERVAL="1", AOTX_HOLD_CHECK_INTERVAL="1",
                     AOTX_CHECKPOINT_INTERVAL="86400", AOTX_AUDIT_EXPORT_INTERVAL="86400")
    stack.token = stack.principal("ops")
    stack.boot_device()
    stack.serve()
    mutate(stack, stack.token, "/participant", {})
    worker = Process([PYTHON, "-m", "celery", "-A", "aotx_site", "worker", "-B", "--pool", "solo",
                      "--loglevel", "INFO", "--without-gossip", "--without-mingle",
                      "--schedule", str(base / "celerybeat-schedule"), "--hostname", f"ops-test-{base.name}@%h"],
                     stack.env, base / "celery.log", ready_line=" ready.")
    stack.celery = Celery("ops-test", broker=REDIS_URL, backend=REDIS_URL)
    try:
        yield stack
    finally:
        worker.kill()
        stack.celery.close()
        stack.stop()
        subprocess.run(["redis-cli", "-n", str(DB), "FLUSHDB"], capture_output=True)


def rows(stack, sql):
    with sqlite3.connect(stack.base / "gateway.sqlite3") as db:
        return db.execute(sql).fetchall()


def run(stack, task):
    """A task sent through Redis to the worker, its result read back from Redis."""
    return stack.celery.send_task(f"shared_api.tasks.{task}").get(timeout=120)


def test_beat_samples_the_device_into_the_database_through_redis(ops_stack):
    wait_for(lambda: len(rows(ops_stack, "SELECT id FROM shared_api_capacitysample")) >= 2, 60,
             what="two capacity samples from beat")
    usage, capacities, journal_bytes = rows(ops_stack, "SELECT usage, capacities, journal_bytes FROM "
                                                       "shared_api_capacitysample ORDER BY taken_at DESC")[0]
    assert json.loads(usage)["participants"] == 1 and json.loads(capacities)["receipts"] > 0
    assert journal_bytes > 0


def test_a_sample_requested_through_redis_is_stored(ops_stack):
    result = run(ops_stack, "sample_capacity")
    assert rows(ops_stack, f"SELECT boot FROM shared_api_capacitysample WHERE id = {result['sample']}") == [(1,)]


def test_hold_detection_through_redis_finds_no_hold_on_a_healthy_device(ops_stack):
    assert run(ops_stack, "detect_holds") == {"new": [], "hold": False, "cause": None}


def test_a_checkpoint_then_an_audit_export_through_redis_verifies(ops_stack):
    mutate(ops_stack, ops_stack.token, "/spaces", {})
    folded = run(ops_stack, "checkpoint")
    assert folded["folded"] >= 1
    mutate(ops_stack, ops_stack.token, "/spaces", {})  # in the journal, after the checkpoint
    export = run(ops_stack, "export_audit")
    assert export["transfers"] >= 4 and export["path"].startswith(str(ops_stack.base / "var" / "audit"))
    lines = open(export["path"]).read().splitlines()
    assert len(lines) == export["transfers"] and json.loads(lines[-1])["seq"] == export["last_seq"]

    ok = ops_stack.manage("verify_audit", "--export", export["path"], "--ccir", ops_stack.runtime, check=False)
    assert ok.returncode == 0, ok.stderr
    latest = ops_stack.manage("verify_audit", "--ccir", ops_stack.runtime, check=False)  # the newest export
    assert latest.returncode == 0 and export["path"] in latest.stdout, latest.stderr
    fresh = ops_stack.manage("verify_audit", "--new", "--ccir", ops_stack.runtime, check=False)  # export, then verify
    assert fresh.returncode == 0 and "audit export:" in fresh.stdout, fresh.stderr

    tampered = ops_stack.base / "tampered.jsonl"
    row = json.loads(lines[1])
    row["payload"] = row["payload"][:-4] + ("AAAA" if not row["payload"].endswith("AAAA") else "BBBB")
    tampered.write_text("\n".join([lines[0], json.dumps(row), *lines[2:]]) + "\n")
    bad = ops_stack.manage("verify_audit", "--export", str(tampered), "--ccir", ops_stack.runtime, check=False)
    assert bad.returncode == 1 and "hash chain" in bad.stderr, (bad.stdout, bad.stderr)
