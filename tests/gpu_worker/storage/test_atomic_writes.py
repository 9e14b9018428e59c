"""Every writer that puts a finished file in place goes through the file layer (filelayer.py:
`write_atomically`, `atomic_writer`, `replace`), so the fault layer can stop it at its writes, its
fsync, its rename and its directory sync. Stopped at any of them, and then after the power cut
that follows, the file's name holds the previous file whole (or nothing, where there was none):
never a part of the new one, and no temporary file is left in its directory.

The device's own sites (the owner marker at boot, a media upload, an audit export, a damaged
media file moved aside, a takeover's DIR/standby) go through the device's layer, `d.fs`; the
others (the standby's media and marker, the grant file, a new runtime file) take one."""
import collections
import dataclasses
import hashlib
import json
import os
import secrets
import stat
from types import SimpleNamespace

import pytest

from gpu_worker.contract import grantfile
from gpu_worker.contract.grantfile import Grants
from gpu_worker.device import Device
from gpu_worker.kinds import media
from gpu_worker.replication.frames import MediaPiece
from gpu_worker.replication.marker import read_marker, record_takeover, write_marker
from gpu_worker.replication.mirror import Mirror
from gpu_worker.state import MediaSource
from gpu_worker.storage import owner, runtime_file_writer
from gpu_worker.storage.filelayer import Crash, FaultyFileLayer
from gpu_worker.storage.runtime_file import RuntimeFile
from tests.gpu_worker.test_faults import FaultyWorld


def listing(directory):
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def crash_at_every_step(directory, reset, write, read):
    """`write(fs)` replaces a file in `directory` through the layer fs; `read()` what its name
    holds now (None: nothing); `reset()` puts the previous file back. Run once to count its steps,
    then stopped at each in turn (a write torn): the name holds the previous file until the rename
    and, after the power cut, again. Returns the steps, by number."""
    reset()
    before, names = read(), listing(directory)
    probe = FaultyFileLayer()
    write(probe)
    after = read()
    assert after != before and probe.steps >= 4, probe.steps
    for step in range(probe.steps):
        reset()
        fs = FaultyFileLayer(seed=step)
        fs.crash_at(step, torn=True)
        with pytest.raises(Crash):
            write(fs)
        # the last step is the directory sync: the process saw the rename, the disk may not have
        assert read() == (after if step == probe.steps - 1 else before), f"step {step}"
        fs.lose_unsynced("garbage" if step % 2 else "cut")
        assert read() == before and listing(directory) == names, f"step {step}"
    return probe.steps


def test_owner_marker(tmp_path):
    old = owner.Owner("a" * 32, 1, 3, 10, 1)
    new = owner.Owner("a" * 32, 1, 4, 11, 1)
    crash_at_every_step(tmp_path, lambda: owner.write(str(tmp_path), old),
                        lambda fs: owner.write(str(tmp_path), new, fs), lambda: owner.read(str(tmp_path)))
    assert stat.S_IMODE(os.stat(owner.path(str(tmp_path))).st_mode) & 0o077 == 0


def test_a_boot_stopped_while_it_replaces_the_owner_marker_leaves_the_old_one_and_boots_again(tiny_runtime, tmp_path):
    """Through the device's own layer (d.fs): each boot rewrites DIR/owner first (storage/owner.py);
    stopped at each of its four steps, the marker read after the power cut is the previous boot's,
    and the next boot is a restart of this journal."""
    w = FaultyWorld(tiny_runtime, tmp_path, ["a"], FaultyFileLayer())
    w.space("a")
    w.device.close()
    w.device = None
    before = owner.read(w.journal)
    assert isinstance(before, owner.Owner)
    for step in range(4):  # the write, the fsync, the rename, the directory sync
        fs = FaultyFileLayer(seed=step)
        fs.crash_at(step)
        with pytest.raises(Crash):
            Device(RuntimeFile.open(w.runtime), w.journal, Grants(w.grants_path), fs=fs)
        fs.lose_unsynced()
        assert owner.read(w.journal) == before and not any(".tmp" in n for n in os.listdir(w.journal)), step
    w.fs = FaultyFileLayer()
    w.boot()
    assert w.fs.steps == 4  # the boot's one atomic write: the marker
    assert owner.read(w.journal) == dataclasses.replace(before, boot=before.boot + 1)
    assert w.read("a", "spaces.list")[0] == 200
    w.device.close()


def test_media_source(tmp_path):
    data = b"\x89PNG" * 100
    sha = hashlib.sha256(data).hexdigest()
    directory = str(tmp_path / "media")
    path = os.path.join(directory, sha)

    def reset():
        os.makedirs(directory, exist_ok=True)
        if os.path.exists(path):
            os.remove(path)

    def read():
        return open(path, "rb").read() if os.path.exists(path) else None

    crash_at_every_step(directory, reset, lambda fs: media._store(directory, fs, sha, data), read)


def test_a_media_upload_stopped_at_any_step_leaves_no_file_and_uploads_again(tiny_runtime, tmp_path):
    """Through the device's own layer (d.fs): an upload stopped at its write, fsync, rename or
    directory sync answers 507, and after the power cut no file (whole or not) has the source's
    name; the next upload of it is saved (201)."""
    fs = FaultyFileLayer()
    w = FaultyWorld(tiny_runtime, tmp_path, ["a"], fs)
    directory = os.path.join(w.journal, "media")
    for step in range(4):
        data = b"\x89PNG" + bytes([step]) * 300
        sha = hashlib.sha256(data).hexdigest()
        fs.crash_at(step)
        status, body = w.read("a", "media.put", sha256=sha, data=data, type="image")
        assert (status, body["error"]["code"]) == (507, "media_write_failed"), body
        assert os.path.exists(os.path.join(directory, sha)) == (step == 3)  # the rename made, not synced
        w.device.close()
        w.device = None
        fs.lose_unsynced()
        assert not any(n.startswith(sha) for n in listing(directory)), step
        fs = w.fs = FaultyFileLayer(seed=step)
        w.boot()
        before = fs.steps
        assert w.read("a", "media.put", sha256=sha, data=data, type="image")[0] == 201
        assert fs.steps == before + 4 and media.read_source(w.device, sha) == data
    w.device.close()


def test_a_damaged_media_file_moved_aside(tmp_path):
    """recover_bytes moves a listed source's file of the wrong length aside (d.fs.replace): stopped
    at the rename or its directory sync, the power cut leaves it under its own name, unchanged."""
    sha = "ab" * 32
    directory = tmp_path / "media"
    path = directory / sha

    def reset():
        directory.mkdir(exist_ok=True)
        for name in os.listdir(directory):
            os.remove(directory / name)
        path.write_bytes(b"not its bytes")

    def recover(fs):
        state = SimpleNamespace(media={sha: MediaSource(length=100, type="image")})
        d = SimpleNamespace(journal_dir=str(tmp_path), fs=fs, state=state,
                            runtime=SimpleNamespace(components={}, path="runtime"))
        media.recover_bytes(d)
        assert state.media[sha].missing

    def read():
        return {name: (directory / name).read_bytes() for name in listing(directory)}

    reset()
    for step in range(2):  # the rename, the directory sync
        reset()
        fs = FaultyFileLayer()
        fs.crash_at(step)
        with pytest.raises(Crash):
            recover(fs)
        assert read() == ({f"{sha}.damaged": b"not its bytes"} if step else {sha: b"not its bytes"})
        fs.lose_unsynced()
        assert read() == {sha: b"not its bytes"}, step
    reset()
    fs = FaultyFileLayer()
    recover(fs)
    fs.lose_unsynced()
    assert read() == {f"{sha}.damaged": b"not its bytes"} and fs.steps == 2


def ops(world, op, **args):
    inbox = collections.deque([("ops", {"v": 1, "id": next(world.ids), "op": op, "principal": None, "args": args})])
    [(_, msg)] = world.device.committer.run_sync(inbox) + world.device.take_outbox()
    return msg.status, json.loads(msg.body)


def test_an_audit_export_stopped_at_any_step_leaves_the_previous_export(tiny_runtime, tmp_path):
    """Through the device's own layer (d.fs): `audit.export` stopped at its write, fsync, rename
    or directory sync answers 507, and after the power cut the previous export is there, whole."""
    fs = FaultyFileLayer()
    w = FaultyWorld(tiny_runtime, tmp_path, ["a"], fs)
    out = str(tmp_path / "exports" / "audit.jsonl")
    os.makedirs(os.path.dirname(out))
    assert ops(w, "audit.export", path=out)[0] == 200
    previous = open(out, "rb").read()
    for step in range(4):
        w.space("a")
        fs.crash_at(step)
        status, body = ops(w, "audit.export", path=out)
        assert (status, body["error"]["code"]) == (507, "audit_export_failed"), body
        assert (open(out, "rb").read() == previous) == (step < 3)  # the rename made, not synced
        w.device.close()
        w.device = None
        fs.lose_unsynced()
        assert open(out, "rb").read() == previous and os.listdir(os.path.dirname(out)) == ["audit.jsonl"]
        fs = w.fs = FaultyFileLayer(seed=step)
        w.boot()
    before = fs.steps
    status, summary = ops(w, "audit.export", path=out)
    assert status == 200 and fs.steps == before + 4
    assert open(out, "rb").read().startswith(previous) and summary["last_seq"] > previous.count(b"\n")
    w.device.close()


def test_standby_marker(tmp_path):
    def read():
        return read_marker(str(tmp_path))

    steps = crash_at_every_step(tmp_path, lambda: write_marker(str(tmp_path), {"replication": "sync"}),
                                lambda fs: record_takeover(str(tmp_path), (3, 128), fs), read)
    assert steps == 4 and "takeovers" not in read()
    record_takeover(str(tmp_path), (3, 128), FaultyFileLayer())
    assert read()["takeovers"] == [[3, 128]] and read()["replication"] == "sync"


def test_standby_media_source(tmp_path):
    """The standby's copy of a media source, received in pieces (Mirror.media_piece): its file is
    named only once whole, hashed and durable."""
    data = b"\x89PNG" * 500
    sha = hashlib.sha256(data).hexdigest()
    journal = tmp_path / "journal"
    directory = journal / "media"
    pieces = [MediaPiece(media=sha, size=len(data), offset=at, data=data[at:at + 700]) for at in range(0, len(data), 700)]

    def reset():
        directory.mkdir(parents=True, exist_ok=True)
        for name in os.listdir(directory):
            os.remove(directory / name)

    def receive(fs):
        mirror = Mirror(str(journal), bytes(16), fs=fs)
        try:
            for piece in pieces:
                mirror.media_piece(piece)
        finally:
            mirror.close()

    def read():
        return (directory / sha).read_bytes() if (directory / sha).exists() else None

    assert crash_at_every_step(directory, reset, receive, read) == len(pieces) + 3


def test_grant_file(tmp_path):
    path = str(tmp_path / "grants.json")
    pid = secrets.token_hex(16)

    def read():
        return open(path, "rb").read()

    old = grantfile.document({pid: ("old", ["shared_read"])}, written_at_ns=1)
    new = grantfile.document({pid: ("new", ["chat"])}, written_at_ns=2)
    crash_at_every_step(tmp_path, lambda: grantfile.write(path, old), lambda fs: grantfile.write(path, new, fs), read)
    assert stat.S_IMODE(os.stat(path).st_mode) & ~grantfile.FILE_MODE == 0


def test_new_runtime_file(tmp_path):
    """runtime_file_writer.create over an existing file (its many writes, then the usual three)."""
    path = str(tmp_path / "r.aotxccir")

    def read():
        with RuntimeFile.open(path) as runtime:  # verifies every extent
            return runtime.text("card")

    steps = crash_at_every_step(tmp_path, lambda: runtime_file_writer.create(path, [("card", "text", "old")]),
                                lambda fs: runtime_file_writer.create(
                                    path, [("card", "text", "new"), ("blob", "bytes", os.urandom(5000))], fs=fs),
                                read)
    assert steps >= 7  # the slots, the extents, the directory, the superblock; fsync, rename, directory sync
