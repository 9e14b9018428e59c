import errno
import os
import stat

import pytest

from gpu_worker.storage.filelayer import Crash, FaultyFileLayer, OsFileLayer


def test_os_layer_appends_truncates_and_reads(tmp_path):
    fs = OsFileLayer()
    path = str(tmp_path / "a")
    f = fs.open_append(path)
    f.write(b"hello ")
    f.write(b"world")
    f.fdatasync()
    assert f.size() == 11
    f.truncate(5)
    f.write(b"!")  # O_APPEND: lands at the new end, not at the old offset
    f.close()
    f.close()
    assert fs.read_file(path) == b"hello!"
    assert fs.exists(path) and fs.listdir(str(tmp_path)) == ["a"]
    fs.fsync_dir(str(tmp_path))
    free, total = fs.statvfs(str(tmp_path))
    assert 0 <= free <= total
    fs.remove(path)
    assert not fs.exists(path)


def test_os_layer_finishes_short_writes(tmp_path, monkeypatch):
    fs = OsFileLayer()
    path = str(tmp_path / "a")
    f = fs.open_append(path)
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data)[:3]))
    f.write(b"0123456789")
    monkeypatch.undo()
    f.close()
    assert fs.read_file(path) == b"0123456789"


def test_os_layer_reports_write_errors_after_a_short_write(tmp_path, monkeypatch):
    fs = OsFileLayer()
    f = fs.open_append(str(tmp_path / "a"))
    real_write = os.write
    calls = []

    def full_disk(fd, data):
        calls.append(len(data))
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, bytes(data)[:4])

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError) as info:
        f.write(b"0123456789")
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC and calls == [10, 6]
    assert f.size() == 4
    f.close()


def test_faulty_layer_writes_what_fits_then_raises_enospc(tmp_path):
    fs = FaultyFileLayer(space=10)
    path = str(tmp_path / "a")
    f = fs.open_append(path)
    f.write(b"0123")
    with pytest.raises(OSError) as info:
        f.write(b"456789abcdef")
    assert info.value.errno == errno.ENOSPC
    assert fs.read_file(path) == b"0123456789" and fs.space == 0
    assert fs.statvfs(str(tmp_path))[0] == 0
    f.truncate(4)  # cutting gives the space back
    assert fs.space == 6
    f.write(b"456789")
    assert fs.read_file(path) == b"0123456789"


def test_faulty_layer_fails_fdatasync_on_demand_and_keeps_the_old_durable_length(tmp_path):
    fs = FaultyFileLayer()
    path = str(tmp_path / "a")
    f = fs.open_append(path)
    f.write(b"abc")
    f.fdatasync()
    f.write(b"def")
    fs.fail_fdatasync(errno.EIO)
    with pytest.raises(OSError) as info:
        f.fdatasync()
    assert info.value.errno == errno.EIO
    assert fs.durable[path] == 3
    f.fdatasync()  # one failure was asked for
    assert fs.durable[path] == 6


def test_faulty_layer_fails_writes_on_demand(tmp_path):
    fs = FaultyFileLayer()
    f = fs.open_append(str(tmp_path / "a"))
    fs.fail_write(errno.EIO)
    with pytest.raises(OSError) as info:
        f.write(b"x")
    assert info.value.errno == errno.EIO
    f.write(b"y")
    assert f.size() == 1


@pytest.mark.parametrize("mode", FaultyFileLayer.LOSS_MODES)
def test_power_loss_keeps_exactly_the_durable_prefix(tmp_path, mode):
    fs = FaultyFileLayer(seed=3)
    path = str(tmp_path / "a")
    f = fs.open_append(path)
    fs.fsync_dir(str(tmp_path))
    f.write(b"durable")
    f.fdatasync()
    f.write(b"x" * 100)
    fs.lose_unsynced(mode)
    data = fs.read_file(path)
    assert data[:7] == b"durable"
    tail = data[7:]
    if mode == "cut":
        assert tail == b""
    elif mode == "zeros":
        assert tail == bytes(100)
    elif mode == "garbage":
        assert len(tail) == 100 and tail != b"x" * 100
    else:
        assert tail == b"x" * len(tail)
    with pytest.raises(OSError):
        f.write(b"the process is gone")


def test_power_loss_removes_files_whose_directory_was_never_synced(tmp_path):
    fs = FaultyFileLayer()
    kept, lost = str(tmp_path / "kept"), str(tmp_path / "lost")
    f = fs.open_append(kept)
    f.write(b"k")
    f.fdatasync()
    fs.fsync_dir(str(tmp_path))
    g = fs.open_append(lost)
    g.write(b"l")
    g.fdatasync()
    fs.lose_unsynced()
    assert fs.read_file(kept) == b"k"
    assert not fs.exists(lost)


def test_files_that_existed_before_count_as_durable(tmp_path):
    path = tmp_path / "old"
    path.write_bytes(b"already here")
    fs = FaultyFileLayer()
    f = fs.open_append(str(path))
    f.write(b"+new")
    fs.lose_unsynced()
    assert path.read_bytes() == b"already here"


def test_unknown_loss_mode_is_refused():
    with pytest.raises(ValueError):
        FaultyFileLayer().lose_unsynced("melt")


# ---- files written in place (the runtime file's appends) -------------------------------------------

def test_os_layer_writes_in_place_at_offsets_and_past_the_end(tmp_path):
    path = tmp_path / "r"
    path.write_bytes(b"0123456789")
    f = OsFileLayer().open_rw(str(path))
    f.pwrite(b"ab", 2)
    f.pwrite(memoryview(b"zz"), 12)  # past the end: the gap reads as zeros
    f.fsync()
    assert f.size() == 14
    f.close()
    assert path.read_bytes() == b"01ab456789\0\0zz"


@pytest.mark.parametrize("mode", FaultyFileLayer.LOSS_MODES)
def test_power_loss_undoes_or_damages_exactly_the_in_place_writes_since_the_last_fsync(tmp_path, mode):
    path = tmp_path / "r"
    path.write_bytes(b"0123456789")
    fs = FaultyFileLayer(seed=5)
    f = fs.open_rw(str(path))
    f.pwrite(b"AB", 0)
    f.fsync()  # durable
    f.pwrite(b"cd", 4)
    f.pwrite(b"efgh", 8)  # grows the file to 12
    fs.lose_unsynced(mode)
    data = path.read_bytes()
    if mode == "cut":
        assert data == b"AB23456789"
    elif mode == "zeros":
        assert data == b"AB23\0\0" + b"67" + bytes(4)
    elif mode == "garbage":
        assert data[:4] == b"AB23" and data[6:8] == b"67" and len(data) == 12
    else:  # the first writes (any number of them) stay, the rest are undone
        assert data in (b"AB23456789", b"AB23cd6789", b"AB23cd67efgh")
    with pytest.raises(OSError):
        f.pwrite(b"the process is gone", 0)


def test_a_crash_stops_the_chosen_write_or_sync_and_a_torn_write_puts_half_first(tmp_path):
    path = tmp_path / "r"
    path.write_bytes(bytes(8))
    fs = FaultyFileLayer()
    f = fs.open_rw(str(path))
    f.pwrite(b"a", 0)
    fs.crash_at(1)  # the second from now: the fsync after the next write
    f.pwrite(b"b", 1)
    with pytest.raises(Crash):
        f.fsync()
    assert fs.steps == 3 and path.read_bytes()[:2] == b"ab"
    fs.crash_at(0, torn=True)
    with pytest.raises(Crash):
        f.pwrite(b"wxyz", 4)
    assert path.read_bytes()[4:] == b"wx\0\0"
    fs.lose_unsynced("cut")
    assert path.read_bytes() == bytes(8)


# ---- a finished file put in place (write_atomically, atomic_writer, replace) ---------------------

def umasked(mode):
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def test_os_layer_puts_a_finished_file_in_place_whole_with_its_mode(tmp_path):
    fs = OsFileLayer()
    path = str(tmp_path / "f")
    fs.write_atomically(path, b"old", mode=0o640)
    fs.write_atomically(path, b"new content", mode=0o640)
    assert fs.read_file(path) == b"new content" and os.listdir(tmp_path) == ["f"]
    assert stat.S_IMODE(os.stat(path).st_mode) == umasked(0o640)
    with fs.atomic_writer(path, tmp=str(tmp_path / "t")) as f:
        f.pwrite(b"abc", 0)
        f.pwrite(b"Z", 5)
        assert fs.read_file(path) == b"new content"  # nothing under the name until the block ends
    assert fs.read_file(path) == b"abc\0\0Z" and sorted(os.listdir(tmp_path)) == ["f"]
    assert stat.S_IMODE(os.stat(path).st_mode) == umasked(0o600)  # the default


def test_os_layer_writes_fsyncs_renames_then_fsyncs_the_directory(tmp_path, monkeypatch):
    fs = OsFileLayer()
    path = str(tmp_path / "f")
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("fsync directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", os.path.basename(src), os.path.basename(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    fs.write_atomically(path, b"data")
    assert events == ["fsync file", ("rename", "f.tmp", "f"), "fsync directory"]
    events.clear()
    fs.replace(path, str(tmp_path / "g"))
    assert events == [("rename", "f", "g"), "fsync directory"]


def test_an_error_in_an_atomic_write_removes_its_temporary_file_and_keeps_the_old_one(tmp_path):
    fs = OsFileLayer()
    path = str(tmp_path / "f")
    fs.write_atomically(path, b"old")
    with pytest.raises(ValueError):
        with fs.atomic_writer(path) as f:
            f.pwrite(b"half", 0)
            raise ValueError("the writer failed")
    assert fs.read_file(path) == b"old" and os.listdir(tmp_path) == ["f"]
    faulty = FaultyFileLayer()
    faulty.fail_fdatasync(errno.EIO)
    with pytest.raises(OSError) as info:
        faulty.write_atomically(path, b"new")
    assert info.value.errno == errno.EIO
    assert fs.read_file(path) == b"old" and os.listdir(tmp_path) == ["f"] and not faulty.renamed
    (tmp_path / "taken").write_bytes(b"another writer's")
    for layer in (fs, faulty):  # exclusive: a temporary file already there is not truncated
        with pytest.raises(FileExistsError):
            layer.write_atomically(path, b"new", tmp=str(tmp_path / "taken"), exclusive=True)
    assert (tmp_path / "taken").read_bytes() == b"another writer's" and fs.read_file(path) == b"old"


def test_faulty_layer_write_atomically_is_four_steps_and_durable_once_done(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"old")
    fs = FaultyFileLayer()
    fs.write_atomically(str(path), b"new!")
    assert fs.steps == 4  # the write, the fsync, the rename, the directory sync
    assert not fs.renamed and not fs.unsynced
    fs.lose_unsynced()
    assert path.read_bytes() == b"new!" and os.listdir(tmp_path) == ["f"]


@pytest.mark.parametrize("mode", FaultyFileLayer.LOSS_MODES)
@pytest.mark.parametrize("existed", [True, False])
def test_a_crash_at_any_step_of_an_atomic_write_leaves_the_old_file_after_the_power_cut(tmp_path, mode, existed):
    """Crash before the write (torn), the fsync, the rename or the directory sync: until the
    rename the name holds the old file; after it the process sees the new one, but the rename is
    not durable, so the power cut brings the old one back (or no file, where there was none).
    The temporary file, never in a synced directory, is gone."""
    path = tmp_path / "f"
    for step, what in enumerate(["write", "fsync", "rename", "directory sync"]):
        if existed:
            path.write_bytes(b"old")
        fs = FaultyFileLayer(seed=step)
        fs.crash_at(step, torn=True)
        with pytest.raises(Crash):
            fs.write_atomically(str(path), b"brand new bytes")
        now = path.read_bytes() if path.exists() else None
        assert now == (b"brand new bytes" if what == "directory sync" else b"old" if existed else None), what
        fs.lose_unsynced(mode)
        assert os.listdir(tmp_path) == (["f"] if existed else []), what
        assert not existed or path.read_bytes() == b"old", what


def test_faulty_replace_undoes_both_names_in_a_power_cut_until_the_directory_is_synced(tmp_path):
    (tmp_path / "a").write_bytes(b"A")
    (tmp_path / "b").write_bytes(b"B")
    fs = FaultyFileLayer()
    fs.replace(str(tmp_path / "a"), str(tmp_path / "c"))  # synced by replace itself
    fs.crash_at(1)  # the directory sync of the next rename
    with pytest.raises(Crash):
        fs.replace(str(tmp_path / "b"), str(tmp_path / "c"))
    assert sorted(os.listdir(tmp_path)) == ["c"] and (tmp_path / "c").read_bytes() == b"B"
    fs.lose_unsynced()
    assert sorted(os.listdir(tmp_path)) == ["b", "c"]
    assert (tmp_path / "b").read_bytes() == b"B" and (tmp_path / "c").read_bytes() == b"A"
    fs = FaultyFileLayer()
    fs.crash_at(0)  # the rename itself
    with pytest.raises(Crash):
        fs.replace(str(tmp_path / "b"), str(tmp_path / "c"))
    assert (tmp_path / "c").read_bytes() == b"A" and fs.steps == 1
    fs.replace(str(tmp_path / "b"), str(tmp_path / "c"))
    fs.lose_unsynced()
    assert os.listdir(tmp_path) == ["c"] and (tmp_path / "c").read_bytes() == b"B"
