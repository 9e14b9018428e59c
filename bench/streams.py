"""Event streams against polling, in one run: how fast a saved event reaches 1,000 open streams,
what each open stream costs the gateway, and the CPU per delivered update, beside the same clients
polling for the same updates.

    .venv/bin/python bench/streams.py [--streams 1000] [--events 20] [--interval 0.5] [--poll 0.1]

Setup: tests.harness.Stack (the real device on a tiny runtime, the gateway as `manage.py serve`
runs it). One conversation in an instance space; a driver (an aotx_client Client) posts --events
inputs to it, one every --interval seconds; every client follows the conversation and records when
each input's event reaches it. Phases:

  stream, 1 gateway   --streams SSE connections (`?stream=true`) on one gateway process with the
                      embedded in-process channel layer;
  stream, 2 gateways  the same number split over two gateway processes on channels_redis (a real
                      redis-server), the driver posting through the first;
  poll                the same number of clients each GET-ing `.../events?cursor=<last seen>` every
                      --poll seconds (the read that returns the same updates), on one gateway.

Latency is from the moment the driver sends the input's POST to the moment a client has the event:
an upper bound on "from the device saving it", since it includes the mutation's own trip through
the gateway and the device. RSS per stream is the gateway's resident memory with every stream
open, less the same process's before they opened, over the number of streams. CPU per delivered
update is the gateway and device processes' CPU (user + system, /proc) over the phase, divided by
the updates the clients received (one per client and input). The clients are one uvloop process
with one HTTP/1.1 connection each (an asyncio protocol per stream, as bench/http.py's load), on the
same 2-core machine.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT  # not bench/: bench/http.py would shadow the standard library's http

import argparse  # noqa: E402
import asyncio  # noqa: E402
import gc  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import uvloop  # noqa: E402

from aotx_client import Client  # noqa: E402
from gpu_worker.pack import pack_tiny  # noqa: E402
from tests.conftest import PYTHON, free_port, wait_for  # noqa: E402
from tests.harness import Process, Stack  # noqa: E402

BASE = "/aotx/v1/shared"
REDIS_DB = 14


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


# ---- clients -----------------------------------------------------------------------------------

class Follower(asyncio.Protocol):
    """One SSE client: records (cursor, arrival time) of each event. A protocol, not a stream
    reader, under uvloop (as bench/http.py's clients): it scans each chunk for `id:` lines only,
    so the clients take as little of the shared CPU as they can."""

    def __init__(self, path, token, received, opened):
        self.request = (f"GET {path}?stream=true HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
                        f"Accept: text/event-stream\r\n\r\n").encode()
        self.marker = f"id: {path}@".encode()
        self.received = received
        self.opened = opened
        self.head = b""
        self.pending = b""
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport):
        self.transport = transport
        transport.write(self.request)

    def data_received(self, chunk):
        now = time.monotonic()
        if not self.opened.is_set():
            self.head += chunk
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            if b" 200 " not in self.head.split(b"\r\n", 1)[0]:
                self.closed.set_exception(RuntimeError(f"stream refused: {self.head[:200]!r}"))
                self.transport.close()
                return
            self.opened.set()
            chunk, self.head = self.head[end + 4:], b""
        marker, received = self.marker, self.received
        data = self.pending + chunk
        start = data.find(marker)
        while start >= 0:
            end = data.find(b"\n", start)
            if end < 0:
                break
            received.append((int(data[start + len(marker):end]), now))
            start = data.find(marker, end)
        self.pending = data[start:] if start >= 0 else data[-len(marker):]

    def connection_lost(self, exc):
        if not self.closed.done():
            self.closed.set_result(None)


async def follow(port, path, token, received, opened):
    """Follow the stream until cancelled (or the server closes it)."""
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_connection(lambda: Follower(path, token, received, opened),
                                                       "127.0.0.1", port)
    try:
        await protocol.closed
    finally:
        transport.close()


BUSY: list[int] = []  # polls the gateway answered 503 gateway_busy


async def poll(port, path, token, received, interval, stop):
    """One polling client: GETs the events after the last it saw, every `interval` seconds."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    cursor = 0
    try:
        while not stop.is_set():
            query = f"?cursor={cursor}" if cursor else ""
            writer.write(f"GET {path}{query} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n\r\n"
                         .encode())
            await writer.drain()
            length = 0
            status = await reader.readline()
            while (line := await reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            body = json.loads(await reader.readexactly(length))
            if b" 503 " in status and body["error"]["code"] == "gateway_busy":
                BUSY.append(1)  # the gateway's bound on requests waiting for the device: poll again later
                await asyncio.sleep(interval)
                continue
            if b" 200 " not in status:
                raise RuntimeError(f"poll refused: {status!r} {body}")
            now = time.monotonic()
            for event in body["items"]:
                received.append((int(event["cursor"]), now))
                cursor = int(event["cursor"])
            await asyncio.sleep(interval)
    finally:
        writer.close()


async def drive(post, events, interval):
    """Post the inputs; returns {cursor: time the POST was sent}."""
    sent = {}
    loop = asyncio.get_running_loop()
    for _ in range(events):
        t0 = time.monotonic()
        cursor = await loop.run_in_executor(None, post)
        sent[cursor] = t0
        await asyncio.sleep(interval)
    return sent


async def warm(ports, path, token):
    """One stream opened and closed on every gateway, so first-request imports and allocations are
    not counted as the streams' memory."""
    for port in ports:
        opened = asyncio.Event()
        task = asyncio.create_task(follow(port, path, token, [], opened))
        await asyncio.wait_for(opened.wait(), 60)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0.5)


async def run_phase(kind, ports, path, token, args, pids, post):
    # This process loaded torch (pack_tiny): a full collection of the cyclic GC then takes ~100 ms
    # and would stall every client at once. What exists now is kept out of its reach.
    gc.collect()
    gc.freeze()
    received = [[] for _ in range(args.streams)]
    await warm(ports, path, token)
    rss_before = {pid: rss_bytes(pid) for pid in pids["gateways"]}
    stop = asyncio.Event()
    tasks, opened = [], []
    for i in range(args.streams):
        port = ports[i % len(ports)]
        if kind == "poll":
            tasks.append(asyncio.create_task(poll(port, path, token, received[i], args.poll, stop)))
        else:
            event = asyncio.Event()
            opened.append(event)
            tasks.append(asyncio.create_task(follow(port, path, token, received[i], event)))
    if opened:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in opened)), 120)
        await asyncio.sleep(1.0)  # let the gateway settle before sampling its memory
    rss_open = {pid: rss_bytes(pid) for pid in pids["gateways"]}
    cpu_before = {pid: cpu_seconds(pid) for pid in pids["all"]}
    sent = await drive(post, args.events, args.interval)
    last = max(sent)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(any(c == last for c, _ in r) for r in received):
        await asyncio.sleep(0.05)
    cpu = sum(cpu_seconds(pid) - cpu_before[pid] for pid in pids["all"])
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    latencies, delivered = [], 0
    for r in received:
        seen = {}
        for cursor, at in r:
            if cursor in sent and cursor not in seen:
                seen[cursor] = at
        delivered += len(seen)
        latencies += [(at - sent[c]) * 1000 for c, at in seen.items()]
    expected = args.streams * len(sent)
    rss = sum(rss_open[pid] - rss_before[pid] for pid in pids["gateways"]) / args.streams
    return {"phase": kind, "delivered": delivered, "expected": expected, "p50_ms": percentile(latencies, 0.5),
            "p99_ms": percentile(latencies, 0.99), "rss_per_stream_kib": rss / 1024 if kind != "poll" else None,
            "cpu_us_per_update": cpu / max(delivered, 1) * 1e6}


def second_gateway(stack, base):
    config = base / "gateway-b.json"
    port = free_port()
    config.write_text(json.dumps({**json.loads(stack.config.read_text()), "listen": f"127.0.0.1:{port}"}))
    proc = Process([PYTHON, "manage.py", "serve", "--config", str(config)],
                   {**stack.env, "AOTX_GATEWAY_CONFIG": str(config)}, base / "gateway-b.log", cwd=Path(ROOT))
    other = Stack.__new__(Stack)
    other.__dict__.update(stack.__dict__)
    other.port, other.gateway = port, proc
    wait_for(other._listening, 60, what="the second gateway")
    return other


def setup(base, redis):
    base.mkdir(parents=True)
    runtime = base / "tiny.aotxccir"
    pack_tiny(str(runtime), shared=True)
    stack = Stack(base, str(runtime))
    if redis:
        subprocess.run(["redis-cli", "-n", str(REDIS_DB), "FLUSHDB"], check=True, capture_output=True)
        stack.env["REDIS_URL"] = f"redis://127.0.0.1:6379/{REDIS_DB}"
    # one principal opens every stream, as many clients would: its requests rate is not what is measured
    token = stack.principal("bench", quotas=("requests_per_second=unlimited",))
    stack.boot_device()
    stack.serve()
    # the driver is a client of the service: aotx_client assigns its sequences and retries exactly
    # through 503 (the pollers fill the gateway's bound on requests waiting for the device)
    driver = Client(f"http://127.0.0.1:{stack.port}", token, timeout=60)
    driver.register()
    space = driver.create_space("instance")["target"]
    conversation = driver.create_conversation(space)["target"]
    return stack, token, conversation, driver


def measure(base, args, redis):
    stack, token, conversation, driver = setup(base, redis)
    gateways = [stack]
    try:
        if redis:
            gateways.append(second_gateway(stack, base))
        path = f"{BASE}/conversations/{conversation}/events"
        posted = itertools.count(1)  # the conversation's inputs: their event cursors

        def post():
            driver.submit_input(conversation, "hi", "tiny-llama", max_output_tokens=1)
            return next(posted)

        pids = {"gateways": [g.gateway.proc.pid for g in gateways]}
        pids["all"] = pids["gateways"] + [stack.device.proc.pid]
        ports = [g.port for g in gateways]
        results = [uvloop.run(run_phase("stream", ports, path, token, args, pids, post))]
        if not redis:
            results.append(uvloop.run(run_phase("poll", ports, path, token, args, pids, post)))
        return results
    finally:
        driver.close()
        for g in gateways[1:]:
            g.gateway.kill()
        stack.stop()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--events", type=int, default=20)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--poll", type=float, default=0.1)
    args = parser.parse_args()
    (Path(ROOT) / "var").mkdir(exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-streams-", dir=Path(ROOT) / "var") as tmp:
        one = measure(Path(tmp) / "one", args, redis=False)
        two = measure(Path(tmp) / "two", args, redis=True)
    stream1, polled = one
    [stream2] = two
    stream1["phase"], stream2["phase"], polled["phase"] = "stream, 1 gateway", "stream, 2 gateways (Redis)", "poll"
    rows = [stream1, stream2, polled]
    print(f"{args.streams} clients, {args.events} inputs one every {args.interval} s; polling every {args.poll} s")
    print(f"{'phase':>28} {'delivered':>11} {'p50 ms':>8} {'p99 ms':>8} {'KiB/stream':>11} {'CPU us/update':>14}")
    for r in rows:
        kib = f"{r['rss_per_stream_kib']:.1f}" if r["rss_per_stream_kib"] is not None else "-"
        print(f"{r['phase']:>28} {r['delivered']:>5}/{r['expected']:<5} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} "
              f"{kib:>11} {r['cpu_us_per_update']:>14.0f}")
    print(f"polling CPU per update / streaming (1 gateway): {polled['cpu_us_per_update'] / stream1['cpu_us_per_update']:.1f}x")
    print(f"polls refused 503 gateway_busy (the gateway's bound on requests waiting for the device): {len(BUSY)}")


if __name__ == "__main__":
    main()
