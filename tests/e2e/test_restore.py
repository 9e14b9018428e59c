"""Restore and credentials (SPEC: "Credentials do not enter the complete runtime file. Restore
requires fresh deployment grants."), with real processes."""
import hashlib
import json
import subprocess

import pytest

from aotx_client import Client
from aotx_client._protocol import Pending, PendingLog, canonical
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


def boot_command(stack, journal=None):
    return [PYTHON, "-m", "gpu_worker", "boot", "--ccir", stack.runtime, "--journal", str(journal or stack.journal),
            "--service-grants", str(stack.grants), "--device", "cpu"]


def test_a_restart_boots_as_it_is_and_a_restore_refuses_stale_grants_in_one_line(stack):
    stack.principal("bob")
    stack.boot_device()
    out = subprocess.run([PYTHON, "-m", "gpu_worker", "checkpoint", "--ccir", stack.runtime, "--journal",
                          str(stack.journal)], cwd=ROOT, capture_output=True, text=True, timeout=120, env=stack.env)
    assert out.returncode == 0, out.stderr  # the file now records the boot
    stack.device.kill()
    stack.boot_device()  # a restart: its own journal, the same grant file
    stack.device.kill()
    stack.journal.rename(stack.base / "journal-before")  # a restore: the file on a journal that is not its own
    out = subprocess.run(boot_command(stack), cwd=ROOT, capture_output=True, text=True, timeout=120, env=stack.env)
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1 and "write_grants" in out.stderr
    assert out.stderr.startswith("boot: restore requires fresh deployment grants: ")
    stack.boot_device(fresh_grants=True)  # the operator step, then it boots


def test_the_runtime_file_in_use_refuses_a_second_device_a_pack_and_an_offline_checkpoint(stack):
    """The device holds its runtime file's lock for its life, and still checkpoints into it."""
    stack.principal("carol")
    device = stack.boot_device()
    holder = f"(pid {device.proc.pid}: a device serving it"
    second = subprocess.run(boot_command(stack, stack.base / "other-journal"), cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env=stack.env)
    assert second.returncode == 3 and second.stderr.count("\n") == 1, second.stderr
    assert second.stderr.startswith(f"boot: runtime file {stack.runtime} is in use by another process {holder}")
    packed = subprocess.run([PYTHON, "-m", "gpu_worker", "pack", "--runtime", stack.runtime, "--shared"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, env=stack.env)
    assert packed.returncode == 2 and packed.stderr.count("\n") == 1, packed.stderr
    assert packed.stderr.startswith(f"pack: error: runtime file {stack.runtime} is in use by another process {holder}")
    offline = subprocess.run([PYTHON, "-m", "gpu_worker", "checkpoint", "--ccir", stack.runtime, "--journal",
                              str(stack.base / "other-journal")], cwd=ROOT, capture_output=True, text=True,
                             timeout=120, env=stack.env)  # no device on that journal: it would write the file
    assert offline.returncode == 2 and offline.stderr.count("\n") == 1, offline.stderr
    assert offline.stderr.startswith(f"checkpoint: runtime file {stack.runtime} is in use by another process {holder}")
    out = subprocess.run([PYTHON, "-m", "gpu_worker", "checkpoint", "--ccir", stack.runtime, "--journal",
                          str(stack.journal)], cwd=ROOT, capture_output=True, text=True, timeout=120, env=stack.env)
    assert out.returncode == 0 and "running device" in out.stdout, out.stderr  # appends under its lock
    device.kill()
    packed = subprocess.run([PYTHON, "-m", "gpu_worker", "pack", "--runtime", stack.runtime, "--shared"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, env=stack.env)
    assert packed.returncode == 0 and packed.stdout.startswith("unchanged"), packed.stderr


def mutate(stack, token, path, fields, lineage, sequence, key=None):
    body = {"schema": "aotx.shared.mutation.v1", "lineage": lineage,
            "operation_key": key or hashlib.sha256(f"{path}{sequence}{lineage}".encode()).hexdigest()[:32],
            "sequence": str(sequence), **fields}
    status, _, reply = stack.http("POST", BASE + path, body, token=token)
    return status, json.loads(reply)


def test_after_a_restore_that_lost_the_journal_tail_no_old_handle_selects_a_new_operation(stack):
    """SPEC: "a retired operation handle cannot select the new receipt"; the participant resource
    gives "the actual lineage". The file is checkpointed after two mutations, a third is saved in
    the journal only, and the file is restored on a fresh journal directory: the third is lost.
    The restore starts a new lineage: a mutation under the old one answers 409 `stale_lineage`
    (naming the new lineage), the new operation at the lost sequence gets an ID of the new lineage,
    the lost operation's and lost space's IDs answer 404, and everything the checkpoint saved keeps
    its ID and reads back."""
    alice = stack.principal("alice")
    stack.boot_device()
    stack.serve()
    me = json.loads(stack.http("GET", f"{BASE}/participant", token=alice)[2])
    assert "lineage" in me, me
    old = me["lineage"]
    assert mutate(stack, alice, "/participant", {}, old, 1)[0] == 202
    kept_fields = {"scope": "room", "id": "a" * 32}
    status, kept = mutate(stack, alice, "/spaces", kept_fields, old, 2)
    assert status == 202
    # a client process killed before it learned the outcome of sequence 2 left it pending (the SDK's
    # PendingLog: written before the first send); its restart after the restore retries it exactly
    pending = stack.base / "pending"
    key = hashlib.sha256(f"/spaces2{old}".encode()).hexdigest()[:32]
    PendingLog(str(pending)).write(Pending("/spaces", kept_fields, key, 2, canonical(
        {"schema": "aotx.shared.mutation.v1", "lineage": old, "operation_key": key, "sequence": "2", **kept_fields})))
    out = subprocess.run([PYTHON, "-m", "gpu_worker", "checkpoint", "--ccir", stack.runtime, "--journal",
                          str(stack.journal)], cwd=ROOT, capture_output=True, text=True, timeout=120, env=stack.env)
    assert out.returncode == 0, out.stderr
    kept_receipt = stack.http("GET", f"{BASE}/operations/{kept['operation']}", token=alice)[2]
    status, lost = mutate(stack, alice, "/spaces", {"scope": "room", "id": "b" * 32}, old, 3)
    assert status == 202 and lost["admission"]["saved"]  # saved, in the journal only
    stack.device.kill()
    stack.journal.rename(stack.base / "journal-lost")  # the restore: the file on a fresh journal directory
    stack.journal.mkdir()
    stack.boot_device(fresh_grants=True)

    me = json.loads(stack.http("GET", f"{BASE}/participant", token=alice)[2])
    assert me["registered"] and me["next_sequence"] == "3" and me["lineage"] != old
    new = me["lineage"]
    # a client still holding the old lineage, retrying the lost mutation exactly: refused, told the new one
    status, refused = mutate(stack, alice, "/spaces", {"scope": "room", "id": "b" * 32}, old, 3)
    assert status == 409 and refused["error"]["code"] == "stale_lineage" and refused["error"]["lineage"] == new
    # what the checkpoint saved keeps its IDs and its receipt bytes
    assert stack.http("GET", f"{BASE}/operations/{kept['operation']}", token=alice)[2] == kept_receipt
    # issue 52 (9): the exact retry of what the restored file kept answers its receipt, old lineage and
    # all (it answered 409 stale_lineage, and the SDK then submitted it again at a new sequence)
    status, again_kept = mutate(stack, alice, "/spaces", kept_fields, old, 2)
    assert status == 200 and again_kept["operation"] == kept["operation"]
    with Client(f"http://127.0.0.1:{stack.port}", alice, pending_dir=str(pending)) as aotx:
        [resumed] = aotx.resume()
    assert resumed["operation"] == kept["operation"] and not list(pending.glob("*.json"))
    assert json.loads(stack.http("GET", f"{BASE}/participant", token=alice)[2])["next_sequence"] == "3"
    assert json.loads(stack.http("GET", f"{BASE}/spaces/{kept['target']}", token=alice)[2])["id"] == kept["target"]
    # the lost operation and the space it created are gone, before and after a new one takes sequence 3
    assert stack.http("GET", f"{BASE}/operations/{lost['operation']}", token=alice)[0] == 404
    status, again = mutate(stack, alice, "/spaces", {"scope": "room", "id": "b" * 32}, new, 3)
    assert status == 202 and again["operation"].startswith(f"op-{new}-")
    assert again["operation"].split("-")[2] != lost["operation"].split("-")[2]
    assert again["target"] == f"spc-{new}-{'b' * 32}" != lost["target"]
    for handle in (f"operations/{lost['operation']}", f"spaces/{lost['target']}"):
        assert stack.http("GET", f"{BASE}/{handle}", token=alice)[0] == 404, handle
    # the next boot on this journal is a restart: the lineage stays
    stack.device.kill()
    stack.boot_device()
    assert json.loads(stack.http("GET", f"{BASE}/participant", token=alice)[2])["lineage"] == new
    assert json.loads(stack.http("GET", f"{BASE}/operations/{again['operation']}", token=alice)[2])["target"] == \
        again["target"]
