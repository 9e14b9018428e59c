"""Can a boot from a checkpoint load its state beside `import torch` (issue 53 §3)? A probe, not
the device's path: it times, in fresh processes from a cold page cache, in turns,

- imports: the modules a boot imports before it is ready (gpu_worker.device, the engine, the loop),
  beside the runtime file's check (sha256 of what a device reads, on a thread, as boot does: in
  every case but load);
- load: a stand-in for a checkpoint's load without torch: the runtime file's state extent decoded,
  every table zeroed at its capacity and its saved rows put in as every load of the device puts
  them (storage/state_extent.py `fill_tables`), then the maps of IDs to rows as every load builds
  them (rowkeys.py `build_maps`);
- sequential: imports, then load, in one process (what a boot does today);
- thread: load on a thread while the main thread imports;
- fork: the process forks before it imports; the child loads while the parent imports, and the
  case ends when both are done (an upper bound: a device would need the child's tables and maps in
  memory it shares with the parent);
- fork-tables: what a device's boot does (recovery/preload.py: the tables and their maps in shared
  anonymous mappings, filled by a child forked before the imports, at nice 0 here; docs/performance.md,
  "Replay").

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
    """The runtime file's table capacities, incarnation and decoded state extent."""
    from gpu_worker.storage.runtime_file import RuntimeFile
    from gpu_worker.storage.state_extent import STATE, decode_state
    runtime = RuntimeFile.open(ccir, verify=False)
    return runtime.capacities, runtime.incarnation, decode_state(runtime.bytes(STATE))


def index(caps, tables, incarnation, saved):
    """The maps of IDs to rows of the tables' live rows, as every load of the device builds them
    (rowkeys.py `build_maps`, the participants' lineages derived as the device derives them)."""
    from gpu_worker.fixedmap import fixed_map
    from gpu_worker.participant_index import ParticipantIndex
    from gpu_worker.rowkeys import MAPS, build_maps
    participants = ParticipantIndex(incarnation, caps["participants"])
    participants.load_lineages(saved.get("lineages", []))
    participants.rebuild(tables["participants"])
    maps = {name: fixed_map(layout, caps[table]) for name, (layout, table) in MAPS.items()}
    build_maps(maps, tables, participants)
    return maps


def load(ccir):
    """The stand-in load (see the docstring): tables zeroed in this process's memory, filled as the
    device's loads fill them (storage/state_extent.py `fill_tables`), indexed."""
    import numpy as np

    from gpu_worker.columns import table_shapes
    from gpu_worker.storage.state_extent import fill_tables
    caps, incarnation, saved = saved_state(ccir)
    tables = {name: np.zeros(shape, dtype=dtype) for name, (shape, dtype) in table_shapes(caps).items()}
    fill_tables(saved, tables)
    return tables, index(caps, tables, incarnation, saved)


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
    child = None
    # (the forks before any thread starts: the child has only this one)
    if case == "fork":
        child = _in_child(lambda: load(ccir))
    elif case == "fork-tables":  # as a device's boot does it (recovery/preload.py): tables and maps
        from gpu_worker.recovery import preload
        caps, incarnation, saved = saved_state(ccir)
        started = preload.start(caps, incarnation, saved)
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
        if started.take() is None:
            raise SystemExit("the child filling the tables failed")
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
