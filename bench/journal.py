"""Saved registrations per second at the device socket, beside the disk's raw fdatasync rate
and the ceiling implied by "at most 16 records per tick, one fdatasync per tick".

    .venv/bin/python bench/journal.py [--seconds 3] [--clients 1,16,64] [--dir DIR] [--tick-cpu N|none]
                                      [--standby [--rounds 3] [--netns]]

Each client is a closed loop on its own connection: send one registration for a fresh
principal, wait for its saved receipt (status 202), repeat. Registrations are encoded before a
phase starts and one epoll loop in C (bench/loadgen.c, compiled at the start) drives every
connection, so the clients spend as little CPU as possible (they share the machine with the
device; the same loop in Python took ~30% of a core at 64 clients). Every reply is checked
after its phase.

The disk's fdatasync rate drifts between minutes on a shared machine, so besides the probes at the
start, each phase is preceded by its own 1.5 s probe of full-tick appends (the device idle), and
that phase's ceiling and ratio use it. The probes run unpinned.

Threads: by default (two CPUs or more) the device boots with `--tick-cpu 0`, its tick loop alone on
CPU 0, and the clients run beside the device's other threads on the remaining CPUs; `--tick-cpu
none` leaves everything to the scheduler (docs/performance.md has the
measurements of both).

Beside the rates it prints the device process's CPU over each phase (user + system, from /proc)
and that CPU per saved registration. The device has three busy threads, the tick loop (the
interpreter), the native socket thread and the native tick I/O thread (write + fdatasync, nearly
all of it kernel time), so its CPU can pass one core; when the tick loop is near a full core, the
interpreter, not the disk, sets the rate. bench/tick_cpu.py measures the interpreter's part alone.

--standby boots a second device beside the first, with a sync standby following it (`boot
--replicate` over a Unix socket, `boot --standby-of` with its own journal directory and a copy of
the runtime file, on the same disk and machine), and runs every phase on both, alternately, for
--rounds rounds: each phase's rate with the standby beside the same phase's without it (medians).
With --netns (root) the primary and the standby are two machines: each in its own network
namespace, joined through a bridge (tests/cluster.py), the link over TCP with TLS (`--link-tls`),
as between two machines; the disk and the CPUs are still the one machine's.
"""
import argparse
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import rfc8785

ROOT = Path(__file__).resolve().parent.parent
MAX_RATE = 80_000  # registrations/s no device here reaches: each phase has this many per second ready
if Path(sys.path[0]).resolve() == ROOT / "bench":  # run as a script: bench/http.py would shadow http
    sys.path[0] = str(ROOT)

from gpu_worker.kinds.kind import Admission  # noqa: E402
from gpu_worker.kinds.kind import Kind  # noqa: E402
from gpu_worker.storage.journal import MAX_DATA, PART_HEADER_SIZE, record_count  # noqa: E402
from gpu_worker.storage.journal_writer import MAX_RECORDS_PER_TICK  # noqa: E402
from gpu_worker.pack import pack_tiny  # noqa: E402
from gpu_worker.contract.wire import LENGTH, decode_payload, encode_frame  # noqa: E402


RECORD_BYTES = PART_HEADER_SIZE + MAX_DATA


def raw_fdatasync_rate(directory, seconds, size):
    path = os.path.join(directory, "fdatasync.probe")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    block = b"\0" * size
    n, start = 0, time.perf_counter()
    try:
        while time.perf_counter() - start < seconds:
            os.write(fd, block)
            os.fdatasync(fd)
            n += 1
    finally:
        os.close(fd)
        os.unlink(path)
    return n / (time.perf_counter() - start)


def process_cpu_seconds(pid):
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def lineages(sock_path, principals, batch=1000):
    """Each principal's lineage as the device gives it (participant.get, pipelined on one
    connection): a fresh state's first boot starts its line of history with a random nonce
    (docs/checkpoint.md, "Lineages after a restore"), so it cannot be computed from the file."""
    found = {}
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(sock_path)
        for start in range(0, len(principals), batch):
            chunk = principals[start:start + batch]
            s.sendall(b"".join(encode_frame({"v": 1, "id": start + i, "op": "participant.get",
                                             "principal": p.hex(), "args": {}}) for i, p in enumerate(chunk)))
            for _ in chunk:
                (n,) = LENGTH.unpack(s.recv(4, socket.MSG_WAITALL))
                reply = decode_payload(s.recv(n, socket.MSG_WAITALL))
                found[reply["id"]] = json.loads(reply["body"])["lineage"]
    return [found[i] for i in range(len(principals))]


def registration_frame(lineage, principal, req_id):
    body = {"schema": "aotx.shared.mutation.v1", "lineage": lineage, "operation_key": secrets.token_hex(16),
            "sequence": "1"}
    canonical = rfc8785.dumps({"method": "POST", "path": "/aotx/v1/shared/participant", "body": body})
    return encode_frame({"v": 1, "id": req_id, "op": "participant.register", "principal": principal.hex(),
                         "args": {"lineage": lineage, "operation_key": body["operation_key"], "sequence": 1,
                                  "canonical": canonical}})


def build_loadgen(directory):
    """Compile bench/loadgen.c (the clients) into directory; returns the executable's path."""
    exe = os.path.join(directory, "loadgen")
    compiler = os.environ.get("CC") or "cc"
    subprocess.run([compiler, "-O2", "-Wall", "-o", exe, str(ROOT / "bench" / "loadgen.c")], check=True)
    return exe


def saved_replies(path):
    """How many replies the file loadgen wrote holds, each checked to be a saved receipt (202)."""
    data = Path(path).read_bytes()
    offset = count = 0
    while offset < len(data):
        (n,) = LENGTH.unpack_from(data, offset)
        msg = decode_payload(data[offset + 4:offset + 4 + n])
        if msg["status"] != 202:
            raise RuntimeError(f"registration answered {msg['status']}: {msg['body'][:200]}")
        offset += 4 + n
        count += 1
    return count


def phase(loadgen, directory, sock_path, frames, clients, seconds, cpus, device_pid):
    """Closed loop on `clients` connections (bench/loadgen.c): send a pre-encoded registration,
    wait for its reply, send the next. Every reply is checked afterwards to be a saved receipt
    (202). Returns (saved registrations per second, the device's CPU over the run in cores)."""
    requests, replies = os.path.join(directory, "requests.bin"), os.path.join(directory, "replies.bin")
    with open(requests, "wb") as f:
        f.writelines(frames)
    cpu_before, wall_before = process_cpu_seconds(device_pid), time.perf_counter()
    done = subprocess.run([loadgen, sock_path, requests, str(clients), str(seconds), replies],
                          check=True, capture_output=True, text=True,
                          preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    busy = (process_cpu_seconds(device_pid) - cpu_before) / (time.perf_counter() - wall_before)
    received, elapsed = done.stdout.split()
    count = saved_replies(replies)
    if count != int(received):
        raise RuntimeError(f"loadgen counted {received} replies but wrote {count}")
    os.unlink(requests)
    os.unlink(replies)
    return count / float(elapsed), busy


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--clients", default="1,16,64")
    parser.add_argument("--dir", help="directory on the disk to measure (default: a temp dir under var/)")
    parser.add_argument("--standby", action="store_true",
                        help="also run every phase on a device with a sync standby beside it, alternately")
    parser.add_argument("--rounds", type=int, default=3, help="with --standby: alternating rounds (medians)")
    parser.add_argument("--netns", action="store_true",
                        help="with --standby: the primary and the standby in two network namespaces, the link over "
                             "TCP with TLS (root)")
    parser.add_argument("--tick-cpu", default="0" if len(os.sched_getaffinity(0)) >= 2 else "none",
                        help="boot the device with --tick-cpu N and run the clients on the other CPUs; 'none' "
                             "leaves every thread unpinned (default: 0 where there are two CPUs or more)")
    args = parser.parse_args()
    tick_cpu = None if args.tick_cpu == "none" else int(args.tick_cpu)
    client_cpus = os.sched_getaffinity(0) - {tick_cpu} if tick_cpu is not None else None
    client_counts = [int(c) for c in args.clients.split(",")]
    (ROOT / "var").mkdir(exist_ok=True)
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-journal-", dir=ROOT / "var"))
    max_frames = int(args.seconds * MAX_RATE)  # per phase: more than the device can save
    rounds = args.rounds if args.standby else 1
    n_principals = max_frames * len(client_counts) * rounds
    runtime = base / "bench.aotxccir"
    pack_tiny(str(runtime), shared=True, capacity={"participants": n_principals, "receipts": n_principals,
                                                    "command_bytes": 512, "result_bytes": 16})
    principals = [secrets.token_bytes(16) for _ in range(n_principals)]
    grants = base / "grants.json"
    grants.write_text(json.dumps({"schema": "aotx.grants.v1", "written_at_ns": time.time_ns(), "principals": {
        p.hex(): {"name": "bench", "actions": ["shared_read", "shared_write"]} for p in principals}}))
    sample = Admission(int(Kind.PARTICIPANT_REGISTER), principals[0], 1, b"\1" * 16, b"\2" * 16, b"\3" * 16,
                       rfc8785.dumps({"method": "POST", "path": "/aotx/v1/shared/participant", "body": {
                           "schema": "aotx.shared.mutation.v1", "lineage": "0" * 32, "operation_key": "1" * 32,
                           "sequence": "1"}}))
    records = record_count(len(sample.encode()))
    journal = base / "journal"
    # The ceiling: every tick full (16 records) and costing exactly one raw fdatasync of that size.
    tick_bytes = MAX_RECORDS_PER_TICK * RECORD_BYTES
    per_tick = MAX_RECORDS_PER_TICK // records
    fsync_small = raw_fdatasync_rate(str(base), 2.0, records * RECORD_BYTES)
    fsync_rate = raw_fdatasync_rate(str(base), 2.0, tick_bytes)

    loadgen = build_loadgen(str(base))
    pin = ["--tick-cpu", str(tick_cpu)] if tick_cpu is not None else []
    processes = []

    def start(name, argv, ready, prefix=()):
        log_path = base / f"{name}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([*prefix, sys.executable, "-m", "gpu_worker", "boot", "--service-grants",
                                     str(grants)] + argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        processes.append(proc)
        while ready not in log_path.read_text():
            if proc.poll() is not None:
                raise SystemExit(f"{name} did not start: {log_path.read_text()}")
            time.sleep(0.05)
        return proc

    net = None
    try:
        device = start("device", ["--ccir", str(runtime), "--journal", str(journal), "--device", "cpu"] + pin,
                       "device ready")
        print(f"device pid {device.pid}", file=sys.stderr, flush=True)
        sock = str(journal / "service.sock")
        frames = [registration_frame(lineage, p, i)
                  for i, (p, lineage) in enumerate(zip(principals, lineages(sock, principals)), 1)]
        replicated = None
        if args.standby:
            copy, standby_copy = base / "replicated.aotxccir", base / "standby.aotxccir"
            shutil.copyfile(runtime, copy)
            shutil.copyfile(runtime, standby_copy)
            link = str(base / "replication.sock")
            where: dict[str, tuple[list[str], list[str]]] = {"primary": ([], []), "standby": ([], [])}
            if args.netns:  # two machines: the link over TCP, with TLS
                from tests.cluster import Network
                net = Network(2)
                subprocess.run([sys.executable, "-m", "gpu_worker", "link-tls", str(base / "certs"), "m1", "m2"],
                               cwd=ROOT, check=True, capture_output=True)
                link = f"{net.address['m1']}:7001"
                for name, m in (("primary", "m1"), ("standby", "m2")):
                    where[name] = (net.exec(m), ["--link-tls", str(base / "certs" / m)])
            replicated = start("primary", ["--ccir", str(copy), "--journal", str(base / "journal-primary"),
                                           "--device", "cpu", "--replicate", link, "--replication", "sync"]
                               + pin + where["primary"][1], "device ready", where["primary"][0])
            start("standby", ["--ccir", str(standby_copy), "--journal", str(base / "journal-standby"),
                              "--standby-of", link] + where["standby"][1], "standby ready", where["standby"][0])
            replicated_sock = str(base / "journal-primary" / "service.sock")
            replicated_frames = [registration_frame(lineage, p, i) for i, (p, lineage) in
                                 enumerate(zip(principals, lineages(replicated_sock, principals)), 1)]
        rows = []
        for c in client_counts:
            runs: dict[str, list] = {"alone": [], "standby": []}
            for _ in range(rounds):
                phase_fsync = raw_fdatasync_rate(str(base), 1.5, tick_bytes)
                rate, busy = phase(loadgen, str(base), sock, frames[:max_frames], c, args.seconds, client_cpus,
                                   device.pid)
                frames = frames[max_frames:]
                runs["alone"].append((rate, busy, phase_fsync))
                if replicated is not None:
                    rate, busy = phase(loadgen, str(base), replicated_sock, replicated_frames[:max_frames], c,
                                       args.seconds, client_cpus, replicated.pid)
                    replicated_frames = replicated_frames[max_frames:]
                    runs["standby"].append((rate, busy, phase_fsync))
            rows.append((c, runs))
    finally:
        for proc in reversed(processes):
            proc.terminate()
            proc.wait(30)
        if net is not None:
            net.close()
    print(f"disk: {base}")
    print("threads: " + (f"the device's tick loop on CPU {tick_cpu}; its other threads and the clients on CPUs "
                         f"{','.join(map(str, sorted(client_cpus)))}; the fdatasync probes unpinned"
                         if tick_cpu is not None else "unpinned (--tick-cpu none)"))
    print(f"registration admission transfer: {len(sample.encode())} bytes = {records} records")
    print(f"raw fdatasync: {fsync_small:,.0f}/s with {records * RECORD_BYTES}-byte appends (one registration), "
          f"{fsync_rate:,.0f}/s with {tick_bytes}-byte appends (one full tick)")
    print(f"ceiling at {MAX_RECORDS_PER_TICK} records/tick: {fsync_rate * per_tick:,.0f} registrations/s "
          f"({per_tick} registrations per full-tick fdatasync); each phase below uses its own probe")
    print(f"{'clients':>8} {'fdatasync/s':>12} {'ceiling':>8} {'saved reg/s':>12} {'x fdatasync':>12} "
          f"{'x ceiling':>10} {'device cpu':>11} {'cpu us/reg':>11}")
    for c, runs in rows:
        rate, busy, phase_fsync = median(runs["alone"])
        ceiling = phase_fsync * per_tick
        print(f"{c:>8} {phase_fsync:>12,.0f} {ceiling:>8,.0f} {rate:>12,.0f} {rate / phase_fsync:>12.2f} "
              f"{rate / ceiling:>10.2f} {busy:>10.0%} {busy / rate * 1e6:>11.0f}")
    if args.standby:
        print(f"\nwith a sync standby ({'another network namespace, TCP with TLS' if args.netns else 'a Unix socket'}; "
              f"the same disk and CPUs), {rounds} alternating rounds, medians:")
        print(f"{'clients':>8} {'alone reg/s':>12} {'standby reg/s':>14} {'ratio':>6} {'primary cpu us/reg':>19}")
        for c, runs in rows:
            alone, with_standby = median(runs["alone"])[0], median(runs["standby"])
            print(f"{c:>8} {alone:>12,.0f} {with_standby[0]:>14,.0f} {with_standby[0] / alone:>6.2f} "
                  f"{with_standby[1] / with_standby[0] * 1e6:>19.0f}")
    print("device cpu: the device process's user + system time over the phase (1.0 = one core busy; the tick "
          "loop and the native I/O threads together can pass it); "
          "cpu us/reg: that time per saved registration")


def median(runs):
    """The run whose rate is the median of `runs` (rate, cpu, fdatasync probe)."""
    return sorted(runs)[len(runs) // 2]


if __name__ == "__main__":
    main()
