"""`python -m gpu_worker boot` refusing a configuration it cannot serve: one line on stderr naming
the problem and the step that fixes it, a non-zero exit, and nothing written to the journal
directory (DESIGN §1: "exits non-zero with a one-line reason when its configuration is wrong")."""
import os
import secrets
import subprocess

from gpu_worker.pack import pack_tiny
from tests.conftest import ALL, PYTHON, ROOT, write_grants


def boot(tmp_path, runtime):
    """`python -m gpu_worker boot` of `runtime` with a fresh grant file into tmp_path/journal, run
    to its exit: (the finished process, the journal directory)."""
    grants = tmp_path / "grants.json"
    write_grants(grants, {secrets.token_hex(16): ALL})
    journal = tmp_path / "journal"
    out = subprocess.run([PYTHON, "-m", "gpu_worker", "boot", "--ccir", str(runtime), "--journal", str(journal),
                          "--service-grants", str(grants), "--device", "cpu"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    return out, journal


def test_boot_refuses_a_runtime_packed_without_shared_in_one_line(tmp_path):
    """SPEC: "The service requires a complete runtime profile with shared state enabled"."""
    runtime = tmp_path / "plain.aotxccir"
    pack_tiny(str(runtime))  # no --shared: no shared profile, no FEATURE_SHARED
    out, journal = boot(tmp_path, runtime)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"boot: runtime file {runtime} has no shared profile; "), out.stderr
    assert f"pack --runtime {runtime} --shared" in out.stderr
    # refused before anything was recorded: no segment, no owner marker, no socket
    assert not journal.exists() or sorted(os.listdir(journal)) in ([], ["lock"])


def test_boot_refuses_replication_flags_that_do_not_go_together(tmp_path, capsys):
    """--standby-timeout is for a sync primary; a standby (--standby-of) does not boot a journal with
    --takeover (it takes over by itself: SIGUSR1, or the leader key gone)."""
    from gpu_worker.recovery import boot
    base = ["--ccir", str(tmp_path / "r.aotxccir"), "--journal", str(tmp_path / "journal"),
            "--service-grants", str(tmp_path / "grants.json")]
    for extra, words in ((["--standby-timeout", "5"], "--standby-timeout S"),
                         (["--replicate", "/tmp/x.sock", "--replication", "async", "--standby-timeout", "5"],
                          "--standby-timeout S"),
                         (["--standby-of", "/tmp/x.sock", "--takeover"], "--standby-of follows a primary")):
        assert boot.main(base + extra) == 2
        err = capsys.readouterr().err
        assert err.startswith("boot: ") and words in err and err.count("\n") == 1, err
    assert not (tmp_path / "journal").exists()


def test_boot_refuses_a_runtime_file_that_fails_its_check_before_it_journals(tmp_path):
    """Boot checks the runtime file's extents on a thread beside the load (RuntimeFile.start_verify):
    a flipped byte in one still stops it with the component named, before anything is journaled
    or served."""
    from gpu_worker.storage.runtime_file import RuntimeFile
    runtime = tmp_path / "flipped.aotxccir"
    pack_tiny(str(runtime), shared=True)
    with RuntimeFile.open(str(runtime)) as opened:
        extent = opened.components["gen/tensor/embed_tokens"]
    with open(runtime, "r+b") as f:
        f.seek(extent.offset + extent.length // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    out, journal = boot(tmp_path, runtime)
    assert out.returncode == 2, out.stderr
    assert "'gen/tensor/embed_tokens' fails its sha256 check" in out.stderr, out.stderr
    assert "device ready" not in out.stdout
    assert not journal.exists() or sorted(os.listdir(journal)) in ([], ["lock"])  # no segment: no BOOT transfer


def test_boot_locks_and_reads_the_journal_without_torch(tmp_path):
    """Boot locks the journal, decodes the checkpoint's head and starts the journal's reader
    (recovery/reading.py) before the device's code imports torch, so that reading runs on another
    CPU while torch loads: nothing on that path imports torch, and the lock is held from there on."""
    from gpu_worker.storage.journal_lock import JournalLock, JournalLocked
    runtime = tmp_path / "r.aotxccir"
    pack_tiny(str(runtime), shared=True)
    journal = tmp_path / "journal"
    code = ("import sys\nfrom gpu_worker.storage.runtime_file import RuntimeFile\n"
            "from gpu_worker.recovery.reading import start\n"
            f"early = start(RuntimeFile.open({str(runtime)!r}, verify=False), {str(journal)!r})\n"
            "pieces = list(early.reading)\n"
            "result = early.reading.result()\n"
            "print('read', sum(map(len, pieces)), result.next_seq, 'torch' in sys.modules, flush=True)\n"
            "sys.stdin.readline()\n")
    proc = subprocess.Popen([PYTHON, "-c", code], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "read 0 1 False\n", proc.stderr.read() if proc.poll() else ""
        try:
            JournalLock(str(journal))
            raise AssertionError("the journal was not locked while it was read")
        except JournalLocked:
            pass
    finally:
        proc.communicate("\n", timeout=60)
    assert proc.returncode == 0


def test_boot_forks_the_child_filling_the_checkpoints_tables_before_any_thread_and_without_torch(tmp_path):
    """From a checkpoint, boot's early read (recovery/reading.py) forks the child that fills the
    tables (recovery/preload.py) before torch is imported and while it is still the process's only
    thread (`preload.start` forks none beside another thread, the journal reader's included); the
    child's tables hold the checkpoint's rows, its maps every live receipt."""
    from tests.gpu_worker.kinds.test_shared_state import World
    runtime = tmp_path / "r.aotxccir"
    pack_tiny(str(runtime), shared=True)
    world = World(str(runtime), tmp_path, ["a", "b"])
    spaces = [world.space(name) for name in ("a", "b", "a")]
    assert world.device.checkpoint() is not None
    live = int((world.device.state.tables.receipts[:, 0] != 0).sum())
    world.device.close()
    code = ("import sys\nfrom gpu_worker.storage.runtime_file import RuntimeFile\n"
            "from gpu_worker.recovery.reading import start\n"
            f"early = start(RuntimeFile.open({str(runtime)!r}, verify=False), {world.journal!r}, fill=True)\n"
            "tables, maps = early.tables.take()\n"
            "print(int((tables['receipts'][:, 0] != 0).sum()), len(maps['receipts.by_op']),"
            " int((tables['spaces'][:, 0] == 1).sum()), 'torch' in sys.modules, flush=True)\n"
            "early.close()\n")
    out = subprocess.run([PYTHON, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(live), str(live), str(len(spaces)), "False"], out.stdout


def test_boot_refuses_a_journal_another_device_holds_in_one_line(tmp_path):
    """The journal is locked before torch is imported (recovery/reading.py): a journal another
    device holds stops the boot there, with one line and exit 3, and its lock stays the holder's."""
    from gpu_worker.storage.journal_lock import JournalLock
    runtime = tmp_path / "r.aotxccir"
    pack_tiny(str(runtime), shared=True)
    with JournalLock(str(tmp_path / "journal")):
        out, journal = boot(tmp_path, runtime)
        assert out.returncode == 3, out.stderr
        assert out.stderr == f"boot: journal {journal} is locked by another device (pid {os.getpid()})\n"
        assert sorted(os.listdir(journal)) == ["lock"]
