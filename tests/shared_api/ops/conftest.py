"""The ops pages, /metrics, /healthz and the Celery tasks against the fake device (real frames):
a `ping` body in the device's shape, settable per test, and the ops commands answered by handlers."""
from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from shared_api import device_client
from tests.shared_api.views.conftest import HANG_UP, FakeDevice

PING: dict[str, Any] = {
    "ok": True, "boot": "3", "generation": "2",
    "usage": {"participants": 2, "spaces": 1, "members": 0, "conversations": 1, "receipts": 5},
    "capacities": {"participants": 1024, "spaces": 1024, "members": 4096, "conversations": 4096, "receipts": 1024,
                   "command_bytes": 8192, "result_bytes": 65536},
    "journal": {"hold": False, "cause": None, "since_ns": None, "pending_bytes": "0", "disk_error": None,
                "bytes": "4096", "file_cap_bytes": "1073741824", "checkpoint_seq": "7"},
    "hold_incidents": [],
    "grants": {"path": "/srv/aotx/grants.json", "written_at_ns": 1, "problem": None},
    "kv": {"pages": 512, "owned": 40, "pending": 8, "running": 2, "waiting": 1},
    "executions": {"queued": 1, "running": 2},
    "subscriptions": 3,
    "ticks": {"saved_transfers": 120, "io_seconds": {"count": 60, "sum": 0.12, "buckets": {
        "0.0005": 10, "0.001": 30, "0.002": 50, "0.005": 58, "0.01": 60, "0.02": 60, "0.05": 60, "0.1": 60,
        "0.25": 60, "0.5": 60, "1.0": 60, "+Inf": 60}}},
    "runtime_file_bytes": 468428,
    "pipeline": {"stalled_seconds": 0.0, "stall_seconds": 5.0, "stalled": False, "inbox": 0, "batches": 0,
                 "ticks_in_flight": 0},
}
# the ping before the device reported kv, executions, subscriptions, ticks and the runtime file size
OLD_KEYS = ("kv", "executions", "subscriptions", "ticks", "runtime_file_bytes", "pipeline")


class OpsDevice(FakeDevice):
    """A fake device whose `ping` answers `self.status` (None: no answer, the socket closes) and
    whose other ops commands go to `self.ops[op](args) -> (status, body)`."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.status: dict[str, Any] | None = copy.deepcopy(PING)
        self.ops: dict[str, Any] = {}
        self.handler = self._handle

    def _handle(self, req: dict[str, Any]) -> Any:
        op = req.get("op")
        if op == "ping":
            if self.status is None:
                return HANG_UP
            return (200, json.dumps(self.status).encode())
        if op in self.ops:
            status, body = self.ops[op](req.get("args") or {})
            return (status, json.dumps(body).encode())
        return (400, json.dumps({"error": {"code": "unknown_command", "message": op}}).encode())

    def calls(self, op: str) -> list[dict[str, Any]]:
        with self._lock:
            return [r.get("args") or {} for r in self.requests if r.get("op") == op]


@pytest.fixture
def ops_device(settings, tmp_path):
    directory = tempfile.mkdtemp(prefix="aotx-ops-")
    fake = OpsDevice(os.path.join(directory, "service.sock")).start()
    config = tmp_path / "gateway.json"
    config.write_text(json.dumps({"listen": "127.0.0.1:8000", "socket": fake.path,
                                  "grants_file": str(tmp_path / "grants.json")}))
    settings.AOTX_GATEWAY_CONFIG = str(config)
    settings.AOTX_DEVICE_TIMEOUT = 0.5
    settings.AOTX_METRICS_DEVICE_TIMEOUT = 0.5
    settings.AOTX_OPS_TIMEOUT = 0.5
    settings.AOTX_AUDIT_DIR = tmp_path / "audit"
    device_client.reset()
    try:
        yield fake
    finally:
        device_client.reset()
        fake.stop()
        shutil.rmtree(directory, ignore_errors=True)
    assert not fake.errors, f"the fake device failed: {fake.errors!r}"


@pytest.fixture
def no_device(settings, tmp_path):
    """The gateway pointed at a socket nobody serves."""
    config = tmp_path / "gateway.json"
    config.write_text(json.dumps({"listen": "127.0.0.1:8000", "socket": str(tmp_path / "absent.sock"),
                                  "grants_file": str(tmp_path / "grants.json")}))
    settings.AOTX_GATEWAY_CONFIG = str(config)
    settings.AOTX_METRICS_DEVICE_TIMEOUT = 0.5
    device_client.reset()
    yield
    device_client.reset()


@pytest.fixture
def staff(db):
    get_user_model().objects.create_superuser("root", "", "pw")
    client = Client()
    client.login(username="root", password="pw")
    return client
