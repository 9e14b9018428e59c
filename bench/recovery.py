"""Recovery time: boot (journal replay) for 10k and 100k journal transfers, and the same state
booted from a checkpoint. In-process (torch already imported), on this machine's disk.

    .venv/bin/python bench/recovery.py [--sizes 10000,100000]
"""
import argparse
import collections
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

import rfc8785

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)  # not bench/: bench/http.py would shadow the standard library http

from gpu_worker.device import Device  # noqa: E402
from gpu_worker.contract.grantfile import Grants  # noqa: E402
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


def build(base, transfers):
    runtime = str(base / "r.aotxccir")
    pack_tiny(runtime, shared=True, capacity={"participants": PRINCIPALS, "spaces": transfers + 1,
                                              "receipts": transfers + 1, "command_bytes": 512, "result_bytes": 16},
              journal_limits={"journal_file_cap_bytes": 1 << 40, "checkpoint_journal_bytes": 1 << 40})
    principals = [secrets.token_bytes(16) for _ in range(PRINCIPALS)]
    grants = str(base / "grants.json")
    write_grants(grants, {p.hex(): ["shared_read", "shared_write"] for p in principals})
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


def boot(runtime, journal, grants):
    write_grants(grants, {pid: sorted(a) for pid, a in Grants(grants).principals.items()})
    started = time.perf_counter()
    device = Device(RuntimeFile.open(runtime, verify=False), journal, Grants(grants))
    seconds = time.perf_counter() - started
    return device, seconds


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="10000,100000")
    args = parser.parse_args()
    (ROOT / "var").mkdir(exist_ok=True)
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        base = Path(tempfile.mkdtemp(prefix="bench-recovery-", dir=ROOT / "var"))
        try:
            runtime, journal, grants, journal_bytes = build(base, size)
            device, seconds = boot(runtime, journal, grants)
            replayed = device.recovered
            started = time.perf_counter()
            result = device.checkpoint()
            checkpoint_seconds = time.perf_counter() - started
            device.close()
            device, after = boot(runtime, journal, grants)
            assert device.recovered <= 2 and list_segments(journal, device.fs)
            device.close()
            rows.append((size, replayed, journal_bytes, seconds, checkpoint_seconds, result["state_bytes"], after))
        finally:
            shutil.rmtree(base, ignore_errors=True)
    print(f"{'transfers':>10} {'journal MiB':>12} {'boot s':>8} {'replay/s':>10} {'checkpoint s':>13} "
          f"{'state MiB':>10} {'boot after ckpt s':>18} {'speedup':>8}")
    for size, replayed, journal_bytes, seconds, ckpt, state, after in rows:
        print(f"{replayed:>10,} {journal_bytes / 2**20:>12.1f} {seconds:>8.2f} {replayed / seconds:>10,.0f} "
              f"{ckpt:>13.2f} {state / 2**20:>10.1f} {after:>18.2f} {seconds / after:>8.1f}x")


if __name__ == "__main__":
    main()
