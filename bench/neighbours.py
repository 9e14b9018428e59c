"""Hostile neighbours, in one run: a normal client's reads and mutations alone, then beside each
hostile pattern, on one stack.

    .venv/bin/python bench/neighbours.py [--seconds 8] [--only PATTERN,...] [--runtime F] [--default-principals]
                                         [--runs N]
    .venv/bin/python bench/neighbours.py --alone [--seconds 8] [--runs 3]

Setup: tests.harness.Stack — the real device on a tiny runtime packed with room for the run
(receipts, conversations, spaces), `manage.py serve` in front. Principals: `normal` (the measured
client: every quota and rate `unlimited`, as an operator would set a trusted client whose closed
loop makes ~800 requests a second, past any fair share) and one hostile
principal per pattern (`hostile-chat-prompts` has only `chat`, as in the attack), each under
HOSTILE_QUOTAS, as an operator would set an untrusted tenant; with --default-principals, as
`principal create` makes them without --quota: every quota and rate its default (docs/grants.md,
"Defaults").

The normal client (this process, one asyncio loop, an aotx_client AsyncClient each for reads and
mutations, so sequences and lineage are the SDK's; it counts refusals rather than retrying them) runs
a closed loop of `GET /participant` (read) and `POST /spaces/{spc}/conversations` then `POST
/conversations/{con}/deletion` of what it made (mutations, its own sequences) for --seconds per
phase, and posts one input a second
(`max_output_tokens` 8) whose terminal status it reads afterwards: an input "on time" ended
`succeeded`, not `deadline_exceeded`. After each phase it retires every receipt it made, so its
conversations and receipts never fill a table however long the run. A request of its that fails
(any refusal: it has no quotas) is counted, and enters the percentiles as never answered. The hostile load runs in another process
(`--hostile PATTERN`), started before the phase and killed after:

  bodies        4 connections at a time POST 1 GiB bodies with no token (zeros, as fast as the
                gateway takes them), one after another;
  chat-prompts  4 concurrent /v1/chat/completions with a 1 MB user message (a chat-only principal);
  long-history  a conversation built to 400 turns of 2 KB before the phase, then more turns;
  media         2 concurrent uploads of distinct 8 MiB media sources, one after another;
  chat-flood    16 concurrent streamed chats of 256 tokens;
  input-flood   30 inputs of 64 tokens kept queued by one participant;
  requests      16 connections in closed loops of `GET /participant`, as fast as they are answered
                (refusals included);
  slow          200 connections that send a request's headers one byte every 2 s.

--alone measures the other side of fairness (issue 53): a principal alone on the device, as
`principal create` makes it (every default), against one with every quota and rate unlimited, on
the same stack, in turns (--runs each; each principal goes first in every other run). Each turn,
on new conversations, has two phases of --seconds: ALONE_CONVERSATIONS closed loops of inputs
(submit, wait for the saved terminal; 32 output tokens), then ALONE_CHATS closed loops of chat
completions (64 tokens). Reported: inputs/s and output tokens/s of each, their ratio default /
unlimited (median and range over the runs), and refusals. Goal: at least 0.9 on both, no refusal.

Reported per phase: the normal client's read and mutation p50/p99 (ms) and their ratio to the
client alone just before that pattern (measured again before each pattern, after the previous one
drained: this machine's speed drifts by 1.3-1.5x over minutes), its inputs on time, and the
gateway's peak RSS over its RSS at the phase's start (all of the gateway's processes, /proc). Goal (issue "hostile neighbours"): p99 within 2x of alone,
every input on time, RSS within +100 MiB, and no failed request of the normal client (the verdict line).
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT  # not bench/: bench/http.py would shadow the standard library's http

import argparse  # noqa: E402
import asyncio  # noqa: E402
import gc  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import secrets  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402

from aotx_client import ApiError, AsyncClient, GaveUp  # noqa: E402

ALONE_CONVERSATIONS = 16  # more than the old defaults let a principal hold unfinished (3 on the embedded runtime)
ALONE_CHATS = 16
PATTERNS = ("bodies", "chat-prompts", "long-history", "media", "chat-flood", "input-flood", "requests", "slow")
CAPACITY = {"participants": 64, "spaces": 4096, "conversations": 65536, "members": 1024, "receipts": 65536}
MODEL = "tiny-llama"
# What an operator gives a tenant it does not trust (`principal create --quota`): two chats and
# four unfinished inputs at a time, 64 MiB of media, 1,024 receipts held; 20 requests, 2 MiB of
# request bodies and 20 output tokens a second.
HOSTILE_QUOTAS = ("chats=2", "queued_inputs=4", f"media_bytes={64 << 20}", "receipts=1024",
                  "requests_per_second=20", f"body_bytes_per_second={2 << 20}", "output_tokens_per_second=20")


# ---- the client side of the API ----------------------------------------------------------------
# Clients that follow the protocol are aotx_client's AsyncClient: sequences, lineage and the answers
# to 409 are the SDK's. retry_for=0: a refusal or a failed request is counted here, not waited out,
# so the table shows what the hostile load does to each request.

def sdk(port: int, token: str, timeout: float = 120) -> AsyncClient:
    return AsyncClient(f"http://127.0.0.1:{port}", token, timeout=timeout, retry_for=0)


async def conversation_of(aotx: AsyncClient) -> tuple[str, str]:
    await aotx.register()
    space = (await aotx.create_space())["target"]
    return space, (await aotx.create_conversation(space))["target"]


def failure(exc: Exception) -> str:
    """How a failed SDK call is counted: the refusal's status, else the kind of failure."""
    return str(exc.status) if isinstance(exc, ApiError) else type(exc).__name__


# ---- hostile patterns (run in their own process) -------------------------------------------------

async def hostile(pattern: str, port: int, token: str) -> None:
    url = f"http://127.0.0.1:{port}"
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        if pattern == "bodies":
            await asyncio.gather(*(_huge_bodies(port) for _ in range(4)))
        elif pattern == "chat-prompts":
            await asyncio.gather(*(_chats(client, token, "x " * 500_000, 8, stream=False) for _ in range(4)))
        elif pattern == "chat-flood":
            await asyncio.gather(*(_chats(client, token, "tell me a story", 256, stream=True) for _ in range(16)))
        elif pattern == "media":
            await asyncio.gather(*(_media(client, token) for _ in range(2)))
        elif pattern == "requests":
            await asyncio.gather(*(_requests(client, token) for _ in range(16)))
        elif pattern == "slow":
            await _slow(port, 200)
        else:
            async with sdk(port, token, timeout=600) as aotx:
                _, con = await conversation_of(aotx)

                async def submit(text: str, tokens: int) -> bool:
                    try:
                        await aotx.submit_input(con, text, MODEL, max_output_tokens=tokens)
                        return True
                    except (ApiError, GaveUp):  # refused (a quota, a full queue) or failed: go on
                        return False

                if pattern == "long-history":
                    for turn in range(400):
                        await submit(f"turn {turn} " + "y" * 2048, 1)
                    print("ready", flush=True)
                    while True:
                        await submit("and another " + "z" * 2048, 8)
                else:  # input-flood: keep submitting; the device queues what it admits
                    print("ready", flush=True)
                    while True:
                        if not await submit("flood", 64):
                            await asyncio.sleep(0.05)
    print("ready", flush=True)


async def _huge_bodies(port: int) -> None:
    chunk = bytes(1 << 20)
    while True:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /aotx/v1/shared/spaces HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (1 << 30))
            for _ in range(1024):
                writer.write(chunk)
                await asyncio.wait_for(writer.drain(), 30)
                if reader.at_eof() or len(reader._buffer) > 0:  # answered early: the point of the fix
                    break
            writer.close()
        except (OSError, asyncio.TimeoutError):
            await asyncio.sleep(0.05)


async def _chats(client: httpx.AsyncClient, token: str, content: str, tokens: int, stream: bool) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": tokens,
            "stream": stream}
    headers = {"Authorization": f"Bearer {token}"}
    while True:
        try:
            if stream:
                async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as reply:
                    async for _ in reply.aiter_bytes():
                        pass
            else:
                await client.post("/v1/chat/completions", json=body, headers=headers)
        except httpx.HTTPError:
            await asyncio.sleep(0.05)


async def _requests(client: httpx.AsyncClient, token: str) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    while True:
        try:
            await client.get("/aotx/v1/shared/participant", headers=headers)
        except httpx.HTTPError:
            await asyncio.sleep(0.05)


async def _media(client: httpx.AsyncClient, token: str) -> None:
    while True:
        data = secrets.token_bytes(8 << 20)
        try:
            await client.put(f"/aotx/v1/media/{hashlib.sha256(data).hexdigest()}", content=data,
                             headers={"Authorization": f"Bearer {token}", "Content-Type": "image/png"})
        except httpx.HTTPError:
            await asyncio.sleep(0.05)


async def _slow(port: int, count: int) -> None:
    request = b"GET /aotx/v1/shared/participant HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + b"a" * 4000
    writers = []
    for _ in range(count):
        try:
            writers.append((await asyncio.open_connection("127.0.0.1", port))[1])
        except OSError:
            await asyncio.sleep(0.01)
    print("ready", flush=True)
    position = 0
    while True:
        for w in list(writers):
            try:
                w.write(request[position % len(request):position % len(request) + 1])
            except OSError:
                writers.remove(w)
        position += 1
        await asyncio.sleep(2)


# ---- the measured client ---------------------------------------------------------------------------

def rss_bytes(root_pid: int) -> int:
    """Resident bytes of a process and its descendants."""
    total, pids, seen = 0, [root_pid], set()
    while pids:
        pid = pids.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                pids.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return total


FAILED = float("inf")  # a failed request's latency in the percentiles: it never got its answer


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def normal_setup(port: int, token: str) -> tuple[str, str]:
    """The normal client's space (its mutations add conversations to it) and the conversation its
    inputs go to, made before any phase."""
    async with sdk(port, token) as aotx:
        return await conversation_of(aotx)


async def normal_phase(port: int, token: str, seconds: float, gateway_pid: int, space: str, con: str) -> dict:
    async with sdk(port, token) as reads, sdk(port, token) as writes:
        while True:  # a stalled gateway may refuse even this: the phase then starts when it answers
            try:
                await writes.participant()
                break
            except (ApiError, GaveUp):
                await asyncio.sleep(0.5)
        start_rss = peak_rss = rss_bytes(gateway_pid)
        read_ms: list[float] = []
        write_ms: list[float] = []
        inputs: list[str] = []
        errors: dict[str, int] = {}
        end = time.monotonic() + seconds

        def count(what: str) -> None:
            errors[what] = errors.get(what, 0) + 1

        async def read_loop() -> None:
            while time.monotonic() < end:
                t = time.perf_counter()
                try:
                    await reads.participant()
                except (ApiError, GaveUp) as exc:
                    count(f"read {failure(exc)}")
                    read_ms.append(FAILED)
                    continue
                read_ms.append((time.perf_counter() - t) * 1e3)

        async def write(path: str) -> dict | None:
            t = time.perf_counter()
            try:
                receipt = await writes.mutate(path, {})
            except (ApiError, GaveUp) as exc:
                count(f"write {failure(exc)}")
                write_ms.append(FAILED)
                return None
            write_ms.append((time.perf_counter() - t) * 1e3)
            return receipt

        async def write_loop() -> None:
            next_input = time.monotonic()
            while time.monotonic() < end:
                if time.monotonic() >= next_input:
                    next_input += 1.0
                    try:
                        receipt = await writes.submit_input(con, "hello neighbour", MODEL, max_output_tokens=8)
                    except (ApiError, GaveUp) as exc:
                        count(f"input {failure(exc)}" + (f" {exc.code}" if isinstance(exc, ApiError) else ""))
                        continue
                    inputs.append(receipt["operation"])
                    continue
                # a conversation made, then deleted: the retirement after the phase gives its row
                # and both receipts back, so a long run never fills a table
                made = await write(f"/spaces/{space}/conversations")
                if made is not None:
                    await write(f"/conversations/{made['target']}/deletion")

        async def rss_loop() -> None:
            nonlocal peak_rss
            while time.monotonic() < end:
                peak_rss = max(peak_rss, rss_bytes(gateway_pid))
                await asyncio.sleep(0.2)

        await asyncio.gather(read_loop(), write_loop(), rss_loop())
        on_time, waited_until = 0, time.monotonic() + 120
        for op in inputs:  # terminal states, read after the phase
            status = None
            while time.monotonic() < waited_until:
                try:
                    terminal = (await reads.receipt(op)).get("terminal") or {}
                except ApiError as exc:
                    if exc.status == 504:  # past its execution deadline
                        status = "deadline_exceeded"
                        break
                    raise
                except GaveUp:
                    await asyncio.sleep(0.1)
                    continue
                if terminal.get("saved"):
                    status = terminal.get("status")
                    break
                await asyncio.sleep(0.1)
            on_time += status == "succeeded"
        try:  # every receipt of the phase retired (each is terminal now): the tables stay as they were
            await writes.retire(int((await writes.participant())["next_sequence"]))
        except (ApiError, GaveUp) as exc:
            count(f"retirement {failure(exc)}")
        return {"read": (pct(read_ms, 0.5), pct(read_ms, 0.99), len(read_ms)),
                "write": (pct(write_ms, 0.5), pct(write_ms, 0.99), len(write_ms)),
                "inputs": (on_time, len(inputs)), "rss_mib": (peak_rss - start_rss) / (1 << 20), "errors": errors}


# ---- a principal alone (--alone) ---------------------------------------------------------------------

async def alone_setup(port: int, token: str) -> list[str]:
    """New conversations for a turn (in a new space: its deletion is left to the tables' size)."""
    async with sdk(port, token) as aotx:
        await aotx.register()
        space = (await aotx.create_space())["target"]
        return [(await aotx.create_conversation(space))["target"] for _ in range(ALONE_CONVERSATIONS)]


async def alone_phase(port: int, token: str, seconds: float, conversations: list[str]) -> dict:
    """Inputs/s and their output tokens/s, then chat output tokens/s, of one principal alone."""
    errors: dict[str, int] = {}
    done = {"inputs": 0, "input_tokens": 0, "chat_tokens": 0}

    def count(what: str) -> None:
        errors[what] = errors.get(what, 0) + 1

    async with sdk(port, token, timeout=300) as aotx:
        end = time.monotonic() + seconds
        # one submission at a time: the participant's sequences reach the device in order (concurrent
        # ones would be refused future_sequence and retried by the SDK after a backoff); the waits
        # for their results overlap
        submitting = asyncio.Lock()

        async def inputs(con: str) -> None:
            while time.monotonic() < end:
                try:
                    async with submitting:
                        op = (await aotx.submit_input(con, "tell me more", MODEL, max_output_tokens=32))["operation"]
                    receipt = await aotx.wait(op)
                except (ApiError, GaveUp) as exc:
                    count(f"input {failure(exc)}" + (f" {exc.code}" if isinstance(exc, ApiError) else ""))
                    await asyncio.sleep(0.05)
                    continue
                if time.monotonic() <= end:
                    done["inputs"] += 1
                    done["input_tokens"] += int(receipt["result"]["output_tokens"])

        started = time.monotonic()
        await asyncio.gather(*(inputs(con) for con in conversations))
        input_seconds = time.monotonic() - started
        try:  # every receipt retired: the next turn starts from the same tables
            await aotx.retire(int((await aotx.participant())["next_sequence"]))
        except (ApiError, GaveUp) as exc:
            count(f"retirement {failure(exc)}")

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300, limits=limits) as client:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 64}
        headers = {"Authorization": f"Bearer {token}"}
        end = time.monotonic() + seconds

        async def chats() -> None:
            while time.monotonic() < end:
                reply = await client.post("/v1/chat/completions", json=body, headers=headers)
                if reply.status_code != 200:
                    count(f"chat {reply.status_code}")
                    await asyncio.sleep(0.05)
                elif time.monotonic() <= end:
                    done["chat_tokens"] += reply.json()["usage"]["completion_tokens"]

        started = time.monotonic()
        await asyncio.gather(*(chats() for _ in range(ALONE_CHATS)))
        chat_seconds = time.monotonic() - started
    return {"inputs_per_s": done["inputs"] / input_seconds, "input_tokens_per_s": done["input_tokens"] / input_seconds,
            "chat_tokens_per_s": done["chat_tokens"] / chat_seconds, "errors": errors}


def run_alone(args: argparse.Namespace) -> None:
    from gpu_worker.contract.grantfile import LIMITS
    from gpu_worker.pack import pack_tiny
    from tests.harness import Stack
    with tempfile.TemporaryDirectory(prefix="aotx-alone-") as tmp:
        runtime = Path(tmp) / "bench.aotxccir"
        if args.runtime:
            runtime.write_bytes(Path(args.runtime).read_bytes())
        else:
            pack_tiny(str(runtime), shared=True, capacity=CAPACITY)
        stack = Stack(tmp, str(runtime))
        actions = "shared_read,shared_write,shared_manage,chat"
        unlimited = [a for name in LIMITS for a in ("--quota", f"{name}=unlimited")]
        tokens = {"default": stack.manage("principal", "create", "default", "--actions", actions,
                                          "--config", str(stack.config)).stdout.strip().splitlines()[-1],
                  "unlimited": stack.manage("principal", "create", "unlimited", "--actions", actions, *unlimited,
                                            "--config", str(stack.config)).stdout.strip().splitlines()[-1]}
        stack.boot_device()
        stack.serve()
        try:
            gc.collect()
            gc.freeze()
            turns: dict[str, list[dict]] = {"default": [], "unlimited": []}
            for run in range(args.runs):
                # in turns, each going first every other run; each turn on new conversations (made
                # before it is timed), so that no turn inherits a longer history than the other's
                for name in ("default", "unlimited") if run % 2 == 0 else ("unlimited", "default"):
                    conversations = asyncio.run(alone_setup(stack.port, tokens[name]))
                    time.sleep(3)  # past the other principal's active window (engine/shares.py): alone
                    turns[name].append(asyncio.run(alone_phase(stack.port, tokens[name], args.seconds,
                                                               conversations)))
                    r = turns[name][-1]
                    print(f"run {run + 1} {name:<9} inputs/s {r['inputs_per_s']:7.1f}  input tokens/s "
                          f"{r['input_tokens_per_s']:8.1f}  chat tokens/s {r['chat_tokens_per_s']:8.1f}  "
                          f"{json.dumps(r['errors']) if r['errors'] else ''}", flush=True)
        finally:
            stack.stop()
    print(f"a principal alone, {args.seconds:.0f} s a phase, {args.runs} runs in turns; {ALONE_CONVERSATIONS} "
          f"conversations of inputs (32 tokens), then {ALONE_CHATS} concurrent chats (64 tokens)")
    print(f"{'measure':<20} {'default':>10} {'unlimited':>10} {'ratio median':>13} {'range':>14}")
    met = True
    for key, label in (("inputs_per_s", "inputs/s"), ("input_tokens_per_s", "input tokens/s"),
                       ("chat_tokens_per_s", "chat tokens/s")):
        ratios = sorted(d[key] / u[key] if u[key] else float("nan")
                        for d, u in zip(turns["default"], turns["unlimited"]))
        median = ratios[len(ratios) // 2]
        met = met and median >= 0.9
        print(f"{label:<20} {pct([d[key] for d in turns['default']], 0.5):>10.1f} "
              f"{pct([u[key] for u in turns['unlimited']], 0.5):>10.1f} {median:>12.2f}x "
              f"{f'{ratios[0]:.2f}-{ratios[-1]:.2f}':>14}")
    refusals = sum(sum(r["errors"].values()) for rows in turns.values() for r in rows)
    print(f"verdict: {'met' if met and not refusals else 'NOT met'} — a default principal alone at >= 0.9 of an "
          f"unlimited one (median); refusals and failures: {refusals}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--only", default=",".join(PATTERNS))
    parser.add_argument("--runtime", help="a shared runtime file to copy (default: a tiny one packed here)")
    parser.add_argument("--default-principals", "--no-quotas", dest="default_principals", action="store_true",
                        help="hostile principals created without --quota: every quota and rate its default "
                             "(--no-quotas: the earlier name, when leaving them out meant unlimited)")
    parser.add_argument("--background-nice", type=int, help="the device's boot --background-nice (default: boot's)")
    parser.add_argument("--alone", action="store_true",
                        help="a default principal alone against an unlimited one (no hostile patterns)")
    parser.add_argument("--runs", type=int, default=None,
                        help="rounds of every pattern (default 1), or with --alone turns of each principal (3)")
    parser.add_argument("--hostile", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--token", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hostile:
        asyncio.run(hostile(args.hostile, args.port, args.token))
        return
    if args.alone:
        args.runs = args.runs or 3
        run_alone(args)
        return
    args.runs = args.runs or 1

    from gpu_worker.contract.grantfile import LIMITS
    from gpu_worker.pack import pack_tiny
    from tests.conftest import PYTHON, wait_for
    from tests.harness import Stack
    patterns = [p for p in args.only.split(",") if p]
    unknown = set(patterns) - set(PATTERNS)
    if unknown:
        sys.exit(f"unknown pattern(s) {', '.join(sorted(unknown))}; known: {', '.join(PATTERNS)}")
    with tempfile.TemporaryDirectory(prefix="aotx-neighbours-") as tmp:
        runtime = Path(tmp) / "bench.aotxccir"
        if args.runtime:
            runtime.write_bytes(Path(args.runtime).read_bytes())
        else:
            pack_tiny(str(runtime), shared=True, capacity=CAPACITY)
        stack = Stack(tmp, str(runtime))
        unlimited = [a for name in LIMITS for a in ("--quota", f"{name}=unlimited")]
        normal = stack.manage("principal", "create", "normal", "--actions",
                              "shared_read,shared_write,shared_manage,chat", *unlimited,
                              "--config", str(stack.config)).stdout.strip().splitlines()[-1]
        tokens = {}
        for p in patterns:  # each hostile principal under an operator's quotas (--default-principals: the defaults)
            actions = "chat" if p == "chat-prompts" else "shared_read,shared_write,shared_manage,chat"
            quota_args = [] if args.default_principals else [a for q in HOSTILE_QUOTAS for a in ("--quota", q)]
            out = stack.manage("principal", "create", f"hostile-{p}", "--actions", actions, *quota_args,
                               "--config", str(stack.config))
            tokens[p] = out.stdout.strip().splitlines()[-1]
        stack.boot_device(*(["--background-nice", str(args.background_nice)] if args.background_nice is not None
                            else []))
        stack.serve()
        pid = stack.gateway.proc.pid
        space, con = asyncio.run(normal_setup(stack.port, normal))
        # this process loaded torch (pack_tiny): a full collection of the cyclic GC would then stall
        # the measured client ~100 ms; what exists now is kept out of its reach
        gc.collect()
        gc.freeze()
        runs: list[list[tuple[str, dict, dict]]] = []
        try:
            for _ in range(args.runs):
                first = asyncio.run(normal_phase(stack.port, normal, args.seconds, pid, space, con))
                rows = [("alone", first, first)]
                runs.append(rows)
                for number, pattern in enumerate(patterns):
                    # the client alone again just before each pattern (after the drain): its ratio is to
                    # that phase, a minute from it at most, not to one the machine's drift left behind
                    alone = first if number == 0 else asyncio.run(normal_phase(stack.port, normal, args.seconds,
                                                                                pid, space, con))
                    log = open(Path(tmp) / f"hostile-{pattern}.log", "w+")
                    proc = subprocess.Popen([PYTHON, __file__, "--hostile", pattern, "--port", str(stack.port),
                                             "--token", tokens[pattern]], stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, cwd=ROOT)
                    if pattern in ("long-history", "input-flood", "slow"):
                        wait_for(lambda: "ready" in Path(log.name).read_text() or proc.poll() is not None, 900,
                                 what=f"{pattern} ready")
                    else:
                        time.sleep(2)  # the load is on before measuring
                    rows.append((pattern, asyncio.run(normal_phase(stack.port, normal, args.seconds, pid, space,
                                                                   con)), alone))
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    if proc.returncode not in (-signal.SIGKILL, 0):
                        print(f"{pattern}: the hostile process failed:\n{Path(log.name).read_text()[-2000:]}")
                    time.sleep(2)  # let the gateway and device drain what the hostile process left
                print_run(rows, args)
        finally:
            stack.stop()
    if len(runs) > 1:
        print(f"{len(runs)} runs: the normal client's p99 as a ratio to alone just before, median (range)")
        print(f"{'phase':<14} {'read p99 x':>20} {'write p99 x':>20}")
        for i, (name, _, _) in enumerate(runs[0][1:], start=1):
            ratios = [(r[i][1]["read"][1] / r[i][2]["read"][1], r[i][1]["write"][1] / r[i][2]["write"][1])
                      for r in runs]
            reads, writes = sorted(x for x, _ in ratios), sorted(y for _, y in ratios)
            print(f"{name:<14} {f'{reads[len(reads) // 2]:.2f} ({reads[0]:.2f}-{reads[-1]:.2f})':>20} "
                  f"{f'{writes[len(writes) // 2]:.2f} ({writes[0]:.2f}-{writes[-1]:.2f})':>20}")


def print_run(rows: list[tuple[str, dict, dict]], args: argparse.Namespace) -> None:
    print(f"normal client beside each pattern, {args.seconds:.0f} s a phase; ms; ratio to the client alone just "
          f"before the pattern (its p99s under 'alone before'); hostile principals: "
          f"{'default principals' if args.default_principals else 'HOSTILE_QUOTAS'}")
    print(f"{'phase':<14} {'read p50':>9} {'read p99':>9} {'x':>6} {'write p50':>10} {'write p99':>10} {'x':>6}"
          f" {'alone before':>13} {'inputs ok':>10} {'RSS +MiB':>9}  errors")
    for name, r, alone in rows:
        (r50, r99, _), (w50, w99, _) = r["read"], r["write"]
        a99, b99 = alone["read"][1], alone["write"][1]
        ok, total = r["inputs"]
        print(f"{name:<14} {r50:>9.1f} {r99:>9.1f} {r99 / a99:>5.2f}x {w50:>10.1f} {w99:>10.1f} {w99 / b99:>5.2f}x"
              f" {f'{a99:.1f} / {b99:.1f}':>13} {ok:>5}/{total:<4} {r['rss_mib']:>9.1f}  "
              f"{json.dumps(r['errors']) if r['errors'] else ''}")
    failures = sum(sum(r["errors"].values()) for _, r, _ in rows)
    late = [name for name, r, alone in rows[1:] if r["read"][1] > 2 * alone["read"][1]
            or r["write"][1] > 2 * alone["write"][1] or r["inputs"][0] < r["inputs"][1] or r["rss_mib"] > 100]
    print(f"verdict: {'met' if not late and not failures else 'NOT met'} — patterns past 2x of alone, an input "
          f"late or RSS past +100 MiB: {', '.join(late) or 'none'}; failed requests of the normal client: {failures} "
          f"(each counted in its percentiles as never answered)", flush=True)


if __name__ == "__main__":
    main()
