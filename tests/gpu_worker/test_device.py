"""The device state machine in-process: registration as a full mutation, retries, restarts."""
import collections
import gc
import json
import secrets

import pytest
import rfc8785

from gpu_worker.device import Device
from gpu_worker.kinds.receipts import receipt_bytes, render
from gpu_worker.contract.grantfile import Grants
from gpu_worker.storage.journal_lock import JournalLocked
from gpu_worker.storage.journal_writer import MAX_RECORDS_PER_TICK
from gpu_worker.storage.runtime_file import RuntimeFile
from tests.conftest import ALL, write_grants

PATH = "/aotx/v1/shared/participant"


class Rig:
    def __init__(self, runtime_path, tmp_path, principals):
        self.runtime_path = runtime_path
        self.journal = str(tmp_path / "journal")
        self.grants_path = str(tmp_path / "grants.json")
        self.principals = principals
        write_grants(self.grants_path, principals)
        self.ids = iter(range(1, 1 << 30))
        self.device = None
        self.boot()

    def boot(self):
        if self.device is not None:
            self.device.close()  # a restart on its own journal: the same grant file
        self.device = Device(RuntimeFile.open(self.runtime_path), self.journal, Grants(self.grants_path))
        return self.device

    def call(self, op, principal, args=None):
        inbox = collections.deque([("c", self.msg(op, principal, args))])
        [(conn, msg)] = self.device.committer.run_sync(inbox)
        assert not inbox
        return msg.status, json.loads(msg.body), msg

    def msg(self, op, principal, args=None):
        return {"v": 1, "id": next(self.ids), "op": op, "principal": principal, "args": args or {}}

    def register_args(self, principal, *, lineage=None, key=None, sequence=1):
        lineage = lineage or self.call("participant.get", principal)[1]["lineage"]
        key = key or secrets.token_hex(16)
        body = {"schema": "aotx.shared.mutation.v1", "lineage": lineage, "operation_key": key,
                "sequence": str(sequence)}
        return {"lineage": lineage, "operation_key": key, "sequence": sequence,
                "canonical": rfc8785.dumps({"method": "POST", "path": PATH, "body": body})}


@pytest.fixture
def rig(tiny_runtime, tmp_path, principal_id):
    r = Rig(tiny_runtime, tmp_path, {principal_id: ALL})
    yield r
    r.device.close()


def test_an_unregistered_principal_sees_its_lineage_and_sequence_one(rig, principal_id):
    status, body, _ = rig.call("participant.get", principal_id)
    assert status == 200
    assert body["registered"] is False and body["id"] is None
    assert len(body["lineage"]) == 32 and body["next_sequence"] == "1" and body["retry_floor"] == "1"


def test_registration_is_a_saved_mutation_with_a_receipt(rig, principal_id):
    status, receipt, msg = rig.call("participant.register", principal_id, rig.register_args(principal_id))
    assert status == 202
    assert msg.headers["Location"].endswith(receipt["operation"])
    assert receipt["kind"] == "participant.register" and receipt["sequence"] == "1"
    assert receipt["admission"]["saved"] and receipt["terminal"]["saved"]
    assert receipt["terminal"]["status"] == "succeeded"
    save = receipt["admission"]["save"]
    assert save["source"] == "journal" and save["boot"] == "1" and len(save["commit_digest"]) == 64
    assert receipt["operation"].startswith("op-" + rig.call("participant.get", principal_id)[1]["lineage"])
    assert receipt["operation"].split("-")[2] != receipt["operation_key"]
    status, participant, _ = rig.call("participant.get", principal_id)
    assert participant["registered"] and participant["id"] == receipt["target"]
    assert participant["next_sequence"] == "2"


def test_exact_retry_returns_the_same_receipt_and_changes_are_refused(rig, principal_id):
    args = rig.register_args(principal_id)
    _, _, first = rig.call("participant.register", principal_id, args)
    status, _, again = rig.call("participant.register", principal_id, args)
    assert status == 200 and again.body == first.body
    changed = dict(args, canonical=args["canonical"].replace(b'"1"', b'"1" '))
    assert rig.call("participant.register", principal_id, changed)[1]["error"]["code"] == "operation_changed"
    future = rig.register_args(principal_id, sequence=5)
    status, body, _ = rig.call("participant.register", principal_id, future)
    assert status == 409 and body["error"]["code"] == "future_sequence" and body["error"]["next_sequence"] == "2"
    again2 = rig.register_args(principal_id, sequence=2)
    assert rig.call("participant.register", principal_id, again2)[1]["error"]["code"] == "already_registered"


def test_stale_lineage_and_missing_grant_are_refused_without_change(rig, principal_id, tmp_path):
    stale = rig.register_args(principal_id, lineage="0" * 31 + "1")
    status, body, _ = rig.call("participant.register", principal_id, stale)
    assert status == 409 and body["error"]["code"] == "stale_lineage"
    write_grants(rig.grants_path, {principal_id: ["shared_read"]})
    status, body, _ = rig.call("participant.register", principal_id, rig.register_args(principal_id))
    assert status == 403 and body["error"]["code"] == "grant_missing"
    assert rig.call("participant.get", principal_id)[1]["registered"] is False
    assert rig.call("participant.get", secrets.token_hex(16))[0] == 403


def test_receipts_survive_a_restart_byte_for_byte(rig, principal_id):
    _, receipt, first = rig.call("participant.register", principal_id, rig.register_args(principal_id))
    rig.boot()
    _, _, again = rig.call("operations.get", principal_id, {"operation": receipt["operation"]})
    assert again.status == 200 and again.body == first.body
    caps = rig.call("capabilities", principal_id)[1]
    assert caps["runtime"]["boot"] == "2"
    listed = rig.call("operations.list", principal_id)[1]
    assert [r["operation"] for r in listed["items"]] == [receipt["operation"]] and listed["next_cursor"] is None


def test_a_second_device_on_the_same_journal_refuses(rig):
    with pytest.raises(JournalLocked):
        Device(RuntimeFile.open(rig.runtime_path), rig.journal, Grants(rig.grants_path))


def test_a_tick_writes_at_most_sixteen_records_and_defers_the_rest(tiny_runtime, tmp_path):
    principals = [secrets.token_hex(16) for _ in range(40)]
    rig = Rig(tiny_runtime, tmp_path, {p: ALL for p in principals})
    batch = collections.deque(("c", rig.msg("participant.register", p, rig.register_args(p))) for p in principals)
    before = rig.device.committer.writer.durable_bytes
    records_total = 0
    ticks = 0
    while batch:
        replies = rig.device.committer.run_sync(batch)
        written = rig.device.committer.writer.durable_bytes - before
        before = rig.device.committer.writer.durable_bytes
        assert written <= MAX_RECORDS_PER_TICK * (32 + 160)
        records_total += len(replies)
        ticks += 1
        assert all(m.status == 202 for _, m in replies)
    assert records_total == 40 and ticks > 1
    rig.device.close()


def test_operations_list_pages_with_a_cursor(rig, principal_id):
    rig.call("participant.register", principal_id, rig.register_args(principal_id))
    page = rig.call("operations.list", principal_id, {"limit": 1})[1]
    assert len(page["items"]) == 1 and page["next_cursor"] is None
    status, body, _ = rig.call("operations.get", principal_id, {"operation": "op-" + "0" * 32 + "-" + "1" * 32})
    assert status == 404 and body["error"]["code"] == "operation_not_found"


def test_receipts_render_as_canonical_json(rig, principal_id):
    from gpu_worker.contract.wire import dumps
    _, receipt, msg = rig.call("participant.register", principal_id, rig.register_args(principal_id))
    assert dumps(json.loads(msg.body)) == msg.body
    rrow = rig.device.state.receipts.by_op[bytes.fromhex(receipt["operation"].split("-")[2])]
    foreign = render(rig.device, rrow, False)[1]
    assert json.loads(foreign)["sequence"] is None and dumps(json.loads(foreign)) == foreign


def test_truncating_the_final_transfer_anywhere_boots_and_drops_only_it(tiny_runtime, tmp_path):
    from gpu_worker.storage.journal import JournalCorrupt
    principals = [secrets.token_hex(16) for _ in range(3)]
    rig = Rig(tiny_runtime, tmp_path, {p: ALL for p in principals})
    receipts = [rig.call("participant.register", p, rig.register_args(p))[2].body for p in principals]
    rig.device.close()
    segment = tmp_path / "journal" / "00000001.journal"
    full = segment.read_bytes()
    start = full.rindex(b"\x25\x41\x02\x00\x00\x00\x02\x00")  # type 37, class A, kind 2, part 0 of 2
    offsets = sorted(set(range(start, len(full), 7)) | {start, start + 1, len(full) - 1})
    for cut in offsets:
        segment.write_bytes(full[:cut])
        write_grants(rig.grants_path, rig.principals)
        device = Device(RuntimeFile.open(tiny_runtime), rig.journal, Grants(rig.grants_path))
        try:
            survivors = [receipt_bytes(device, r) for r in sorted(device.state.receipts.by_op.values())]
            assert sorted(survivors) == sorted(receipts[:2]), cut
            assert bool(device.dropped) == (cut > start)
        finally:
            device.close()
        segment.write_bytes(full)
    damaged = bytearray(full)
    damaged[40] ^= 0x01  # inside the first record (the boot transfer)
    segment.write_bytes(bytes(damaged))
    with pytest.raises(JournalCorrupt) as err:
        Device(RuntimeFile.open(tiny_runtime), rig.journal, Grants(rig.grants_path))
    assert "00000001.journal" in str(err.value) and "offset 32" in str(err.value)


def test_admissions_leave_nothing_for_the_cyclic_gc_to_scan(tiny_runtime, tmp_path):
    """What an admission adds for the life of the device (index entries, participant names, the
    rendered receipt) must be objects the cyclic GC does not track (ints, bytes, str, tuples of
    those), or every full collection scans all of them: on a busy device those collections cost
    more than the admissions (docs/architecture.md, "The device's memory")."""
    principals = [secrets.token_hex(16) for _ in range(150)]
    rig = Rig(tiny_runtime, tmp_path, {p: ALL for p in principals})
    commands = [("c", rig.msg("participant.register", p, rig.register_args(p))) for p in principals]
    inbox = collections.deque(commands)  # `commands` keeps them: only what the device adds is counted
    gc.collect()
    before = len(gc.get_objects())
    statuses = []
    while inbox:
        statuses += [msg.status for _, msg in rig.device.committer.run_sync(inbox)]
    assert statuses == [202] * len(principals)
    rig.call("operations.list", principals[0])  # reads render receipts too: nothing is kept
    gc.collect()
    assert len(gc.get_objects()) - before < len(principals) // 10
    rig.device.close()
