"""The fault harness for replication (docs/replication.md): two device machines on loopback (each
its runtime file copy, journal and replication socket; the standby hot), a three-member etcd, two
gateways that follow the leader key (gateway.json "etcd"), and clients of the SDK (aotx_client,
exact retries) creating spaces through them, half through each gateway, while it injects, round
after round:

- kill   : kill -9 of the primary; the standby takes over by itself (the etcd lease lapses);
- stop   : SIGSTOP of the primary past its lease; the standby takes over; SIGCONT: the zombie must
           answer 503 not_primary to a new mutation; then it is killed;
- quiet  : SIGSTOP of the standby (the link goes quiet) for twice the standby timeout, then SIGCONT:
           the primary holds meanwhile (the link is up, nothing acknowledges), then the standby
           catches up; no failover;
- cut    : the replication connection cut (the standby reaches the primary through a relay here,
           which closes the connection and refuses new ones) for twice the standby timeout, then
           restored: the primary holds (with a standby timeout, then saves alone); the standby
           connects again and catches up; no failover;
- drop   : kill -9 of the standby (the link is gone): the primary holds (with a standby timeout,
           saves alone after it); the standby starts again from its own journal and catches up; no
           failover;
- behind : as drop, and the primary checkpoints while the standby is gone: the standby starts
           again with its copy of the runtime file a generation behind and catches up from the
           primary's file (docs/replication.md, "Catch-up"); no failover.

After a failover the old primary's machine rejoins as the new primary's standby from its own
journal (its copy of the runtime file adopts the generation the takeover made: no catch-up).
After every round: every receipt a client saw saved reads back byte for byte from the current
primary, each client's next sequence is one past its last saved one (none assigned twice), the
leadership generation has grown with every takeover (no two primaries in one generation), and so
has the runtime file generation the receipts carry in their save fields (a takeover makes the next
one: no generation saved in by two devices).

    .venv/bin/python bench/failover.py [--rounds 20] [--lease-seconds S] [--standby-timeout S]

The devices run with the device's defaults (a 3 s lease; no standby timeout: a primary whose
standby is gone holds its admissions until a standby holds them again) unless the options say
otherwise; the quiet and cut faults last twice the standby timeout (2 s without one).

The faults cycle kill, stop, quiet, cut, drop, and behind when a standby timeout is set (without one
the primary holds while its standby is away, so no checkpoint can leave the standby behind).

Reported: per round, the fault, the time from it to the first admission on the (new) primary (a
probe registers a fresh principal at its socket, every 10 ms), each SDK client's time to the first
receipt it saw saved by it through a gateway (the client's view: its retries back off, to 0.5 s
apart; every client's, not the fastest's), the leadership and file generations; then p50 and max
over the failovers (the clients' times pooled). The devices run the tiny model (a
hot standby loads its model before it follows, so the model's size does not reach the takeover)."""
import argparse
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)  # not bench/: bench/http.py would shadow the standard library http

from gpu_worker.pack import pack_tiny  # noqa: E402
from tests.conftest import PYTHON, wait_for  # noqa: E402
from tests.e2e.test_failover import SdkClient, gateway_stack, listening, make_principals, register  # noqa: E402
from tests.e2e.test_failover import as_given, verify_through  # noqa: E402
from tests.e2e.test_failover import each_takeover_made_a_generation, saves_by_boot  # noqa: E402
from tests.e2e.test_kill9 import Zygote, alive, call  # noqa: E402
from tests.etcd import EtcdCluster  # noqa: E402
from tests.harness import Process  # noqa: E402

CLIENTS = 4  # (each creates a space every 0.05 s: the receipt table holds 60,000 for all the rounds)


class Relay:
    """A replication connection the harness can cut: listens at `path` and joins each connection to
    `target` (a primary's --replicate), a thread a direction; `cut` closes every joined connection
    and refuses new ones until `restore`."""

    def __init__(self, path, target):
        self.path, self.target = path, target
        self.down = False
        self.joined = []
        self.lock = threading.Lock()
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(path)
        self.listener.listen()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                near, _ = self.listener.accept()
            except OSError:
                return
            far = socket.socket(socket.AF_UNIX)
            try:
                if self.down:
                    raise OSError("cut")
                far.connect(self.target)
            except OSError:
                near.close()
                far.close()
                continue
            with self.lock:
                self.joined.append((near, far))
            for a, b in ((near, far), (far, near)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a, b):
        try:
            while data := a.recv(1 << 16):
                b.sendall(data)
        except OSError:
            pass
        for sock in (a, b):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        a.close()  # (each socket is `a` of one pump; the other pump's writes to it fail: ended)

    def cut(self):
        self.down = True
        with self.lock:
            joined, self.joined = self.joined, []
        for pair in joined:
            for sock in pair:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def restore(self):
        self.down = False

    def close(self):
        self.cut()
        self.listener.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--lease-seconds", type=int, default=None,
                        help="the devices' leadership lease (default: the device's own default)")
    parser.add_argument("--standby-timeout", type=float, default=None,
                        help="the devices' --standby-timeout (default: the device's own default)")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-failover-"))
    etcd = EtcdCluster(base).start()
    grants = str(base / "grants.json")
    env, configs, urls = gateway_stack(base, etcd, grants, 2)
    names = [f"client-{i}" for i in range(CLIENTS)] + [f"probe-{i}" for i in range(2 * args.rounds + 2)]
    principals = make_principals(env, configs[0], names)
    probes = [bytes.fromhex(principals[n][0]) for n in names if n.startswith("probe-")]
    runtime = str(base / "a.aotxccir")
    pack_tiny(runtime, shared=True, capacity={"participants": 64, "spaces": 60000, "receipts": 60000,
                                              "command_bytes": 1024, "result_bytes": 16})
    shutil.copyfile(runtime, str(base / "b.aotxccir"))
    log = base / "devices.log"
    log.touch()
    zygote = Zygote()
    # "behind" needs a primary that saves alone (a checkpoint while its standby is away): with no
    # standby timeout the primary holds instead, and the checkpoint would wait for a standby
    faults = ("kill", "stop", "quiet", "cut", "drop") + (("behind",) if args.standby_timeout is not None else ())
    # the options a deployment would set; left out, the device's defaults are what is measured
    lease = ["--etcd", ",".join(etcd.endpoints)]
    if args.lease_seconds is not None:
        lease += ["--lease-seconds", str(args.lease_seconds)]
    if args.standby_timeout is not None:
        lease += ["--standby-timeout", str(args.standby_timeout)]
    machines = {name: {"ccir": str(base / f"{name}.aotxccir"), "journal": str(base / f"journal-{name}"),
                       "replicate": str(base / f"{name}.sock")} for name in "ab"}
    for m in machines.values():  # a standby reaches its primary's --replicate through a relay it can cut
        m["relay"] = Relay(m["replicate"] + ".relay", m["replicate"])

    def start(argv, ready):
        begin = log.stat().st_size
        pid = zygote.boot(argv, str(log))
        wait_for(lambda: ready in log.read_text()[begin:] or not alive(pid), 120, what=ready)
        if not alive(pid):
            raise SystemExit(log.read_text()[begin:])
        return pid

    def standby(m, primary):
        return start(["--ccir", m["ccir"], "--journal", m["journal"], "--service-grants", grants,
                      "--standby-of", primary["relay"].path, "--replicate", m["replicate"]] + lease, "standby ready")

    def sock_of(m):
        return os.path.join(m["journal"], "service.sock")

    def probe_admission(m, principal):
        """Register `principal` at m's device as soon as it answers: when it did."""
        while True:
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.settimeout(10)
                    s.connect(sock_of(m))
                    lineage = json.loads(call(s, {"v": 1, "id": 0, "op": "participant.get", "principal": principal.hex(),
                                                  "args": {}})["body"])["lineage"]
                    reply = call(s, register(principal, lineage))
                if reply["status"] == 202:
                    return time.monotonic()
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.01)  # (a bounded poll of a socket that is not there yet)

    def checkpoint(m):
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(60)
            s.connect(sock_of(m))
            done = call(s, {"v": 1, "id": 0, "op": "checkpoint", "principal": None, "args": {}})
        assert done["status"] == 200, done

    def ping(m):
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(30)
            s.connect(sock_of(m))
            return json.loads(call(s, {"v": 1, "id": 0, "op": "ping", "principal": None, "args": {}})["body"])

    stop = threading.Event()
    primary, spare = machines["a"], machines["b"]
    pids, gateways = {}, []
    rows = []
    try:
        pids["a"] = start(["--ccir", primary["ccir"], "--journal", primary["journal"], "--service-grants", grants,
                           "--device", "cpu", "--replicate", primary["replicate"]] + lease,
                          "device ready")
        pids["b"] = standby(spare, primary)
        for i, config in enumerate(configs):
            gateways.append(Process([PYTHON, "manage.py", "serve", "--config", str(config)], env,
                                    base / f"gateway-{i}.log"))
        for url in urls:
            wait_for(lambda: listening(url), 60, what=f"the gateway at {url}")
        clients = [SdkClient(urls[i % len(urls)], *principals[f"client-{i}"], stop) for i in range(CLIENTS)]
        for c in clients:
            c.start()
        generation = ping(primary)["pipeline"]["leadership"]["generation"]
        file_generation, failovers = int(ping(primary)["generation"]), 0
        probe = iter(probes)
        for round_ in range(args.rounds):
            fault = faults[round_ % len(faults)]
            floor = [len(c.saved) for c in clients]
            wait_for(lambda: all(len(c.saved) >= f + 3 or c.errors for c, f in zip(clients, floor)), 120,
                     what="each client to save three more receipts")
            for c in clients:
                assert not c.errors, c.errors
            old, new = ("a", "b") if primary is machines["a"] else ("b", "a")
            began = time.monotonic()
            seen = None
            if fault in ("quiet", "cut", "drop", "behind"):
                losses = ping(primary)["pipeline"]["replication"]["standby_losses"]
                if fault == "cut":
                    primary["relay"].cut()
                else:
                    os.kill(pids[new], signal.SIGSTOP if fault == "quiet" else signal.SIGKILL)
                time.sleep(2 * (args.standby_timeout or 1.0))  # the fault lasts this long
                if fault == "quiet":
                    os.kill(pids[new], signal.SIGCONT)
                elif fault == "cut":
                    primary["relay"].restore()
                else:
                    wait_for(lambda: not alive(pids[new]), 30, what="the standby to be gone")
                    if fault == "behind":  # its copy of the runtime file falls a generation behind
                        checkpoint(primary)
                    begin = log.stat().st_size
                    pids[new] = standby(spare, primary)  # from its own journal
                took = probe_admission(primary, next(probe)) - began
                wait_for(lambda: (ping(primary)["pipeline"]["replication"]["standby"] is not None
                                  and ping(primary)["pipeline"]["replication"]["lag_transfers"] == 0), 60,
                         what="the standby to catch up")
                if fault != "quiet":  # (the link was gone: the primary saw the standby leave)
                    assert ping(primary)["pipeline"]["replication"]["standby_losses"] > losses
                if fault == "behind":
                    assert "standby: caught up to the primary's generation" in log.read_text()[begin:]
            else:
                if fault == "stop":  # a principal for the zombie check, and its lineage (the same on both)
                    late = next(probe)
                    with socket.socket(socket.AF_UNIX) as current:
                        current.settimeout(30)
                        current.connect(sock_of(primary))
                        lineage = json.loads(call(current, {"v": 1, "id": 0, "op": "participant.get",
                                                            "principal": late.hex(), "args": {}})["body"])["lineage"]
                os.kill(pids[old], signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
                begin = log.stat().st_size
                wait_for(lambda: "device ready" in log.read_text()[begin:], 120, what="the standby to take over")
                primary, spare = spare, primary
                boot = ping(primary)["boot"]
                if fault == "stop":  # the zombie runs again: it must admit nothing
                    os.kill(pids[old], signal.SIGCONT)
                    with socket.socket(socket.AF_UNIX) as zombie:
                        zombie.settimeout(30)
                        zombie.connect(sock_of(spare))
                        reply = call(zombie, register(late, lineage))
                    assert reply["status"] == 503 and b"not_primary" in reply["body"], reply
                    os.kill(pids[old], signal.SIGKILL)
                wait_for(lambda: not alive(pids[old]), 30, what="the old primary to be gone")
                # The old primary's machine restarts at once as the new primary's standby, from its
                # own journal (as its supervisor would restart it): without a standby timeout the
                # new primary admits nothing until a standby holds what it saves
                rejoined: list = []
                rejoin = threading.Thread(target=lambda: rejoined.append(standby(spare, primary)), daemon=True)
                rejoin.start()
                took = probe_admission(primary, next(probe)) - began
                rejoin.join(180)
                if not rejoined:
                    raise SystemExit("the old primary's machine did not rejoin as a standby")
                pids[old] = rejoined[0]
                now = ping(primary)["pipeline"]["leadership"]["generation"]
                assert now > generation, (now, generation)  # a new generation for every takeover
                generation = now
                made = int(ping(primary)["generation"])  # the runtime file's, made by the takeover
                assert made > file_generation, (made, file_generation)
                failovers += 1
                wait_for(lambda: all(c.first_saved_by(boot) or c.errors for c in clients), 120,
                         what="every SDK client to be answered by the new primary")
                seen = [c.first_saved_by(boot) - began for c in clients]  # every client's, not the fastest's
                wait_for(lambda: (ping(primary)["pipeline"]["replication"]["standby"] is not None
                                  and ping(primary)["pipeline"]["replication"]["lag_transfers"] == 0), 60,
                         what="the old primary to rejoin")
                # its copy, a failover generation behind, adopted it: nothing was caught up from the file
                assert ping(primary)["pipeline"]["replication"]["catch_ups"] == 0
                assert "adopted the primary's failover generation" in log.read_text()[begin:]
            verified = verify(clients, sock_of(primary))
            file_generation = int(ping(primary)["generation"])  # (a checkpoint of "behind" moves it too)
            rows.append((round_ + 1, fault, took, seen, generation, verified))
            print(f"round {round_ + 1:>2} {fault:>4}: first admission {took:6.2f}s after the fault"
                  + (f", each SDK client's first receipt through a gateway {min(seen):.2f}-{max(seen):.2f}s"
                     if seen is not None else "")
                  + f", leadership generation {generation}, file generation {file_generation}, {verified} saved "
                  "receipts read back", flush=True)
        stop.set()
        for c in clients:
            c.join(60)
            assert not c.errors, c.errors
        print(f"at the end, through the SDK at both gateways: {verify_through(clients, urls)} receipts read back as "
              "they were given", flush=True)
        by_boot = saves_by_boot([json.dumps(r) for r in c.saved.values()] for c in clients)
        each_takeover_made_a_generation(by_boot, failovers + 1)
        spans = " ".join(f"{boot}:{min(g)}-{max(g)}" for boot, g in sorted(by_boot.items()))
        print(f"file generations in the receipts' save fields, by boot: {spans}", flush=True)
    finally:
        stop.set()
        for pid in pids.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        for g in gateways:
            g.kill(signal.SIGTERM)
        zygote.close()
        etcd.stop()
        for m in machines.values():
            m["relay"].close()
        shutil.rmtree(base, ignore_errors=True)
    for fault in ("kill", "stop"):
        for index, what in ((2, "first admission on the new primary"),
                            (3, "each SDK client's first receipt through a gateway")):
            times = sorted(t for row in rows if row[1] == fault
                           for t in (row[index] if isinstance(row[index], list) else [row[index]]))
            if times:
                print(f"{fault}: {len(times)} failovers, fault to {what}: p50 {times[len(times) // 2]:.2f}s, "
                      f"max {times[-1]:.2f}s")
    print(f"{len(rows)} rounds, {rows[-1][5] if rows else 0} saved receipts read back as given after the last; "
          "no sequence assigned twice; leadership and file generations only grew")


def verify(clients, path):
    """Every receipt each SDK client saw saved, read from the device at `path` (the current
    primary): its bytes are the canonical JSON of what the client was given (the gateway passed
    the device's bytes on; a receipt a checkpoint folded since, but for its
    save place: `as_given`), the sequences each client was given are saved without a gap or a
    repeat, and its next sequence is past the last. The number of receipts checked."""
    import rfc8785
    checked = 0
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(path)
        for c in clients:
            with c.lock:
                saved = dict(c.saved)
            principal = c.principal_hex
            for op, receipt in saved.items():
                got = call(s, {"v": 1, "id": 0, "op": "operations.get", "principal": principal,
                               "args": {"operation": op}})
                assert got["status"] == 200 and as_given(got["body"], rfc8785.dumps(receipt)), (op, got)
                checked += 1
            me = json.loads(call(s, {"v": 1, "id": 0, "op": "participant.get", "principal": principal,
                                     "args": {}})["body"])
            sequences = sorted(int(r["sequence"]) for r in saved.values())
            assert sequences == list(range(sequences[0], sequences[0] + len(sequences))), "a sequence twice or lost"
            assert int(me["next_sequence"]) >= sequences[-1] + 1
    return checked


if __name__ == "__main__":
    main()
