"""Restart versus restore (docs/checkpoint.md, "Restart and restore"): a runtime file booted again
on its own journal directory with the grant file it last accepted boots with no operator step; a
restore — the file on a journal directory that is not its own, or a copy of the file — still
needs a grant file written after the file's last boot (SPEC: "Restore requires fresh deployment
grants")."""
import json
import os
import shutil

import pytest

from gpu_worker.contract.grantfile import Grants
from gpu_worker.device import Device, DeviceBootError
from gpu_worker.pack import pack_tiny
from gpu_worker.storage import owner
from gpu_worker.storage.journal import JournalCorrupt, list_segments, segment_name
from gpu_worker.storage.runtime_file import RuntimeFile
from tests.gpu_worker.ops.test_shared_state import World

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
