"""HTTP mutations/s and p50/p99 latency through the gateway, beside a plain DRF + PostgreSQL
baseline doing the same idempotent insert, at 16 and 64 concurrent clients, in one run.

    .venv/bin/python bench/http.py [--seconds 5] [--clients 16,64] [--mutation spaces|participant]

aotx: `manage.py serve` (daphne) in front of `python -m gpu_worker boot` on a tiny runtime, set up
by tests.harness.Stack. Each client is one principal that registers first; the measured mutation
is POST /aotx/v1/shared/spaces {scope: private} with sequences 2, 3, 4, ... (--mutation participant
measures registration instead, each request under a fresh principal).

baseline: bench/baseline, a separate Django project served by daphne on its own port: DRF parses
the same envelope, checks a bearer token by one indexed sha256 lookup, and inserts (lineage,
sequence) unique with the RFC 8785 canonical bytes into a fresh PostgreSQL database
(synchronous_commit on); an exact retry answers the stored bytes, changed bytes 409.

Load: one asyncio process, one keep-alive HTTP/1.1 connection per client, closed loop (send,
read the whole reply, send the next). Each phase warms up for --warmup seconds, then counts the
202s completed during --seconds; p50/p99 are over those requests. Any status other than 202
aborts the run with the reply printed. Each system runs alone (the other is stopped), so the
idle one takes no CPU from it; everything started here is stopped before exit.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Run as a script, this file's directory comes first on sys.path, and this file (http.py) would
# then shadow the standard library's `http` package for urllib, daphne and Django. Use the repo
# root instead (it is where the project's packages live).
sys.path[0] = ROOT

import argparse  # noqa: E402
import asyncio  # noqa: E402
import hashlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import secrets  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import psycopg  # noqa: E402

from gpu_worker.state import ids  # noqa: E402
from gpu_worker.pack import pack_tiny  # noqa: E402
from gpu_worker.storage.runtime_file import RuntimeFile  # noqa: E402
from tests.conftest import PYTHON, free_port, wait_for  # noqa: E402
from tests.harness import Process, Stack  # noqa: E402

BASE = "/aotx/v1/shared"
SCHEMA = "aotx.shared.mutation.v1"
PG = "postgresql://postgres@127.0.0.1:5432"
BASELINE_DB = "aotx_bench_baseline"
GATEWAY_DB = "aotx_bench_gateway"


class BenchError(Exception):
    pass


# ---- the load generator ---------------------------------------------------------------------

class Identity:
    """One client's principal: its token, lineage and the next sequence it will send."""

    def __init__(self, token, lineage, sequence):
        self.token, self.lineage, self.sequence = token, lineage, sequence


def body(lineage, sequence, scope):
    """The mutation body; the same bytes (but for lineage, key and sequence) for both systems."""
    doc = {"schema": SCHEMA, "lineage": lineage, "operation_key": secrets.token_hex(16), "sequence": str(sequence)}
    if scope:
        doc["scope"] = "private"
    return json.dumps(doc).encode()


def request(port, path, token, data):
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data


def sequential(port, path, identity, scope):
    """Requests for one identity with sequences identity.sequence, +1, ... (a closed loop)."""
    def make():
        data = body(identity.lineage, identity.sequence, scope)
        identity.sequence += 1
        return request(port, path, identity.token, data)
    return make


def fresh(port, path, pool):
    """Registrations, each under the next unused principal of the shared pool (--mutation participant)."""
    def make():
        identity = next(pool, None)
        if identity is None:
            return None
        return request(port, path, identity.token, body(identity.lineage, 1, scope=False))
    return make


async def read_response(reader):
    """A minimal HTTP/1.1 reply reader: status line, headers, Content-Length or chunked body."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    length, chunked = 0, False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
    if not chunked:
        return status, await reader.readexactly(length)
    parts = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        parts.append((await reader.readexactly(size + 2))[:-2])  # chunk data, then CRLF
        if size == 0:  # (no trailers: daphne sends none)
            return status, b"".join(parts)


async def client(port, make, end, samples, notes):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.perf_counter() < end:
            req = make()
            if req is None:
                notes.append("pool of fresh principals exhausted")
                return
            sent = time.perf_counter()
            writer.write(req)
            status, reply = await read_response(reader)
            done = time.perf_counter()
            if status != 202:
                raise BenchError(f"{req.split(b' ', 2)[1].decode()} answered {status}: {reply[:2000].decode(errors='replace')}")
            samples.append((done, done - sent))
    finally:
        writer.close()


async def phase(port, makers, warmup, seconds):
    """Returns (mutations/s, p50 ms, p99 ms, count, client CPU share, notes) over the window after
    the warm-up. The client's CPU share (of one core) shows whether the load generator limited it."""
    samples, notes = [], []
    cpu_start = time.process_time()
    start = time.perf_counter()
    window_start, window_end = start + warmup, start + warmup + seconds
    await asyncio.gather(*(client(port, m, window_end, samples, notes) for m in makers))
    client_cpu = (time.process_time() - cpu_start) / (time.perf_counter() - start)
    latencies = sorted(lat for done, lat in samples if window_start <= done < window_end)
    if not latencies:
        raise BenchError("no request completed in the measured window")
    elapsed = min(window_end, max(done for done, _ in samples)) - window_start if notes else seconds
    return (len(latencies) / elapsed, percentile(latencies, 0.50) * 1e3, percentile(latencies, 0.99) * 1e3,
            len(latencies), client_cpu, sorted(set(notes)))


def percentile(ordered, q):
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]  # nearest rank


# ---- aotx: device + gateway -------------------------------------------------------------------

CREATE_PRINCIPALS = """
import json
from django.db import transaction
from shared_api import config
from shared_api.grants import write_grant_file
from shared_api.models import ACTIONS, Principal
with transaction.atomic():
    made = [Principal.create(PREFIX + str(i), ACTIONS) for i in range(COUNT)]
write_grant_file(config.load(CONFIG)["grants_file"])
print(json.dumps([[p.principal_id, token] for p, token in made]))
"""


def create_principals(stack, prefix, count):
    """[(principal_id, token)]. One manage.py process for all (stack.principal() starts one per
    principal, about a second each); still the gateway's own code and grant file."""
    code = (CREATE_PRINCIPALS.replace("PREFIX", repr(prefix)).replace("COUNT", str(count))
            .replace("CONFIG", repr(str(stack.config))))
    out = stack.manage("shell", "-c", code, check=False)
    if out.returncode:
        raise BenchError(f"creating principals failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def aotx_http(stack, method, path, token, payload=None):
    status, _, reply = stack.http(method, path, payload, token=token)
    return status, json.loads(reply)


def register(stack, token):
    """GET /participant, POST /participant at sequence 1: the client's lineage and next sequence."""
    status, participant = aotx_http(stack, "GET", f"{BASE}/participant", token)
    if status != 200:
        raise BenchError(f"GET /participant answered {status}: {participant}")
    status, receipt = aotx_http(stack, "POST", f"{BASE}/participant", token, {
        "schema": SCHEMA, "lineage": participant["lineage"], "operation_key": secrets.token_hex(16),
        "sequence": participant["next_sequence"]})
    if status != 202:
        raise BenchError(f"registration answered {status}: {receipt}")
    status, participant = aotx_http(stack, "GET", f"{BASE}/participant", token)
    return Identity(token, participant["lineage"], int(participant["next_sequence"]))


def run_aotx(base, args, clients_max, fresh_count):
    runtime = base / "bench.aotxccir"
    participants = clients_max + fresh_count
    # room for every mutation of the run (a few thousand per second at most), memory kept modest
    pack_tiny(str(runtime), shared=True, capacity={"participants": max(256, participants), "spaces": 400_000,
                                                    "receipts": 400_000, "command_bytes": 1024, "result_bytes": 16})
    (base / "aotx").mkdir()
    # the gateway's production configuration: PostgreSQL (pooled), like the baseline
    pg_admin(f"DROP DATABASE IF EXISTS {GATEWAY_DB} WITH (FORCE)")
    pg_admin(f"CREATE DATABASE {GATEWAY_DB}")
    stack = Stack(base / "aotx", str(runtime), database_url=f"{PG}/{GATEWAY_DB}")
    try:
        made = create_principals(stack, "c", clients_max)
        pool = create_principals(stack, "f", fresh_count) if fresh_count else []
        stack.boot_device()
        stack.serve()
        print(f"aotx: device pid {stack.device.proc.pid}, gateway pid {stack.gateway.proc.pid}, "
              f"port {stack.port}", file=sys.stderr, flush=True)
        identities = [register(stack, token) for _, token in made]
        if args.mutation == "spaces":
            path = f"{BASE}/spaces"
            makers = [sequential(stack.port, path, identity, scope=True) for identity in identities]
        else:
            incarnation = RuntimeFile.open(str(runtime), verify=False).incarnation
            path = f"{BASE}/participant"
            unused = iter([Identity(token, ids.lineage(incarnation, bytes.fromhex(pid)).hex(), 1)
                           for pid, token in pool])
            makers = [fresh(stack.port, path, unused) for _ in range(clients_max)]
        results = {}
        for c in args.clients:
            results[c] = asyncio.run(phase(stack.port, makers[:c], args.warmup, args.seconds))
            print(f"aotx {c} clients: {results[c][0]:,.0f}/s", file=sys.stderr, flush=True)
        return results, gateway_errors(stack.gateway.output())
    finally:
        stack.stop()
        pg_admin(f"DROP DATABASE IF EXISTS {GATEWAY_DB} WITH (FORCE)")


def gateway_errors(log):
    """Server-side trouble the clients may not have seen: 5xx lines, tracebacks."""
    return [line for line in log.splitlines() if "Traceback" in line or re.search(r'" 5\d\d ', line)][:10]


# ---- baseline: DRF + PostgreSQL ---------------------------------------------------------------

def pg_admin(sql):
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(sql)


def run_baseline(base, args, clients_max, scope):
    port = free_port()
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="bench.baseline.settings",
               BASELINE_DATABASE_URL=f"{PG}/{BASELINE_DB}")
    identities = [Identity("base_" + secrets.token_urlsafe(32), secrets.token_hex(16), 1) for _ in range(clients_max)]
    pg_admin(f"DROP DATABASE IF EXISTS {BASELINE_DB}")
    pg_admin(f"CREATE DATABASE {BASELINE_DB}")
    server = None
    try:
        rows = [[hashlib.sha256(i.token.encode()).hexdigest(), i.lineage] for i in identities]
        subprocess.run([PYTHON, "-m", "bench.baseline.schema"], cwd=ROOT, env=env, input=json.dumps(rows),
                       text=True, check=True, capture_output=True, timeout=120)
        # the gateway's own server and flags (manage.py serve): daphne, access log to stdout
        server = Process([PYTHON, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "--access-log", "-",
                          "bench.baseline.asgi:application"], env, base / "baseline.log")
        wait_for(lambda: listening(server, port), 60, what="baseline port")
        print(f"baseline: daphne pid {server.proc.pid}, port {port}", file=sys.stderr, flush=True)
        makers = [sequential(port, "/m", identity, scope) for identity in identities]
        results = {}
        for c in args.clients:
            results[c] = asyncio.run(phase(port, makers[:c], args.warmup, args.seconds))
            print(f"baseline {c} clients: {results[c][0]:,.0f}/s", file=sys.stderr, flush=True)
        check_idempotence(port, identities[0], scope)
        return results, gateway_errors(server.output())
    finally:
        if server is not None:
            server.kill()
        pg_admin(f"DROP DATABASE IF EXISTS {BASELINE_DB} WITH (FORCE)")


def listening(server, port):
    if server.proc.poll() is not None:
        raise BenchError(f"baseline daphne exited: {server.output()[-2000:]}")
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def check_idempotence(port, identity, scope):
    """The baseline must really be idempotent: exact retry 200 with the same bytes, changed 409."""
    async def go():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            data = body(identity.lineage, identity.sequence, scope)
            answers = []
            for payload in (data, data, body(identity.lineage, identity.sequence, scope)):
                writer.write(request(port, "/m", identity.token, payload))
                answers.append(await read_response(reader))
            return answers
        finally:
            writer.close()
    (s1, r1), (s2, r2), (s3, _) = asyncio.run(go())
    if (s1, s2, s3) != (202, 200, 409) or r1 != r2:
        raise BenchError(f"baseline idempotence check answered {s1}, {s2}, {s3}")


# ---- main ---------------------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per phase")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each phase")
    parser.add_argument("--clients", default="16,64", help="concurrencies, comma-separated")
    parser.add_argument("--mutation", choices=("spaces", "participant"), default="spaces",
                        help="aotx route measured: space creation, or registration under fresh principals")
    parser.add_argument("--fresh", type=int, default=20_000,
                        help="fresh principals created for --mutation participant")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    args = parser.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    clients_max = max(args.clients)
    os.makedirs(os.path.join(ROOT, "var"), exist_ok=True)
    # on the real disk (var/), like the PostgreSQL data directory: /tmp may be a tmpfs
    base = Path(tempfile.mkdtemp(prefix="bench-http-", dir=os.path.join(ROOT, "var")))
    try:
        aotx, aotx_errors = run_aotx(base, args, clients_max, args.fresh if args.mutation == "participant" else 0)
        # the baseline always inserts (lineage, sequence) per client; with --mutation participant it
        # only drops "scope" from the body, so the bodies stay the same size as aotx's
        baseline, baseline_errors = run_baseline(base, args, clients_max, scope=args.mutation == "spaces")
    except BenchError as exc:
        raise SystemExit(f"bench aborted: {exc}\n(logs kept in {base})")
    if not args.keep:  # after a failure the logs stay
        shutil.rmtree(base, ignore_errors=True)

    route = "POST /aotx/v1/shared/spaces" if args.mutation == "spaces" else "POST /aotx/v1/shared/participant (fresh principal each)"
    pooled = importlib.util.find_spec("psycopg_pool") is not None  # what bench/baseline/settings.py chose
    print(f"aotx: {route}; baseline: DRF + PostgreSQL POST /m, "
          f"{'psycopg pool' if pooled else 'a new connection per request (install psycopg-pool to pool)'}; "
          f"{args.seconds:g} s per phase after {args.warmup:g} s warm-up; {os.cpu_count()} CPUs")
    print(f"{'system':<10} {'clients':>7} {'mutations/s':>12} {'p50 ms':>8} {'p99 ms':>8} {'n':>8} {'client CPU':>10}")
    for name, results in (("aotx", aotx), ("baseline", baseline)):
        for c in args.clients:
            rate, p50, p99, n, cpu, notes = results[c]
            print(f"{name:<10} {c:>7} {rate:>12,.0f} {p50:>8.2f} {p99:>8.2f} {n:>8} {cpu:>10.0%}"
                  + (f"  ({'; '.join(notes)})" if notes else ""))
    print(f"{'ratio aotx/baseline':<20} {'throughput':>11} {'p99':>8}")
    for c in args.clients:
        print(f"{c:>7} clients{'':<5} {aotx[c][0] / baseline[c][0]:>11.2f} {aotx[c][2] / baseline[c][2]:>8.2f}")
    for name, errors in (("aotx gateway", aotx_errors), ("baseline", baseline_errors)):
        for line in errors:
            print(f"{name} log: {line}")


if __name__ == "__main__":
    main()
