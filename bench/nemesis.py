"""The replication fault harness across machines, in the manner of Jepsen (docs/replication.md,
"Proof"): three machines, each a Linux network namespace with its own address, journal (a tmpfs, so
its disk can fill), runtime file copy, device, gateway and etcd member, joined by veth pairs
through a bridge (tests/cluster.py). The primary ships to a hot standby over TLS between machines;
the third machine runs a second hot standby that waits for the place (`--standby-of` names every
machine: a standby follows whichever is the primary, and after a failover the waiting one joins the
new primary, which holds, in strict sync, until a standby is in sync again). SDK clients (aotx_client, given every gateway's URL) create spaces
through whichever gateway answers, and retry some of their mutations exactly (the same bytes, to
every gateway in turn) to check that each answers its receipt. A nemesis injects, round after
round (the default lease of 3 s, no --standby-timeout: the primary holds while it has no standby):

- partition   : the primary's machine cut off, both ways, past the lease; the standby takes over;
                healed, the old primary must be fenced (not_primary), then rejoins as the standby;
- etcd-cut    : the primary cut from etcd only (nftables), its gateway and link still reachable:
                it fences itself, the standby takes over, clients move;
- kill        : kill -9 of the primary;
- stop        : SIGSTOP of the primary past its lease; SIGCONT: the zombie must answer not_primary;
- delete      : the leader key deleted (`etcdctl del`): the standby named in the sync key takes
                over; the old primary must be fenced at once;
- replace     : the standby killed while the clients go on, and the waiting one, started again empty
                just before, takes its place (it catches up from the primary's runtime file,
                catching-up until it holds what was saved);
- disk        : the standby's journal disk filled: it stops (exit 6, acknowledging nothing more) and
                the waiting one takes its place; freed, it is started again and waits;
- behind      : the standby killed, the primary checkpoints, the standby starts again a generation
                behind (and waits; it catches up from the primary's file when its turn comes);
- etcd-member : an etcd member killed and started again (no failover);
- double      : kill -9 of the primary and of an etcd member at once.

The checker, from what the clients were answered and from every device's log: every receipt
answered saved reads back (byte for byte, or folded by a checkpoint since) from the last primary,
through every gateway; no (lineage, sequence) answered for two operations; no leadership
generation held by two devices, and no zombie admitting after a failover; every exact retry
answered its receipt; per failover, the time from the fault to the first receipt a client got
from the new primary through a gateway on a surviving machine (goal < 5 s).

    sudo .venv/bin/python bench/nemesis.py [--rounds 100]

Needs root (network namespaces), etcd and nftables (make setup installs both).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if sys.path and Path(sys.path[0] or ".").resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)  # run as a script: bench/http.py must not shadow the standard library's http
elif str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import rfc8785  # noqa: E402

from gpu_worker.pack import pack_tiny  # noqa: E402
from tests.cluster import Etcd, Network, usable  # noqa: E402
from tests.conftest import PYTHON, wait_for  # noqa: E402
from tests.e2e.test_failover import as_given, make_principals, register  # noqa: E402
from tests.e2e.test_kill9 import Zygote, alive, call  # noqa: E402
from tests.harness import Process  # noqa: E402

FAULTS = ("partition", "etcd-cut", "kill", "stop", "delete", "replace", "disk", "behind", "etcd-member", "double")
FAILOVERS = frozenset({"partition", "etcd-cut", "kill", "stop", "delete", "double"})
LEASE = 3  # the default --lease-seconds
KEY = "/aotx/primary"
LINK_PORT, GATEWAY_PORT = 7001, 8000
SPACES = 60000  # receipts and spaces the tables hold (one space a client every PACE seconds, every round)


class Bodies:
    """A client's pending log (aotx_client.PendingLog's place): it keeps each mutation's exact bytes,
    by sequence, for the exact retries."""

    def __init__(self) -> None:
        self.by_sequence: dict[int, tuple[str, bytes]] = {}

    def write(self, pending) -> None:
        self.by_sequence[pending.sequence] = (pending.path, pending.body)

    def remove(self, sequence: int) -> None:
        pass

    def load(self) -> list:
        return []


class Client(threading.Thread):
    """One principal's participant, given every gateway: a space every `pace` seconds until
    stopped (or paused), each receipt answered saved kept with when; every `exact_every`-th sent
    again, exactly, by itself (its receipt must come back, 200)."""

    def __init__(self, urls, principal_hex, token, stop, pause, pace=0.2, exact_every=5):
        super().__init__(daemon=True)
        self.urls, self.principal_hex, self.token, self.stop, self.pause = urls, principal_hex, token, stop, pause
        self.pace, self.exact_every = pace, exact_every
        self.saved: dict[str, dict] = {}
        self.at: dict[str, float] = {}
        self.by_sequence: dict[tuple[str, str], set[str]] = {}  # (lineage, sequence) -> operations answered
        self.exact = 0
        self.exact_failures: list[str] = []
        self.errors: list[BaseException] = []
        self.lock = threading.Lock()
        self.idle = threading.Event()  # set while paused

    def run(self):
        from aotx_client import Client as Sdk
        bodies = Bodies()
        try:
            # a gateway that does not take the connection at once is on a lost machine: the next is tried;
            # one that does answers when its primary can (it holds, in strict sync, until a standby is in sync)
            with Sdk(self.urls, self.token, timeout=httpx.Timeout(3.0, connect=0.5), retry_for=300) as aotx:
                aotx.mutations.log = bodies
                aotx.register()
                made = 0
                while not self.stop.wait(self.pace):
                    if self.pause.is_set():
                        self.idle.set()
                        while self.pause.is_set() and not self.stop.wait(0.05):
                            pass
                        self.idle.clear()
                        continue
                    receipt = aotx.create_space()
                    made += 1
                    op = receipt["operation"]
                    with self.lock:
                        self.saved[op] = receipt
                        self.at[op] = time.monotonic()
                        lineage = op.split("-")[1]
                        self.by_sequence.setdefault((lineage, receipt["sequence"]), set()).add(op)
                    if made % self.exact_every == 0:
                        self._exactly(aotx, bodies.by_sequence[int(receipt["sequence"])], receipt)
        except Exception as exc:  # reported at the end: a client must never give up
            self.errors.append(exc)

    def _exactly(self, aotx, sent, receipt):
        """The same bytes again, to each gateway in turn until one reaches the primary: 200 and
        the receipt (the gateway's own retries aside, as the SDK's)."""
        path, body = sent
        deadline = time.monotonic() + 120
        at = 0
        while time.monotonic() < deadline:
            url = self.urls[at % len(self.urls)] + "/aotx/v1/shared" + path
            at += 1
            try:
                r = aotx.http.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=2)
            except httpx.HTTPError:
                continue
            if r.status_code in (503, 429):
                time.sleep(0.05)
                continue
            self.exact += 1
            if r.status_code != 200 or not as_given(r.content, rfc8785.dumps(receipt)):
                self.exact_failures.append(f"{receipt['operation']}: {r.status_code} {r.content[:200]!r}")
            return
        self.exact_failures.append(f"{receipt['operation']}: no gateway answered in 120 s")

    def first_saved_by(self, boot):
        with self.lock:
            times = [self.at[op] for op, r in self.saved.items() if r["admission"]["save"]["boot"] == str(boot)]
        return min(times, default=None)


class Harness:
    """Everything one run holds (module docstring)."""

    def __init__(self, base: Path, clients: int = 4, pace: float = 0.2) -> None:
        why = usable()
        if why is not None:
            raise SystemExit(f"bench/nemesis.py: {why}")
        self.base = base
        self.net = Network(3)
        self.mounts: list[str] = []
        self.zygote: Zygote | None = None
        self.gateways: list[Process] = []
        self.pids: dict[str, int] = {}
        self.stop, self.pause = threading.Event(), threading.Event()
        try:
            self._setup(clients, pace)
        except BaseException:
            self.close()
            raise

    # ---- set-up -----------------------------------------------------------------------------------

    def _setup(self, count: int, pace: float) -> None:
        base, net = self.base, self.net
        subprocess.run([PYTHON, "-m", "gpu_worker", "link-tls", str(base / "certs"), *net.names], cwd=ROOT,
                       check=True, capture_output=True, timeout=120)
        self.etcd = Etcd(net, base)
        self.etcd.start()
        wait_for(lambda: self._etcd_healthy(), 60, what="the etcd members to elect a leader")
        self.grants = str(base / "grants.json")
        packed = str(base / "packed.aotxccir")
        pack_tiny(packed, shared=True, capacity={"participants": 64, "spaces": SPACES, "receipts": SPACES,
                                                 "command_bytes": 1024, "result_bytes": 16})
        self.packed = packed
        self.ccir = {m: str(base / f"{m}.aotxccir") for m in net.names}
        self.journal = {m: str(base / f"journal-{m}") for m in net.names}
        for m in net.names:
            shutil.copyfile(packed, self.ccir[m])
            os.makedirs(self.journal[m])
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m,mode=0700", "tmpfs", self.journal[m]], check=True,
                           capture_output=True, timeout=30)
            self.mounts.append(self.journal[m])
        env = dict(os.environ, AOTX_VAR_DIR=str(base / "var"), DATABASE_URL=f"sqlite:///{base / 'gateway.sqlite3'}",
                   DJANGO_SETTINGS_MODULE="aotx_site.settings", AOTX_DEVICE_TIMEOUT="10")
        env.pop("REDIS_URL", None)
        configs = {}
        for m in net.names:
            configs[m] = base / f"gateway-{m}.json"
            configs[m].write_text(json.dumps({
                "listen": f"{net.address[m]}:{GATEWAY_PORT}", "socket": os.path.join(self.journal[m], "service.sock"),
                "grants_file": self.grants, "etcd": ",".join(self.etcd.endpoints), "etcd_key": KEY, "machine": m}))
        names = [f"client-{i}" for i in range(count)] + [f"probe-{i}" for i in range(400)]
        principals = make_principals(env, configs["m1"], names)
        self.probes = iter(bytes.fromhex(principals[n][0]) for n in names if n.startswith("probe-"))
        self.urls = [f"http://{net.address[m]}:{GATEWAY_PORT}" for m in net.names]
        self.zygote = Zygote()
        self.primary = net.names[0]
        self.pids[self.primary] = self._boot(self.primary, standby=False)
        for m in net.names[1:]:
            self.pids[m] = self._boot(m)
        for m in net.names:
            self.gateways.append(Process([*net.exec(m), PYTHON, "manage.py", "serve", "--config", str(configs[m])],
                                         env, base / f"gateway-{m}.log"))
        for url in self.urls:
            wait_for(lambda: self._listening(url), 60, what=f"the gateway at {url}")
        self.wait_in_sync()
        self.clients = [Client(self.urls, *principals[f"client-{i}"], self.stop, self.pause, pace=pace)
                        for i in range(count)]
        for c in self.clients:
            c.start()

    def _etcd_healthy(self) -> bool:
        try:
            r = httpx.get(self.etcd.endpoints[0] + "/health", timeout=1)
            return r.json().get("health") == "true"
        except (httpx.HTTPError, ValueError):
            return False

    @staticmethod
    def _listening(url: str) -> bool:
        try:
            httpx.get(url + "/healthz", timeout=2)
            return True
        except httpx.HTTPError:
            return False

    def log(self, m: str) -> Path:
        return self.base / f"device-{m}.log"

    def _boot(self, m: str, standby: bool = True) -> int:
        """m's device: a hot standby of whichever machine is the primary, or the first primary; its
        pid once ready."""
        net = self.net
        argv = ["--ccir", self.ccir[m], "--journal", self.journal[m], "--service-grants", self.grants,
                "--device", "cpu", "--replicate", f"{net.address[m]}:{LINK_PORT}",
                "--link-tls", str(self.base / "certs" / m), "--etcd", ",".join(self.etcd.endpoints),
                "--etcd-key", KEY, "--lease-seconds", str(LEASE), "--machine", m]
        if standby:
            argv += ["--standby-of", ",".join(f"{net.address[n]}:{LINK_PORT}" for n in net.names if n != m)]
        log = self.log(m)
        log.touch()
        begin = log.stat().st_size
        assert self.zygote is not None
        pid = self.zygote.boot(argv, str(log), net.netns[m])
        ready = "standby ready" if standby else "device ready"
        wait_for(lambda: ready in log.read_text()[begin:] or not alive(pid), 180, what=f"{m}: {ready}")
        if not alive(pid):
            raise AssertionError(f"{m} did not start:\n{log.read_text()[begin:][-3000:]}")
        return pid

    # ---- reading the devices ----------------------------------------------------------------------

    def sock(self, m: str) -> str:
        return os.path.join(self.journal[m], "service.sock")

    def ping(self, m: str) -> dict:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(30)
            s.connect(self.sock(m))
            return json.loads(call(s, {"v": 1, "id": 0, "op": "ping", "principal": None, "args": {}})["body"])

    def in_sync(self) -> bool:
        try:
            r = self.ping(self.primary)["pipeline"]["replication"]
        except (OSError, KeyError, ValueError):
            return False
        return bool(r["standby"] is not None and r["in_sync"] and r["lag_transfers"] == 0 and not r["catching_up"])

    def linked(self) -> str:
        """The machine whose standby the primary streams to (in sync: `wait_in_sync` first)."""
        member = self.ping(self.primary)["pipeline"]["replication"]["member"]
        for m in self.net.names:
            try:
                with open(os.path.join(self.journal[m], "standby")) as f:
                    if json.load(f).get("member") == member:
                        return m
            except (OSError, ValueError):
                continue
        raise AssertionError(f"no machine's journal is the standby {member}")

    def waiting(self) -> str:
        """The machine whose standby waits for the place."""
        linked = self.linked()
        return next(m for m in self.net.names if m not in (self.primary, linked))

    def wait_in_sync(self, seconds: float = 180) -> None:
        wait_for(self.in_sync, seconds, what="the standby to be in sync with the primary")

    def admits(self, m: str) -> bool | None:
        """Whether m's device admits a fresh principal's registration now (None: it answers nothing)."""
        principal = next(self.probes)
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(10)
                s.connect(self.sock(m))
                lineage = json.loads(call(s, {"v": 1, "id": 0, "op": "participant.get", "principal": principal.hex(),
                                              "args": {}})["body"])["lineage"]
                reply = call(s, register(principal, lineage))
        except (OSError, ValueError, KeyError):
            return None
        if reply["status"] == 202:
            return True
        assert reply["status"] == 503 and b"not_primary" in reply["body"], reply
        return False

    def checkpoint(self, m: str) -> None:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(120)
            s.connect(self.sock(m))
            done = call(s, {"v": 1, "id": 0, "op": "checkpoint", "principal": None, "args": {}})
        assert done["status"] == 200, done

    def kill(self, m: str, sig: int = signal.SIGKILL) -> None:
        pid = self.pids[m]
        if alive(pid):
            os.kill(pid, sig)
        if sig == signal.SIGKILL:
            wait_for(lambda: not alive(pid), 30, what=f"{m}'s device to be gone")

    def delete_key(self) -> None:
        import base64
        httpx.post(self.etcd.endpoints[1] + "/v3/kv/deleterange",
                   json={"key": base64.b64encode(KEY.encode()).decode()}, timeout=5).raise_for_status()

    def fill(self, m: str) -> None:
        """m's journal disk full (a file takes what is left of its tmpfs)."""
        with open(os.path.join(self.journal[m], "filler"), "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
            except OSError:
                pass

    def free(self, m: str) -> None:
        os.remove(os.path.join(self.journal[m], "filler"))

    def empty(self, m: str) -> None:
        """m as a new machine: an empty journal and the runtime file as packed."""
        for name in os.listdir(self.journal[m]):
            path = os.path.join(self.journal[m], name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        shutil.copyfile(self.packed, self.ccir[m])

    # ---- a round ----------------------------------------------------------------------------------

    def round(self, fault: str) -> dict:
        """Inject `fault`, wait for the service to be whole again (a standby in sync), check every
        answer so far: the round's row."""
        floor = [len(c.saved) for c in self.clients]
        wait_for(lambda: all(len(c.saved) >= f + 3 or c.errors for c, f in zip(self.clients, floor)), 300,
                 what="each client to save three more receipts")
        self._raise_client_errors()
        row = {"fault": fault, "took": None, "zombie": None}
        self.wait_in_sync()
        old, standby, spare = self.primary, self.linked(), self.waiting()
        began = time.monotonic()
        row["at"] = time.time()  # (the wall clock the devices' logs use: where the time went)
        if fault in FAILOVERS:
            member = None
            if fault == "partition":
                self.net.partition(old)
            elif fault == "etcd-cut":
                self.net.cut_etcd(old)
            elif fault in ("kill", "double"):
                self.kill(old)
                if fault == "double":
                    member = spare  # (the waiting machine's member: a quorum of two stays)
                    self.etcd.kill(member)
            elif fault == "stop":
                self.kill(old, signal.SIGSTOP)
            elif fault == "delete":
                self.delete_key()
            log = self.log(standby)
            begin = log.stat().st_size
            wait_for(lambda: "device ready" in log.read_text()[begin:], 120, what="the standby to take over")
            self.primary = standby
            boot = self.ping(self.primary)["boot"]
            wait_for(lambda: all(c.first_saved_by(boot) or c.errors for c in self.clients), 120,
                     what="every client to be answered by the new primary")
            self._raise_client_errors()
            row["took"] = min(c.first_saved_by(boot) for c in self.clients) - began
            if fault == "stop":
                os.kill(self.pids[old], signal.SIGCONT)
            if fault in ("partition", "etcd-cut"):
                self.net.heal(old)
            if fault in ("partition", "etcd-cut", "stop", "delete"):
                row["zombie"] = self.admits(old)  # must be False: fenced (None: it ended by itself)
            self.kill(old)
            if member is not None:
                self.etcd.start(member, new=False)
            self.pids[old] = self._boot(old)  # the old primary rejoins from its own journal, and waits
        elif fault == "replace":
            self.kill(spare)
            self.empty(spare)
            self.pids[spare] = self._boot(spare)  # an empty standby, waiting
            self.kill(standby)  # it takes the place, under load
            wait_for(lambda: self.in_sync() and self.linked() == spare, 180, what="the empty standby in sync")
            self.pids[standby] = self._boot(standby)
        elif fault == "disk":
            pid = self.pids[standby]
            self.fill(standby)
            wait_for(lambda: not alive(pid), 120, what="the standby to stop on its full disk")
            assert "acknowledging nothing more" in self.log(standby).read_text(), "the standby did not stop on ENOSPC"
            self.free(standby)
            self.pids[standby] = self._boot(standby)
        elif fault == "behind":
            self.pause.set()  # (a strict primary checkpoints only what its standby holds: nothing unsaved)
            wait_for(lambda: all(c.idle.is_set() or c.errors for c in self.clients), 60, what="the clients to pause")
            self.wait_in_sync()
            self.kill(standby)
            self.checkpoint(self.primary)
            self.pause.clear()
            self.pids[standby] = self._boot(standby)
        elif fault == "etcd-member":
            self.etcd.kill(spare)
            time.sleep(LEASE)  # (the fault lasts a lease: leadership must hold through it)
            self.etcd.start(spare, new=False)
        self.wait_in_sync()
        self._raise_client_errors()
        row["checked"] = self.verify_at(self.primary)
        row["generation"] = self.ping(self.primary)["pipeline"]["leadership"]["generation"]
        return row

    def _raise_client_errors(self) -> None:
        for c in self.clients:
            if c.errors:
                raise AssertionError(f"a client gave up: {c.errors[0]!r}")

    # ---- the checker ------------------------------------------------------------------------------

    def verify_at(self, m: str) -> int:
        """Every receipt a client was answered saved, read from m's device: as given (or folded
        since); each (lineage, sequence) answered for one operation only; the sequences each
        client was given are saved without a gap or a repeat. The number checked."""
        checked = 0
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(60)
            s.connect(self.sock(m))
            for c in self.clients:
                with c.lock:
                    saved, twice = dict(c.saved), {k: v for k, v in c.by_sequence.items() if len(v) > 1}
                assert not twice, f"a (lineage, sequence) answered for two operations: {twice}"
                for op, receipt in saved.items():
                    got = call(s, {"v": 1, "id": 0, "op": "operations.get", "principal": c.principal_hex,
                                   "args": {"operation": op}})
                    assert got["status"] == 200 and as_given(got["body"], rfc8785.dumps(receipt)), \
                        f"a receipt answered saved is lost or changed: {op} {got}"
                    checked += 1
                sequences = sorted(int(r["sequence"]) for r in saved.values())
                assert sequences == list(range(sequences[0], sequences[0] + len(sequences))), "a sequence twice or lost"
        return checked

    def verify_through_gateways(self) -> int:
        from aotx_client import Client as Sdk
        checked = 0
        for c in self.clients:
            with c.lock:
                saved = dict(c.saved)
            for url in self.urls:
                with Sdk(self.urls[self.urls.index(url):] + self.urls[:self.urls.index(url)], c.token, timeout=5,
                         retry_for=120) as aotx:
                    for op, receipt in saved.items():
                        assert as_given(rfc8785.dumps(aotx.receipt(op)), rfc8785.dumps(receipt)), op
                        checked += 1
        return checked

    def generations_held(self) -> dict[int, list[str]]:
        """{leadership generation: [machines whose device held it]}, from every device's log."""
        held: dict[int, list[str]] = {}
        for m in self.net.names:
            log = self.log(m)
            for generation in re.findall(r"leadership: holding \S+ as generation (\d+)", log.read_text()
                                         if log.exists() else ""):
                held.setdefault(int(generation), []).append(m)
        return held

    def finish(self) -> dict:
        """Stop the clients and check everything: the totals."""
        self.stop.set()
        for c in self.clients:
            c.join(120)
        self._raise_client_errors()
        twice = {g: ms for g, ms in self.generations_held().items() if len(ms) > 1}
        assert not twice, f"a leadership generation held by two devices: {twice}"
        failures = [f for c in self.clients for f in c.exact_failures]
        assert not failures, f"exact retries not answered their receipt: {failures[:5]}"
        return {"read_back": self.verify_at(self.primary), "through_gateways": self.verify_through_gateways(),
                "exact_retries": sum(c.exact for c in self.clients),
                "saved": sum(len(c.saved) for c in self.clients)}

    def close(self) -> None:
        self.stop.set()
        for pid in self.pids.values():
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for g in self.gateways:
            g.kill(signal.SIGTERM)
        if self.zygote is not None:
            self.zygote.close()
        if hasattr(self, "etcd"):
            self.etcd.stop()
        for path in self.mounts:
            subprocess.run(["umount", "-l", path], capture_output=True, timeout=30)
        self.net.close()


def run(rounds: int, base: Path, faults: tuple[str, ...] = FAULTS, report=print) -> tuple[list[dict], dict]:
    """`rounds` rounds cycling through `faults`: their rows and the final check's totals."""
    harness = Harness(base)
    rows = []
    try:
        for number in range(rounds):
            row = harness.round(faults[number % len(faults)])
            rows.append(row)
            report(f"round {number + 1:>3} {row['fault']:>11}: "
                   + (f"first receipt through a surviving gateway {row['took']:5.2f}s after the fault, "
                      if row["took"] is not None else "")
                   + (f"zombie admitted: {row['zombie']}, " if row["zombie"] is not None else "")
                   + f"leadership generation {row['generation']}, {row['checked']} receipts read back")
        totals = harness.finish()
    finally:
        harness.close()
    zombies = sum(1 for r in rows if r["zombie"])
    assert zombies == 0, f"{zombies} rounds with a deposed primary that still admitted"
    return rows, totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=100)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-nemesis-"))
    started = time.monotonic()
    try:
        rows, totals = run(args.rounds, base, report=lambda line: print(line, flush=True))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"{len(rows)} rounds in {time.monotonic() - started:.0f} s: {totals['saved']} receipts answered saved, "
          f"{totals['read_back']} read back from the last primary as given, {totals['through_gateways']} through "
          f"every gateway; {totals['exact_retries']} exact retries, each answered its receipt; no (lineage, "
          "sequence) answered twice; no leadership generation held twice; 0 rounds with a deposed primary admitting")
    for fault in sorted({r["fault"] for r in rows if r["took"] is not None}):
        times = sorted(r["took"] for r in rows if r["fault"] == fault)
        print(f"{fault:>11}: {len(times)} failovers, fault to the first receipt through a surviving gateway: "
              f"p50 {times[len(times) // 2]:.2f}s, max {times[-1]:.2f}s")
    times = sorted(r["took"] for r in rows if r["took"] is not None)
    if times:
        print(f"all failovers: {len(times)}, p50 {times[len(times) // 2]:.2f}s, max {times[-1]:.2f}s (goal < 5 s)")


if __name__ == "__main__":
    main()
