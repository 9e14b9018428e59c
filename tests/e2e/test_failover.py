"""Failover to a sync standby (docs/replication.md), with real processes: a primary device ships
its journal to a hot standby process while clients mutate through it; the primary is killed -9;
the standby becomes the new primary — promoted in place (SIGUSR1: its tables and model are
ready) in even rounds, stopped and its journal booted (`--takeover`) in odd ones — and the clients go on,
retrying exactly what was unanswered. Every receipt any client saw saved reads back byte for
byte, no sequence is assigned twice, nothing is applied twice, and the clients keep their
lineages (a takeover continues the line of history). The old primary rejoins as the standby of the
new one from its own journal, cut back to the takeover point — in odd rounds the new primary,
saving alone once 1 s passed without a standby, checkpoints first, and the old one catches up
from its runtime file instead — and takes over in the next round."""
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time

import pytest
import rfc8785

from gpu_worker.pack import pack_tiny
from tests.conftest import PYTHON, ROOT, free_port, wait_for, write_grants
from tests.e2e.test_kill9 import Client, Zygote, alive, call, list_spaces
from tests.e2e.test_supervised_restart import without_save_place

pytestmark = pytest.mark.e2e
CLIENTS = 4
ROUNDS = int(os.environ.get("AOTX_FAILOVER_ROUNDS", "3"))


def test_a_sync_standby_takes_over_with_every_saved_receipt(tmp_path):
    principals = [os.urandom(16) for _ in range(CLIENTS)]
    grants = str(tmp_path / "grants.json")
    write_grants(grants, {p.hex(): ["shared_read", "shared_write"] for p in principals})
    runtime = str(tmp_path / "a.aotxccir")
    pack_tiny(runtime, shared=True, capacity={"participants": 8, "spaces": 20000, "receipts": 20000,
                                              "command_bytes": 1024, "result_bytes": 16},
              # no checkpoint: a standby catches up from segments the primary keeps
              journal_limits={"journal_file_cap_bytes": 1 << 40, "checkpoint_journal_bytes": 1 << 40})
    short = tempfile.mkdtemp(prefix="aotx-fo-")  # AF_UNIX paths are short
    log = tmp_path / "devices.log"
    log.touch()
    zygote = Zygote()

    def start(argv, ready):
        begin = log.stat().st_size
        pid = zygote.boot(argv, str(log))
        wait_for(lambda: ready in log.read_text()[begin:] or not alive(pid), 60, what=ready)
        assert alive(pid), log.read_text()[begin:]
        return pid

    # the machines: each has its runtime file (a copy: the same incarnation) and journal
    machines = []
    for name in "ab":
        path = str(tmp_path / f"{name}.aotxccir")
        if not os.path.exists(path):
            shutil.copyfile(runtime, path)
        machines.append({"ccir": path, "journal": str(tmp_path / f"journal-{name}"),
                         "replicate": os.path.join(short, f"{name}.sock")})

    def serve(m, takeover):
        # a takeover's primary saves alone after 1 s without a standby (--standby-timeout): its
        # checkpoint, which waits until every transfer is saved, runs before the old primary rejoins
        return start(["--ccir", m["ccir"], "--journal", m["journal"], "--service-grants", grants, "--device", "cpu",
                      "--replicate", m["replicate"], "--replication", "sync"]
                     + (["--takeover", "--standby-timeout", "1"] if takeover else []), "device ready")

    def follow(m, primary):
        return start(["--ccir", m["ccir"], "--journal", m["journal"], "--service-grants", grants,
                      "--standby-of", primary["replicate"],  # and, promoted, ships to the next standby
                      "--replicate", m["replicate"], "--replication", "sync"], "standby ready")

    stop = threading.Event()
    primary, standby = machines
    primary_pid = serve(primary, takeover=False)
    standby_pid = follow(standby, primary)
    clients = [Client(p, os.path.join(primary["journal"], "service.sock"), stop) for p in principals]
    for c in clients:
        c.start()
    takeovers = []
    try:
        for round_ in range(ROUNDS):
            floor = [len(c.saved_so_far()) for c in clients]
            wait_for(lambda: all(len(c.saved_so_far()) >= f + 5 for c, f in zip(clients, floor)), 60,
                     what="each client to save five more receipts")
            killed = time.monotonic()
            os.kill(primary_pid, signal.SIGKILL)
            wait_for(lambda: not alive(primary_pid), 30, what="the primary to die")
            before = [len(c.saved_so_far()) for c in clients]
            if round_ % 2 == 0:  # promoted in place: the same process serves
                begin = log.stat().st_size
                os.kill(standby_pid, signal.SIGUSR1)
                wait_for(lambda: "device ready" in log.read_text()[begin:] or not alive(standby_pid), 60,
                         what="the standby to take over")
                assert alive(standby_pid), log.read_text()[begin:]
                primary, standby, primary_pid = standby, primary, standby_pid
            else:
                os.kill(standby_pid, signal.SIGTERM)  # the standby stops following; its journal is whole
                wait_for(lambda: not alive(standby_pid), 30, what="the standby to stop")
                primary, standby = standby, primary
                primary_pid = serve(primary, takeover=True)
            for c in clients:
                c.path = os.path.join(primary["journal"], "service.sock")
            if round_ % 2 == 1:  # the new primary checkpoints before the old one rejoins: it catches up from the file
                with socket.socket(socket.AF_UNIX) as sock:
                    sock.settimeout(60)
                    sock.connect(c.path)
                    done = call(sock, {"v": 1, "id": 0, "op": "checkpoint", "principal": None, "args": {}})
                    assert done["status"] == 200, done
            # the old primary's machine follows the new one, from its own journal (a tail the standby
            # never acknowledged is cut back to the takeover point; after a checkpoint it catches up
            # from the new primary's runtime file instead)
            standby_pid = follow(standby, primary)
            if round_ % 2 == 1:  # caught up from the runtime file, a generation behind; and what was saved
                # alone (if anything was: --standby-timeout) is held by the standby too before the next fault
                wait_for(lambda: caught_up_from_the_file(primary), 60, what="the standby to catch up from the file")
            wait_for(lambda: any(len(c.saved_so_far()) > b for c, b in zip(clients, before)), 60,
                     what="a first admission on the new primary")
            takeovers.append(time.monotonic() - killed)
        stop.set()
        for c in clients:
            c.join(60)
            assert not c.is_alive() and not c.errors, c.errors
        with socket.socket(socket.AF_UNIX) as verifier:
            verifier.connect(os.path.join(primary["journal"], "service.sock"))
            for c in clients:
                saved_read_back(verifier, c)
                spaces = list_spaces(verifier, c.principal)
                assert len(spaces) == len({s["id"] for s in spaces}) == len(c.saved) - 1  # nothing applied twice
        # (the last boot's first answers may all be exact retries of receipts the boot before saved)
        each_takeover_made_a_generation(saves_by_boot(c.saved.values() for c in clients), ROUNDS)
        total = sum(len(c.saved) for c in clients)
        takeovers.sort()
        print(f"{ROUNDS} failovers, {total} saved receipts, kill to first admission on the new primary: "
              f"p50 {takeovers[len(takeovers) // 2]:.2f}s, max {takeovers[-1]:.2f}s")
    finally:
        stop.set()
        for pid in (primary_pid, standby_pid):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        zygote.close()
        shutil.rmtree(short, ignore_errors=True)


def test_a_standby_takes_over_by_itself_when_the_primarys_lease_lapses_and_the_zombie_admits_nothing(tmp_path):
    """Leadership through a three-member etcd: the primary holds the leader key under a 2 s lease.
    SIGSTOP stops it past its lease; the standby sees the key gone and becomes the primary by itself
    (`boot --takeover`, the same process); the clients go on there. SIGCONT: the old primary, a
    zombie, admits nothing (503 not_primary) though it still believes nothing; every receipt a
    client saw saved reads back from the new primary."""
    from tests.etcd import EtcdCluster
    etcd = EtcdCluster(tmp_path).start()
    principals = [os.urandom(16) for _ in range(CLIENTS)]
    late = os.urandom(16)  # registers at the zombie: refused
    probe = os.urandom(16)  # registers at the new primary as soon as it is ready: the time to the first admission
    grants = str(tmp_path / "grants.json")
    write_grants(grants, {p.hex(): ["shared_read", "shared_write"] for p in principals + [late, probe]})
    m = Machines(tmp_path, etcd)
    runtime, a_sock, b_sock, log, lease, start = m.runtime, m.a_sock, m.b_sock, m.log, m.lease, m.start
    a_journal, b_journal = str(tmp_path / "journal-a"), str(tmp_path / "journal-b")

    stop = threading.Event()
    try:
        primary_pid = start(["--ccir", runtime, "--journal", a_journal, "--service-grants", grants, "--device", "cpu",
                             "--replicate", a_sock] + lease, "device ready")
        standby_pid = start(["--ccir", str(tmp_path / "b.aotxccir"), "--journal", b_journal, "--service-grants", grants,
                             "--standby-of", a_sock, "--replicate", b_sock, "--standby-timeout", "1"] + lease,
                            "standby ready")  # once it took over, it saves alone after 1 s without a standby
        clients = [FollowingClient(p, os.path.join(a_journal, "service.sock"), stop) for p in principals]
        for c in clients:
            c.start()
        wait_for(lambda: all(len(c.saved_so_far()) >= 5 for c in clients), 60, what="five receipts each")
        begin = log.stat().st_size
        stopped = time.monotonic()
        os.kill(primary_pid, signal.SIGSTOP)  # past its lease: a zombie once it runs again
        before = [len(c.saved_so_far()) for c in clients]
        for c in clients:
            c.path = os.path.join(b_journal, "service.sock")
        wait_for(lambda: "device ready" in log.read_text()[begin:], 60, what="the standby to take over by itself")
        assert alive(standby_pid)  # the same process, now the primary
        with socket.socket(socket.AF_UNIX) as current:  # the line of history is the same on both
            current.settimeout(30)
            current.connect(os.path.join(b_journal, "service.sock"))
            lineage, probe_lineage = (json.loads(call(current, {"v": 1, "id": 0, "op": "participant.get",
                                                                "principal": p.hex(), "args": {}})["body"])["lineage"]
                                      for p in (late, probe))
            probed = call(current, register(probe, probe_lineage))
            assert probed["status"] == 202, probed
        took = time.monotonic() - stopped
        wait_for(lambda: any(len(c.saved_so_far()) > b for c, b in zip(clients, before)), 60,
                 what="the clients to go on at the new primary (after their 10 s socket timeout at the stopped one)")
        os.kill(primary_pid, signal.SIGCONT)
        with socket.socket(socket.AF_UNIX) as zombie:
            zombie.settimeout(30)
            zombie.connect(os.path.join(a_journal, "service.sock"))
            reply = call(zombie, register(late, lineage))
        assert reply["status"] == 503 and json.loads(reply["body"])["error"]["code"] == "not_primary", reply
        os.kill(primary_pid, signal.SIGKILL)
        stop.set()
        for c in clients:
            c.join(60)
            assert not c.is_alive() and not c.errors, c.errors
        with socket.socket(socket.AF_UNIX) as verifier:
            verifier.connect(os.path.join(b_journal, "service.sock"))
            for c in clients:
                saved_read_back(verifier, c)
            status = json.loads(call(verifier, {"v": 1, "id": 0, "op": "ping", "principal": None, "args": {}})["body"])
            [failover] = status["failovers"]  # the takeover, an incident of the saved state
            assert failover["generation"] == status["pipeline"]["leadership"]["generation"] > 0
            by_boot = saves_by_boot([c.saved.values() for c in clients] + [[probed["body"]]])
            each_takeover_made_a_generation(by_boot, 2)
            assert by_boot[2] == {failover["file_generation"]} == {int(status["generation"])}
            assert status["pipeline"]["leadership"]["fenced"] is None
        print(f"SIGSTOP of the primary (2 s lease) to the first admission on the standby that took over by "
              f"itself: {took:.2f}s")
    finally:
        stop.set()
        m.close()


def test_sdk_clients_through_two_gateways_go_on_at_the_standby_that_took_over(tmp_path):
    """The whole way: a primary and its hot standby (etcd, 2 s lease), two gateways following the
    leader key (gateway.json "etcd"), SDK clients creating spaces through them, one through each.
    kill -9 of the primary: the standby takes over by itself, both gateways find it through the
    key, the clients go on (exact retries, nothing given up), and every receipt any client was
    given reads back the same through either gateway, no sequence assigned twice."""
    from tests.etcd import EtcdCluster
    from tests.harness import Process
    etcd = EtcdCluster(tmp_path).start()
    grants = str(tmp_path / "grants.json")
    env, configs, urls = gateway_stack(tmp_path, etcd, grants, 2)
    principals = make_principals(env, configs[0], ["client-0", "client-1"])
    m = Machines(tmp_path, etcd)
    stop = threading.Event()
    try:
        primary = m.start(["--ccir", m.runtime, "--journal", str(tmp_path / "journal-a"), "--service-grants", grants,
                           "--device", "cpu", "--replicate", m.a_sock] + m.lease, "device ready")
        m.start(["--ccir", m.copy, "--journal", str(tmp_path / "journal-b"), "--service-grants", grants,
                 "--standby-of", m.a_sock, "--replicate", m.b_sock, "--standby-timeout", "1"] + m.lease, "standby ready")
        for i, config in enumerate(configs):
            m.gateways.append(Process([PYTHON, "manage.py", "serve", "--config", str(config)], env,
                                    tmp_path / f"gateway-{i}.log"))
        for url in urls:
            wait_for(lambda: listening(url), 60, what=f"the gateway at {url}")
        clients = [SdkClient(urls[i], *principals[f"client-{i}"], stop) for i in range(2)]
        for c in clients:
            c.start()
        wait_for(lambda: all(len(c.saved) >= 5 or c.errors for c in clients), 60, what="five receipts each")
        begin = m.log.stat().st_size
        os.kill(primary, signal.SIGKILL)
        wait_for(lambda: "device ready" in m.log.read_text()[begin:], 60, what="the standby to take over by itself")
        wait_for(lambda: all(c.first_saved_by(2) or c.errors for c in clients), 60,
                 what="each client to be answered by the new primary (boot 2) through its gateway")
        stop.set()
        for c in clients:
            c.join(60)
            assert not c.is_alive() and not c.errors, c.errors
        assert verify_through(clients, urls) == 2 * sum(len(c.saved) for c in clients)
        each_takeover_made_a_generation(saves_by_boot((rfc8785.dumps(r) for r in c.saved.values()) for c in clients), 2)
        for i, gateway in enumerate(m.gateways):
            assert "leader key /aotx/primary: a new primary" in gateway.output(), f"gateway {i} did not follow the key"
    finally:
        stop.set()
        m.close()


class Machines:
    """Two device machines on loopback for the tests with etcd: a runtime file (`runtime`) and its
    copy (`copy`), replication sockets in a short directory (AF_UNIX paths are short), one log,
    the zygote that boots them, `lease` the devices' etcd options (a 2 s lease); `close` ends the
    devices and gateways it started, the zygote and etcd."""

    def __init__(self, tmp_path, etcd):
        self.etcd = etcd
        self.runtime, self.copy = str(tmp_path / "a.aotxccir"), str(tmp_path / "b.aotxccir")
        pack_tiny(self.runtime, shared=True, capacity={"participants": 8, "spaces": 20000, "receipts": 20000,
                                                       "command_bytes": 1024, "result_bytes": 16})
        shutil.copyfile(self.runtime, self.copy)
        self.short = tempfile.mkdtemp(prefix="aotx-le-")
        self.a_sock, self.b_sock = os.path.join(self.short, "a.sock"), os.path.join(self.short, "b.sock")
        self.log = tmp_path / "devices.log"
        self.log.touch()
        self.zygote = Zygote()
        self.lease = ["--etcd", ",".join(etcd.endpoints), "--lease-seconds", "2"]
        self.pids, self.gateways = [], []

    def start(self, argv, ready, begin=None):
        begin = self.log.stat().st_size if begin is None else begin
        pid = self.zygote.boot(argv, str(self.log))
        self.pids.append(pid)
        wait_for(lambda: ready in self.log.read_text()[begin:] or not alive(pid), 60, what=ready)
        assert alive(pid), self.log.read_text()[begin:]
        return pid

    def close(self):
        for pid in self.pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        for gateway in self.gateways:
            gateway.kill(signal.SIGTERM)
        self.zygote.close()
        self.etcd.stop()
        shutil.rmtree(self.short, ignore_errors=True)


def register(principal, lineage):
    """A participant registration as the gateway sends it (a fresh operation key)."""
    key = os.urandom(16).hex()
    body = {"schema": "aotx.shared.mutation.v1", "lineage": lineage, "operation_key": key, "sequence": "1"}
    return {"v": 1, "id": 1, "op": "participant.register", "principal": principal.hex(), "args": {
        "lineage": lineage, "operation_key": key, "sequence": 1,
        "canonical": rfc8785.dumps({"method": "POST", "path": "/aotx/v1/shared/participant", "body": body})}}


class FollowingClient(Client):
    """A client that, told `not_primary`, sends the same request, exactly, to the current primary
    (its `path`, which the test moves), as the SDK's exact retry would."""

    def exchange(self, sock, msg):
        while True:
            reply, sock = super().exchange(sock, msg)
            if reply["status"] != 503 or json.loads(reply["body"])["error"]["code"] != "not_primary":
                return reply, sock
            sock.close()
            sock = None
            self.retries += 1


def as_given(got, given):
    """Whether receipt bytes read back are those a client was given: the same bytes, or folded by
    a checkpoint since, only its save place changed ("source": "file" and the checkpoint's
    generation, SPEC's save fields)."""
    return got == given or ((json.loads(got)["admission"]["save"] or {}).get("source") == "file"
                            and without_save_place(got) == without_save_place(given))


def saves_by_boot(bodies_per_client):
    """{boot: {save generation}} of the receipt bodies the clients were given saved in the journal
    (one given as an exact retry's answer after a checkpoint folded it says "source": "file" and
    that checkpoint's generation instead: left out)."""
    by_boot: dict[int, set[int]] = {}
    for bodies in bodies_per_client:
        for body in bodies:
            save = json.loads(body)["admission"]["save"]
            if save["source"] == "journal":
                by_boot.setdefault(int(save["boot"]), set()).add(int(save["generation"]))
    return by_boot


def each_takeover_made_a_generation(by_boot, boots):
    """Boots 1..`boots` (at least) saved receipts, each boot after the first a takeover: every
    takeover made the runtime file's next generation (SPEC's save fields identify it), so the
    generations each boot's receipts carry are past those of the boot before: no generation was
    saved in by two devices."""
    present = sorted(by_boot)
    assert present[:boots] == list(range(1, boots + 1)) and present == list(range(1, len(present) + 1)), present
    for before, after in zip(present, present[1:]):
        assert max(by_boot[before]) < min(by_boot[after]), by_boot


def replication(machine):
    """The device's replication state (ping's pipeline.replication)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(30)
        sock.connect(os.path.join(machine["journal"], "service.sock"))
        return json.loads(call(sock, {"v": 1, "id": 0, "op": "ping", "principal": None, "args": {}})["body"])[
            "pipeline"]["replication"]


def caught_up_from_the_file(machine):
    """The primary streams to a standby it caught up from its runtime file (one catch-up since
    its boot, done) and waits for it again (not alone)."""
    r = replication(machine)
    return r["standby"] is not None and r["catch_ups"] == 1 and not r["catching_up"] and not r["alone"]


def saved_read_back(verifier, client):
    """Every receipt the client saw saved reads back byte for byte — or, folded by a checkpoint
    since, with only its save place changed ("source": "file" and the checkpoint's generation,
    SPEC's save fields) —; its lineage is kept (a takeover continues the line of history) and its
    next sequence is one past its last saved (none twice)."""
    for sequence, body in client.saved.items():
        got = call(verifier, {"v": 1, "id": 0, "op": "operations.get", "principal": client.principal.hex(),
                              "args": {"operation": json.loads(body)["operation"]}})
        assert got["status"] == 200 and as_given(got["body"], body), (sequence, got, body)
    me = json.loads(call(verifier, {"v": 1, "id": 0, "op": "participant.get", "principal": client.principal.hex(),
                                    "args": {}})["body"])
    assert me["lineage"] == client.lineage and me["next_sequence"] == str(max(client.saved) + 1)


class SdkClient(threading.Thread):
    """One principal's participant through the SDK (exact retries) at one gateway, creating a space
    every `pace` seconds until stopped: `saved` {operation: receipt} of every mutation the SDK
    returned saved (the receipt's save fields name the boot of the primary that saved it), `at`
    when each was returned."""

    def __init__(self, base_url, principal_hex, token, stop, pace=0.05):
        super().__init__(daemon=True)
        self.base_url, self.principal_hex, self.token, self.stop = base_url, principal_hex, token, stop
        self.pace = pace
        self.saved, self.at, self.errors = {}, {}, []
        self.lock = threading.Lock()

    def run(self):
        from aotx_client import Client
        try:
            with Client(self.base_url, self.token, timeout=30, retry_for=120) as aotx:
                aotx.register()
                while not self.stop.wait(self.pace):
                    receipt = aotx.create_space()
                    with self.lock:
                        self.saved[receipt["operation"]] = receipt
                        self.at[receipt["operation"]] = time.monotonic()
        except Exception as exc:  # reported at the end: an SDK client must never give up
            self.errors.append(exc)

    def first_saved_by(self, boot):
        """When this client was first answered saved by the primary of `boot` (None: not yet)."""
        with self.lock:
            times = [self.at[op] for op, r in self.saved.items() if r["admission"]["save"]["boot"] == str(boot)]
        return min(times, default=None)


def gateway_stack(base, etcd, grants, count):
    """A gateway database with the principals, and `count` gateways (`manage.py serve`) on it, each
    following the leader key: (gateway processes, their base URLs, {name: (principal hex, token)})."""
    env = dict(os.environ, AOTX_VAR_DIR=str(base / "var"), DATABASE_URL=f"sqlite:///{base / 'gateway.sqlite3'}",
               DJANGO_SETTINGS_MODULE="aotx_site.settings", AOTX_DEVICE_TIMEOUT="10")
    env.pop("REDIS_URL", None)
    configs, urls = [], []
    for i in range(count):
        port = free_port()
        config = base / f"gateway-{i}.json"
        config.write_text(json.dumps({"listen": f"127.0.0.1:{port}", "socket": str(base / "no-primary-yet.sock"),
                                      "grants_file": grants, "etcd": ",".join(etcd.endpoints)}))
        configs.append(config)
        urls.append(f"http://127.0.0.1:{port}")
    return env, configs, urls


def make_principals(env, config, names):
    """Create the principals in the gateway database and write the grant file: {name: (id hex, token)}."""
    script = ("import json, sys, django; django.setup()\n"
              "from django.core.management import call_command\n"
              "from shared_api.models import Principal, apply_quotas, parse_quotas\n"
              "free = apply_quotas({}, parse_quotas(['receipts=unlimited', 'spaces=unlimited', "
              "'requests_per_second=unlimited', 'body_bytes_per_second=unlimited']))\n"
              "call_command('migrate', '--noinput', verbosity=0)\n"
              "out = {}\n"
              "for name in sys.argv[2:]:\n"
              "    p, token = Principal.create(name, ['shared_read', 'shared_write'], free)\n"
              "    out[name] = [p.principal_id, token]\n"
              "call_command('write_grants', '--config', sys.argv[1])\n"
              "print(json.dumps(out))\n")
    done = subprocess.run([PYTHON, "-c", script, str(config), *names], cwd=ROOT, env=env, capture_output=True,
                          text=True, check=True, timeout=300)
    return {name: (pid, token) for name, (pid, token) in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def listening(url):
    import urllib.error
    import urllib.request
    try:
        urllib.request.urlopen(url + "/aotx/v1/shared/capabilities", timeout=2)
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def verify_through(clients, urls):
    """Every receipt each SDK client was given, read back through the SDK at each gateway: the
    same (`as_given`); the sequences it was given are saved without a gap or a repeat, and its next sequence is
    past the last. The number of receipts read back."""
    from aotx_client import Client
    checked = 0
    for c in clients:
        with c.lock:
            saved = dict(c.saved)
        for url in urls:
            with Client(url, c.token, timeout=30, retry_for=120) as aotx:
                for op, receipt in saved.items():
                    assert as_given(rfc8785.dumps(aotx.receipt(op)), rfc8785.dumps(receipt)), (op, receipt)
                    checked += 1
                me = aotx.participant()
            sequences = sorted(int(r["sequence"]) for r in saved.values())
            assert sequences == list(range(sequences[0], sequences[0] + len(sequences))), "a sequence twice or lost"
            assert int(me["next_sequence"]) >= sequences[-1] + 1
    return checked
