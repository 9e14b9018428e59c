"""Recovery time: boot (journal replay) for 10k and 100k journal transfers, and the same state
booted from a checkpoint. Each boot runs in a fresh process, as a restart does (the state is built
in this one, and a boot beside its leftovers measured up to half as much again); the timed window
is the device's construction, after the imports. --versus COMMIT boots the same files with that
commit's code too (a copy of them: each tree checkpoints in its own format), in turns, its
medians beside this tree's, and the ratios.

    .venv/bin/python bench/recovery.py [--sizes 10000,100000] [--repeat 3] [--versus COMMIT]
"""
import argparse
import collections
import contextlib
import json
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import rfc8785

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)  # not bench/: bench/http.py would shadow the standard library http

from gpu_worker.device import Device  # noqa: E402
from gpu_worker.contract.grantfile import Grants  # noqa: E402
from gpu_worker.storage.filelayer import OsFileLayer  # noqa: E402
from gpu_worker.storage.journal import list_segments  # noqa: E402
from gpu_worker.pack import pack_tiny  # noqa: E402
from gpu_worker.storage.runtime_file import RuntimeFile  # noqa: E402
from tests.conftest import write_grants  # noqa: E402

PRINCIPALS = 64


def mutation(principal, lineage, sequence):
    key = secrets.token_hex(16)
    if sequence == 1:
        op, path, fields = "participant.register", "/aotx/v1/shared/participant", {}
    else:
        op, path, fields = "spaces.create", "/aotx/v1/shared/spaces", {"scope": "private"}
    body = {"schema": "aotx.shared.mutation.v1", "lineage": lineage, "operation_key": key,
            "sequence": str(sequence), **fields}
    return {"v": 1, "id": 0, "op": op, "principal": principal.hex(),
            "args": {"lineage": lineage, "operation_key": key, "sequence": sequence, **fields,
                     "canonical": rfc8785.dumps({"method": "POST", "path": path, "body": body})}}


def build(base, transfers, spare=()):
    """A runtime file and a journal of `transfers` transfers (64 principals' registrations and
    spaces), with room and grants for the `spare` principals too (bench/checkpoint.py's load)."""
    runtime = str(base / "r.aotxccir")
    pack_tiny(runtime, shared=True, capacity={"participants": PRINCIPALS + len(spare), "spaces": transfers + 1,
                                              "receipts": transfers + len(spare) + 1, "command_bytes": 512,
                                              "result_bytes": 16},
              journal_limits={"journal_file_cap_bytes": 1 << 40, "checkpoint_journal_bytes": 1 << 40})
    principals = [secrets.token_bytes(16) for _ in range(PRINCIPALS)]
    grants = str(base / "grants.json")
    write_grants(grants, {p.hex(): ["shared_read", "shared_write"] for p in [*principals, *spare]})
    journal = str(base / "journal")
    device = Device(RuntimeFile.open(runtime), journal, Grants(grants))
    lineages = [device.state.participants.lineage_of(p).hex() for p in principals]
    inbox = collections.deque()
    made, sequence = 1, 1  # the boot transfer
    while made < transfers:
        for p, lineage in zip(principals, lineages):
            if made + len(inbox) >= transfers:
                break
            inbox.append((None, mutation(p, lineage, sequence)))
        made += len(inbox)
        sequence += 1
        while inbox:
            device.committer.run_sync(inbox)
    journal_bytes = device.journal_bytes
    device.close()
    return runtime, journal, grants, journal_bytes


# One boot in a fresh process, as a restart does, with the code of the tree given first (this one,
# or --versus's): the imports first, then the timed window, the device's construction; then, if
# asked, a checkpoint. Prints JSON. (The same few calls in every tree since the checkpoint existed.)
_BOOT = """
import json, sys, time
sys.path[0] = sys.argv[1]
from gpu_worker.contract.grantfile import Grants
from gpu_worker.device import Device
from gpu_worker.storage.runtime_file import RuntimeFile
from tests.conftest import write_grants
runtime, journal, grants, checkpoint = sys.argv[2:]
write_grants(grants, {pid: sorted(a) for pid, a in Grants(grants).principals.items()})
started = time.perf_counter()
device = Device(RuntimeFile.open(runtime, verify=False), journal, Grants(grants))
out = {"seconds": time.perf_counter() - started, "recovered": device.recovered}
if checkpoint == "1":
    started = time.perf_counter()
    out["state_bytes"] = device.checkpoint()["state_bytes"]
    out["checkpoint_seconds"] = time.perf_counter() - started
device.close()
print(json.dumps(out))
"""


def boot_fresh(tree, runtime, journal, grants, checkpoint=False):
    done = subprocess.run([sys.executable, "-c", _BOOT, str(tree), runtime, journal, grants, "1" if checkpoint else "0"],
                          cwd=tree, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"a boot with {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def alternating(places, repeat):
    """Median boot seconds of each tree, booting its copy of the files in turns (a, b, a, b, ...),
    and the last boot's recovered count."""
    seconds = {name: [] for name in places}
    for _ in range(repeat):
        for name, (tree, *files) in places.items():
            out = boot_fresh(tree, *files)
            seconds[name].append(out["seconds"])
    return {name: statistics.median(values) for name, values in seconds.items()}, out["recovered"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="10000,100000")
    parser.add_argument("--repeat", type=int, default=1, help="boots of each kind (the median is reported)")
    parser.add_argument("--versus", metavar="COMMIT", help="also boot the same files with that commit's code, in turns")
    args = parser.parse_args()
    (ROOT / "var").mkdir(exist_ok=True)
    with contextlib.ExitStack() as stack:
        trees = {"this": ROOT}
        if args.versus:
            base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="aotx-recovery-"))) / "base"
            subprocess.run(["git", "worktree", "add", "--detach", str(base), args.versus], cwd=ROOT, check=True,
                           capture_output=True)
            stack.callback(subprocess.run, ["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                           capture_output=True)
            trees = {args.versus: base, "this": ROOT}
        rows = []
        for size in (int(s) for s in args.sizes.split(",")):
            work = Path(tempfile.mkdtemp(prefix="bench-recovery-", dir=ROOT / "var"))
            try:
                built = work / "built"
                built.mkdir()
                *files, journal_bytes = build(built, size)
                places = {}  # each tree boots its own copy: its checkpoints are in its own format
                for i, (name, tree) in enumerate(trees.items()):
                    place = built if len(trees) == 1 else Path(shutil.copytree(built, work / str(i)))
                    places[name] = (tree, *(str(place / Path(f).name) for f in files))
                replays, replayed = alternating(places, args.repeat)
                folded = {name: boot_fresh(*place, checkpoint=True) for name, place in places.items()}
                afters, recovered = alternating(places, args.repeat)
                assert recovered <= args.repeat + 1 and all(list_segments(journal, OsFileLayer())
                                                            for _, _, journal, _ in places.values())
                for name in trees:
                    rows.append((name, replayed, journal_bytes, replays[name], folded[name]["checkpoint_seconds"],
                                 folded[name]["state_bytes"], afters[name]))
            finally:
                shutil.rmtree(work, ignore_errors=True)
    print(f"{'code':>10} {'transfers':>10} {'journal MiB':>12} {'boot s':>8} {'replay/s':>10} {'checkpoint s':>13} "
          f"{'state MiB':>10} {'boot after ckpt s':>18} {'speedup':>8}")
    for name, replayed, journal_bytes, seconds, ckpt, state, after in rows:
        print(f"{name:>10} {replayed:>10,} {journal_bytes / 2**20:>12.1f} {seconds:>8.2f} {replayed / seconds:>10,.0f} "
              f"{ckpt:>13.2f} {state / 2**20:>10.1f} {after:>18.2f} {seconds / after:>8.1f}x")
    if args.versus:
        for base_row, this_row in zip(rows[::2], rows[1::2]):  # (boot s: [3], after the checkpoint: [6])
            print(f"{this_row[1]:,} transfers, this / {args.versus}: boot {this_row[3] / base_row[3]:.3f}, "
                  f"boot after checkpoint {this_row[6] / base_row[6]:.3f}")


if __name__ == "__main__":
    main()
