"""`make run`'s start (scripts/run_local.sh) for real, in a var directory of its own (AOTX_VAR_DIR,
AOTX_PORT; a tiny runtime file stands in for the default one): the token is printed only once the
device answers, it is kept (0600) and the same at the next start, and Ctrl-C through a pipe
(`make run | tee log`) stops device, gateway and Celery — the case where `honcho start` used to
run on (scripts/run_procfile.py says why). SIGTERM stops them too."""
import json
import os
import re
import signal
import stat
import subprocess
import urllib.error
import urllib.request

import pytest

from gpu_worker.pack import pack_tiny
from tests.conftest import PYTHON, ROOT, free_port, wait_for

pytestmark = pytest.mark.e2e
TOKEN_LINE = re.compile(r"^  export TOKEN=(aotx_\S+)$", re.M)
STARTED = re.compile(r"\| (\w+)\.1 started \(pid=(\d+)\)")


@pytest.fixture
def local(tmp_path):
    """A var directory set up as `make setup` leaves it, and the environment that points there."""
    var = tmp_path / "var"
    var.mkdir()
    pack_tiny(str(var / "identity.aotxccir"), shared=True)
    env = dict(os.environ, AOTX_VAR_DIR=str(var), AOTX_PORT=str(free_port()))
    for name in ("REDIS_URL", "DATABASE_URL", "AOTX_GATEWAY_CONFIG", "DJANGO_SETTINGS_MODULE"):
        env.pop(name, None)
    subprocess.run([PYTHON, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True,
                   timeout=120)
    subprocess.run(["scripts/write_local_config.sh"], cwd=ROOT, env=env, check=True, timeout=60)
    config = json.loads((var / "gateway.json").read_text())
    started = []  # process groups of every run, to clean up whatever a failing test leaves
    yield var, env, config, started
    for pgid in started:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def read(path):
    return path.read_text(errors="replace") if path.exists() else ""


def process_groups(log_text):
    """{name: pgid} of device, gateway and celery, from the manager's 'started' lines (each runs
    in a session of its own)."""
    return {name: int(pid) for name, pid in STARTED.findall(log_text)}


def all_gone(pgids):
    for pgid in pgids:
        try:
            os.killpg(pgid, 0)
            return False
        except ProcessLookupError:
            pass
    return True


def child_named(parent, name):
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
                comm = open(f"/proc/{entry}/comm").read().strip()
            except OSError:
                continue
            if int(fields[1]) == parent and comm == name:
                return int(entry)
    return None


def capabilities(config, token):
    request = urllib.request.Request(f"http://{config['listen']}/aotx/v1/shared/capabilities",
                                     headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def as_from_a_terminal():
    """preexec_fn of the processes these tests start: SIGINT, SIGQUIT, SIGTERM and SIGHUP act as
    they do for a job started from a terminal, however pytest itself was started. A background job
    of a non-interactive shell (`make test &` in a script) starts with SIGINT and SIGQUIT ignored;
    an ignored signal stays ignored across fork and exec, and a non-interactive bash cannot trap
    one it found ignored: tee, bash and everything below them would then ignore the Ctrl-C these
    tests send. (Only signal.signal runs in the child, between fork and exec.)"""
    for signum in (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def start(env, log, started, through_tee):
    """scripts/run_local.sh as `make run` starts it, its output through `| tee log` or into log."""
    command = f"scripts/run_local.sh 2>&1 | tee {log}" if through_tee else f"exec scripts/run_local.sh > {log} 2>&1"
    shell = subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             start_new_session=True,  # its own process group: the terminal's foreground job
                             preexec_fn=as_from_a_terminal)
    started.append(shell.pid)
    wait_for(lambda: TOKEN_LINE.search(read(log)) or shell.poll() is not None, 180, what=f"the token in {log}")
    assert shell.poll() is None, read(log)[-3000:]
    groups = process_groups(read(log))
    assert set(groups) == {"device", "gateway", "celery"}, read(log)[-3000:]
    started.extend(groups.values())
    return shell, TOKEN_LINE.search(read(log)).group(1), groups


def test_make_run_keeps_its_token_prints_it_once_the_device_answers_and_stops_on_ctrl_c_through_a_pipe(local):
    var, env, config, started = local
    log = var.parent / "run.log"
    shell, token, groups = start(env, log, started, through_tee=True)
    # (b) printed once the device answers: the very first request with it is served by the device
    status, body = capabilities(config, token)
    assert status == 200 and body["runtime"]["boot"] == "1", body
    assert read(log).index("device ready") < read(log).index("export TOKEN=")
    # (a) kept in var/, readable by its owner only
    token_file = var / "local_token"
    assert token_file.read_text().strip() == token
    assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
    # (c) Ctrl-C reaches the whole foreground job; the pipe's reader may die first (the order in
    # which the terminal's SIGINT lands is up to the scheduler): take that order
    tee = child_named(shell.pid, "tee")
    assert tee is not None
    os.kill(tee, signal.SIGINT)
    wait_for(lambda: child_named(shell.pid, "tee") is None, 30, what="tee gone")
    os.killpg(shell.pid, signal.SIGINT)
    wait_for(lambda: all_gone(groups.values()), 60, what="device, gateway and celery stopped after Ctrl-C")
    assert shell.wait(60) != 0
    wait_for(lambda: all_gone([shell.pid]), 60, what="the launcher stopped")
    assert capabilities_unreachable(config, token)

    # the next start: the same token, and SIGTERM to the launcher stops everything as well
    log2 = var.parent / "run2.log"
    shell, again, groups = start(env, log2, started, through_tee=False)
    assert again == token
    status, body = capabilities(config, token)
    assert status == 200 and body["runtime"]["boot"] == "2", body
    assert "admin console user" not in read(log2)  # the admin password was shown once, at the first start
    os.kill(shell.pid, signal.SIGTERM)  # the shell exec'd run_local.sh, which exec'd the launcher
    wait_for(lambda: all_gone(groups.values()), 60, what="device, gateway and celery stopped after SIGTERM")
    assert shell.wait(60) == 0 and "SIGTERM received" in read(log2)  # a stop asked for, clean: status 0


def capabilities_unreachable(config, token):
    try:
        capabilities(config, token)
    except OSError:
        return True
    return False


# A process that ignores SIGTERM and leaves a child that ignores it too in its group; each says so
# on its output (the launcher prints it to its log) once it does, then sleeps until SIGKILL.
STUBBORN = """import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if sys.argv[1:] == ["child"]:
    print("child ignores SIGTERM", flush=True)
else:
    subprocess.Popen([sys.executable, __file__, "child"])
    print("parent ignores SIGTERM", flush=True)
time.sleep(600)
"""


def test_sigterm_stops_every_process_group_even_when_none_of_them_ends_on_its_own(tmp_path):
    """honcho alone SIGKILLs only after a first process has stopped, and only processes it counts as
    running: with processes that ignore SIGTERM (one leaving a child behind in its group), its stop
    never ended. The launcher kills every group a few seconds after the SIGTERM."""
    (tmp_path / "stubborn.py").write_text(STUBBORN)
    stubborn = f"{PYTHON} {tmp_path / 'stubborn.py'}"
    (tmp_path / "Procfile").write_text(f"one: {stubborn}\ntwo: {stubborn}\n")
    (tmp_path / "gateway.json").write_text(json.dumps({"listen": f"127.0.0.1:{free_port()}",
                                                       "socket": str(tmp_path / "none.sock")}))
    (tmp_path / "token").write_text("aotx_x\n")
    log = tmp_path / "run.log"
    with open(log, "wb") as out:
        launcher = subprocess.Popen([PYTHON, "scripts/run_procfile.py", "--procfile", str(tmp_path / "Procfile"),
                                     "--config", str(tmp_path / "gateway.json"), "--token-file",
                                     str(tmp_path / "token")], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=as_from_a_terminal)
    groups = []
    try:
        wait_for(lambda: len(process_groups(read(log))) == 2, 60, what="both processes started")
        groups = list(process_groups(read(log)).values())
        wait_for(lambda: read(log).count("parent ignores SIGTERM") == read(log).count("child ignores SIGTERM") == 2,
                 60, what="both processes and their children ignoring SIGTERM")
        assert not all_gone(groups)
        launcher.send_signal(signal.SIGTERM)
        wait_for(lambda: all_gone(groups), 60, what="every process group killed after SIGTERM")
        assert launcher.wait(60) != 0 and "SIGTERM received" in read(log)
    finally:
        for pgid in [launcher.pid, *groups]:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
