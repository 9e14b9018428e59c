"""Can a boot from a checkpoint load its state beside `import torch` (issue 53 §3)? A probe, not
the device's path: it times, in fresh processes from a cold page cache, in turns,

- imports: the modules a boot imports before it is ready (gpu_worker.device, the engine, the loop),
  beside the runtime file's check (sha256 of what a device reads, on a thread, as boot does: in
  every case but load);
- load: a stand-in for a checkpoint's load without torch: the runtime file's state extent decoded,
  every table zeroed at its capacity and its saved rows put in (numpy, and jcodec.scatter for the
  receipts' command and result bytes and the conversations' histories), then FixedMaps of the
  receipts' (participant, sequence), operation keys and IDs and of the spaces' and conversations'
  IDs, with the layouts and sizes of the device's indexes (state/indexes.py; the owners' lineages
  in the spaces' and conversations' keys left zero);
- sequential: imports, then load, in one process (what a boot does today);
- thread: load on a thread while the main thread imports;
- fork: the process forks before it imports; the child loads while the parent imports, and the
  case ends when both are done (an upper bound: a device would need the child's tables and maps in
  memory it shares with the parent);
- fork-tables: the tables in shared anonymous mappings made before the fork; the child fills them
  while the parent imports, then the parent builds the maps from them (the tables in shared
  memory, the maps as today: docs/performance.md, "Replay").

    .venv/bin/python bench/load_beside_imports.py --ccir F [--repeat 3] [--page-cache drop|fadvise|warm]

F is a runtime file that holds a checkpoint (bench/recovery.py --keep DIR, then a boot and
`python -m gpu_worker checkpoint` of a copy; the device's own file after a checkpoint). Each case
is timed from Popen to the line its process prints once done; median and range of --repeat runs.
--page-cache as bench/recovery.py's: drop (the default), fadvise (the runtime file evicted) or warm.
"""
import argparse
import json
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


def shapes(ccir, layout):
    """Each table's (shape, dtype) at the runtime file's capacities, the file's capacities, and the
    decoded state extent."""
    from gpu_worker.storage.runtime_file import DEFAULT_CAPACITIES, RuntimeFile
    from gpu_worker.storage.state_extent import STATE, decode_state
    runtime = RuntimeFile.open(ccir, verify=False)
    caps = {**DEFAULT_CAPACITIES, **runtime.shared_profile["capacities"]}
    n = caps["receipts"]
    made = {name: ((caps[name], width), "<i8") for name, width in layout["widths"].items()}
    made.update(digests=((n, 64), "u1"), commands=((n, caps["command_bytes"]), "u1"),
                results=((n, caps["result_bytes"]), "u1"),
                history=((caps["conversations"], caps["history_bytes"]), "u1"))
    return made, caps, decode_state(runtime.bytes(STATE))


def fill(saved, layout, tables):
    """The saved rows put into the (zero) tables."""
    import numpy as np

    from gpu_worker import native
    scatter = native.load("jcodec").scatter
    for name in layout["widths"]:
        rows_raw, data = saved["tables"][name]
        rows = np.frombuffer(rows_raw, dtype="<i8")
        if len(rows):
            width = len(data) // 8 // len(rows)
            tables[name][rows, :width] = np.frombuffer(data, dtype="<i8").reshape(len(rows), width)
    r, c = layout["receipts"], layout["conversations"]
    receipts = tables["receipts"]
    live = np.flatnonzero(receipts[:, r["STATE"]])
    tables["digests"][live] = np.frombuffer(saved["digests"], dtype=np.uint8).reshape(len(live), 64)
    for name, col in (("commands", r["COMMAND_LEN"]), ("results", r["RESULT_LEN"])):
        table = tables[name]
        lengths = np.ascontiguousarray(receipts[live, col])
        scatter(memoryview(table).cast("B"), table.shape[1], live, lengths, saved[name])
    talked = np.flatnonzero(tables["conversations"][:, c["HISTORY_LEN"]])
    history = tables["history"]
    scatter(memoryview(history).cast("B"), history.shape[1], talked,
            np.ascontiguousarray(tables["conversations"][talked, c["HISTORY_LEN"]]), saved.get("history", b""))


def index(caps, layout, tables):
    """FixedMaps of the tables' live rows, in the device's layouts and sizes."""
    import numpy as np

    from gpu_worker.fixedmap import fixed_map
    r = layout["receipts"]
    receipts = tables["receipts"]
    n = caps["receipts"]
    live = np.flatnonzero(receipts[:, r["STATE"]])
    rows = np.ascontiguousarray(live, dtype=np.int64)
    sequences = fixed_map("ii", n)
    sequences.put_packed(np.ascontiguousarray(receipts[live][:, [r["PARTICIPANT"], r["SEQUENCE"]]], dtype="<i8"), rows)
    keys = np.empty((len(live), 20), dtype=np.uint8)  # the operation key, then the participant row in 4 bytes
    keys[:, :16] = np.ascontiguousarray(receipts[live, r["KEY_HI"]:r["KEY_HI"] + 2], dtype="<i8").view(np.uint8)
    keys[:, 16:] = np.asarray(receipts[live, r["PARTICIPANT"]], dtype="<u4").reshape(-1, 1).view(np.uint8)
    by_key = fixed_map("b20", n)
    by_key.put_packed(keys, rows)
    by_op = fixed_map("b16", n)
    by_op.put_packed(np.ascontiguousarray(receipts[live, r["OP_HI"]:r["OP_HI"] + 2], dtype="<i8"), rows)
    maps = [sequences, by_key, by_op]
    for name in ("spaces", "conversations"):
        values = tables[name]
        at = np.flatnonzero(values[:, 0] == 1)
        hi = layout[name]["ID_HI"]
        ids = np.zeros((len(at), 4), dtype="<i8")  # (lineage, id): the lineage left zero
        ids[:, 2:] = values[at, hi:hi + 2]
        by_id = fixed_map("b16b16", caps[name])
        by_id.put_packed(ids, at.astype(np.int64))
        maps.append(by_id)
    return maps


def load(ccir, layout):
    """The stand-in load (see the docstring): tables zeroed in this process's memory, filled, indexed."""
    import numpy as np
    made, caps, saved = shapes(ccir, layout)
    tables = {name: np.zeros(shape, dtype=dtype) for name, (shape, dtype) in made.items()}
    fill(saved, layout, tables)
    return tables, index(caps, layout, tables)


def shared_tables(ccir, layout):
    """The tables in shared anonymous mappings (zero until written), made before a fork: what a
    child fills is the parent's too."""
    import mmap

    import numpy as np
    made, caps, saved = shapes(ccir, layout)
    tables = {}
    for name, (shape, dtype) in made.items():
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        tables[name] = np.frombuffer(mmap.mmap(-1, size), dtype=dtype).reshape(shape)
    return tables, caps, saved


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


def run_case(case, ccir, layout):
    from gpu_worker.storage.runtime_file import RuntimeFile
    checked = RuntimeFile.open(ccir, verify=False)
    child = shared = None
    # (the forks before any thread starts: the child has only this one)
    if case == "fork":
        child = _in_child(lambda: load(ccir, layout))
    elif case == "fork-tables":
        shared, caps, saved = shared_tables(ccir, layout)
        child = _in_child(lambda: fill(saved, layout, shared))
    if case != "load":
        checked.start_verify()  # as boot checks the file beside its imports (recovery/boot.py)
    if case == "imports":
        imports()
    elif case == "load":
        load(ccir, layout)
    elif case == "sequential":
        imports()
        load(ccir, layout)
    elif case == "thread":
        loader = threading.Thread(target=load, args=(ccir, layout))
        loader.start()
        imports()
        loader.join()
    else:
        imports()
        _, status = os.waitpid(child, 0)
        if status:
            raise SystemExit(f"the loading child ended with status {status}")
        if shared is not None:  # the tables filled by the child: indexed here, as a device would
            index(caps, layout, shared)
    checked.verified()
    print("done", flush=True)


def layout_of_tables():
    """The columns the stand-in reads, from the device's own table layout (imports torch: untimed)."""
    from gpu_worker.state.tables import C, M, P, R, S, width
    return {"widths": {"participants": width(P), "spaces": width(S), "members": width(M),
                       "conversations": width(C), "receipts": width(R)},
            "receipts": {k: getattr(R, k) for k in ("STATE", "PARTICIPANT", "SEQUENCE", "KEY_HI", "OP_HI",
                                                    "COMMAND_LEN", "RESULT_LEN")},
            "conversations": {"HISTORY_LEN": C.HISTORY_LEN, "ID_HI": C.ID_HI}, "spaces": {"ID_HI": S.ID_HI}}


def timed(case, ccir, layout, cache):
    """Seconds from Popen to the line a case's process prints once done, and what `cold_cache` did
    before it (bench/recovery.py: the page cache dropped, or the runtime file evicted)."""
    from bench.recovery import cold_cache  # (imports torch: only here, in the untimed parent)
    done = cold_cache(cache, ccir, "")
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--case", case, "--ccir", ccir, "--layout", json.dumps(layout)],
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
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path[0] = ROOT  # (not bench/, whose http.py would stand for the standard library's)
    if args.case:
        run_case(args.case, args.ccir, json.loads(args.layout))
        return
    layout = layout_of_tables()
    times: dict[str, list[float]] = {case: [] for case in CASES}
    caches = set()
    for _ in range(args.repeat):
        for case in CASES:
            seconds, done = timed(case, args.ccir, layout, args.page_cache)
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
