"""CPU per saved registration inside the device, without the disk or the sockets.

    .venv/bin/python bench/tick_cpu.py [--registrations 40000]

bench/journal.py measures the whole device at its socket; this one tells where a busy device's
interpreter time goes. A real Device (tiny runtime, real journal files) takes registrations in
ticks of 8 (a full 16-record tick) from an inbox that, as at 64 clients, always holds the next
tick's too; its file layer skips only the fdatasync. Each phase is
timed per chunk of 800 registrations and the best chunk is printed, because this machine's CPU
speed drifts between minutes: decode (frame payloads -> messages), gather (admission: checks, tables,
journal encoding), commit_and_answer (write, save bookkeeping, receipts rendered and framed).
The mean over all chunks follows: it includes the cyclic GC's collections, which a best chunk
may miss.
"""
import argparse
import collections
import gc
import json
import secrets
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)  # not bench/: bench/http.py would shadow the standard library http

from bench.journal import registration_frame  # noqa: E402
from gpu_worker.storage import filelayer  # noqa: E402
from gpu_worker.device import Device  # noqa: E402
from gpu_worker.contract.grantfile import Grants  # noqa: E402
from gpu_worker.pack import pack_tiny  # noqa: E402
from gpu_worker.contract.wire import decode_payload, encode_reply  # noqa: E402
from gpu_worker.storage.committer import Batch  # noqa: E402
from gpu_worker.storage.runtime_file import RuntimeFile  # noqa: E402

CHUNK = 800
TICK = 8


class NoSyncFile(filelayer.OsAppendFile):
    native_io = False  # its fdatasync is the one above, not fdatasync(2)

    def fdatasync(self):
        pass


class NoSyncLayer(filelayer.OsFileLayer):
    def open_append(self, path):
        handle = super().open_append(path)
        return NoSyncFile(handle.path, handle.fileno())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--registrations", type=int, default=40_000)
    args = parser.parse_args()
    n = args.registrations // CHUNK * CHUNK
    (ROOT / "var").mkdir(exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="bench-tick-", dir=ROOT / "var"))
    runtime = base / "bench.aotxccir"
    pack_tiny(str(runtime), shared=True, capacity={"participants": n, "receipts": n, "command_bytes": 512,
                                                    "result_bytes": 16})
    principals = [secrets.token_bytes(16) for _ in range(n)]
    grants = base / "grants.json"
    grants.write_text(json.dumps({"schema": "aotx.grants.v1", "written_at_ns": time.time_ns(), "principals": {
        p.hex(): {"name": "bench", "actions": ["shared_read", "shared_write"]} for p in principals}}))
    device = Device(RuntimeFile.open(str(runtime)), str(base / "journal"), Grants(str(grants)), fs=NoSyncLayer())
    lineages = [device.state.participants.lineage_of(p).hex() for p in principals]
    payloads = [registration_frame(lineage, p, i)[4:] for i, (p, lineage) in enumerate(zip(principals, lineages), 1)]  # as sockio hands them
    committer = device.committer
    gc.freeze()  # as boot does once the device is ready
    best = collections.defaultdict(lambda: float("inf"))
    overall = collections.Counter()
    # As at 64 clients, the inbox always holds more than a tick: gather stops at the full budget and
    # leaves the next tick's registrations queued (so the last tick's are never admitted).
    ticks = n // TICK - 1
    inbox = collections.deque(("bench", decode_payload(p)) for p in payloads[:TICK])
    for first in range(0, ticks, CHUNK // TICK):
        spent = collections.Counter()
        chunk = range(first, min(first + CHUNK // TICK, ticks))
        for k in chunk:
            t0 = time.perf_counter()
            inbox.extend(("bench", decode_payload(p)) for p in payloads[(k + 1) * TICK:(k + 2) * TICK])
            t1 = time.perf_counter()
            batch = Batch()
            device.gather(inbox, batch)
            batch.last_seq = committer.writer.next_seq - 1
            committer.batches.append(batch)
            t2 = time.perf_counter()
            replies = [encode_reply(msg) for _, msg in committer.commit()]
            t3 = time.perf_counter()
            assert len(replies) == TICK and len(inbox) == TICK
            spent.update(decode=t1 - t0, gather=t2 - t1, commit_and_answer=t3 - t2, total=t3 - t0)
        overall.update(spent)
        for phase, seconds in spent.items():
            best[phase] = min(best[phase], seconds / (len(chunk) * TICK) * 1e6)
    device.close()
    admitted = ticks * TICK
    print(f"{admitted} registrations in ticks of {TICK} (the next tick's always queued behind); best of "
          f"{-(-ticks * TICK // CHUNK)} chunks, microseconds per registration:")
    print("best:", "  ".join(f"{phase} {us:.1f}" for phase, us in best.items()))
    print("mean:", "  ".join(f"{phase} {seconds / admitted * 1e6:.1f}" for phase, seconds in overall.items()))


if __name__ == "__main__":
    main()
