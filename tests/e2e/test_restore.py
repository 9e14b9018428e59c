"""Restore and credentials (SPEC: "Credentials do not enter the complete runtime file. Restore
requires fresh deployment grants."), with real processes."""
import hashlib
import json
import subprocess

import pytest

from tests.conftest import PYTHON, ROOT
from tests.harness import Stack

pytestmark = pytest.mark.e2e
BASE = "/aotx/v1/shared"


@pytest.fixture
def stack(tmp_path):
    from gpu_worker.pack import pack_tiny
    runtime = tmp_path / "own.aotxccir"  # this test checkpoints into it: its own file
    pack_tiny(str(runtime), shared=True)
    s = Stack(tmp_path, str(runtime))
    yield s
    s.stop()


def register_and_create(stack, token):
    me = json.loads(stack.http("GET", f"{BASE}/participant", token=token)[2])
    for sequence, path, fields in (("1", "/participant", {}), ("2", "/spaces", {"scope": "room"})):
        body = {"schema": "aotx.shared.mutation.v1", "lineage": me["lineage"], "operation_key": f"{int(sequence):032x}",
                "sequence": sequence, **fields}
        status, _, receipt = stack.http("POST", BASE + path, body, token=token)
        assert status == 202, receipt


def test_no_credential_byte_enters_the_runtime_file_or_the_journal(stack):
    token = stack.principal("alice")
    stack.boot_device()
    stack.serve()
    register_and_create(stack, token)
    out = subprocess.run([PYTHON, "-m", "gpu_worker", "checkpoint", "--ccir", stack.runtime, "--journal",
                          str(stack.journal)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "running device" in out.stdout, out.stderr
    register_and_create_more = json.loads(stack.http("GET", f"{BASE}/capabilities", token=token)[2])
    assert register_and_create_more["runtime"]["generation"] == "2"
    digest = hashlib.sha256(token.encode()).digest()
    secrets = [token.encode(), token.removeprefix("aotx_").encode(), digest, digest.hex().encode()]
    files = [stack.runtime, stack.grants, *sorted(stack.journal.glob("*.journal"))]
    for path in files:
        data = open(path, "rb").read()
        for secret in secrets:
            assert secret not in data, f"credential bytes in {path}"


def test_boot_refuses_stale_grants_with_one_line_naming_write_grants(stack):
    stack.principal("bob")
    stack.boot_device()
    stack.device.kill()
    out = subprocess.run([PYTHON, "-m", "gpu_worker", "boot", "--ccir", stack.runtime, "--journal",
                          str(stack.journal), "--service-grants", str(stack.grants)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, env=stack.env)
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1 and "write_grants" in out.stderr
    stack.boot_device()  # writes fresh grants first, then boots
