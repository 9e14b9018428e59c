"""HTTP mutations/s and receipt reads/s through the gateway beside the service a team would build
instead, at 16, 64 and 256 concurrent clients, in one run; p50/p99 latency; a table with ratios.

    .venv/bin/python bench/http.py [--seconds 5] [--clients 16,64,256] [--workers N] [--rounds 3] [--no-drf]
                                   [--front-of COMMIT]

aotx: `manage.py serve` (shared_api/http/server.py: granian, RSGI, --workers processes) in front of
`python -m gpu_worker boot` on a tiny runtime, set up by tests.harness.Stack, its database on the
local PostgreSQL. Each client is one principal that registers first; the mutation is POST
/aotx/v1/shared/spaces {scope: private} with sequences 2, 3, ...; the read is GET
/aotx/v1/shared/operations/{op} of the client's registration receipt.

fastapi: bench/fastapi_baseline (FastAPI + asyncpg on granian's ASGI, same worker count): the same
envelope parsing, a sha256 token lookup, an insert unique by (lineage, sequence) with the RFC 8785
canonical bytes, synchronously committed on the local PostgreSQL (database `test`; the run prints
its `fsync` and `synchronous_commit` settings); principals cached for 5 s in each worker, as the
gateway caches them; exact retry 200, changed bytes 409 (checked after the run); the read is its
stored receipt by operation ID.

ceiling: bench/ceiling.py, a trivial async view answering a fixed 200, under the gateway's own
server and worker count: what no gateway on this machine can beat.

drf: bench/baseline, the earlier baseline (DRF + PostgreSQL under daphne, one process), kept for
history (--no-drf leaves it out).

front-of (--front-of COMMIT): that commit's gateway, checked out in a worktree, served beside this
one on the same device and database, its own principals: this gateway against an earlier one in
the same rounds (issue 54 §1 measured DRF's dispatch of the shared routes so).

Load: bench/httpgen.c (compiled at the start), one epoll loop in C with one keep-alive HTTP/1.1
connection per client, closed loop (send, read the whole reply, send the next); each mutation
has its own sequence and operation key. Each phase warms up for --warmup seconds, then counts the
replies completed during --seconds; p50/p99 are over those. Any unexpected status aborts the run
with the reply printed. The clients share the machine with what they measure: in C they take
~25% less CPU a request than the earlier Python clients on uvloop (the rest is the kernel's
loopback TCP, which no client avoids).

Every system is started first and waits, idle, while another is measured; then --rounds rounds
run every phase, the systems in turn for each (kind, concurrency), so the phases
a ratio compares ran within a minute of each other (this machine's speed drifts by 1.3-1.5x over
minutes). The table shows each system's median round; the ratios are computed per round and
their median is shown beside every round's. Everything started here is stopped before exit.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Run as a script, this file's directory comes first on sys.path, and this file (http.py) would
# then shadow the standard library's `http` package for urllib, daphne and Django. Use the repo
# root instead (it is where the project's packages live).
sys.path[0] = ROOT

import argparse  # noqa: E402
import array  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import secrets  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import psycopg  # noqa: E402

from gpu_worker.pack import pack_tiny  # noqa: E402
from tests.conftest import PYTHON, free_port, wait_for  # noqa: E402
from tests.harness import Process, Stack  # noqa: E402
from bench.versus import worktree  # noqa: E402

BASE = "/aotx/v1/shared"
SCHEMA = "aotx.shared.mutation.v1"
PG = "postgresql://postgres@127.0.0.1:5432"
BASELINE_DB = "aotx_bench_baseline"
FASTAPI_DB = "test"  # the local PostgreSQL's database the FastAPI baseline writes to (its own tables)
GATEWAY_DB = "aotx_bench_gateway"


class BenchError(Exception):
    pass


# ---- the load generator ---------------------------------------------------------------------

class Identity:
    """One client's principal: its token, lineage, the next sequence it will send, and the
    operation ID it reads back."""

    def __init__(self, token, lineage, sequence, operation=None):
        self.token, self.lineage, self.sequence, self.operation = token, lineage, sequence, operation


def body_template(lineage, scope=True):
    """The mutation body with "{KEY}" for its operation key and "{SEQ}" for its sequence: the same
    bytes (but for lineage, key and sequence) for every system."""
    doc = {"schema": SCHEMA, "lineage": lineage, "operation_key": "{KEY}", "sequence": "{SEQ}"}
    if scope:
        doc["scope"] = "private"
    return json.dumps(doc).encode()


def body(lineage, sequence, scope=True):
    return (body_template(lineage, scope).replace(b"{KEY}", secrets.token_hex(16).encode())
            .replace(b"{SEQ}", str(sequence).encode()))


def head(method, port, path, token):
    """A request's line and headers, without Content-Length and the blank line."""
    lines = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\n"
    return (lines + ("Content-Type: application/json\r\n" if method == "POST" else "")).encode()


def request(port, path, token, data=None):
    if data is None:
        return head("GET", port, path, token) + b"\r\n"
    return head("POST", port, path, token) + f"Content-Length: {len(data)}\r\n\r\n".encode() + data


class Load:
    """One client's requests: a mutation (POST, its body from body_template, the identity's
    sequences in turn) or a read (GET, the same request every time)."""

    def __init__(self, port, path, identity, post):
        self.identity = identity
        self.head = head("POST" if post else "GET", port, path, identity.token)
        self.template = body_template(identity.lineage) if post else b""
        self.key = secrets.token_hex(8)  # (the operation keys' first half; httpgen writes the sequence after it)


def mutations(port, path, identity):
    return Load(port, path, identity, post=True)


def reads(port, path_of, identity):
    return Load(port, path_of(identity.operation), identity, post=False)


# ---- the load generator (bench/httpgen.c) --------------------------------------------------------

def build_httpgen(directory):
    """Compile bench/httpgen.c into directory; returns the executable's path."""
    exe = os.path.join(directory, "httpgen")
    subprocess.run([os.environ.get("CC") or "cc", "-O2", "-Wall", "-o", exe, os.path.join(ROOT, "bench", "httpgen.c")],
                   check=True)
    return exe


def phase(httpgen, directory, port, loads, expect, warmup, seconds):
    """One closed-loop phase on bench/httpgen.c: (requests/s, p50 ms, p99 ms, count, client CPU
    share) over the window after the warm-up. The client's CPU share (of one core) shows what the
    load generator took of the machine. Each identity's next sequence comes from httpgen's output."""
    spec, latencies = os.path.join(directory, "clients"), os.path.join(directory, "latencies")
    with open(spec, "wb") as f:
        for load in loads:
            f.write(f"{load.identity.sequence} {load.key} {len(load.head)} {len(load.template)}\n".encode())
            f.write(load.head + load.template)
    done = subprocess.run([httpgen, str(port), spec, str(expect), str(warmup), str(seconds), latencies],
                          capture_output=True, text=True, timeout=warmup + seconds + 60)
    if done.returncode:
        raise BenchError(done.stderr.strip()[-3000:] or f"httpgen exited {done.returncode}")
    cpu, *following = done.stdout.split()
    for load, sequence in zip(loads, following):
        if load.template:
            load.identity.sequence = int(sequence)
    measured = array.array("d", Path(latencies).read_bytes())
    os.unlink(spec)
    os.unlink(latencies)
    if not measured:
        raise BenchError("no request completed in the measured window")
    ordered = sorted(measured)
    return (len(ordered) / seconds, percentile(ordered, 0.50) * 1e3, percentile(ordered, 0.99) * 1e3,
            len(ordered), float(cpu))


def percentile(ordered, q):
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]  # nearest rank


class System:
    """One system under test, started and waiting: its port, the clients' request makers for each
    kind (None: the kind is not measured), the status a mutation answers, and `finish()`, run once
    after the last phase (checks, the server log's errors)."""

    def __init__(self, name, port, makers, readers, created=202, finish=lambda: []):
        self.name, self.port, self.created, self.finish = name, port, created, finish
        self.makers = {"mutations": makers, "reads": readers}


def run_round(systems, args, results, number):
    """Each kind and concurrency once for every system, the systems one after another for each
    (their order turned by the round's number, so that none always runs first); results[name,
    kind, clients] collects one phase result per round."""
    order = systems[number % len(systems):] + systems[:number % len(systems)]
    for kind in ("mutations", "reads"):
        for c in args.clients:
            for system in order:
                makers = system.makers[kind]
                if makers is None:
                    continue
                expect = system.created if kind == "mutations" else 200
                result = phase(args.httpgen, args.base, system.port, makers[:c], expect, args.warmup, args.seconds)
                results.setdefault((system.name, kind, c), []).append(result)
                print(f"round {number + 1}: {system.name} {kind} {c} clients: {result[0]:,.0f}/s",
                      file=sys.stderr, flush=True)


# ---- aotx: device + gateway -------------------------------------------------------------------

CREATE_PRINCIPALS = """
import json
from django.db import transaction
from shared_api import config
from shared_api.grants import write_grant_file
from shared_api.models import ACTIONS, Principal
with transaction.atomic():
    made = [Principal.create(PREFIX + str(i), list(ACTIONS), {"requests_per_second": None}) for i in range(COUNT)]
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
    """GET /participant, POST /participant at sequence 1: the client's lineage, next sequence and
    its registration's operation ID."""
    status, participant = aotx_http(stack, "GET", f"{BASE}/participant", token)
    if status != 200:
        raise BenchError(f"GET /participant answered {status}: {participant}")
    status, receipt = aotx_http(stack, "POST", f"{BASE}/participant", token, {
        "schema": SCHEMA, "lineage": participant["lineage"], "operation_key": secrets.token_hex(16),
        "sequence": participant["next_sequence"]})
    if status != 202:
        raise BenchError(f"registration answered {status}: {receipt}")
    status, participant = aotx_http(stack, "GET", f"{BASE}/participant", token)
    return Identity(token, participant["lineage"], int(participant["next_sequence"]), receipt["operation"])


@contextlib.contextmanager
def aotx_system(base, args, clients_max):
    runtime = base / "bench.aotxccir"
    # room for every mutation of the run (tens of thousands per second at most), memory kept modest
    pack_tiny(str(runtime), shared=True, capacity={"participants": max(512, clients_max), "spaces": 2_000_000,
                                                    "receipts": 2_000_000, "command_bytes": 1024, "result_bytes": 16})
    (base / "aotx").mkdir()
    # the gateway's production configuration: PostgreSQL (pooled)
    pg_admin(f"DROP DATABASE IF EXISTS {GATEWAY_DB} WITH (FORCE)")
    pg_admin(f"CREATE DATABASE {GATEWAY_DB}")
    stack = Stack(base / "aotx", str(runtime), database_url=f"{PG}/{GATEWAY_DB}")
    cfg = json.loads(stack.config.read_text())
    stack.config.write_text(json.dumps({**cfg, "workers": args.workers}))
    try:
        made = create_principals(stack, "c", clients_max)
        stack.boot_device()
        stack.serve()
        print(f"aotx: device pid {stack.device.proc.pid}, gateway pid {stack.gateway.proc.pid}, "
              f"port {stack.port}, {args.workers} workers", file=sys.stderr, flush=True)
        identities = [register(stack, token) for _, token in made]
        makers = [mutations(stack.port, f"{BASE}/spaces", identity) for identity in identities]
        readers = [reads(stack.port, lambda op: f"{BASE}/operations/{op}", identity) for identity in identities]
        args.aotx_stack = stack  # (front_of_system serves the same device and database)
        yield System("aotx", stack.port, makers, readers, finish=lambda: gateway_errors(stack.gateway.output()))
    finally:
        stack.stop()
        pg_admin(f"DROP DATABASE IF EXISTS {GATEWAY_DB} WITH (FORCE)")


def gateway_errors(log):
    """Server-side trouble the clients may not have seen: 5xx lines, tracebacks."""
    return [line for line in log.splitlines() if "Traceback" in line or re.search(r'" 5\d\d ', line)][:10]


# ---- the baselines and the ceiling ---------------------------------------------------------------

def pg_admin(sql, database="postgres"):
    with psycopg.connect(f"{PG}/{database}", autocommit=True) as conn:
        conn.execute(sql)


GATEWAY_POOL = 32  # the gateway's psycopg pool per process, at most (aotx_site/settings.py)
PG_RESERVE = 10    # connections kept for the DRF baseline, the bench's own and PostgreSQL's


def fastapi_pool(workers, clients_max):
    """asyncpg connections per FastAPI worker: the clients' share of each worker, within what
    PostgreSQL's max_connections leaves once the gateway's workers could hold their whole pools
    (all systems run at once) and PG_RESERVE; at most 40, at least 4. With 2 workers and 256
    clients the earlier 40 a worker, beside the gateway's pools, ran PostgreSQL out of connections."""
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        max_connections = int(conn.execute("SHOW max_connections").fetchone()[0])
        # what a commit costs the baseline: with fsync or synchronous_commit off its "committed"
        # is not on disk, and its figures are not comparable with a receipt saved by fdatasync
        durability = {name: conn.execute(f"SHOW {name}").fetchone()[0] for name in ("fsync", "synchronous_commit")}
    room = (max_connections - PG_RESERVE - GATEWAY_POOL * workers) // workers
    size = max(4, min(40, clients_max // workers, room))
    print(f"fastapi: asyncpg pool of {size} a worker x {workers} (PostgreSQL max_connections {max_connections}, "
          f"gateway pools {GATEWAY_POOL} x {workers}, reserve {PG_RESERVE}); PostgreSQL fsync={durability['fsync']}, "
          f"synchronous_commit={durability['synchronous_commit']}", file=sys.stderr, flush=True)
    return size


def listening(server, port, what):
    if server.proc.poll() is not None:
        raise BenchError(f"{what} exited: {server.output()[-2000:]}")
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def granian_server(base, name, app, port, workers, env, interface, cwd=ROOT):
    """`app` under the gateway's server and its settings (shared_api/http/server.py: granian, uvloop,
    HTTP/1.1, the header read timeout, no server access log: the gateway writes its own, and so
    does the ceiling; the FastAPI baseline runs without one, its fastest), `workers` processes;
    `interface`: rsgi (the gateway's, the ceiling's) or asgi (the FastAPI baseline's: the same
    server, so the comparison is of the applications)."""
    args = [PYTHON, "-m", "granian", "--interface", interface, "--host", "127.0.0.1", "--port", str(port),
            "--workers", str(workers), "--loop", "uvloop", "--http", "1", "--no-ws",
            "--http1-header-read-timeout", "10000", "--no-access-log", app]
    server = Process(args, env, base / f"{name}.log", cwd=cwd)
    wait_for(lambda: listening(server, port, name), 60, what=f"{name} port")
    return server


def seed(port, identities, path, expect_status=202):
    """One mutation per identity (its operation is what the read phase reads)."""
    async def go():
        for identity in identities:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                data = body(identity.lineage, identity.sequence)
                writer.write(request(port, path, identity.token, data))
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
                reply = await reader.readexactly(length)
                status = int(head.split(b" ", 2)[1])
                if status != expect_status:
                    raise BenchError(f"seeding {path} answered {status}: {reply[:500]!r}")
                identity.sequence += 1
                identity.operation = json.loads(reply).get("operation")
            finally:
                writer.close()
    asyncio.run(go())


def check_idempotence(port, identity, path):
    """A baseline must really be idempotent: exact retry 200 with the same bytes, changed 409."""
    async def go():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            data = body(identity.lineage, identity.sequence)
            answers = []
            for payload in (data, data, body(identity.lineage, identity.sequence)):
                writer.write(request(port, path, identity.token, payload))
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
                answers.append((int(head.split(b" ", 2)[1]), await reader.readexactly(length)))
            return answers
        finally:
            writer.close()
    (s1, r1), (s2, r2), (s3, _) = asyncio.run(go())
    if (s1, s2, s3) != (202, 200, 409) or r1 != r2:
        raise BenchError(f"baseline idempotence check on {path} answered {s1}, {s2}, {s3}")


@contextlib.contextmanager
def fastapi_system(base, args, clients_max):
    from bench.fastapi_baseline.app import PREFIX, TABLES
    port = free_port()
    size = fastapi_pool(args.workers, clients_max)
    env = dict(os.environ, BASELINE_PG=f"{PG}/{FASTAPI_DB}", BASELINE_TABLE_PREFIX=PREFIX, BASELINE_POOL=str(size))
    identities = [Identity("base_" + secrets.token_urlsafe(32), secrets.token_hex(16), 1) for _ in range(clients_max)]
    drop = f"DROP TABLE IF EXISTS {PREFIX}_tokens, {PREFIX}_operations"
    pg_admin(drop, FASTAPI_DB)
    server = None
    try:
        with psycopg.connect(f"{PG}/{FASTAPI_DB}", autocommit=True) as conn:
            conn.execute(TABLES)
            with conn.cursor() as cur:
                cur.executemany(f"INSERT INTO {PREFIX}_tokens VALUES (%s, %s)",
                                [(hashlib.sha256(i.token.encode()).hexdigest(), i.lineage) for i in identities])
        server = granian_server(base, "fastapi", "bench.fastapi_baseline.app:app", port, args.workers, env, "asgi")
        print(f"fastapi: granian (ASGI) pid {server.proc.pid}, port {port}, {args.workers} workers", file=sys.stderr, flush=True)
        seed(port, identities, "/m")
        makers = [mutations(port, "/m", identity) for identity in identities]
        readers = [reads(port, lambda op: f"/operations/{op}", identity) for identity in identities]

        def finish():
            check_idempotence(port, identities[0], "/m")
            return gateway_errors(server.output())
        yield System("fastapi", port, makers, readers, finish=finish)
    finally:
        if server is not None:
            server.kill(signal.SIGTERM)  # (the server then writes out what it still holds: a failure's traceback)
        pg_admin(drop, FASTAPI_DB)


@contextlib.contextmanager
def ceiling_system(base, args, clients_max):
    port = free_port()
    server = granian_server(base, "ceiling", "bench.ceiling:app", port, args.workers, dict(os.environ), "rsgi")
    try:
        print(f"ceiling: granian (RSGI) pid {server.proc.pid}, port {port}, {args.workers} workers", file=sys.stderr, flush=True)
        identities = [Identity("x", secrets.token_hex(16), 1, "op-x") for _ in range(clients_max)]
        makers = [mutations(port, "/m", identity) for identity in identities]
        readers = [reads(port, lambda op: f"/operations/{op}", identity) for identity in identities]
        yield System("ceiling", port, makers, readers, created=200)
    finally:
        server.kill()


@contextlib.contextmanager
def front_of_system(base, args, clients_max):
    """The gateway of an earlier commit (--front-of, checked out in a worktree), on the aotx
    system's device and database, with its own principals: this gateway's cost against that one's
    on the same device, alternating (issue 54 §1: the shared routes dispatched by DRF, against the
    front that dispatched them itself)."""
    stack = args.aotx_stack
    port = free_port()
    made = create_principals(stack, "d", clients_max)
    with contextlib.ExitStack() as trees:
        tree = worktree(trees, args.front_of, base / "front-of")
        server = granian_server(base, "front-of", "aotx_site.gateway:application", port, args.workers,
                                dict(stack.env, PYTHONPATH=str(tree)), "rsgi", cwd=tree)
        try:
            print(f"front-of {args.front_of}: granian (RSGI) pid {server.proc.pid}, port {port}, {args.workers} "
                  f"workers", file=sys.stderr, flush=True)
            identities = [register(stack, token) for _, token in made]
            makers = [mutations(port, f"{BASE}/spaces", identity) for identity in identities]
            readers = [reads(port, lambda op: f"{BASE}/operations/{op}", identity) for identity in identities]
            yield System("front-of", port, makers, readers, finish=lambda: gateway_errors(server.output()))
        finally:
            server.kill(signal.SIGTERM)


@contextlib.contextmanager
def drf_system(base, args, clients_max):
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
        server = Process([PYTHON, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "--access-log", "-",
                          "bench.baseline.asgi:application"], env, base / "drf.log")
        wait_for(lambda: listening(server, port, "drf baseline"), 60, what="drf baseline port")
        print(f"drf: daphne pid {server.proc.pid}, port {port}", file=sys.stderr, flush=True)
        makers = [mutations(port, "/m", identity) for identity in identities]

        def finish():
            check_idempotence(port, identities[0], "/m")
            return gateway_errors(server.output())
        yield System("drf", port, makers, None, finish=finish)  # (mutations only, as it was measured)
    finally:
        if server is not None:
            server.kill()
        pg_admin(f"DROP DATABASE IF EXISTS {BASELINE_DB} WITH (FORCE)")


# ---- main ---------------------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per phase")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each phase")
    parser.add_argument("--clients", default="16,64,256", help="concurrencies, comma-separated")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="server processes of the gateway, the FastAPI baseline and the ceiling")
    parser.add_argument("--today", type=float, default=265.0,
                        help="the gateway's mutations/s at 64 clients before this work (issue 20: daphne, sync views)")
    parser.add_argument("--no-drf", action="store_true", help="leave out the earlier DRF + daphne baseline")
    parser.add_argument("--front-of", metavar="COMMIT",
                        help="also that commit's gateway (a worktree) on the same device, in turns with this one")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of every phase; the systems take turns within each (ratios per round, and their median)")
    args = parser.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    clients_max = max(args.clients)
    os.makedirs(os.path.join(ROOT, "var"), exist_ok=True)
    # on the real disk (var/), like the PostgreSQL data directory: /tmp may be a tmpfs
    base = Path(tempfile.mkdtemp(prefix="bench-http-", dir=os.path.join(ROOT, "var")))
    args.base, args.httpgen = str(base), build_httpgen(str(base))
    starts = [aotx_system, *((front_of_system,) if args.front_of else ()), fastapi_system, ceiling_system,
              *(() if args.no_drf else (drf_system,))]
    results, errors = {}, {}
    try:
        with contextlib.ExitStack() as running:  # every system up (and idle) while the others run
            systems = [running.enter_context(start(base, args, clients_max)) for start in starts]
            for number in range(args.rounds):
                run_round(systems, args, results, number)
            for system in systems:
                errors[system.name] = system.finish()
    except BenchError as exc:
        raise SystemExit(f"bench aborted: {exc}\n(logs kept in {base})")
    if not args.keep:  # after a failure the logs stay
        shutil.rmtree(base, ignore_errors=True)
    report(args, results, errors)


def middle(values):
    """The median of an odd count, the upper middle of an even one (a phase result: by its rate)."""
    return sorted(values)[len(values) // 2]


def report(args, results, errors):
    """Each system's phases (the round with the median rate), then the ratios of each round (its
    phases ran minutes apart at most, the systems in turn) and their median."""
    print(f"aotx: POST {BASE}/spaces, GET {BASE}/operations/{{op}}; fastapi: FastAPI + asyncpg POST /m, "
          f"GET /operations/{{op}}; ceiling: fixed 200; drf: DRF + PostgreSQL under daphne (1 process); "
          f"{args.workers} workers; {args.seconds:g} s per phase after {args.warmup:g} s warm-up; "
          f"{args.rounds} rounds; {os.cpu_count()} CPUs")
    print(f"{'system':<9} {'kind':<10} {'clients':>7} {'per s':>9} {'p50 ms':>8} {'p99 ms':>8} {'n':>8} "
          f"{'client CPU':>10}  per s in each round")
    for kind in ("mutations", "reads"):
        for name in ("aotx", "front-of", "fastapi", "ceiling", "drf"):
            for c in args.clients:
                runs = results.get((name, kind, c))
                if not runs:
                    continue
                rate, p50, p99, n, cpu = middle(runs)
                each = " / ".join(f"{r[0]:,.0f}" for r in runs)
                print(f"{name:<9} {kind:<10} {c:>7} {rate:>9,.0f} {p50:>8.2f} {p99:>8.2f} {n:>8} {cpu:>10.0%}  {each}")
    print(f"{'ratios':<20} {'clients':>7} {'aotx/fastapi':>12} {'p99 aotx/fastapi':>16} {'aotx/ceiling':>12}"
          f" {'aotx/today':>10}  (median of the rounds; each round)")
    for kind in ("mutations", "reads"):
        for c in args.clients:
            rounds = list(zip(results["aotx", kind, c], results["fastapi", kind, c], results["ceiling", kind, c]))
            columns = [[a[0] / f[0] for a, f, _ in rounds], [a[2] / f[2] for a, f, _ in rounds],
                       [a[0] / t[0] for a, _, t in rounds]]
            if kind == "mutations":
                columns.append([a[0] / args.today for a, _, _ in rounds])
            medians = [middle(column) for column in columns]
            cells = [f"{medians[0]:>12.2f}", f"{medians[1]:>16.2f}", f"{medians[2]:>12.2f}",
                     f"{medians[3]:>10.1f}" if kind == "mutations" else f"{'':>10}"]
            each = "; ".join(", ".join(f"{value:.2f}" for value in column) for column in columns)
            print(f"{kind:<20} {c:>7} {' '.join(cells)}  ({each})")
    if args.front_of:
        print(f"this gateway over {args.front_of}'s (front-of), per round and their median:")
        for kind in ("mutations", "reads"):
            for c in args.clients:
                ratios = [a[0] / d[0] for a, d in zip(results["aotx", kind, c], results["front-of", kind, c])]
                print(f"  {kind:<10} {c:>4} clients: {middle(ratios):.2f} ({', '.join(f'{r:.2f}' for r in ratios)})")
    for name, lines in errors.items():
        for line in lines:
            print(f"{name} log: {line}")


if __name__ == "__main__":
    main()
