import errno
import os

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
