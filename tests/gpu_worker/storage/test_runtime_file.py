import fcntl
import hashlib
import os

import pytest
import torch

from gpu_worker.storage import runtime_file, runtime_file_lock, runtime_file_writer
from gpu_worker.storage.filelayer import Crash, FaultyFileLayer
from gpu_worker.storage.runtime_file import (ALIGN, DATA_START, FEATURE_BASE, FEATURE_SHARED, SLOT_OFFSETS, SLOT_SIZE,
                                     SUPERBLOCK, RuntimeFile, RuntimeFileError)
from gpu_worker.storage.runtime_file_lock import RuntimeFileLocked
from tests.conftest import flock_held_elsewhere


def components():
    return [
        ("gen/tensor/w", "tensor", torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16)),
        ("gen/tensor/h", "tensor", torch.tensor([1.5, -2.0], dtype=torch.float16)),
        ("gen/card", "json", {"name": "x", "layers": 2}),
        ("ids", "tensor", torch.arange(5, dtype=torch.int64)),
        ("mask", "tensor", torch.tensor([[1, 0], [0, 255]], dtype=torch.uint8)),
        ("scalar", "tensor", torch.tensor(3.25)),
        ("template", "text", "héllo {{ x }}"),
        ("blob", "bytes", b"\x00\x01\x02"),
    ]


@pytest.fixture
def path(tmp_path):
    path = tmp_path / "r.aotxccir"
    runtime_file_writer.create(path, components())
    return path


def slot_fields(path, slot):
    with open(path, "rb") as f:
        f.seek(SLOT_OFFSETS[slot])
        return SUPERBLOCK.unpack(f.read(SUPERBLOCK.size))


def corrupt(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_superblock_layout_has_the_documented_offsets():
    assert SUPERBLOCK.format == "<8sIIQQ16sQQQ32s32s"
    assert SUPERBLOCK.size == 136
    assert runtime_file.CHECKSUM_OFFSET == 104


def test_superblock_round_trips_and_fills_its_slot():
    superblock = runtime_file.Superblock(FEATURE_BASE, 0, bytes(range(16)), 7, 8192, 100, b"d" * 32)
    raw = superblock.pack()
    assert len(raw) == SLOT_SIZE and raw[SUPERBLOCK.size:] == bytes(SLOT_SIZE - SUPERBLOCK.size)
    assert runtime_file.Superblock.unpack(raw) == superblock
    assert hashlib.sha256(raw[:104]).digest() == raw[104:136]


def test_it_reads_back_every_kind_of_component(path):
    with RuntimeFile.open(path) as runtime:
        for name, kind, payload in components():
            if kind == "tensor":
                assert runtime.components[name].dtype == runtime_file_writer.DTYPE_NAMES[payload.dtype]
                assert torch.equal(runtime.tensor(name), payload)
            elif kind == "json":
                assert runtime.json(name) == payload
            elif kind == "text":
                assert runtime.text(name) == payload
            else:
                assert bytes(runtime.bytes(name)) == payload


def test_it_starts_every_extent_aligned_after_the_superblocks(path):
    with RuntimeFile.open(path) as runtime:
        offsets = [c.offset for c in runtime.components.values()]
    assert min(offsets) >= DATA_START
    assert all(offset % ALIGN == 0 for offset in offsets)
    fields = slot_fields(path, 0)
    assert fields[7] >= DATA_START and fields[7] % ALIGN == 0  # directory offset


def test_a_new_file_has_generation_1_in_slot_a_and_an_empty_slot_b(path):
    magic, version, header_size, required, optional, incarnation, generation, *_ = slot_fields(path, 0)
    assert (magic, version, header_size, required, generation) == (b"AOTXCCIR", 1, 136, FEATURE_BASE, 1)
    assert slot_fields(path, 1)[0] == bytes(8)
    with RuntimeFile.open(path) as runtime:
        assert (runtime.slot, runtime.generation, runtime.incarnation) == (0, 1, incarnation)


def test_each_new_file_gets_a_fresh_incarnation(tmp_path):
    runtime_file_writer.create(tmp_path / "a", components())
    runtime_file_writer.create(tmp_path / "b", components())
    assert slot_fields(tmp_path / "a", 0)[5] != slot_fields(tmp_path / "b", 0)[5]


def test_append_writes_the_other_slot_with_the_next_generation(path):
    incarnation = slot_fields(path, 0)[5]
    assert runtime_file_writer.append(path, [("extra", "text", "one")]) == 2
    assert slot_fields(path, 1)[6] == 2 and slot_fields(path, 0)[6] == 1
    assert runtime_file_writer.append(path, [("extra", "text", "two")]) == 3
    assert slot_fields(path, 0)[6] == 3 and slot_fields(path, 1)[6] == 2
    with RuntimeFile.open(path) as runtime:
        assert (runtime.slot, runtime.generation, runtime.incarnation) == (0, 3, incarnation)
        assert runtime.text("extra") == "two"


def test_append_reuses_existing_extents_and_replaces_same_named_components(path):
    with RuntimeFile.open(path) as before:
        old = dict(before.components)
    size = os.path.getsize(path)
    runtime_file_writer.append(path, [("gen/card", "json", {"name": "y"}), ("new", "bytes", b"z")])
    with RuntimeFile.open(path) as after:
        assert after.json("gen/card") == {"name": "y"}
        assert after.components["gen/card"].offset >= size
        assert after.components["new"].offset >= size
        for name, component in old.items():
            if name != "gen/card":
                assert after.components[name] == component
        assert torch.equal(after.tensor("gen/tensor/w"), components()[0][2])


def test_append_sets_required_bits(path):
    runtime_file_writer.append(path, [("shared_profile", "json", {})], set_required=FEATURE_SHARED)
    with RuntimeFile.open(path) as runtime:
        assert runtime.required_features == FEATURE_BASE | FEATURE_SHARED


def test_append_refuses_unknown_required_bits(path):
    with pytest.raises(ValueError):
        runtime_file_writer.append(path, [], set_required=1 << 5)


def test_append_refuses_while_another_writer_holds_the_file(path):
    with open(path, "rb") as other:
        fcntl.flock(other.fileno(), fcntl.LOCK_EX)
        with pytest.raises(RuntimeFileLocked, match="in use by another process"):
            runtime_file_writer.append(path, [("x", "text", "y")])


def test_a_second_file_lock_refuses_in_one_line_naming_the_holder(path):
    with runtime_file_lock.FileLock(path):
        with pytest.raises(RuntimeFileLocked) as error:
            runtime_file_lock.FileLock(path)  # flock is per open file description: even in one process
        assert str(error.value) == (f"runtime file {path} is in use by another process (pid {os.getpid()}: a device "
                                    "serving it, a pack or a checkpoint); stop it first")
    runtime_file_lock.FileLock(path).release()  # released: free again


def test_the_lock_holder_appends_under_its_lock_and_others_refuse(path):
    """A running device holds its file's lock for its life and still checkpoints into it."""
    with runtime_file_lock.FileLock(path):
        assert runtime_file_writer.append(path, [("x", "text", "y")]) == 2
    with flock_held_elsewhere(path) as pid:
        with pytest.raises(RuntimeFileLocked, match=f"in use by another process \\(pid {pid}"):
            runtime_file_writer.append(path, [("x", "text", "z")])
        with pytest.raises(RuntimeFileLocked, match=f"in use by another process \\(pid {pid}"):
            runtime_file_lock.FileLock(path)
    with RuntimeFile.open(path) as runtime:
        assert runtime.generation == 2 and runtime.text("x") == "y"


def test_create_refuses_to_replace_a_file_in_use(path):
    before = open(path, "rb").read()
    with flock_held_elsewhere(path):
        with pytest.raises(RuntimeFileLocked):
            runtime_file_writer.create(path, components())
    assert open(path, "rb").read() == before and not os.path.exists(f"{path}.tmp")
    with runtime_file_lock.FileLock(path):  # its holder may replace it
        runtime_file_writer.create(path, components())
    assert open(path, "rb").read() != before


def test_it_falls_back_to_the_older_slot_when_the_newer_checksum_is_corrupt(path):
    runtime_file_writer.append(path, [("gen/card", "json", {"name": "new"})])
    corrupt(path, SLOT_OFFSETS[1] + runtime_file.CHECKSUM_OFFSET)
    with RuntimeFile.open(path) as runtime:
        assert (runtime.slot, runtime.generation) == (0, 1)
        assert runtime.json("gen/card") == {"name": "x", "layers": 2}


def test_it_falls_back_when_the_newer_directory_does_not_match_its_digest(path):
    runtime_file_writer.append(path, [("gen/card", "json", {"name": "new"})])
    directory_offset = slot_fields(path, 1)[7]
    corrupt(path, directory_offset + 3)
    with RuntimeFile.open(path) as runtime:
        assert runtime.generation == 1


def test_it_refuses_a_file_without_a_valid_superblock(path):
    runtime_file_writer.append(path, [("extra", "text", "one")])
    corrupt(path, SLOT_OFFSETS[0] + 20)
    corrupt(path, SLOT_OFFSETS[1])
    with pytest.raises(RuntimeFileError, match="no valid superblock") as error:
        RuntimeFile.open(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_it_refuses_a_file_too_short_or_missing(tmp_path):
    (tmp_path / "short").write_bytes(b"AOTXCCIR")
    with pytest.raises(RuntimeFileError, match="too short"):
        RuntimeFile.open(tmp_path / "short")
    with pytest.raises(RuntimeFileError, match="cannot open"):
        RuntimeFile.open(tmp_path / "missing")


def test_it_names_the_component_whose_extent_is_corrupt(path):
    with RuntimeFile.open(path) as runtime:
        offset = runtime.components["gen/tensor/w"].offset
    corrupt(path, offset + 5)
    with pytest.raises(RuntimeFileError, match="'gen/tensor/w' fails its sha256 check"):
        RuntimeFile.open(path)
    with RuntimeFile.open(path, verify=False) as runtime:  # boot may skip hashing; the directory is still checked
        assert runtime.has("gen/tensor/w")


def test_a_serving_check_leaves_the_audit_extents_to_their_readers(path):
    """A boot checks what a device reads (`start_verify`: every extent but the audit's, which stay
    for the life of the file and would make every boot longer with each checkpoint ever made); an
    audit extent is checked when it is read (`read_verified`), and by a whole check."""
    runtime_file_writer.append(path, [("audit/00000002", "bytes", b"folded transfers" * 64)])
    with RuntimeFile.open(path) as runtime:
        audit = runtime.components["audit/00000002"].offset
        weights = runtime.components["gen/tensor/w"].offset
    corrupt(path, audit + 7)
    with RuntimeFile.open(path, verify=False) as runtime:
        runtime.start_verify()
        runtime.verified()  # what a device reads is intact
        with pytest.raises(RuntimeFileError, match="'audit/00000002' of generation"):
            runtime.read_verified("audit/00000002")
        with pytest.raises(RuntimeFileError, match="'audit/00000002' fails its sha256 check"):
            runtime.verify()
    corrupt(path, weights + 5)
    with RuntimeFile.open(path, verify=False) as runtime:
        runtime.start_verify()
        with pytest.raises(RuntimeFileError, match="'gen/tensor/w' fails its sha256 check"):
            runtime.verified()


def test_a_boots_check_runs_at_the_background_nice_value(path, monkeypatch):
    """start_verify(nice): the check's thread runs at that nice value (boot's background one), so
    the imports the load waits for first keep their CPU; the calling thread's stays as it was."""
    import os
    import threading
    seen = []
    real = RuntimeFile.verify

    def verify(self, served=False):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real(self, served)
    monkeypatch.setattr(RuntimeFile, "verify", verify)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with RuntimeFile.open(path, verify=False) as runtime:
        runtime.start_verify(min(mine + 7, 19))
        runtime.verified()
    assert seen == [min(mine + 7, 19)] and os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


def test_an_older_reader_refuses_a_required_shared_file(path):
    with RuntimeFile.open(path, known_required=FEATURE_BASE) as runtime:
        assert runtime.required_features == FEATURE_BASE
    runtime_file_writer.append(path, [("shared_profile", "json", {})], set_required=FEATURE_SHARED)
    with pytest.raises(RuntimeFileError, match=r"requires feature bits 0x2 \(shared\) unknown to this reader"):
        RuntimeFile.open(path, known_required=FEATURE_BASE)


def test_optional_bits_do_not_stop_a_reader(tmp_path):
    runtime_file_writer.create(tmp_path / "o", components(), optional=1 << 40)
    with RuntimeFile.open(tmp_path / "o") as runtime:
        assert runtime.optional_features == 1 << 40


def test_tensors_are_views_of_the_mapping_that_outlive_close(path):
    runtime = RuntimeFile.open(path)
    first, second = runtime.tensor("gen/tensor/w"), runtime.tensor("gen/tensor/w")
    assert first.data_ptr() == second.data_ptr()
    runtime.close()
    assert torch.equal(first, components()[0][2])


def test_writing_to_a_tensor_never_changes_the_file(path):
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    with RuntimeFile.open(path) as runtime:
        runtime.tensor("ids").add_(1)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest


def test_names_has_and_kind_checks(path):
    with RuntimeFile.open(path) as runtime:
        assert runtime.names("gen/tensor/") == ["gen/tensor/h", "gen/tensor/w"]
        assert runtime.has("blob") and not runtime.has("nope")
        with pytest.raises(RuntimeFileError, match="no component 'nope'"):
            runtime.bytes("nope")
        with pytest.raises(RuntimeFileError, match="is tensor, not json"):
            runtime.json("ids")


def test_model_digest_covers_names_and_contents_not_positions(tmp_path):
    runtime_file_writer.create(tmp_path / "a", components())
    runtime_file_writer.create(tmp_path / "b", [("padding", "bytes", b"p" * 10000)] + components()[::-1])
    runtime_file_writer.create(tmp_path / "c", [("gen/card", "json", {"name": "other"})] + components()[3:])
    with RuntimeFile.open(tmp_path / "a") as a, RuntimeFile.open(tmp_path / "b") as b, \
            RuntimeFile.open(tmp_path / "c") as c:
        assert a.components["gen/card"].offset != b.components["gen/card"].offset
        assert a.model_digest() == b.model_digest()
        assert a.model_digest() != c.model_digest()
        lines = "".join(f"{n}:{a.components[n].sha256}\n" for n in ["gen/card", "gen/tensor/h", "gen/tensor/w"])
        assert a.model_digest("gen") == hashlib.sha256(lines.encode()).hexdigest()


def test_create_refuses_duplicates_and_leaves_nothing_behind(tmp_path):
    with pytest.raises(ValueError, match="given twice"):
        runtime_file_writer.create(tmp_path / "d", components() + [("blob", "bytes", b"")])
    assert list(tmp_path.iterdir()) == []


def test_create_refuses_unstorable_payloads(tmp_path):
    with pytest.raises(ValueError, match="not storable"):
        runtime_file_writer.create(tmp_path / "d", [("x", "tensor", torch.zeros(2, dtype=torch.int32))])
    with pytest.raises(ValueError, match="unknown kind"):
        runtime_file_writer.create(tmp_path / "d", [("x", "pickle", b"")])
    with pytest.raises(ValueError, match="FEATURE_BASE"):
        runtime_file_writer.create(tmp_path / "d", [], required=FEATURE_SHARED)


def test_profiles_and_bootability_checks(path):
    with RuntimeFile.open(path) as runtime:
        assert runtime.shared_profile is None
        with pytest.raises(RuntimeFileError, match="no component 'gen/tokenizer'"):
            runtime.check_bootable()


# ---- reusing superseded extents (docs/runtime-file.md, "Writing") ----------------------------------

def contents(path):
    """(generation, {name: extent bytes}) of the winning generation, every extent checked (verify)."""
    with RuntimeFile.open(path) as runtime:
        return runtime.generation, {name: runtime.bytes(name).tobytes() for name in runtime.names()}


def test_appends_reuse_superseded_extents_so_a_replaced_state_stops_growing_the_file(path):
    """Each append replaces a 20 kB state (as every checkpoint does): the file grows while the first
    generations lay out their extents, then each new state and directory fills space an older
    generation superseded, and the size stays put."""
    sizes = []
    for i in range(20):
        runtime_file_writer.append(path, [("state/current", "bytes", bytes([i]) * 20000)])
        sizes.append(os.path.getsize(path))
        assert contents(path)[1]["state/current"] == bytes([i]) * 20000
    assert len(set(sizes[4:])) == 1, sizes


def test_the_previous_generation_stays_whole_while_superseded_space_is_reused(path):
    """The A/B guarantee holds with reuse: an append writes only where the current generation
    reaches nothing, so right after it the previous generation (the other slot) is whole — a
    reader falls back to it, every extent checked, if the new superblock is damaged."""
    for i in range(8):
        previous = contents(path)
        runtime_file_writer.append(path, [("state/current", "bytes", bytes([i]) * (5000 + 3000 * (i % 3))),
                                   (f"audit/{i:08d}", "bytes", bytes([i]) * 100)], drop=["blob"])
        backup = path.read_bytes()
        with RuntimeFile.open(path) as runtime:
            winner = SLOT_OFFSETS[runtime.slot]
        corrupt(path, winner + 50)
        assert contents(path) == previous
        path.write_bytes(backup)


def test_drop_leaves_a_component_out_of_the_next_generation(path):
    runtime_file_writer.append(path, [("extra", "text", "x")], drop=["blob", "not-there"])
    _, names = contents(path)
    assert "blob" not in names and names["extra"] == b"x" and "gen/card" in names


@pytest.mark.parametrize("torn", [False, True], ids=["whole-writes", "torn-writes"])
@pytest.mark.parametrize("mode", FaultyFileLayer.LOSS_MODES)
def test_an_append_interrupted_at_every_write_and_sync_leaves_one_whole_generation(tmp_path, mode, torn):
    """The append is stopped before each of its writes and syncs in turn (a torn write puts half
    its bytes first), then a power cut loses what was not synced (cut: undone; zeros, garbage:
    overwritten; prefix: the first writes kept). The file opens, every extent checked, as exactly
    the old generation or exactly the new one, and the next append goes on from there."""
    path = tmp_path / "r.aotxccir"
    runtime_file_writer.create(path, components())
    for i in range(3):  # earlier generations: superseded extents for this append to reuse
        runtime_file_writer.append(path, [("state/current", "bytes", bytes([i]) * 9000),
                                   (f"audit/{i:08d}", "bytes", bytes([i]) * 50)])
    before = path.read_bytes()
    old = contents(path)
    change = [("state/current", "bytes", b"new!" * 2500), ("audit/00000003", "bytes", b"y" * 60)]
    probe = FaultyFileLayer()
    runtime_file_writer.append(path, change, drop=["blob"], fs=probe)
    new = contents(path)
    assert new[0] == old[0] + 1 and probe.steps >= 5  # the writes, an fsync, the superblock, an fsync
    outcomes = set()
    for step in range(probe.steps):
        path.write_bytes(before)
        fs = FaultyFileLayer(seed=step)
        fs.crash_at(step, torn=torn)
        with pytest.raises(Crash):
            runtime_file_writer.append(path, change, drop=["blob"], fs=fs)
        fs.lose_unsynced(mode)
        after = contents(path)
        assert after in (old, new), f"step {step}"
        outcomes.add(after[0])
        runtime_file_writer.append(path, [("after", "text", f"{step}")])
        assert contents(path)[1]["after"] == str(step).encode()
    assert old[0] in outcomes


@pytest.mark.parametrize("mode", FaultyFileLayer.LOSS_MODES)
def test_an_append_after_one_that_died_before_its_last_sync_makes_that_generation_durable_first(tmp_path, mode):
    """A process that died after writing its superblock but before the fsync that makes it durable
    leaves a winner the disk may not hold yet (no power cut: the page cache still has it). The next
    append writes over what that winner supersedes — its predecessor, still the fallback on disk —
    so it syncs first: a power cut at any later point leaves a whole generation."""
    path = tmp_path / "r.aotxccir"
    runtime_file_writer.create(path, components())
    runtime_file_writer.append(path, [("state/current", "bytes", b"a" * 9000)])
    base = path.read_bytes()
    first = [("state/current", "bytes", b"b" * 9000)]
    second = [("state/current", "bytes", b"c" * 9000)]
    probe = FaultyFileLayer()
    runtime_file_writer.append(path, first, fs=probe)
    runtime_file_writer.append(path, second, fs=probe)
    steps = probe.steps // 2
    for step in range(steps):
        path.write_bytes(base)
        fs = FaultyFileLayer(seed=step)
        fs.crash_at(steps - 1)  # the first append's last fsync: its superblock is written, not synced
        with pytest.raises(Crash):
            runtime_file_writer.append(path, first, fs=fs)
        dead = contents(path)  # what the cache shows the next process: the first append's generation
        fs.crash_at(step)
        with pytest.raises(Crash):
            runtime_file_writer.append(path, second, fs=fs)
        fs.lose_unsynced(mode)
        generation, names = contents(path)
        whole = {b"a" * 9000, b"b" * 9000}
        if step == steps - 1:  # the second append's superblock is written, not synced: a cut may keep it
            whole.add(b"c" * 9000)
        assert names["state/current"] in whole, f"step {step}"
        if names["state/current"] != b"c" * 9000:
            assert step == 0 or (generation, names) == dead  # synced before anything was written over


def test_an_append_may_jump_to_a_later_generation_only(tmp_path):
    path = str(tmp_path / "f.aotxccir")
    runtime_file_writer.create(path, [("a", "bytes", b"1")])
    assert runtime_file_writer.append(path, [("b", "bytes", b"2")], generation=7) == 7
    with runtime_file.RuntimeFile.open(path) as f:
        assert f.generation == 7 and bytes(f.bytes("b")) == b"2"
    for generation in (7, 3):
        with pytest.raises(ValueError, match="cannot make it"):
            runtime_file_writer.append(path, [("c", "bytes", b"3")], generation=generation)
    assert runtime_file_writer.append(path, [("c", "bytes", b"3")]) == 8



def test_an_append_syncs_every_slice_so_no_sync_waits_for_the_whole_state(path):
    """A checkpoint's append is the whole state on the journal's disk: one fsync at its end held
    the journal's fdatasync (and every reply) until all of it was on the disk. Every sync of an
    append now finds at most SYNC_SLICE bytes written since the one before, and the state reads
    back whole."""
    from gpu_worker.storage.filelayer import OsFileLayer, OsRandomAccessFile

    syncs = []

    class Counting(OsRandomAccessFile):
        unsynced = 0

        def pwrite(self, data, offset):
            super().pwrite(data, offset)
            self.unsynced += len(memoryview(data).cast("B"))

        def fsync(self):
            syncs.append(self.unsynced)
            self.unsynced = 0
            super().fsync()

    class Layer(OsFileLayer):
        def open_rw(self, p):
            return Counting(p, os.open(p, os.O_RDWR | os.O_CLOEXEC))

    big = torch.arange(6 * runtime_file_writer.SYNC_SLICE // 8, dtype=torch.int64)  # 24 MiB at 4 MiB slices
    runtime_file_writer.append(path, [("state", "tensor", big), ("small", "text", "x" * 1000)], fs=Layer())
    assert max(syncs) <= runtime_file_writer.SYNC_SLICE + 4096 and len(syncs) >= 6
    with RuntimeFile.open(path) as runtime:
        assert torch.equal(runtime.tensor("state"), big) and runtime.text("small") == "x" * 1000
