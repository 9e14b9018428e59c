"""Faults (SPEC "Recorded state and recovery"): journal holds, ENOSPC, EIO, power loss and
checkpoints; each recovery is a plain restart (the same grant file). Restart versus restore:
test_restart.py."""
import errno
import subprocess

import pytest

from gpu_worker.device import Device
from gpu_worker.storage.filelayer import FaultyFileLayer
from gpu_worker.contract.grantfile import Grants
from gpu_worker.storage.journal import JournalIOError, list_segments
from gpu_worker.pack import pack_tiny
from gpu_worker.storage.runtime_file import RuntimeFile
from tests.conftest import PYTHON, ROOT
from tests.gpu_worker.ops.test_shared_state import World, code


def runtime(tmp_path, **limits):
    path = str(tmp_path / "faults.aotxccir")
    pack_tiny(path, shared=True, runtime_profile={"min_free_disk_bytes": 1}, journal_limits=limits or None)
    return path


class FaultyWorld(World):
    """A World whose device does all journal I/O through a FaultyFileLayer."""

    def __init__(self, runtime, tmp_path, names, fs):
        self.fs = fs
        super().__init__(runtime, tmp_path, names)

    def boot(self):
        if self.device is not None:
            self.device.close()
        self.device = Device(RuntimeFile.open(self.runtime), self.journal, Grants(self.grants_path), fs=self.fs)


def saved_state(world, name):
    """What is saved, as reads show it (receipts without the current journal_hold, which
    reflects the device's state now, not the receipt's)."""
    receipts = world.read(name, "operations.list")[1]
    receipts["items"] = [{k: v for k, v in r.items() if k != "journal_hold"} for r in receipts["items"]]
    return world.read(name, "participant.get")[1], world.read(name, "spaces.list")[1], receipts


def test_a_checkpoint_folds_the_journal_into_the_file_and_trims_it(tmp_path):
    w = World(runtime(tmp_path), tmp_path, ["a", "b"])
    space = w.space("a")
    w.member("a", space, "b", ["read"])
    before = w.read("a", "operations.list")[1]["items"]
    assert {r["admission"]["save"]["source"] for r in before} == {"journal"}
    result = w.device.checkpoint()
    assert result["generation"] == 2 and result["folded"] >= 4
    assert list_segments(w.journal, w.device.fs) == [2]
    after = w.read("a", "operations.list")[1]["items"]
    assert [r["operation"] for r in after] == [r["operation"] for r in before]
    assert {(r["admission"]["save"]["source"], r["admission"]["save"]["generation"]) for r in after} == {("file", "2")}
    assert [r["admission"]["save"]["commit_digest"] for r in after] == \
        [r["admission"]["save"]["commit_digest"] for r in before]
    new = w.space("a")
    w.boot()
    again = w.read("a", "operations.list")[1]["items"]
    assert again[:len(after)] == after
    last = w.read("a", "operations.get", operation=again[-1]["operation"])[1]
    assert last["target"] == new and last["admission"]["save"]["source"] == "journal"
    assert last["admission"]["save"]["generation"] == "2"
    assert w.read("b", "spaces.get", space=space)[0] == 200
    audit = RuntimeFile.open(w.runtime)
    assert audit.has("audit/00000002") and audit.generation == 2


def test_the_checkpoint_command_works_offline_and_boot_continues_from_it(tmp_path):
    w = World(runtime(tmp_path), tmp_path, ["a"])
    w.space("a")
    before = w.read("a", "operations.list")[1]["items"]
    w.device.close()
    out = subprocess.run([PYTHON, "-m", "gpu_worker", "checkpoint", "--ccir", w.runtime, "--journal", w.journal],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "offline" in out.stdout, out.stderr
    w.device = None
    w.boot()
    after = w.read("a", "operations.list")[1]["items"]
    assert [r["operation_key"] for r in after] == [r["operation_key"] for r in before]
    assert {r["admission"]["save"]["source"] for r in after} == {"file"}


def test_a_file_cap_holds_new_mutations_with_429_until_a_checkpoint(tmp_path):
    w = World(runtime(tmp_path, journal_file_cap_bytes=2500), tmp_path, ["a"])
    space = w.space("a")
    while not w.device.holds.current:
        assert w.mutate("a", "conversations.create", f"/spaces/{space}/conversations", {})[0] == 202
        w.device.check_hold()
    state = saved_state(w, "a")
    status, body = w.mutate("a", "spaces.create", "/spaces", {})
    assert status == 429 and body["error"]["code"] == "journal_hold" and body["error"]["cause"] == "file_cap"
    assert saved_state(w, "a") == state
    caps = w.read("a", "capabilities")[1]["journal"]
    assert caps["hold"] is True and caps["cause"] == "file_cap" and caps["pending_bytes"] == 0
    assert w.read("a", "operations.get", operation=state[2]["items"][0]["operation"])[0] == 200
    w.device.checkpoint()
    assert w.device.holds.current is None and w.device.state.hold_incidents[-1]["cause"] == "file_cap"
    assert w.mutate("a", "spaces.create", "/spaces", {})[0] == 202
    [incident] = w.device.state.hold_incidents
    assert incident["ended_ns"] > incident["since_ns"] and incident["pending_bytes"] is not None
    w.boot()  # journaled: the incident survives the restart
    assert w.read("a", "ping")[1]["hold_incidents"] == [incident]


def test_a_hold_open_when_the_device_stopped_is_closed_at_the_next_boot(tmp_path):
    w = World(runtime(tmp_path, journal_file_cap_bytes=2500), tmp_path, ["a"])
    space = w.space("a")
    while not w.device.holds.current:
        assert w.mutate("a", "conversations.create", f"/spaces/{space}/conversations", {})[0] == 202
        w.device.check_hold()
    w.read("a", "capabilities")  # a tick: the hold's start is saved
    [open_incident] = w.device.state.hold_incidents
    assert open_incident["ended_ns"] is None and open_incident["cause"] == "file_cap"
    w.boot()
    [closed] = w.device.state.hold_incidents
    assert closed["since_ns"] == open_incident["since_ns"] and closed["ended_ns"] == w.device.state.last_boot_ns


def test_enospc_refuses_the_tick_with_429_changes_nothing_and_lifts_when_space_returns(tmp_path):
    fs = FaultyFileLayer()
    w = FaultyWorld(runtime(tmp_path), tmp_path, ["a"], fs)
    w.space("a")
    state = saved_state(w, "a")
    fs.space = 100  # the next tick's write runs out of space part-way
    status, body = w.mutate("a", "spaces.create", "/spaces", {})
    assert status == 429 and body["error"]["code"] == "journal_hold"
    assert body["error"]["disk_error"].startswith("ENOSPC")
    assert saved_state(w, "a") == state
    assert w.read("a", "capabilities")[1]["journal"]["cause"] == "disk_full"
    held = w.read("a", "operations.get", operation=state[2]["items"][0]["operation"])[1]
    assert held["journal_hold"]["cause"] == "disk_full" and held["journal_hold"]["disk_error"].startswith("ENOSPC")
    assert w.mutate("a", "spaces.create", "/spaces", {})[0] == 429
    fs.space = 1 << 30
    status, receipt = w.mutate("a", "spaces.create", "/spaces", {})
    assert status == 202
    w.boot()
    assert saved_state(w, "a")[2]["items"][-1] == {k: v for k, v in receipt.items() if k != "journal_hold"}


def test_a_checkpoint_lifts_a_disk_full_hold_and_nothing_saved_is_lost(tmp_path):
    fs = FaultyFileLayer()
    w = FaultyWorld(runtime(tmp_path), tmp_path, ["a"], fs)
    w.space("a")
    state = saved_state(w, "a")
    fs.space = 100
    assert code(w.mutate("a", "spaces.create", "/spaces", {})) == (429, "journal_hold")
    fs.space = 1 << 16  # some room, less than the margin a disk_full hold waits for by itself
    w.device.check_hold()
    assert w.device.holds.current["cause"] == "disk_full"
    w.device.checkpoint()
    assert w.device.holds.current is None
    status, receipt = w.mutate("a", "spaces.create", "/spaces", {})
    assert status == 202 and receipt["journal_hold"] is None
    w.boot()
    assert saved_state(w, "a")[2]["items"][:-1] == [
        dict(r, admission=dict(r["admission"], save=dict(r["admission"]["save"], source="file", generation="2")),
             terminal=dict(r["terminal"], save=dict(r["terminal"]["save"], source="file", generation="2")))
        for r in state[2]["items"]]


def test_eio_stops_the_device_and_a_restart_recovers_every_saved_receipt(tmp_path):
    fs = FaultyFileLayer()
    w = FaultyWorld(runtime(tmp_path), tmp_path, ["a"], fs)
    w.space("a")
    state = saved_state(w, "a")
    fs.fail_fdatasync(errno.EIO)
    with pytest.raises(JournalIOError):
        w.mutate("a", "spaces.create", "/spaces", {})
    w.device.lock.release()
    w.device = None
    w.fs = FaultyFileLayer()
    w.boot()
    assert saved_state(w, "a") == state


@pytest.mark.parametrize("mode", ["cut", "zeros", "garbage", "prefix"])
def test_power_loss_keeps_every_saved_receipt(tmp_path, mode):
    fs = FaultyFileLayer(seed=7)
    w = FaultyWorld(runtime(tmp_path), tmp_path, ["a", "b"], fs)
    for _ in range(5):
        w.space("a")
        w.space("b")
    saved = {n: saved_state(w, n) for n in ("a", "b")}

    class PowerCut(BaseException):
        pass

    def cut():
        raise PowerCut
    w.device.committer.writer._file.fdatasync = cut  # the tick's write happens, its fdatasync never does
    with pytest.raises(PowerCut):
        w.mutate("a", "spaces.create", "/spaces", {})
    fs.lose_unsynced(mode)
    w.device.lock.release()
    w.device = None
    w.boot()
    assert {n: saved_state(w, n) for n in ("a", "b")} == saved


def test_the_device_checkpoints_by_itself_past_the_journal_threshold(tmp_path):
    w = World(runtime(tmp_path, checkpoint_journal_bytes=3000), tmp_path, ["a"])
    sizes = []
    while w.device.state.generation == 1:
        assert len(sizes) < 50, "no automatic checkpoint"
        w.space("a")
        sizes.append(w.device.journal_bytes)
        w.device.idle()
    assert sizes[-1] >= 3000 and all(size < 3000 for size in sizes[:-1])  # exactly past the threshold
    assert w.device.journal_bytes < 3000
    assert {r["admission"]["save"]["source"] for r in w.read("a", "operations.list")[1]["items"]} == {"file"}


def test_low_free_disk_holds_admission_and_the_hold_lifts_when_space_returns(tmp_path):
    path = str(tmp_path / "lowdisk.aotxccir")
    pack_tiny(path, shared=True, runtime_profile={"min_free_disk_bytes": 1 << 20})
    fs = FaultyFileLayer()
    w = FaultyWorld(path, tmp_path, ["a"], fs)
    w.space("a")
    state = saved_state(w, "a")
    fs.space = 1 << 19  # statvfs now reports less free space than the runtime profile's minimum
    status, body = w.mutate("a", "spaces.create", "/spaces", {})
    assert status == 429 and body["error"]["cause"] == "low_disk" and saved_state(w, "a") == state
    assert w.read("a", "capabilities")[1]["journal"]["cause"] == "low_disk"
    fs.space = 1 << 30
    w.device.idle()
    assert w.device.holds.current is None and w.device.state.hold_incidents[-1]["cause"] == "low_disk"
    assert w.mutate("a", "spaces.create", "/spaces", {})[0] == 202
