"""A checkpoint beside the ticks: the tick loop's longest pause and the admissions per second while
a checkpoint of a large state folds, under closed-loop clients, beside the same load without one.

    .venv/bin/python bench/checkpoint.py [--transfers 1000000] [--clients 64] [--rounds 3]
                                         [--seconds 5] [--window 120] [--rate 20000]
                                         [--paced] [--boot ARGS] [--versus COMMIT]

Setup, outside every timed window: a runtime file and a journal of --transfers transfers (64
principals' registrations and spaces: bench/recovery.py's build), with room and grants for the
load's principals, and a snapshot of them. Each run boots `python -m gpu_worker boot` (--tick-cpu
0 where there are two CPUs; the clients on the others) on those files put back as the snapshot
has them (the runtime file rewritten in place: every boot is a restart of the same file, the same
lineages), and the first run asks each load principal's lineage (its registration needs it).

A run has two phases, each --clients closed loops (bench/loadgen.c) registering fresh principals,
every reply checked to be a saved receipt and its arrival time kept:

- without: --seconds of load;
- during: the load, a `checkpoint` asked on its own connection 1 s in; the load ends 0.5 s after
  the checkpoint's answer (or after --window seconds: then the run fails). The checkpoint's window
  runs from the ask to its answer.

Reported per code: how long the checkpoint took, the registrations saved per second inside its
window against the phase without (the ratio), and the longest gap between two consecutive replies
(any client) inside the window against the longest in the phase without. With every client
waiting for a reply, a gap is the tick loop answering no one: the tick's pause. Beside each phase,
how many ticks' write and fdatasync took over 50 ms (the device's own histogram, read by `ping`
before and after the phase): a gap that long with none of those was not the disk. --versus COMMIT
boots that commit's code on the same files too, the runs alternating (this, COMMIT, this, ...):
medians of --rounds runs each.

--paced sends at most --rate registrations a second in both phases (loadgen's PACE): the frames
last the whole window however fast the device answers. Unpaced, a device faster than --rate spends
them before a long checkpoint ends (a 1M-transfer fold takes minutes here), and frames for its
whole speed are more principals than the machine holds beside the device and the fold. Paced, the
longest gap still shows the tick's pause (clients whose turn came wait for their replies), and
the ratio only says whether the device kept the pace during the checkpoint.
"""
import argparse
import contextlib
import itertools
import json
import os
import secrets
import shutil
import signal
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
from bench.versus import worktree  # noqa: E402
from tests.e2e.test_kill9 import call  # noqa: E402

# registrations/s a device here does not pass at 64 clients (11-16k/s measured): each phase has this
# many a second ready, each a fresh principal in the grant file (a 3.9M-principal run took 11 GiB here)
RATE = 20_000


def boot(tree, files, log_path, tick_cpu, extra=()):
    runtime, journal, grants = files
    argv = [sys.executable, "-m", "gpu_worker", "boot", "--ccir", runtime, "--journal", journal,
            "--service-grants", grants, "--device", "cpu"] + (["--tick-cpu", str(tick_cpu)] if tick_cpu is not None
                                                              else []) + list(extra)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=tree, stdout=log, stderr=subprocess.STDOUT)
    while b"device ready" not in Path(log_path).read_bytes():
        if proc.poll() is not None:
            raise SystemExit(f"the device did not start:\n{Path(log_path).read_text()[-3000:]}")
        time.sleep(0.1)
    return proc


def start_load(loadgen, base, sock_path, requests, clients, seconds, cpus, pace=0):
    """Closed loops (bench/loadgen.c) on `clients` connections sending the frames of the file
    `requests` (on the disk, written and synced once: loadgen reads it whole before it starts),
    until `seconds` pass, the frames run out or `finish_load`; `pace`: at most that many a second
    (0: as fast as the replies come). `base`: where the replies go (a tmpfs where there is one:
    gigabytes of replies stay off the device's disk). What else is dirty goes to the disk first,
    so that no writeback of the setup's files falls inside a phase."""
    os.sync()
    return subprocess.Popen([loadgen, sock_path, requests, str(clients), str(seconds), "-",
                             os.path.join(base, "times.bin"), str(pace)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)


def finish_load(proc, base, stop=False):
    """The load's replies' arrival times (time.monotonic seconds), in order, each reply checked by
    loadgen to be 202; `stop`: end it first (SIGUSR1: each client waits for its last reply)."""
    if stop:
        proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=600)  # (err: after the "sending" line start_load's caller read)
    if proc.returncode:
        raise SystemExit(f"loadgen failed: {err.strip()}")
    times = os.path.join(base, "times.bin")
    arrived = Path(times).read_bytes()
    os.unlink(times)
    if len(arrived) // 8 != int(out.split()[0]):
        raise SystemExit(f"loadgen counted {out.split()[0]} replies and timed {len(arrived) // 8}")
    return list(struct.unpack(f"{len(arrived) // 8}d", arrived))


def longest_gap(times):
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


# a tick's write and fdatasync that took longer than this answered no one meanwhile: the disk's share
# of a gap (the device's own histogram, `ping`'s "ticks": IO_BUCKETS in gpu_worker/storage/committer.py)
SLOW_SYNC = "0.05"


def slow_syncs(sock_path):
    """How many of the device's ticks so far took longer than SLOW_SYNC seconds on the disk."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(sock_path)
        reply = call(s, {"v": 1, "id": 1, "op": "ping", "principal": None, "args": {}})
    buckets = json.loads(reply["body"])["ticks"]["io_seconds"]["buckets"]
    return buckets["+Inf"] - buckets[SLOW_SYNC]


def checkpoint_after(sock_path, delay, out):
    """Ask for a checkpoint `delay` seconds from now on a connection of its own; out gets the
    ask's and the answer's time.monotonic and the answer."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(sock_path)
        time.sleep(delay)
        out["asked"] = time.monotonic()
        out["reply"] = call(s, {"v": 1, "id": 1, "op": "checkpoint", "principal": None, "args": {}})
        out["answered"] = time.monotonic()


_BUILD = """
import sys
from pathlib import Path
sys.path[0] = sys.argv[1]
from bench.recovery import build
ids = Path(sys.argv[4]).read_bytes()
# 256 bytes a command (not 512): the receipt table has a row for every principal of the load, and
# the device and the fold each hold it: at 512 a 1M run did not fit the machine (docs/performance.md)
*_, journal_bytes = build(Path(sys.argv[2]), int(sys.argv[3]), spare=[ids[i:i + 16] for i in range(0, len(ids), 16)],
                          command_bytes=256)
print(journal_bytes)
"""


class Runs:
    """The built files (a snapshot beside the working copy the devices boot: each run starts from
    the snapshot, the runtime file rewritten in place so that every boot is a restart of the same
    file, and the load's lineages and frames are the same in every run)."""

    def __init__(self, base, transfers, principals):
        self.work, self.snapshot = base / "work", base / "snapshot"
        self.work.mkdir()
        started = time.perf_counter()
        # in a process of its own: what the build's device held (tables and grants for millions of
        # principals, gigabytes) goes back to the system before the runs, beside which it was killed
        (base / "principals.bin").write_bytes(b"".join(principals))
        built = subprocess.run([sys.executable, "-c", _BUILD, str(ROOT), str(self.work), str(transfers),
                                str(base / "principals.bin")], capture_output=True, text=True)
        if built.returncode:
            raise SystemExit(f"the build failed:\n{built.stderr[-3000:]}")
        journal_bytes = int(built.stdout.split()[-1])
        print(f"built {transfers:,} transfers ({journal_bytes / 2**20:.0f} MiB of journal) in "
              f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        shutil.copytree(self.work, self.snapshot)
        self.principals, self.requests = principals, None
        self.base = base
        self.scratch = str(base / "load")  # (main: a tmpfs where there is one)

    def reset(self):
        shutil.copyfile(self.snapshot / "r.aotxccir", self.work / "r.aotxccir")  # (the same inode)
        shutil.rmtree(self.work / "journal")
        shutil.copytree(self.snapshot / "journal", self.work / "journal")

    def run(self, tree, loadgen, args, tick_cpu, client_cpus):
        """One run: {"rate", "gap"} without a checkpoint, and {"rate", "gap", "seconds"} in the
        checkpoint's window."""
        self.reset()
        work = self.work
        device = boot(tree, [str(work / n) for n in ("r.aotxccir", "journal", "grants.json")],
                      str(work / "device.log"), tick_cpu, args.boot.split())
        try:
            sock = str(work / "journal" / "service.sock")
            if self.requests is None:  # once, on the disk: in memory and in a tmpfs they were
                # gigabytes beside the device and its fold process, which need the rest of the memory
                frames = (registration_frame(lineage, p, i) for i, (p, lineage)
                          in enumerate(zip(self.principals, lineages(sock, self.principals)), 1))
                before = int(args.rate * args.seconds)
                self.requests = [str(self.base / "quiet.bin"), str(self.base / "during.bin")]
                for path, count in zip(self.requests, (before, None)):
                    with open(path, "wb") as f:
                        f.writelines(itertools.islice(frames, count))
                os.sync()
            pace = args.rate if args.paced else 0
            slow = [slow_syncs(sock)]
            quiet = finish_load(start_load(loadgen, self.scratch, sock, self.requests[0], args.clients,
                                           args.seconds, client_cpus, pace), self.scratch)
            slow.append(slow_syncs(sock))
            asked: dict = {}
            proc = start_load(loadgen, self.scratch, sock, self.requests[1], args.clients, args.window,
                              client_cpus, pace)
            if proc.stderr.readline() != "sending\n":  # (its requests read: 1 s of load from here on)
                raise SystemExit(f"loadgen failed: {proc.communicate()[1]}")
            asker = threading.Thread(target=checkpoint_after, args=(sock, 1.0, asked))
            asker.start()
            asker.join(args.window + 60)
            time.sleep(0.5)
            during = finish_load(proc, self.scratch, stop=True)
            slow.append(slow_syncs(sock))
        finally:
            died = device.poll()  # (before the terminate: a device that ended on its own)
            device.terminate()
            device.wait(60)
            log = (work / "device.log").read_text().splitlines()
            for line in log[-60:] if died is not None else (line for line in log if "beside the ticks" in line):
                print(line, file=sys.stderr)
        if "answered" not in asked or asked["answered"] > during[-1]:
            raise SystemExit(f"the checkpoint did not answer within the load (it took "
                             f"{asked.get('answered', float('nan')) - asked['asked']:.1f} s, the load "
                             f"{during[-1] - during[0]:.1f} s): raise --window")
        if asked["reply"]["status"] != 200:
            raise SystemExit(f"the checkpoint failed: {asked['reply']}")
        inside = [t for t in during if asked["asked"] <= t <= asked["answered"]]
        seconds = asked["answered"] - asked["asked"]
        # the gap that spans the ask counts too: the window's replies plus the last one before it
        edge = [t for t in during if t < asked["asked"]][-1:] or [asked["asked"]]  # (none: from the ask)
        window = edge + inside + [asked["answered"]]
        gaps = sorted(((b - a, a - asked["asked"]) for a, b in zip(window, window[1:])), reverse=True)[:3]
        return ({"rate": (len(quiet) - 1) / (quiet[-1] - quiet[0]), "gap": longest_gap(quiet),
                 "slow": slow[1] - slow[0]},
                {"rate": len(inside) / seconds, "gap": longest_gap(window), "seconds": seconds,
                 "where": ", ".join(f"{g * 1e3:.0f} ms at {at:+.2f} s" for g, at in gaps),
                 "slow": slow[2] - slow[1]})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--transfers", type=int, default=1_000_000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="the phase without a checkpoint")
    parser.add_argument("--window", type=float, default=120.0,
                        help="the longest load of the phase with one (it ends 0.5 s after the checkpoint's answer)")
    parser.add_argument("--rate", type=int, default=RATE,
                        help="registrations made ready a second of each phase (each a principal in the grant file)")
    parser.add_argument("--paced", action="store_true",
                        help="send at most --rate registrations a second (the frames last the window at any speed)")
    parser.add_argument("--boot", default="", help="more arguments for every device's boot (one string)")
    parser.add_argument("--versus", metavar="COMMIT", help="also run that commit's code on its own copies, in turns")
    args = parser.parse_args()
    tick_cpu = 0 if len(os.sched_getaffinity(0)) >= 2 else None
    client_cpus = os.sched_getaffinity(0) - {tick_cpu} if tick_cpu is not None else None
    (ROOT / "var").mkdir(exist_ok=True)
    with contextlib.ExitStack() as stack:
        base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-checkpoint-", dir=ROOT / "var")))
        trees = {"this": ROOT}
        if args.versus:
            other = worktree(stack, args.versus, base / "tree")
            trees = {"this": ROOT, args.versus: other}
        principals = [secrets.token_bytes(16) for _ in range(int(args.rate * (args.seconds + args.window)))]
        runs = Runs(base, args.transfers, principals)
        if os.path.isdir("/dev/shm"):
            runs.scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-checkpoint-", dir="/dev/shm"))
        else:
            os.mkdir(runs.scratch)
        loadgen = build_loadgen(str(base))
        results = {name: [] for name in trees}
        for r in range(args.rounds):
            for name, tree in trees.items():
                results[name].append(runs.run(tree, loadgen, args, tick_cpu, client_cpus))
                quiet, during = results[name][-1]
                print(f"round {r + 1} {name}: without {quiet['rate']:,.0f}/s (longest gap {quiet['gap'] * 1e3:.1f} ms; "
                      f"{quiet['slow']} ticks' syncs over {float(SLOW_SYNC) * 1e3:.0f} ms); checkpoint "
                      f"{during['seconds']:.2f} s, {during['rate']:,.0f}/s inside it (longest gap "
                      f"{during['gap'] * 1e3:.1f} ms; the longest: {during['where']} from the ask; {during['slow']} "
                      f"ticks' syncs over {float(SLOW_SYNC) * 1e3:.0f} ms in the load)", file=sys.stderr, flush=True)
    print(f"{args.transfers:,}-transfer state, {args.clients} clients"
          + (f" paced at {args.rate:,}/s" if args.paced else "") + f", {args.rounds} alternating runs, medians (range):")
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
