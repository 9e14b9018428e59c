"""Shared fixtures: a tiny random-weight runtime file (seconds to pack and boot), grant files,
and helpers that wait on conditions instead of sleeping."""
import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


# A wait's bound is a safety net against waiting forever, never the time a step is expected to
# take: a machine running another `make test` (or a soak) beside this one can be several times
# slower, so every bound is stretched by this factor (AOTX_TEST_WAIT_SCALE, default 3).
WAIT_SCALE = float(os.environ.get("AOTX_TEST_WAIT_SCALE", "3"))


def wait_for(condition, timeout=30.0, interval=0.02, what="condition"):
    """Polls `condition` until it returns something true (returned), or fails after `timeout`
    seconds times WAIT_SCALE."""
    timeout *= WAIT_SCALE
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class Clock:
    """A clock that stands still until a test moves `now` (for code that takes a clock argument)."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_grants(path, principals):
    """principals: {principal_id_hex: [actions]}"""
    doc = {"schema": "aotx.grants.v1", "written_at_ns": time.time_ns(),
           "principals": {pid: {"name": pid[:8], "actions": sorted(a)} for pid, a in principals.items()}}
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(doc))
    os.replace(tmp, path)


ALL = ["shared_read", "shared_write", "shared_manage", "chat"]

_HOLD_FLOCK = ("import fcntl, os, sys\n"
               "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
               "fcntl.flock(fd, fcntl.LOCK_EX)\n"
               "print('locked', flush=True)\n"
               "sys.stdin.read()\n")


@contextlib.contextmanager
def flock_held_elsewhere(path):
    """Another process holding an exclusive flock on path (as a running device holds its runtime
    file) until the block ends; yields its pid."""
    holder = subprocess.Popen([PYTHON, "-c", _HOLD_FLOCK, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        yield holder.pid
    finally:
        holder.stdin.close()
        holder.wait(30)


@pytest.fixture(autouse=True)
def _umask_kept():
    """A command run in-process (pack's main sets umask 077, as the real command does) must not
    change the file modes of the tests after it."""
    umask = os.umask(0o022)
    os.umask(umask)
    yield
    os.umask(umask)


@pytest.fixture(scope="session")
def tiny_runtime(tmp_path_factory):
    from gpu_worker.pack import pack_tiny
    path = tmp_path_factory.mktemp("runtime") / "tiny.aotxccir"
    pack_tiny(str(path), shared=True)
    return str(path)


@pytest.fixture(scope="session")
def tiny_vlm_runtime(tmp_path_factory):
    """A shared runtime whose model takes images: a random scaled-down SmolVLM (pack.pack_tiny_vlm),
    named "smolvlm-tiny", 64 KV pages."""
    from gpu_worker.pack import pack_tiny_vlm
    base = tmp_path_factory.mktemp("vlm")
    path = base / "vlm.aotxccir"
    pack_tiny_vlm(str(path), base / "smolvlm-tiny", shared=True,
                  runtime_profile={"kv_pages": 64, "page_grant": 16, "deadline_ms": 60000})
    return str(path)


@pytest.fixture
def principal_id():
    return secrets.token_hex(16)
