"""Everything `make setup` and `make run` create under var/ is their user's alone, whatever umask
they were started with (here 0o022, the usual default, which made the database and Celery's beat
schedule 0644): every file 0600 (the device's socket too), every directory 0700. The processes are
the real ones, started as make starts them: write_local_config.sh, `gpu_worker pack`, `manage.py
migrate` and `collectstatic`, then run_local.sh (device, gateway, Celery with beat) with work that
makes each write: a registration and an input (journal), a media upload (media), capacity samples
(the database and its journal), checkpoints (the runtime file) and audit exports (var/audit)."""
import os
import signal
import sqlite3
import stat
import subprocess

import pytest

from aotx_client import Client
from tests.conftest import PYTHON, ROOT, free_port, wait_for
from tests.e2e.test_make_run import TOKEN_LINE, process_groups, read

pytestmark = pytest.mark.e2e
UMASK = 0o022


def modes(var):
    """{path relative to var: (kind, mode)} of everything under var, var itself included."""
    found = {".": ("dir", stat.S_IMODE(os.stat(var).st_mode))}
    for directory, dirs, files in os.walk(var):
        for name in dirs + files:
            path = os.path.join(directory, name)
            st = os.lstat(path)
            kind = "dir" if stat.S_ISDIR(st.st_mode) else "socket" if stat.S_ISSOCK(st.st_mode) else "file"
            found[os.path.relpath(path, var)] = (kind, stat.S_IMODE(st.st_mode))
    return found


def not_private(found):
    want = {"dir": 0o700, "file": 0o600, "socket": 0o600}
    return {path: f"{kind} {mode:04o}" for path, (kind, mode) in found.items() if mode != want[kind]}


def count(var, table):
    with sqlite3.connect(f"file:{var / 'gateway.sqlite3'}?mode=ro", uri=True, timeout=10) as db:
        return db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]


def test_everything_the_processes_create_is_private_whatever_the_umask(tmp_path):
    var = tmp_path / "var"
    env = dict(os.environ, AOTX_VAR_DIR=str(var), AOTX_PORT=str(free_port()), AOTX_SAMPLE_INTERVAL="1",
               AOTX_HOLD_CHECK_INTERVAL="1", AOTX_CHECKPOINT_INTERVAL="2", AOTX_AUDIT_EXPORT_INTERVAL="2")
    for name in ("REDIS_URL", "DATABASE_URL", "AOTX_GATEWAY_CONFIG", "DJANGO_SETTINGS_MODULE"):
        env.pop(name, None)

    def run(*args):
        subprocess.run(args, cwd=ROOT, env=env, check=True, timeout=180, umask=UMASK, capture_output=True)
    run("scripts/write_local_config.sh")
    run(PYTHON, "-m", "gpu_worker", "pack", "--runtime", str(var / "identity.aotxccir"), "--tiny", "--shared")
    run(PYTHON, "manage.py", "migrate", "--noinput", "-v", "0")
    run(PYTHON, "manage.py", "collectstatic", "--noinput", "-v", "0")
    assert (var / "static").is_dir()
    log = tmp_path / "run.log"
    with open(log, "wb") as out:
        launcher = subprocess.Popen(["scripts/run_local.sh"], cwd=ROOT, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True, umask=UMASK)
    try:
        wait_for(lambda: TOKEN_LINE.search(read(log)) or launcher.poll() is not None, 180, what="the token")
        assert launcher.poll() is None, read(log)[-3000:]
        token = TOKEN_LINE.search(read(log)).group(1)
        listen = f"http://127.0.0.1:{env['AOTX_PORT']}"
        with Client(listen, token) as aotx:
            aotx.register()
            aotx.upload_media(b"\x89PNG\r\n\x1a\n" + os.urandom(64), "image/png")
            space = aotx.create_space()["target"]
            conversation = aotx.create_conversation(space)["target"]
            aotx.wait(aotx.submit_input(conversation, "hello", model="tiny-llama")["operation"])
        wait_for(lambda: count(var, "shared_api_capacitysample") >= 2 and list((var / "audit").glob("audit-*"))
                 and list(var.glob("celerybeat-schedule*")), 120,
                 what="capacity samples, an audit export and the beat schedule")
        running = modes(var)
        assert running["journal/service.sock"] == ("socket", 0o600)
        assert any(path.startswith("journal/media") for path in running), sorted(running)
        assert not_private(running) == {}
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(60) == 0, read(log)[-3000:]
        assert not_private(modes(var)) == {}
    finally:
        for pgid in [launcher.pid, *process_groups(read(log)).values()]:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
