"""The ops commands of the local socket (no principal): the receipt browser's reads, the status
the gateway's metrics and health check read, and the audit export and its verification."""
import base64
import collections
import json
import subprocess

import pytest

from gpu_worker.pack import pack_tiny
from tests.conftest import PYTHON, ROOT
from tests.gpu_worker.kinds.test_inputs import EngineWorld, slow_engine


@pytest.fixture
def world(tmp_path):
    path = str(tmp_path / "engine.aotxccir")
    pack_tiny(path, shared=True, runtime_profile={"kv_pages": 64, "page_grant": 16, "deadline_ms": 60000})
    w = EngineWorld(path, tmp_path, ["a", "b"])
    yield w
    if w.device.runner is not None:
        w.device.runner.stop()
    w.device.close()


def ops(world, op, **args):
    inbox = collections.deque([("ops", {"v": 1, "id": next(world.ids), "op": op, "principal": None, "args": args})])
    replies = world.device.committer.run_sync(inbox) + world.device.take_outbox()
    [(_, msg)] = replies
    return msg.status, json.loads(msg.body)


def test_the_receipt_browser_filters_by_participant_kind_status_and_save_state(world):
    _, conversation = world.conversation("a")
    done = world.say("a", conversation, "finish", max_output_tokens=2)[1]
    world.pump(world.finished("a", done["operation"]))
    world.space("b")
    everything = ops(world, "ops.receipts")[1]["items"]
    assert [r["kind"] for r in everything] == ["participant.register", "participant.register", "space.create",
                                               "conversation.create", "conversation.input", "space.create"]
    mine = ops(world, "ops.receipts", participant=world.par["b"])[1]["items"]
    assert {r["participant"] for r in mine} == {world.par["b"]} and len(mine) == 2
    inputs = ops(world, "ops.receipts", kind="conversation.input", status="succeeded", saved="terminal")[1]["items"]
    assert [r["operation"] for r in inputs] == [done["operation"]]
    assert ops(world, "ops.receipts", status="running")[1]["items"] == []
    page = ops(world, "ops.receipts", limit=2)[1]
    assert len(page["items"]) == 2 and ops(world, "ops.receipts", cursor=page["next_cursor"])[1]["items"] == everything[2:]
    assert ops(world, "ops.receipts", kind="nonsense")[0] == 400
    assert ops(world, "ops.receipt", operation=done["operation"])[1]["operation"] == done["operation"]
    result = ops(world, "ops.result", operation=done["operation"], offset=0)[1]
    whole = world.read("a", "operations.result", operation=done["operation"])[1]
    assert result["bytes"] == whole["bytes"] and result["complete"] is True
    assert ops(world, "ops.receipt", operation=f"op-{'0' * 32}-{'1' * 32}")[0] == 404


def test_a_running_inputs_receipt_counts_its_output_not_yet_saved(world):
    _, conversation = world.conversation("a")
    slow_engine(world, 0.01)
    receipt = world.say("a", conversation, "keep talking", max_output_tokens=48)[1]
    seen = []

    def pending():
        now = world.read("a", "operations.get", operation=receipt["operation"])[1]
        seen.append(int(now["pending_bytes"]))
        return now["terminal"]["saved"]
    world.pump(pending)
    assert max(seen) > 0 and seen[-1] == 0  # output waited for its save; nothing pending at the end
    assert all(r["disk_error"] is None for r in ops(world, "ops.receipts")[1]["items"])


def test_the_status_reports_the_pool_the_queues_and_the_journals_io(world):
    status = ops(world, "ping")[1]
    assert status["kv"]["pages"] == 64 and status["kv"]["owned"] == 0
    assert status["executions"] == {"queued": 0, "running": 0} and status["subscriptions"] == 0
    ticks = status["ticks"]
    assert ticks["saved_transfers"] > 0 and ticks["io_seconds"]["count"] > 0
    assert ticks["io_seconds"]["buckets"]["+Inf"] == ticks["io_seconds"]["count"]
    buckets = ticks["io_seconds"]["buckets"]  # cumulative; keys arrive in canonical (sorted string) order
    counts = [buckets[b] for b in sorted(buckets, key=lambda b: float("inf") if b == "+Inf" else float(b))]
    assert counts == sorted(counts) and status["runtime_file_bytes"] > 0


def test_an_audit_export_verifies_across_a_checkpoint_and_a_changed_byte_does_not(world, tmp_path):
    world.space("a")
    world.device.checkpoint()
    world.space("b")  # after the checkpoint: still in the journal
    out = str(tmp_path / "audit.jsonl")
    status, summary = ops(world, "audit.export", path=out)
    assert status == 200 and summary["transfers"] == summary["last_seq"] > 4
    lines = open(out).read().splitlines()
    assert [json.loads(line)["seq"] for line in lines] == list(range(1, len(lines) + 1))
    verify = [PYTHON, "-m", "gpu_worker", "audit", "verify", "--export", out, "--ccir", world.runtime,
              "--journal", world.journal]
    done = subprocess.run(verify, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    row = json.loads(lines[2])
    payload = bytearray(base64.b64decode(row["payload"]))
    payload[-1] ^= 1
    lines[2] = json.dumps({**row, "payload": base64.b64encode(bytes(payload)).decode()})
    open(out, "w").write("\n".join(lines) + "\n")
    done = subprocess.run(verify, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "seq 3" in done.stderr
    assert ops(world, "audit.export", path="relative.jsonl")[0] == 400
