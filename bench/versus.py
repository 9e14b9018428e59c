"""This tree against an earlier commit, in one run: benches in both trees, alternately (old, new,
old, new, ...), so that the machine's drift between minutes falls on both sides alike; prints
each round's figures and the ratios of the medians.

    .venv/bin/python bench/versus.py BASE_COMMIT [--rounds 3] [--seconds 3] [--clients 64]
                                     [--benches tick_cpu,journal,http,streams]

The earlier commit is checked out (git worktree) into a temporary directory and run with this
virtualenv's interpreter, so both trees need the same packages. Figures: tick_cpu's best-chunk
and mean microseconds per registration (total); journal.py's saved registrations per second,
their share of the phase's ceiling and the device's CPU microseconds per saved registration;
http.py's mutations and reads per second through the gateway at --clients (one gateway worker,
one round, its FastAPI baseline and ceiling run beside it) and their share of its ceiling;
streams.py's delivery p50 and CPU microseconds per update for 300 streams through one gateway.
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable



def worktree(stack, commit, path):
    """A checkout of `commit` at `path` (git worktree), removed when `stack` (an ExitStack) closes:
    the tree a bench's --versus boots."""
    subprocess.run(["git", "worktree", "add", "--detach", str(path), commit], cwd=ROOT, check=True,
                   capture_output=True)
    stack.callback(subprocess.run, ["git", "worktree", "remove", "--force", str(path)], cwd=ROOT,
                   capture_output=True)
    return path

def run(tree: Path, script: str, *args: str) -> str:
    done = subprocess.run([PYTHON, f"bench/{script}", *args], cwd=tree, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: bench/{script} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return done.stdout


def tick_cpu(tree: Path) -> dict[str, float]:
    out = run(tree, "tick_cpu.py")
    best = re.search(r"^best:.*\btotal ([\d.]+)", out, re.M)
    mean = re.search(r"^mean:.*\btotal ([\d.]+)", out, re.M)
    assert best and mean, out
    return {"best us/reg": float(best.group(1)), "mean us/reg": float(mean.group(1))}


def journal(tree: Path, seconds: str, clients: str) -> dict[str, float]:
    out = run(tree, "journal.py", "--seconds", seconds, "--clients", clients)
    row = re.search(rf"^\s+{clients}\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)%\s+(\d+)\s*$", out, re.M)
    assert row, out
    return {"saved reg/s": float(row.group(3).replace(",", "")), "x ceiling": float(row.group(5)),
            "cpu us/reg": float(row.group(7))}


def http(tree: Path, seconds: str, clients: str) -> dict[str, float]:
    out = run(tree, "http.py", "--no-drf", "--workers", "1", "--rounds", "1", "--clients", clients,
              "--seconds", seconds)
    figures = {}
    for kind in ("mutations", "reads"):
        rate = re.search(rf"^aotx\s+{kind}\s+{clients}\s+([\d,]+)\s", out, re.M)
        ratio = re.search(rf"^{kind}\s+{clients}\s+[\d.]+\s+[\d.]+\s+([\d.]+)", out, re.M)
        assert rate and ratio, out
        figures[f"http {kind}/s"] = float(rate.group(1).replace(",", ""))
        figures[f"http {kind} x ceil"] = float(ratio.group(1))
    return figures


def streams(tree: Path) -> dict[str, float]:
    out = run(tree, "streams.py", "--streams", "300", "--events", "10")
    row = re.search(r"^\s+stream, 1 gateway\s+\d+/\d+\s+([\d.]+)\s+([\d.]+)\s+\S+\s+(\d+)\s*$", out, re.M)
    assert row, out
    return {"streams p50 ms": float(row.group(1)), "streams us/upd": float(row.group(3))}


def prepare_base(tree: Path) -> None:
    """Older bench/journal.py prepared 40,000 registrations a second per phase, fewer than a fast
    disk now saves (the phase then ran out of receipts): give the base as many as this tree's.
    Older bench/streams.py opened its streams as a principal with the default requests rate,
    which refuses most of 300 opened at once, and older bench/http.py's clients had the default
    rate too: give the base's the unlimited rate this tree's have."""
    script = tree / "bench" / "journal.py"
    script.write_text(script.read_text().replace("args.seconds * 40_000", "args.seconds * 80_000"))
    script = tree / "bench" / "streams.py"
    script.write_text(script.read_text().replace(
        'token = stack.principal("bench")',
        'token = stack.manage("principal", "create", "bench", "--actions", "shared_read,shared_write,shared_manage,chat", '
        '"--quota", "requests_per_second=unlimited", "--config", str(stack.config)).stdout.strip().splitlines()[-1]'))
    script = tree / "bench" / "http.py"  # (and its clients, which a fast gateway took past 200 reads/s each)
    script.write_text(script.read_text().replace(
        "Principal.create(PREFIX + str(i), list(ACTIONS))",
        'Principal.create(PREFIX + str(i), list(ACTIONS), {"requests_per_second": None})'))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("base", help="the commit to compare with (e.g. a commit of main before the change)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", default="3")
    parser.add_argument("--clients", default="64")
    parser.add_argument("--benches", default="tick_cpu,journal,http,streams")
    args = parser.parse_args()
    benches = {"tick_cpu": tick_cpu, "journal": lambda tree: journal(tree, args.seconds, args.clients),
               "http": lambda tree: http(tree, args.seconds, args.clients), "streams": streams}
    chosen = [benches[name] for name in args.benches.split(",")]
    with tempfile.TemporaryDirectory(prefix="aotx-versus-") as tmp:
        old = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), args.base], cwd=ROOT, check=True,
                       capture_output=True)
        prepare_base(old)
        try:
            series: dict[str, dict[str, list[float]]] = {"base": {}, "this": {}}
            for round_ in range(1, args.rounds + 1):
                for name, tree in (("base", old), ("this", ROOT)):
                    figures = {key: value for bench in chosen for key, value in bench(tree).items()}
                    for key, value in figures.items():
                        series[name].setdefault(key, []).append(value)
                    print(f"round {round_} {name}: " + "  ".join(f"{k} {v:,.2f}" for k, v in figures.items()),
                          flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, capture_output=True)
    base_id = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True,
                             text=True).stdout.strip()
    print(f"\nmedians over {args.rounds} alternating rounds ({args.clients} clients for journal.py), "
          f"this tree / {base_id}:")
    print(f"{'figure':>20} {'base':>12} {'this':>12} {'ratio':>7}")
    for key in series["base"]:
        before, after = statistics.median(series["base"][key]), statistics.median(series["this"][key])
        print(f"{key:>20} {before:>12,.2f} {after:>12,.2f} {after / before:>7.3f}")


if __name__ == "__main__":
    main()
