"""Restart versus restore (docs/checkpoint.md, "Restart and restore"): a runtime file booted again
on its own journal directory with the grant file it last accepted boots with no operator step; a
restore — the file on a journal directory that is not its own, or a copy of the file — still
needs a grant file written after the file's last boot (SPEC: "Restore requires fresh deployment
grants")."""
import hashlib
import json
import os
import shutil

import pytest

from gpu_worker.contract.grantfile import Grants
from gpu_worker.device import Device
from gpu_worker.recovery import DeviceBootError
from gpu_worker.pack import pack_tiny
from gpu_worker import derived as ids
from gpu_worker.storage import owner
from gpu_worker.storage.journal import JournalCorrupt, list_segments, segment_name
from gpu_worker.storage.runtime_file import RuntimeFile
from tests.gpu_worker.kinds.test_shared_state import World, code

REFUSED = r"^restore requires fresh deployment grants: .*write_grants"


def own_runtime(tmp_path, name="own.aotxccir"):
    path = str(tmp_path / name)
    pack_tiny(path, shared=True)
    return path


def boot(runtime, journal, grants):
    return Device(RuntimeFile.open(runtime), str(journal), Grants(str(grants)))


def receipts(world):
    return world.read("a", "operations.list")[1]["items"]


def checkpointed_world(tmp_path):
    """A world whose runtime file records a boot (a checkpoint folded it), closed."""
    w = World(own_runtime(tmp_path), tmp_path, ["a"])
    w.space("a")
    assert w.device.checkpoint()["generation"] == 2
    w.device.close()
    return w


def refusal(excinfo):
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_a_restart_on_its_own_journal_boots_with_the_grant_file_it_accepted(tmp_path):
    w = World(own_runtime(tmp_path), tmp_path, ["a"])
    w.space("a")
    saved = receipts(w)
    grants_before = os.stat(w.grants_path)
    for expected_boot in (2, 3):
        w.device.close()
        w.device = boot(w.runtime, w.journal, w.grants_path)  # the very same, unwritten grant file
        assert w.device.state.boot == expected_boot
        assert receipts(w) == saved
    assert os.stat(w.grants_path).st_mtime_ns == grants_before.st_mtime_ns
    marker = owner.read(w.journal)
    assert isinstance(marker, owner.Owner) and marker.boot == 3 and marker.inode == os.stat(w.runtime).st_ino
    w.device.close()


def test_a_restart_right_after_a_checkpoint_needs_no_journal_segment(tmp_path):
    """A checkpoint trims the journal; its marker, not its segments, says whose journal it is."""
    w = checkpointed_world(tmp_path)
    for name in list_segments(w.journal, w.device.fs):  # the header-only segment the checkpoint began
        os.remove(os.path.join(w.journal, segment_name(name)))
    assert list_segments(w.journal, w.device.fs) == []
    w.device = boot(w.runtime, w.journal, w.grants_path)
    saved_ops = receipts(w)
    assert len(saved_ops) == 2 and {r["admission"]["save"]["source"] for r in saved_ops} == {"file"}
    w.device.close()


def test_a_crash_before_the_boot_was_recorded_still_restarts(tmp_path):
    """The marker is written before the boot transfer: a crash between the two leaves a marker one
    boot ahead of the saved state, and the next boot is still a restart."""
    w = World(own_runtime(tmp_path), tmp_path, ["a"])
    w.device.close()
    marker = owner.read(w.journal)
    owner.write(w.journal, owner.Owner(marker.incarnation, marker.inode, marker.boot + 1,
                                       marker.grants_written_at_ns))
    w.device = boot(w.runtime, w.journal, w.grants_path)
    assert w.device.state.boot == 2
    w.device.close()


def test_a_restore_on_a_fresh_journal_directory_needs_fresh_grants(tmp_path):
    w = checkpointed_world(tmp_path)
    fresh = tmp_path / "restored-journal"
    with pytest.raises(DeviceBootError, match=REFUSED) as excinfo:
        boot(w.runtime, fresh, w.grants_path)
    assert "has no owner marker" in refusal(excinfo)
    w.write_grants()  # the operator step
    w.device = boot(w.runtime, fresh, w.grants_path)
    assert len(receipts(w)) == 2
    w.device.close()
    w.device = boot(w.runtime, fresh, w.grants_path)  # now its own journal: a restart
    w.device.close()


def test_a_journal_directory_of_another_runtime_file_is_refused(tmp_path):
    w = checkpointed_world(tmp_path)
    stale = open(w.grants_path).read()  # written before the file's last boot
    (tmp_path / "other").mkdir()
    other = World(own_runtime(tmp_path / "other"), tmp_path / "other", ["a"])
    other.device.close()
    # its segments name the other file's incarnation: recovery refuses them, whatever the grants
    w.write_grants()
    with pytest.raises(JournalCorrupt, match="belongs to file incarnation"):
        boot(w.runtime, other.journal, w.grants_path)
    # with no segment left, its marker still names the other file
    for name in list_segments(other.journal, other.device.fs):
        os.remove(os.path.join(other.journal, segment_name(name)))
    open(w.grants_path, "w").write(stale)
    with pytest.raises(DeviceBootError, match=REFUSED) as excinfo:
        boot(w.runtime, other.journal, w.grants_path)
    assert f"belongs to runtime file incarnation {other.device.incarnation_hex}" in refusal(excinfo)
    w.write_grants()
    boot(w.runtime, other.journal, w.grants_path).close()


def test_a_copy_of_the_runtime_file_and_its_journal_is_a_restore(tmp_path):
    w = checkpointed_world(tmp_path)
    copy, copied_journal = str(tmp_path / "copy.aotxccir"), tmp_path / "copied-journal"
    shutil.copyfile(w.runtime, copy)
    shutil.copytree(w.journal, copied_journal, ignore=shutil.ignore_patterns("lock", "service.sock"))
    with pytest.raises(DeviceBootError, match=REFUSED) as excinfo:
        boot(copy, copied_journal, w.grants_path)
    assert "another copy of this runtime file" in refusal(excinfo)
    w.device = boot(w.runtime, w.journal, w.grants_path)  # the original still restarts as it was
    w.device.close()
    w.write_grants()
    boot(copy, copied_journal, w.grants_path).close()


def test_a_runtime_file_rolled_back_in_place_is_a_restore(tmp_path):
    """An older copy written back over the file keeps its inode and incarnation; the boot its
    state is at, behind the journal's marker, still tells. (One boot behind is what a crash
    between the marker and the boot's record leaves, so that counts as a restart: the copy here
    is two boots old.)"""
    w = checkpointed_world(tmp_path)
    backup = open(w.runtime, "rb").read()  # its checkpoint holds boot 1
    for _ in range(2):
        w.device = boot(w.runtime, w.journal, w.grants_path)
        w.space("a")
        w.device.checkpoint()  # boots 2, then 3, are in the file
        w.device.close()
    with open(w.runtime, "r+b") as f:  # in place: the same inode
        f.write(backup)
        f.truncate()
    for name in list_segments(w.journal, w.device.fs):  # whatever followed the newer checkpoints
        os.remove(os.path.join(w.journal, segment_name(name)))
    with pytest.raises(DeviceBootError, match=REFUSED) as excinfo:
        boot(w.runtime, w.journal, w.grants_path)
    assert "state is at boot 1, while journal" in refusal(excinfo) and "last saw boot 3" in refusal(excinfo)
    w.write_grants()
    boot(w.runtime, w.journal, w.grants_path).close()


def test_a_restart_with_an_older_grant_file_than_it_accepted_is_refused(tmp_path):
    w = World(own_runtime(tmp_path), tmp_path, ["a"])
    older = json.loads(open(w.grants_path).read())
    w.device.close()
    w.write_grants()
    w.device = boot(w.runtime, w.journal, w.grants_path)  # accepts the newer file
    w.device.close()
    open(w.grants_path, "w").write(json.dumps(older))  # e.g. a grant file restored from a backup
    with pytest.raises(DeviceBootError, match="older than the one this device accepted.*write_grants") as excinfo:
        boot(w.runtime, w.journal, w.grants_path)
    refusal(excinfo)
    w.write_grants()
    boot(w.runtime, w.journal, w.grants_path).close()


# ---- lineages after a restore (docs/checkpoint.md, "Lineages after a restore") ---------------------

def lineage(world, name="a"):
    return world.read(name, "participant.get")[1]["lineage"]


def test_the_lineage_and_operation_ids_without_a_nonce_are_those_from_before_nonces_existed():
    """State saved before lineage nonces existed (no "lineage" in its boots, no "lineages" in its
    checkpoint) keeps every lineage and operation ID it issued; a nonce changes both."""
    incarnation, principal = bytes(range(16)), bytes(range(16, 32))
    assert ids.lineage(incarnation, principal) == hashlib.sha256(
        b"aotx/lineage\0" + incarnation + principal).digest()[:16]
    tag = hashlib.sha256(b"aotx/operation\0" + incarnation + (7).to_bytes(8, "little")).digest()[:8]
    assert ids.operation(incarnation, 7)[8:] == tag
    nonce = b"\x42" * 16
    assert ids.lineage(incarnation, principal, nonce) != ids.lineage(incarnation, principal)
    raw = ids.operation(incarnation, 7, nonce)
    assert raw[:8] == ids.operation(incarnation, 7)[:8] and raw != ids.operation(incarnation, 7)
    assert ids.operation_counter(incarnation, raw, lambda counter: nonce) == 7
    assert ids.operation_counter(incarnation, raw) is None  # not under the line without a nonce


def test_a_restore_gives_every_participant_a_new_lineage_and_keeps_every_saved_id(tmp_path):
    """The file is checkpointed with a space, a conversation and a member; a second space is saved
    in the journal only. Restored on a fresh journal directory, every participant has a new lineage
    (an old-lineage mutation: 409 stale_lineage), what the checkpoint saved keeps its ID, the lost
    space and its operation are 404 (not 410: this history never issued them), and new IDs carry
    the new lineage, across a checkpoint of the new line and a restart."""
    w = World(own_runtime(tmp_path), tmp_path, ["a", "b"])
    old = lineage(w)
    space = w.space("a", scope="room")
    status, created = w.mutate("a", "conversations.create", f"/spaces/{space}/conversations", {})
    assert status == 202
    conversation = created["target"]
    assert w.member("a", space, "b", ["read"])[0] == 202
    kept = w.read("a", "operations.list")[1]["items"]
    assert w.device.checkpoint() is not None
    kept = w.read("a", "operations.list")[1]["items"]  # their save fields now say "file"
    status, lost = w.mutate("a", "spaces.create", "/spaces", {"id": "b" * 32})
    assert status == 202 and lost["admission"]["saved"]
    w.device.close()

    w.journal = str(tmp_path / "restored-journal")
    w.write_grants()
    w.device = boot(w.runtime, w.journal, w.grants_path)
    new = lineage(w)
    assert new != old and lineage(w, "b") != old
    assert w.read("a", "participant.get")[1]["next_sequence"] == lost["sequence"]
    me = w.read("a", "participant.get")[1]
    canonical = b'{"stale":true}'
    status, refused = w.send("a", "spaces.create", {"lineage": old, "operation_key": "c" * 32,
                                                    "sequence": int(me["next_sequence"]), "canonical": canonical})
    assert status == 409 and refused["error"]["code"] == "stale_lineage" and refused["error"]["lineage"] == new
    assert w.read("a", "operations.list")[1]["items"] == kept
    for receipt in kept:
        assert w.read("a", "operations.get", operation=receipt["operation"])[1] == receipt
    assert w.read("b", "spaces.get", space=space)[1]["id"] == space
    assert w.read("a", "conversations.get", conversation=conversation)[1]["id"] == conversation
    assert [s["id"] for s in w.read("a", "spaces.list")[1]["items"]] == [space]
    assert code(w.read("a", "operations.get", operation=lost["operation"])) == (404, "operation_not_found")
    assert code(w.read("a", "spaces.get", space=lost["target"])) == (404, "space_not_found")
    status, again = w.mutate("a", "spaces.create", "/spaces", {"id": "b" * 32})
    assert status == 202 and again["sequence"] == lost["sequence"] and again["operation"] != lost["operation"]
    assert again["operation"].startswith(f"op-{new}-") and again["target"] == f"spc-{new}-{'b' * 32}"
    assert code(w.read("a", "operations.get", operation=lost["operation"])) == (404, "operation_not_found")
    status, converse = w.mutate("a", "conversations.create", f"/spaces/{space}/conversations", {})
    assert status == 202 and converse["target"].startswith(f"con-{new}-")  # new IDs: the new lineage
    # the lines of history survive a checkpoint and a restart: old IDs keep theirs, new ones theirs
    assert w.device.checkpoint() is not None
    views = {s: w.read("a", "spaces.get", space=s)[1] for s in (space, again["target"])}
    for _ in range(2):
        w.device.close()
        w.device = boot(w.runtime, w.journal, w.grants_path)
        assert lineage(w) == new
        assert {s: w.read("a", "spaces.get", space=s)[1] for s in views} == views
        assert w.read("a", "conversations.get", conversation=converse["target"])[1]["id"] == converse["target"]
        w.space("a")  # a journal transfer after the checkpoint, for the second restart to replay
    w.device.close()


def test_an_exact_retry_after_a_restore_answers_its_receipt_whatever_the_lineage_is_now(tmp_path):
    """Issue 52 (9): a restore gives every participant a new lineage, and admission checked the
    lineage before looking the sequence up, so the very bytes of an operation the restored file
    kept answered 409 stale_lineage; the SDK then took it as not admitted and submitted it again
    at a new sequence: applied twice. Now an exact retry answers 200 with its receipt; a retired
    one 410; only one the restored history never admitted answers stale_lineage."""
    w = World(own_runtime(tmp_path), tmp_path, ["a"])
    sent = []
    send = w.send

    def recording(name, op, args):
        sent.append((name, op, dict(args)))
        return send(name, op, args)
    w.send = recording
    w.space("a")
    retired = sent[-1]
    assert w.mutate("a", "retirements.record", "/retirements", {"retry_floor": str(retired[2]["sequence"] + 1)})[0] \
        == 202
    status, kept = w.mutate("a", "spaces.create", "/spaces", {"scope": "room"})
    assert status == 202
    kept_args = sent[-1]
    assert w.device.checkpoint() is not None
    kept = w.read("a", "operations.get", operation=kept["operation"])[1]  # (its save fields now say "file")
    status, lost = w.mutate("a", "spaces.create", "/spaces", {})
    assert status == 202 and lost["admission"]["saved"]
    lost_args = sent[-1]
    old = lineage(w)
    w.device.close()

    w.journal = str(tmp_path / "restored-journal")
    w.write_grants()
    w.device = boot(w.runtime, w.journal, w.grants_path)
    assert lineage(w) != old
    assert send(*kept_args) == (200, kept)  # the same bytes, the old lineage: its receipt
    assert code(send(*retired)) == (410, "below_retry_floor")  # admitted, and retired, in this history
    status, refused = send(*lost_args)  # the journal tail the restore lost: never admitted here
    assert (status, refused["error"]["code"]) == (409, "stale_lineage")
    changed = dict(kept_args[2], canonical=kept_args[2]["canonical"].replace(b'"room"', b'"instance"'))
    assert code(send("a", "spaces.create", {**changed, "scope": "instance"})) == (409, "stale_lineage")
    assert [s["scope"] for s in w.read("a", "spaces.list")[1]["items"]].count("room") == 1  # nothing twice
    w.device.close()


def test_a_restore_that_stopped_before_recording_its_boot_still_starts_a_new_lineage(tmp_path):
    """The marker a restore boot writes counts the line of history that boot starts: a boot that
    stopped before recording itself leaves a marker one line ahead of the saved state, and the
    next boot (now a restart on that journal) starts the line instead."""
    w = checkpointed_world(tmp_path)
    old = lineage(w)
    w.device.close()
    restored = str(tmp_path / "restored-journal")
    os.makedirs(restored)
    w.write_grants()  # the restore's fresh grants, accepted by the boot that stopped
    with RuntimeFile.open(w.runtime) as runtime:
        inode, incarnation = runtime.inode, runtime.incarnation.hex()
    state_boot, lines = w.device.state.boot, len(w.device.state.participants.starts)
    owner.write(restored, owner.Owner(incarnation, inode, state_boot + 1, Grants(w.grants_path).written_at_ns,
                                      lines + 1))
    w.journal = restored
    w.device = boot(w.runtime, restored, w.grants_path)  # no new grants needed: its own journal now
    assert lineage(w) != old
    assert owner.read(restored).lineages == lines + 1
    w.device.close()
