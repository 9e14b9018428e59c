"""Can a boot from a checkpoint load its state beside `import torch` (issue 53 §3)? A probe, not
the device's path: it times, in fresh processes from a cold page cache, in turns,

- imports: the modules a boot imports before it is ready (gpu_worker.device, the engine, the loop),
  beside the runtime file's check (sha256 of what a device reads, on a thread, as boot does: in
  every case but load);
- load: a stand-in for a checkpoint's load without torch: the runtime file's state extent decoded,
  every table zeroed at its capacity and its saved rows put in as every load of the device puts
  them (storage/state_extent.py `fill_tables`), then FixedMaps of the receipts' (participant,
  sequence), operation keys and IDs and of the spaces' and conversations' IDs, with the layouts and sizes of the
  device's indexes (state/indexes.py; the owners' lineages in the spaces' and conversations' keys
  left zero);
- sequential: imports, then load, in one process (what a boot does today);
- thread: load on a thread while the main thread imports;
- fork: the process forks before it imports; the child loads while the parent imports, and the
  case ends when both are done (an upper bound: a device would need the child's tables and maps in
  memory it shares with the parent);
- fork-tables: what a device's boot does (recovery/preload.py: the tables in shared anonymous
  mappings, filled by a child forked before the imports), then the maps built by the parent from
  them (docs/performance.md, "Replay").

    .venv/bin/python bench/load_beside_imports.py --ccir F [--repeat 3] [--page-cache drop|fadvise|warm]

F is a runtime file that holds a checkpoint (bench/recovery.py --keep DIR, then a boot and
`python -m gpu_worker checkpoint` of a copy; the device's own file after a checkpoint). Each case
is timed from Popen to the line its process prints once done; median and range of --repeat runs.
--page-cache as bench/recovery.py's: drop (the default), fadvise (the runtime file evicted) or warm.
"""
import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ("imports", "load", "sequential", "thread", "fork", "fork-tables")
IMPORTS = ("gpu_worker.device", "gpu_worker.engine.engine", "gpu_worker.loop.server", "gpu_worker.loop.runner")


def imports():
    import importlib
    for module in IMPORTS:
        importlib.import_module(module)


def saved_state(ccir):
    """The runtime file's table capacities and its decoded state extent."""
    from gpu_worker.storage.runtime_file import RuntimeFile
    from gpu_worker.storage.state_extent import STATE, decode_state
    runtime = RuntimeFile.open(ccir, verify=False)
    return runtime.capacities, decode_state(runtime.bytes(STATE))


def index(caps, tables):
    """FixedMaps of the tables' live rows, in the device's layouts and sizes (state/indexes.py; the
    owners' lineages in the spaces' and conversations' keys left zero)."""
    import numpy as np

    from gpu_worker.columns import C, R, S
    from gpu_worker.fixedmap import fixed_map
    receipts = tables["receipts"]
    n = caps["receipts"]
    live = np.flatnonzero(receipts[:, R.STATE])
    rows = np.ascontiguousarray(live, dtype=np.int64)
    sequences = fixed_map("ii", n)
    sequences.put_packed(np.ascontiguousarray(receipts[live][:, [R.PARTICIPANT, R.SEQUENCE]], dtype="<i8"), rows)
    keys = np.empty((len(live), 20), dtype=np.uint8)  # the operation key, then the participant row in 4 bytes
    keys[:, :16] = np.ascontiguousarray(receipts[live, R.KEY_HI:R.KEY_HI + 2], dtype="<i8").view(np.uint8)
    keys[:, 16:] = np.asarray(receipts[live, R.PARTICIPANT], dtype="<u4").reshape(-1, 1).view(np.uint8)
    by_key = fixed_map("b20", n)
    by_key.put_packed(keys, rows)
    by_op = fixed_map("b16", n)
    by_op.put_packed(np.ascontiguousarray(receipts[live, R.OP_HI:R.OP_HI + 2], dtype="<i8"), rows)
    maps = [sequences, by_key, by_op]
    for name, hi in (("spaces", S.ID_HI), ("conversations", C.ID_HI)):
        values = tables[name]
        at = np.flatnonzero(values[:, 0] == 1)
        ids = np.zeros((len(at), 4), dtype="<i8")  # (lineage, id): the lineage left zero
        ids[:, 2:] = values[at, hi:hi + 2]
        by_id = fixed_map("b16b16", caps[name])
        by_id.put_packed(ids, at.astype(np.int64))
        maps.append(by_id)
    return maps


def load(ccir):
    """The stand-in load (see the docstring): tables zeroed in this process's memory, filled as the
    device's loads fill them (storage/state_extent.py `fill_tables`), indexed."""
    import numpy as np

    from gpu_worker.columns import table_shapes
    from gpu_worker.storage.state_extent import fill_tables
    caps, saved = saved_state(ccir)
    tables = {name: np.zeros(shape, dtype=dtype) for name, (shape, dtype) in table_shapes(caps).items()}
    fill_tables(saved, tables)
    return tables, index(caps, tables)


def _in_child(work):
    """Fork; the child does `work` and exits (0: done); the parent gets the child's pid."""
    child = os.fork()
    if child == 0:
        code = 1
        try:
            work()
            code = 0
        finally:
            os._exit(code)
    return child


def run_case(case, ccir):
    from gpu_worker.storage.runtime_file import RuntimeFile
    checked = RuntimeFile.open(ccir, verify=False)
    child = shared = None
    # (the forks before any thread starts: the child has only this one)
    if case == "fork":
        child = _in_child(lambda: load(ccir))
    elif case == "fork-tables":  # as a device's boot does it (recovery/preload.py), then its maps
        from gpu_worker.recovery import preload
        caps, saved = saved_state(ccir)
        started = preload.start(caps, saved)
        assert started is not None
    if case != "load":
        checked.start_verify()  # as boot checks the file beside its imports (recovery/boot.py)
    if case == "imports":
        imports()
    elif case == "load":
        load(ccir)
    elif case == "sequential":
        imports()
        load(ccir)
    elif case == "thread":
        loader = threading.Thread(target=load, args=(ccir,))
        loader.start()
        imports()
        loader.join()
    elif case == "fork":
        imports()
        _, status = os.waitpid(child, 0)
        if status:
            raise SystemExit(f"the loading child ended with status {status}")
    else:
        imports()
        shared = started.take()
        if shared is None:
            raise SystemExit("the child filling the tables failed")
        index(caps, shared)
    checked.verified()
    print("done", flush=True)


def timed(case, ccir, cache):
    """Seconds from Popen to the line a case's process prints once done, and what `cold_cache` did
    before it (bench/recovery.py: the page cache dropped, or the runtime file evicted)."""
    from bench.recovery import cold_cache  # (imports torch: only here, in the untimed parent)
    done = cold_cache(cache, ccir, "")
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--case", case, "--ccir", ccir],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = proc.stdout.readline()
    seconds = time.perf_counter() - started
    _, err = proc.communicate(timeout=300)
    if line != b"done\n" or proc.returncode:
        raise RuntimeError(f"case {case} failed:\n{err.decode('utf-8', 'replace')[-2000:]}")
    return seconds, done


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ccir", required=True, help="a runtime file that holds a checkpoint")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--page-cache", choices=("drop", "fadvise", "warm"), default="drop",
                        help="before each case: as bench/recovery.py's (drop falls back to fadvise where it cannot)")
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path[0] = ROOT  # (not bench/, whose http.py would stand for the standard library's)
    if args.case:
        run_case(args.case, args.ccir)
        return
    times: dict[str, list[float]] = {case: [] for case in CASES}
    caches = set()
    for _ in range(args.repeat):
        for case in CASES:
            seconds, done = timed(case, args.ccir, args.page_cache)
            times[case].append(seconds)
            caches.add(done)
    print(f"page cache before each case: {'; '.join(sorted(caches))}")
    print(f"{args.repeat} runs of each case in turns, seconds from Popen to done, median (range):")
    for case in CASES:
        t = times[case]
        print(f"  {case:11s} {statistics.median(t):6.3f} ({min(t):.3f}-{max(t):.3f})")
    base = statistics.median(times["sequential"])
    for case in ("thread", "fork", "fork-tables"):
        print(f"{case} / sequential: {statistics.median(times[case]) / base:.3f}")


if __name__ == "__main__":
    main()
