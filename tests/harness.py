"""Real processes on loopback: the device (`python -m gpu_worker boot`) and the gateway
(`manage.py serve`: granian, shared_api/http/server.py), each in its own process group so kill -9 is a real crash."""
import json
import os
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

from tests.conftest import PYTHON, ROOT, free_port, wait_for


class Process:
    def __init__(self, args, env, log_path, ready_line=None, cwd=ROOT, ready_seconds=120):
        self.log_path = Path(log_path)
        self.log = open(self.log_path, "ab")
        self.start = self.log.tell()  # a restarted process appends to the same log
        self.proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        if ready_line:
            wait_for(lambda: ready_line in self.output() or self.proc.poll() is not None, ready_seconds,
                     what=f"{ready_line!r} in {self.log_path}")
            if self.proc.poll() is not None:
                raise RuntimeError(f"{args[2:4]} exited {self.proc.returncode}: {self.output()[-2000:]}")

    def output(self):
        with open(self.log_path, "rb") as f:
            f.seek(self.start)
            return f.read().decode(errors="replace")

    def kill(self, sig=signal.SIGKILL):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        self.proc.wait(30)
        self.log.close()
        return self.proc.returncode


class Stack:
    """A runtime file, a journal, a gateway database and config in one temporary directory."""

    def __init__(self, base, runtime, database_url=None):
        self.base = Path(base)
        self.runtime = runtime
        self.journal = self.base / "journal"
        self.grants = self.base / "grants.json"
        self.config = self.base / "gateway.json"
        self.port = free_port()
        self.config.write_text(json.dumps({"listen": f"127.0.0.1:{self.port}",
                                           "socket": str(self.journal / "service.sock"),
                                           "grants_file": str(self.grants)}))
        self.env = dict(os.environ, AOTX_VAR_DIR=str(self.base / "var"),
                        DATABASE_URL=database_url or f"sqlite:///{self.base / 'gateway.sqlite3'}",
                        AOTX_GATEWAY_CONFIG=str(self.config), AOTX_DEVICE_TIMEOUT="10",
                        DJANGO_SETTINGS_MODULE="aotx_site.settings")
        self.env.pop("REDIS_URL", None)
        self.ready_seconds = 120  # how long a device start may take (bench/soak.py allows more beside its load)
        self.manage("migrate", "--noinput", "-v", "0")
        self.device = None
        self.gateway = None

    def manage(self, *args, check=True):
        return subprocess.run([PYTHON, "manage.py", *args], cwd=ROOT, env=self.env, capture_output=True,
                              text=True, check=check, timeout=120)

    def principal(self, name, actions="shared_read,shared_write,shared_manage,chat", quotas=()):
        """A new principal's token; `quotas`: NAME=N|unlimited, as `manage.py principal create --quota`."""
        out = self.manage("principal", "create", name, "--actions", actions,
                          *(arg for quota in quotas for arg in ("--quota", quota)), "--config", str(self.config))
        return out.stdout.strip().splitlines()[-1]

    def boot_device(self, *options, fresh_grants=False):
        """Boot (or restart) the device. A restart on its own journal needs no new grant file; a
        restore does (fresh_grants=True writes one first, as an operator would)."""
        if fresh_grants or not self.grants.exists():
            self.manage("write_grants", "--config", str(self.config))
        self.device = Process([PYTHON, "-m", "gpu_worker", "boot", "--ccir", str(self.runtime), "--journal",
                               str(self.journal), "--service-grants", str(self.grants), "--device", "cpu",
                               *options],
                              self.env, self.base / "device.log", "device ready", ready_seconds=self.ready_seconds)
        return self.device

    def serve(self):
        self.gateway = Process([PYTHON, "manage.py", "serve", "--config", str(self.config)], self.env,
                               self.base / "gateway.log")
        wait_for(self._listening, self.ready_seconds / 2, what="gateway port")
        return self.gateway

    def _listening(self):
        if self.gateway.proc.poll() is not None:
            raise RuntimeError(f"gateway exited: {self.gateway.output()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{self.port}/aotx/v1/shared/capabilities", timeout=2)
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False
        return True

    def http(self, method, path, body=None, token=None, raw=None, headers=None):
        """Returns (status, headers, body bytes)."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method)
        if data is not None and "Content-Type" not in (headers or {}):
            req.add_header("Content-Type", "application/json")
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        for k, v in (headers or {}).items():
            req.add_header(k, v)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, resp.headers, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.headers, err.read()

    def stop(self):
        for p in (self.gateway, self.device):
            if p is not None and p.proc.poll() is None:
                p.kill(signal.SIGTERM)
