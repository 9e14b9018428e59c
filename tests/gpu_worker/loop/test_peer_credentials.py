"""Who may talk to the device: the socket file is the device's user's alone (0600) unless a group
is named, and every accepted peer is checked by its kernel credentials (SO_PEERCRED), so a
process that can open the socket file still cannot act as any principal unless its uid (the
device's own or an allowed one) or its gid is allowed. Tests run as root: a forked child that
setuid()s to nobody is the foreign peer."""
import logging
import os
import pwd
import socket
import stat

import pathlib
import shutil
import tempfile

import pytest

from gpu_worker.contract.wire import LENGTH, encode_frame
from tests.gpu_worker.loop.test_server import LiveDevice, call

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to setuid() a child to nobody")
NOBODY = pwd.getpwnam("nobody")
PING = encode_frame({"v": 1, "id": 1, "op": "ping", "principal": None, "args": {}})


@pytest.fixture
def searchable(tmp_path):
    """A directory nobody may traverse (pytest's tmp_path is root's alone), so that only the
    socket's own mode and the peer check decide."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="aotx-peer-"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start(runtime, directory, **options):
    live = LiveDevice(runtime, directory, 1, **options).start()
    os.chmod(live.journal, 0o711)
    return live


def ping_as_nobody(path):
    """Fork a child that becomes nobody, connects, sends a ping and reports what came back:
    'answered', 'closed' (the device hung up), or 'EACCES' (the file mode kept it out)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no threads of its own; report through the pipe and leave
        outcome = b"error"
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY.pw_gid)
            os.setuid(NOBODY.pw_uid)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(20)
            try:
                s.connect(path)
            except PermissionError:
                outcome = b"EACCES"
            else:
                try:
                    s.sendall(PING)
                    header = s.recv(LENGTH.size)
                    outcome = b"answered" if len(header) == LENGTH.size else b"closed"
                except (ConnectionResetError, BrokenPipeError):
                    outcome = b"closed"
            os.write(w, outcome)
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        outcome = f.read().decode()
    os.waitpid(pid, 0)
    return outcome


def test_the_socket_is_the_device_users_alone_by_default(tiny_runtime, searchable):
    live = start(tiny_runtime, searchable)
    try:
        mode = stat.S_IMODE(os.stat(live.server.socket_path).st_mode)
        assert mode == 0o600
        assert ping_as_nobody(live.server.socket_path) == "EACCES"
    finally:
        live.stop()


def test_a_socket_group_opens_the_file_to_that_group(tiny_runtime, searchable):
    live = start(tiny_runtime, searchable, socket_group=NOBODY.pw_gid)
    try:
        st = os.stat(live.server.socket_path)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, NOBODY.pw_gid)
        # nobody's primary gid is the socket's group: the peer check lets it in as well
        assert ping_as_nobody(live.server.socket_path) == "answered"
    finally:
        live.stop()


def test_a_foreign_uid_is_refused_and_logged_even_when_the_file_lets_it_connect(tiny_runtime, searchable, caplog):
    live = start(tiny_runtime, searchable)
    try:
        os.chmod(live.server.socket_path, 0o666)  # a mistaken mode: the peer check still holds
        with caplog.at_level(logging.WARNING, logger="gpu_worker.server"):
            assert ping_as_nobody(live.server.socket_path) == "closed"
            with live.connect() as own:  # the device's own uid is served, before and after
                assert call(own, PING)["status"] == 200
        assert any(f"uid {NOBODY.pw_uid} gid {NOBODY.pw_gid}: not an allowed uid or gid" in r.getMessage()
                   for r in caplog.records)
    finally:
        live.stop()


def test_an_allowed_uid_is_served(tiny_runtime, searchable):
    live = start(tiny_runtime, searchable, allow_uids=(NOBODY.pw_uid,))
    try:
        os.chmod(live.server.socket_path, 0o666)
        assert ping_as_nobody(live.server.socket_path) == "answered"
    finally:
        live.stop()


def test_boot_refuses_an_unknown_socket_group_in_one_line(capsys):
    from gpu_worker.recovery import boot
    code = boot.main(["--ccir", "/nonexistent.aotxccir", "--journal", "/nonexistent", "--service-grants",
                      "/nonexistent.json", "--socket-group", "no-such-group-aotx"])
    assert code == 2
    assert capsys.readouterr().err.strip() == "boot: --socket-group no-such-group-aotx: no such group"


def test_a_booted_device_serves_its_socket_to_the_named_group_and_uid(tiny_runtime, searchable):
    """boot's options reach the server: the socket file 0660 with the group, nobody (an allowed
    uid) served even though its gid is not the socket's."""
    import subprocess
    import sys

    from tests.conftest import write_grants
    grants = searchable / "grants.json"
    write_grants(str(grants), {})
    journal = searchable / "journal"
    proc = subprocess.Popen([sys.executable, "-m", "gpu_worker", "boot", "--ccir", tiny_runtime, "--journal",
                             str(journal), "--service-grants", str(grants), "--device", "cpu",
                             "--socket-group", "0", "--allow-uid", str(NOBODY.pw_uid)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if "device ready" in line:
                break
        else:
            pytest.fail("the device did not start")
        path = str(journal / "service.sock")
        st = os.stat(path)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, 0)
        os.chmod(journal, 0o711)
        os.chmod(path, 0o666)  # the file's mode aside: the peer check lets the allowed uid in
        assert ping_as_nobody(path) == "answered"
    finally:
        proc.terminate()
        proc.wait(30)
