"""A checkpoint beside the ticks: the tick loop's longest pause and the admissions per second while
a checkpoint of a large state folds, under closed-loop clients, beside the same load without one.

    .venv/bin/python bench/checkpoint.py [--transfers 1000000] [--clients 64] [--rounds 3]
                                         [--seconds 5] [--window 30] [--versus COMMIT]

Setup, outside every timed window: a runtime file and a journal of --transfers transfers (64
principals' registrations and spaces: bench/recovery.py's build), with room and grants for the
load's principals. Each run boots `python -m gpu_worker boot` (--tick-cpu 0 where there are two
CPUs; the clients on the others) on a fresh copy of those files, and asks each load principal's
lineage (its registration needs it) before any phase.

A run has two phases, each --clients closed loops (bench/loadgen.c) registering fresh principals,
every reply checked to be a saved receipt and its arrival time kept:

- without: --seconds of load;
- during: load for --window seconds, a `checkpoint` asked on its own connection 1 s in. The
  checkpoint's window runs from the ask to its answer (it must answer within the load).

Reported per code: the registrations saved per second inside the checkpoint's window against the
phase without (the ratio), and the longest gap between two consecutive replies (any client) inside
the window against the longest in the phase without. With every client waiting for a reply, a gap
is the tick loop answering no one: the tick's pause. --versus COMMIT runs the same with that
commit's code on its own copies, the runs alternating (this, COMMIT, this, ...): medians of
--rounds runs each.
"""
import argparse
import contextlib
import json
import os
import secrets
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)  # not bench/: bench/http.py would shadow the standard library http

from bench.journal import build_loadgen, lineages, registration_frame  # noqa: E402
from bench.recovery import build  # noqa: E402
from gpu_worker.contract.wire import LENGTH, decode_payload, encode_frame  # noqa: E402

RATE = 40_000  # registrations/s no device here reaches: each phase has this many per second ready


def boot(tree, files, log_path, tick_cpu):
    runtime, journal, grants = files
    argv = [sys.executable, "-m", "gpu_worker", "boot", "--ccir", runtime, "--journal", journal,
            "--service-grants", grants, "--device", "cpu"] + (["--tick-cpu", str(tick_cpu)] if tick_cpu is not None
                                                              else [])
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=tree, stdout=log, stderr=subprocess.STDOUT)
    while b"device ready" not in Path(log_path).read_bytes():
        if proc.poll() is not None:
            raise SystemExit(f"the device did not start:\n{Path(log_path).read_text()[-3000:]}")
        time.sleep(0.1)
    return proc


def load(loadgen, base, sock_path, frames, clients, seconds, cpus):
    """Closed loops (bench/loadgen.c); every reply checked to be 202. The replies' arrival times
    (time.monotonic seconds), in order."""
    requests, replies, times = (os.path.join(base, n) for n in ("requests.bin", "replies.bin", "times.bin"))
    with open(requests, "wb") as f:
        f.writelines(frames)
    subprocess.run([loadgen, sock_path, requests, str(clients), str(seconds), replies, times], check=True,
                   capture_output=True, text=True,
                   preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    data, offset = Path(replies).read_bytes(), 0
    while offset < len(data):
        (n,) = LENGTH.unpack_from(data, offset)
        msg = decode_payload(data[offset + 4:offset + 4 + n])
        if msg["status"] != 202:
            raise SystemExit(f"a registration was answered {msg['status']}: {msg['body'][:300]}")
        offset += 4 + n
    arrived = Path(times).read_bytes()
    for path in (requests, replies, times):
        os.unlink(path)
    return list(struct.unpack(f"{len(arrived) // 8}d", arrived))


def longest_gap(times):
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def checkpoint_after(sock_path, delay, out):
    """Ask for a checkpoint `delay` seconds from now on a connection of its own; out gets the
    ask's and the answer's time.monotonic and the answer."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(sock_path)
        time.sleep(delay)
        out["asked"] = time.monotonic()
        s.sendall(encode_frame({"v": 1, "id": 1, "op": "checkpoint", "principal": None, "args": {}}))
        (n,) = LENGTH.unpack(s.recv(4, socket.MSG_WAITALL))
        out["reply"] = decode_payload(s.recv(n, socket.MSG_WAITALL))
        out["answered"] = time.monotonic()


def run(tree, built, work, principals, loadgen, args, tick_cpu, client_cpus):
    """One run on a fresh copy of the built files: {"rate", "gap"} without a checkpoint, and
    {"rate", "gap", "seconds"} in the checkpoint's window."""
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(built, work)
    files = [str(work / n) for n in ("r.aotxccir", "journal", "grants.json")]
    device = boot(tree, files, str(work / "device.log"), tick_cpu)
    try:
        sock = str(work / "journal" / "service.sock")
        frames = [registration_frame(lineage, p, i)
                  for i, (p, lineage) in enumerate(zip(principals, lineages(sock, principals)), 1)]
        before = int(RATE * args.seconds)
        quiet = load(loadgen, str(work), sock, frames[:before], args.clients, args.seconds, client_cpus)
        asked: dict = {}
        asker = threading.Thread(target=checkpoint_after, args=(sock, 1.0, asked))
        asker.start()
        during = load(loadgen, str(work), sock, frames[before:], args.clients, args.window, client_cpus)
        asker.join(600)
        if "answered" not in asked or asked["answered"] > during[-1]:
            raise SystemExit(f"the checkpoint did not answer within the load's {args.window} s: raise --window")
        if asked["reply"]["status"] != 200:
            raise SystemExit(f"the checkpoint failed: {asked['reply']}")
        inside = [t for t in during if asked["asked"] <= t <= asked["answered"]]
        seconds = asked["answered"] - asked["asked"]
        # the gap that spans the ask counts too: the window's replies plus the last one before it
        edge = [t for t in during if t < asked["asked"]][-1:]
        return ({"rate": (len(quiet) - 1) / (quiet[-1] - quiet[0]), "gap": longest_gap(quiet)},
                {"rate": len(inside) / seconds, "gap": longest_gap(edge + inside + [asked["answered"]]),
                 "seconds": seconds, "folded": json.loads(asked["reply"]["body"]).get("folded")})
    finally:
        device.terminate()
        device.wait(60)
        shutil.rmtree(work, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--transfers", type=int, default=1_000_000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="the phase without a checkpoint")
    parser.add_argument("--window", type=float, default=30.0, help="the load of the phase with one")
    parser.add_argument("--versus", metavar="COMMIT", help="also run that commit's code on its own copies, in turns")
    args = parser.parse_args()
    tick_cpu = 0 if len(os.sched_getaffinity(0)) >= 2 else None
    client_cpus = os.sched_getaffinity(0) - {tick_cpu} if tick_cpu is not None else None
    (ROOT / "var").mkdir(exist_ok=True)
    with contextlib.ExitStack() as stack:
        base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-checkpoint-", dir=ROOT / "var")))
        trees = {"this": ROOT}
        if args.versus:
            other = base / "tree"
            subprocess.run(["git", "worktree", "add", "--detach", str(other), args.versus], cwd=ROOT, check=True,
                           capture_output=True)
            stack.callback(subprocess.run, ["git", "worktree", "remove", "--force", str(other)], cwd=ROOT,
                           capture_output=True)
            trees = {"this": ROOT, args.versus: other}
        principals = [secrets.token_bytes(16) for _ in range(int(RATE * (args.seconds + args.window)))]
        built = base / "built"
        built.mkdir()
        started = time.perf_counter()
        *_, journal_bytes = build(built, args.transfers, spare=[p.hex() for p in principals])
        print(f"built {args.transfers:,} transfers ({journal_bytes / 2**20:.0f} MiB of journal) in "
              f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        loadgen = build_loadgen(str(base))
        results = {name: [] for name in trees}
        for r in range(args.rounds):
            for name, tree in trees.items():
                results[name].append(run(tree, built, base / "run", principals, loadgen, args, tick_cpu, client_cpus))
                quiet, during = results[name][-1]
                print(f"round {r + 1} {name}: without {quiet['rate']:,.0f}/s (longest gap {quiet['gap'] * 1e3:.1f} ms); "
                      f"checkpoint {during['seconds']:.2f} s, {during['rate']:,.0f}/s inside it (longest gap "
                      f"{during['gap'] * 1e3:.1f} ms)", file=sys.stderr, flush=True)
    print(f"{args.transfers:,}-transfer state, {args.clients} clients, {args.rounds} alternating runs, medians "
          f"(range):")
    print(f"{'code':>10} {'ckpt s':>14} {'reg/s without':>14} {'reg/s during':>13} {'ratio':>16} "
          f"{'gap without ms':>15} {'longest gap during ms':>22}")
    for name, runs in results.items():
        def stat(values, scale=1.0, fmt=".2f"):
            values = [v * scale for v in values]
            return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"
        ratios = [d["rate"] / q["rate"] for q, d in runs]
        print(f"{name:>10} {stat([d['seconds'] for _, d in runs]):>14} "
              f"{statistics.median(q['rate'] for q, _ in runs):>14,.0f} "
              f"{statistics.median(d['rate'] for _, d in runs):>13,.0f} {stat(ratios):>16} "
              f"{stat([q['gap'] for q, _ in runs], 1e3, '.0f'):>15} {stat([d['gap'] for _, d in runs], 1e3, '.0f'):>22}")


if __name__ == "__main__":
    main()
