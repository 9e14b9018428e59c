"""Faults (SPEC "Recorded state and recovery"): journal holds, ENOSPC, EIO, power loss and
checkpoints; each recovery is a plain restart (the same grant file). Restart versus restore:
test_restart.py."""
import collections
import errno
import subprocess

import pytest

from gpu_worker.device import Device
from gpu_worker.storage.filelayer import FaultyFileLayer
from gpu_worker.contract.grantfile import Grants
from gpu_worker.storage.journal import list_segments
from gpu_worker.storage.journal_writer import JournalIOError
from gpu_worker.pack import pack_tiny
from gpu_worker.storage.runtime_file import RuntimeFile
from tests.conftest import PYTHON, ROOT
from tests.gpu_worker.kinds.test_inputs import EngineWorld, slow_engine
from tests.gpu_worker.kinds.test_shared_state import World, code


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


class FaultyEngineWorld(EngineWorld):
    """An EngineWorld (the tiny model on a runner thread) whose device does all journal I/O
    through a FaultyFileLayer."""

    def __init__(self, runtime, tmp_path, names, fs):
        self.fs = fs
        super().__init__(runtime, tmp_path, names)

    def boot(self):
        if self.device is not None:
            if self.device.runner is not None:
                self.device.runner.stop()
            self.device.close()
        self.device = Device(RuntimeFile.open(self.runtime), self.journal, Grants(self.grants_path), fs=self.fs)


def engine_runtime(tmp_path):
    path = str(tmp_path / "engine-faults.aotxccir")
    pack_tiny(path, shared=True, runtime_profile={"min_free_disk_bytes": 1, "kv_pages": 64, "page_grant": 16,
                                                  "deadline_ms": 600000})
    return path


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
    assert caps["hold"] is True and caps["cause"] == "file_cap" and caps["pending_bytes"] == "0"
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


def test_after_enospc_every_unfinished_input_ends_interrupted_once_room_returns(tmp_path):
    """ENOSPC rebuilds the state from what is saved and stops every input (their unsaved leases
    and outputs are gone). Each then ends with a saved COMPLETION `interrupted` as soon as the
    journal accepts writes again, as at a restart (SPEC: a restored unfinished admission becomes
    interrupted and does not repeat its memory input): it has a result and a terminal, its quotas
    are free, and a retirement may cover it (before, all of that waited for a restart). While the
    disk is full nothing can be written: a cancellation answers 429 like every mutation (its
    target is stopped already)."""
    fs = FaultyFileLayer()
    w = FaultyEngineWorld(engine_runtime(tmp_path), tmp_path, ["a"], fs)
    try:
        _, conversation = w.conversation("a")
        _, other = w.conversation("a")
        slow_engine(w)
        _, running = w.say("a", conversation, "running", max_output_tokens=120, temperature=1.0)
        w.pump(lambda: w.device.executions.live and w.device.runner.engine.pool.owned)
        _, waiting = w.say("a", conversation, "waiting", max_output_tokens=8)  # behind the first
        _, queued = w.say("a", other, "queued", max_output_tokens=8)
        inputs = (running, waiting, queued)
        fs.space = 100  # the next tick's write runs out of space part-way
        assert code(w.mutate("a", "spaces.create", "/spaces", {})) == (429, "journal_hold")
        assert w.device.holds.current["cause"] == "disk_full"
        assert code(w.mutate("a", "cancellations.record", "/cancellations",
                             {"target_sequence": waiting["sequence"]})) == (429, "journal_hold")
        w.device.idle()  # still full: nothing is written, nothing ends
        w.device.committer.run_sync(collections.deque())
        assert [w.read("a", "operations.get", operation=r["operation"])[1]["terminal"]["saved"]
                for r in inputs] == [False, False, False]
        w.pump(lambda: w.device.runner.engine.pool.owned == 0)  # the engine stopped them
        fs.space = None  # room returns; the hold lifts at its next check
        w.device.idle()
        assert w.device.holds.current is None
        w.pump(lambda: all(w.finished("a", r["operation"])() for r in inputs), timeout=30)
        ends = [w.read("a", "operations.get", operation=r["operation"])[1] for r in inputs]
        assert [(e["terminal"]["status"], e["result"]["finish"]) for e in ends] == [("interrupted", "interrupted")] * 3
        assert all(e["terminal"]["save"]["source"] == "journal" for e in ends)
        assert not w.device.executions.live and not w.device.executions.to_lease
        state = saved_state(w, "a")
        w.boot()  # replay gives what live application gave
        w.attach()
        assert saved_state(w, "a") == state
        status, _ = w.mutate("a", "retirements.record", "/retirements",
                             {"retry_floor": str(int(queued["sequence"]) + 1)})
        assert status == 202
    finally:
        w.device.runner.stop()
        w.device.close()


def test_a_cancellation_is_admitted_during_a_file_cap_hold_and_ends_its_input(tmp_path):
    """During a hold new mutations answer 429, but a cancellation of an admitted input is admitted
    (one small admission that ends the output its target would still journal) and its target ends
    `cancelled`, as it would without the hold."""
    w = EngineWorld(engine_runtime(tmp_path), tmp_path, ["a"])
    try:
        _, conversation = w.conversation("a")
        slow_engine(w)
        _, running = w.say("a", conversation, "running", max_output_tokens=120, temperature=1.0)
        w.pump(lambda: w.device.executions.live and w.device.runner.engine.pool.owned)
        w.device.holds.file_cap = w.device.journal_bytes  # the journal reaches its cap now
        w.device.check_hold()
        assert w.device.holds.current["cause"] == "file_cap"
        assert code(w.mutate("a", "spaces.create", "/spaces", {})) == (429, "journal_hold")
        status, cancel = w.mutate("a", "cancellations.record", "/cancellations",
                                  {"target_sequence": running["sequence"]})
        assert status == 202 and cancel["target"] == running["operation"], cancel
        w.pump(w.finished("a", running["operation"]))
        done = w.read("a", "operations.get", operation=running["operation"])[1]
        assert done["terminal"]["status"] == "cancelled"
        state = saved_state(w, "a")
        w.boot()
        w.attach()
        assert saved_state(w, "a") == state
    finally:
        w.device.runner.stop()
        w.device.close()
