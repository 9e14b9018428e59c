"""Checkpoints and the runtime file's size and content (docs/checkpoint.md, docs/runtime-file.md):
a checkpoint reuses the space of the state it supersedes, so many checkpoints leave the file the
size of what its current generation holds plus a bounded slack; a checkpoint interrupted at any of
its writes and syncs loses nothing that was saved; and the checkpoint carries the media bytes it
lists, so a restore onto another journal directory has them (or says precisely which it lacks)."""
import hashlib
import os
import shutil

import numpy as np
import pytest
import torch

from gpu_worker.contract.grantfile import Grants
from gpu_worker.device import Device
from gpu_worker.pack import pack_tiny
from gpu_worker.storage import runtime_file_writer
from gpu_worker.storage.filelayer import Crash, FaultyFileLayer
from gpu_worker.storage.runtime_file import ALIGN, DATA_START, RuntimeFile
from gpu_worker.state.tables import ALONE, HELD, R, Source
from tests.gpu_worker.kinds.test_shared_state import World, code


def own_runtime(tmp_path):
    path = str(tmp_path / "own.aotxccir")
    pack_tiny(path, shared=True)
    return path


def aligned(n):
    return -(-n // ALIGN) * ALIGN


def layout(path):
    """(file size, bytes the winning generation reaches — its extents and directory, each aligned —,
    the largest state extent plus directory, aligned)."""
    with RuntimeFile.open(path, verify=False) as runtime:
        live = sum(aligned(c.length) for c in runtime.components.values())
        directory = aligned(runtime._superblock.directory_length)
        state = aligned(runtime.components["state/current"].length) if runtime.has("state/current") else 0
    return os.path.getsize(path), DATA_START + live + directory, state + directory


def saved(w, name="a"):
    return w.read(name, "participant.get")[1], w.read(name, "operations.list", limit=200)[1]


def test_many_checkpoints_leave_the_file_the_size_of_what_it_holds_plus_a_bounded_slack(tmp_path):
    """Each checkpoint writes a new state and directory and supersedes the previous ones: their
    space is reused, so what the file holds beyond its current generation stays under two states
    and directories however many checkpoints run (before, every checkpoint added a state)."""
    w = World(own_runtime(tmp_path), tmp_path, ["a"])
    slack = []
    for _ in range(30):
        w.space("a")
        assert w.device.checkpoint() is not None
        size, live, state = layout(w.runtime)
        slack.append((size - live, state))
    assert all(extra <= 2 * state for extra, state in slack), slack
    w.device.close()


@pytest.mark.parametrize("mode", FaultyFileLayer.LOSS_MODES)
def test_a_checkpoint_interrupted_at_every_write_and_sync_loses_nothing_saved(tmp_path, mode):
    """The device's checkpoint (state, audit and a media source's bytes into the runtime file,
    where superseded extents were) is stopped before each of its writes and syncs in turn, as a
    crash would, and the power cut loses what was not synced. The next boot on the same journal
    (a restart) reads back every saved receipt and the participant exactly, and checkpoints again."""
    w = World(own_runtime(tmp_path), tmp_path, ["a"])
    for _ in range(3):  # earlier checkpoints: superseded extents for the next one to reuse
        w.space("a")
        w.device.checkpoint()
    data = b"\x89PNG" * 300
    assert w.read("a", "media.put", sha256=hashlib.sha256(data).hexdigest(), data=data, type="image")[0] == 201
    w.space("a")
    expected = saved(w)
    w.device.close()
    snapshot = tmp_path / "snapshot"
    shutil.copytree(w.journal, snapshot / "journal", ignore=shutil.ignore_patterns("lock"))
    shutil.copyfile(w.runtime, snapshot / "runtime")

    def restore_snapshot():
        shutil.rmtree(w.journal)
        shutil.copytree(snapshot / "journal", w.journal)
        with open(w.runtime, "r+b") as f:  # in place: the same inode, so the next boot is a restart
            f.write((snapshot / "runtime").read_bytes())
            f.truncate()

    probe = FaultyFileLayer()
    w.device = Device(RuntimeFile.open(w.runtime), w.journal, Grants(w.grants_path))
    w.device.runtime_fs = probe
    assert w.device.checkpoint() is not None
    w.device.close()
    assert probe.steps >= 6  # state, audit, media, directory, fsync, superblock, fsync
    for step in range(probe.steps):
        restore_snapshot()
        w.device = Device(RuntimeFile.open(w.runtime), w.journal, Grants(w.grants_path))
        fs = FaultyFileLayer(seed=step)
        fs.crash_at(step, torn=step % 2 == 1)
        w.device.runtime_fs = fs
        with pytest.raises(Crash):
            w.device.checkpoint()
        w.device.close()
        fs.lose_unsynced(mode)
        w.device = Device(RuntimeFile.open(w.runtime), w.journal, Grants(w.grants_path))  # verifies every extent
        participant, receipts = saved(w)
        assert participant == expected[0], f"step {step}"
        assert [{k: v for k, v in r.items() if k != "admission" and k != "terminal"} for r in receipts["items"]] \
            == [{k: v for k, v in r.items() if k != "admission" and k != "terminal"} for r in expected[1]["items"]]
        assert [r["admission"]["save"]["commit_digest"] for r in receipts["items"]] == \
            [r["admission"]["save"]["commit_digest"] for r in expected[1]["items"]]
        assert w.device.checkpoint() is not None
        w.device.close()


def test_a_restore_on_a_fresh_journal_gets_the_media_bytes_the_checkpoint_lists(tmp_path):
    """SPEC: "The complete runtime file saves this state": the checkpoint lists a media source and
    carries its bytes, so the file restored on a fresh journal directory writes them back under
    its media directory, byte for byte; a source uploaded after the checkpoint is lost with the
    journal's tail, as everything saved after it."""
    w = World(own_runtime(tmp_path), tmp_path, ["a"])
    kept, lost = b"\x89PNG kept" * 100, b"\x89PNG lost" * 100
    kept_sha, lost_sha = hashlib.sha256(kept).hexdigest(), hashlib.sha256(lost).hexdigest()
    assert w.read("a", "media.put", sha256=kept_sha, data=kept, type="image")[0] == 201
    w.device.checkpoint()
    assert w.read("a", "media.put", sha256=lost_sha, data=lost, type="image")[0] == 201
    with RuntimeFile.open(w.runtime) as runtime:
        assert runtime.names("media/") == [f"media/{kept_sha}"]
    w.device.close()
    w.journal = str(tmp_path / "restored-journal")
    w.write_grants()
    w.device = Device(RuntimeFile.open(w.runtime), w.journal, Grants(w.grants_path))
    with open(os.path.join(w.journal, "media", kept_sha), "rb") as f:
        assert f.read() == kept
    assert not os.path.exists(os.path.join(w.journal, "media", lost_sha))
    assert w.device.state.media.keys() == {kept_sha}
    status, ping = w.read("a", "ping")
    assert status == 200 and ping["media_missing"] == []
    w.device.close()


def test_a_restore_that_lacks_a_sources_bytes_names_it_and_refuses_inputs_until_it_is_uploaded(tmp_path):
    """A checkpoint written before checkpoints carried media bytes lists a source without them: a
    restore onto a fresh journal directory knows which source it lacks (the boot log, `ping`'s
    `media_missing`) and an input naming it answers 409 `media_unavailable` with its sha256 —
    until its owner uploads it again."""
    w = World(own_runtime(tmp_path), tmp_path, ["a"])
    space = w.space("a")
    status, created = w.mutate("a", "conversations.create", f"/spaces/{space}/conversations", {})
    conversation = created["target"]
    data = b"\x89PNG old" * 100
    sha = hashlib.sha256(data).hexdigest()
    assert w.read("a", "media.put", sha256=sha, data=data, type="image")[0] == 201
    w.device.checkpoint()
    w.device.close()
    runtime_file_writer.append(w.runtime, [], drop=[f"media/{sha}"])  # as an older checkpoint wrote it
    w.journal = str(tmp_path / "restored-journal")
    w.write_grants()
    w.device = Device(RuntimeFile.open(w.runtime), w.journal, Grants(w.grants_path))
    assert w.read("a", "ping")[1]["media_missing"] == [sha]
    media = [{"type": "image", "sha256": sha}]
    args = {"text": "look", "model": "tiny-llama", "media": media}
    status, refused = w.mutate("a", "conversations.input", f"/conversations/{conversation}/inputs", args,
                               extra={"conversation": conversation})
    assert (status, refused["error"]["code"], refused["error"]["sha256"]) == (409, "media_unavailable", sha)
    assert w.read("a", "media.put", sha256=sha, data=data, type="image")[0] == 200  # its owner uploads it again
    assert w.read("a", "ping")[1]["media_missing"] == []
    with open(os.path.join(w.journal, "media", sha), "rb") as f:
        assert f.read() == data
    # the tiny model takes no media: past the bytes check, model compatibility refuses
    assert code(w.mutate("a", "conversations.input", f"/conversations/{conversation}/inputs", args,
                         extra={"conversation": conversation})) == (409, "model_lacks_media")
    w.device.checkpoint()  # the next checkpoint carries its bytes
    with RuntimeFile.open(w.runtime) as runtime:
        assert runtime.names("media/") == [f"media/{sha}"]
    w.device.close()


def test_a_state_extent_reads_the_same_in_both_layouts_and_refuses_a_damaged_head(tmp_path):
    """Version 2 keeps the large byte strings after a msgpack head that names them (ext values);
    version 1, one msgpack map, still loads. Both decode to the same map, and a boot from a
    version 1 extent reads back what one from version 2 does."""
    import msgpack

    from gpu_worker.state import DeviceState
    from gpu_worker.storage import checkpoint
    w = World(own_runtime(tmp_path), tmp_path, ["a", "b"])
    try:
        for name in ("a", "b"):
            w.space(name)
        state = w.device.state
        blob = checkpoint.encode_state(state, 7, b"d" * 32, 3)
        assert blob[:8] == b"AOTXST\x00\x02"
        spilled = checkpoint.decode_state(blob)
        assert isinstance(spilled["commands"], memoryview) and spilled["last_digest"] == b"d" * 32
        whole = msgpack.packb(spilled, use_bin_type=True)  # version 1's layout of the same map
        assert checkpoint.decode_state(whole) == spilled
        loaded = []
        for extent in (blob, whole):
            fresh = DeviceState(state.capacities, "cpu", state.incarnation, 3, w.device.embedding_dim)
            checkpoint.load_state(fresh, extent, 6)
            loaded.append([getattr(fresh.tables, n).clone() for n in ("receipts", "spaces", "command_bytes",
                                                                       "receipt_digests")])
        assert all(map(torch.equal, *loaded))
        assert torch.equal(loaded[0][1], state.tables.spaces) and torch.equal(loaded[0][2], state.tables.command_bytes)
        # its receipts are saved marked (their saves in the file, at its generation); an extent
        # written before that, its receipts as the tables had them, is marked as it loads: the same rows
        rows, marked = spilled["tables"]["receipts"]
        as_kept = state.tables.receipts.numpy()[np.frombuffer(rows, dtype="<i8")].astype("<i8").tobytes()
        assert spilled["marked"] and as_kept != bytes(marked)
        older = {**{k: v for k, v in spilled.items() if k != "marked"},
                 "tables": {**spilled["tables"], "receipts": [rows, as_kept]}}
        fresh = DeviceState(state.capacities, "cpu", state.incarnation, 3, w.device.embedding_dim)
        checkpoint.load_saved(fresh, older, 6)
        assert torch.equal(fresh.tables.receipts, loaded[0][0])
        sources = fresh.tables.receipts[fresh.tables.receipts[:, R.STATE] != 0][:, [R.ADM_SOURCE, R.ADM_GENERATION]]
        assert set(map(tuple, sources.tolist())) <= {(int(Source.FILE) | bit, 3) for bit in (0, HELD, ALONE)}
        head = int.from_bytes(blob[8:16], "little")
        for damaged, why in ((blob[:16 + head - 1], "head runs past"),  # cut inside the head
                             (blob[:16 + head + 10], "runs past its end")):  # cut inside the values
            with pytest.raises(ValueError, match=why):
                checkpoint.decode_state(damaged)
    finally:
        w.device.close()


def test_a_checkpoint_removes_its_segments_a_slice_at_a_time_and_a_boot_what_a_stop_left(tmp_path, monkeypatch):
    """The folded segments are renamed out of the journal's segments, cut TRIM_SLICE bytes at a
    time from their end, then removed (a segment of hundreds of MB removed at once held the
    journal's fdatasync); one a stop left under its trimmed name is removed by the next boot, and
    everything saved reads back."""
    from gpu_worker.storage import checkpoint
    from gpu_worker.storage.filelayer import OsAppendFile
    from gpu_worker.storage.journal import TRIMMED, list_segments
    monkeypatch.setattr(checkpoint, "TRIM_SLICE", 1024)
    cuts, real_truncate = [], OsAppendFile.truncate

    def truncate(self, length):
        cuts.append((os.path.basename(self.path), length))
        real_truncate(self, length)
    monkeypatch.setattr(OsAppendFile, "truncate", truncate)
    w = World(own_runtime(tmp_path), tmp_path, ["a"])
    for _ in range(6):
        w.space("a")
    folded = list_segments(w.journal, w.device.fs)
    size = os.path.getsize(os.path.join(w.journal, "%08d.journal" % folded[-1]))
    assert w.device.checkpoint() is not None
    lengths = [length for name, length in cuts if name == TRIMMED + "%08d.journal" % folded[-1]]
    assert lengths == list(range(size - 1024, 0, -1024)) and len(lengths) >= 2, (size, cuts)
    assert not set(folded) & set(list_segments(w.journal, w.device.fs))
    assert not [n for n in os.listdir(w.journal) if n.startswith(TRIMMED)]
    expected = saved(w)
    w.device.close()
    left = os.path.join(w.journal, TRIMMED + "%08d.journal" % folded[-1])
    with open(left, "wb") as f:  # what a stop in the middle of a trim leaves
        f.write(b"\0" * 3000)
    w.boot()
    assert not os.path.exists(left)
    assert saved(w) == expected
    w.device.close()
