"""The soak: the whole stack under a mixed load for a long while, with the machine kept busy beside
it, then many fresh boots of the case that once stalled the device (issue 35). Loopback only,
bounded in time.

    .venv/bin/python bench/soak.py [--minutes 20] [--boots 50] [--clients 4] [--runtime F] [--no-load]
                                   [--only soak|boots]

Setup: tests.harness.Stack on a copy of the runtime file (default: var/identity.aotxccir, the default
model, when `make setup` made it; else a tiny random-weight runtime packed here), device on the CPU,
`manage.py serve` in front.

Beside it, unless --no-load: a loop of `dd if=/dev/urandom of=F bs=1M count=300 conv=fdatasync`
(disk and fdatasync pressure on the journal's file system) and one process spinning a core.

The soak (--minutes): --clients asyncio clients, each its own principal created without --quota
(the fair-share defaults), its own space and conversation, in closed loops picking at random:
mutations (create a conversation and delete it), inputs (8 output tokens, waited for), an input
cancelled while it runs, retirements (to the highest floor below which every receipt is terminal),
reads (participant, receipts, results, events, memory, capabilities), an SSE stream of the
conversation's events (read, then closed) and of an input's output, and chats (streamed and not).
Every HTTP answer is counted by status through the client's transport; a request with no answer
within 120 s, or a connection that failed, is counted apart. At the end the device is killed (-9)
and booted again, and every receipt a client saw saved (and did not retire) is read back: its
admission save and its terminal save must be the same.

The boots (--boots): each a fresh runtime copy, journal, gateway database, device and gateway; one
principal registers, makes a space and a conversation, submits three inputs of 8 output tokens and
polls `GET /operations/{op}` until all three are terminal. A boot whose inputs are not all terminal
within 120 s is a hang (its device log is kept and named).

Prints one table; exits 1 when any goal is missed: 0 requests without an answer, 0 5xx, 0 device
timeouts, every saved receipt readable at the end, 0 hangs.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT  # not bench/: bench/http.py would shadow the standard library's http

import argparse  # noqa: E402
import asyncio  # noqa: E402
import collections  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402

from aotx_client import ApiError, AsyncClient, GaveUp  # noqa: E402

REQUEST_SECONDS = 120.0   # a request not answered within this is one "without an answer"
BOOT_SECONDS = 120.0      # a boot whose three inputs are not terminal within this is a hang
START_SECONDS = 600       # a device start beside the load (a 360 MB file copied, a model loaded) may take minutes
TERMINAL = ("succeeded", "failed", "cancelled", "interrupted", "deadline_exceeded")
ACTIONS = (("mutation", 3), ("input", 3), ("cancel", 1), ("retire", 1), ("read", 6), ("events", 1),
           ("output", 1), ("chat", 1), ("chat-stream", 1))


class Counts:
    """Every answer by status, and the requests that got none, across all clients."""

    def __init__(self) -> None:
        self.status: collections.Counter[int] = collections.Counter()
        self.unanswered: collections.Counter[str] = collections.Counter()
        self.device_timeouts = 0
        self.actions: collections.Counter[str] = collections.Counter()
        self.failures: collections.Counter[str] = collections.Counter()  # an action's unexpected error


class CountingTransport(httpx.AsyncBaseTransport):
    """Counts every response's status (and every 503 device_timeout) before the SDK sees it."""

    def __init__(self, counts: Counts) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.counts = counts

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            response = await self.inner.handle_async_request(request)
        except httpx.TimeoutException:
            self.counts.unanswered["timeout"] += 1
            raise
        except httpx.TransportError as exc:
            self.counts.unanswered[type(exc).__name__] += 1
            raise
        self.counts.status[response.status_code] += 1
        if response.status_code == 503:
            body = await response.aread()
            if b"device_timeout" in body:
                self.counts.device_timeouts += 1
            return httpx.Response(503, headers=response.headers, content=body, request=request)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


def client(port: int, token: str, counts: Counts) -> AsyncClient:
    return AsyncClient(f"http://127.0.0.1:{port}", token, timeout=REQUEST_SECONDS, retry_for=60,
                       transport=CountingTransport(counts))


# ---- the load beside ---------------------------------------------------------------------------

def start_load(directory: Path) -> list[subprocess.Popen[bytes]]:
    """fdatasync pressure (dd) and one spinning core, each in a process group of its own."""
    dd = (f"while true; do dd if=/dev/urandom of={directory / 'dd.bin'} bs=1M count=300 conv=fdatasync "
          "status=none; done")
    return [subprocess.Popen(["bash", "-c", dd], start_new_session=True),
            subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)]


def stop_load(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)


# ---- the soak's clients -----------------------------------------------------------------------

class Worker:
    def __init__(self, number: int, port: int, token: str, counts: Counts, model: str, rng: random.Random) -> None:
        self.number, self.port, self.token, self.counts, self.model, self.rng = number, port, token, counts, model, rng
        self.aotx = client(port, token, counts)
        self.space = self.con = ""
        self.ops: dict[int, str] = {}          # sequence -> operation, every receipt this client got
        self.inputs: set[str] = set()          # the operations of its inputs (they have results)
        self.saved: dict[str, dict[str, Any]] = {}  # operation -> its receipt once terminal and saved
        self.floor = 1

    async def setup(self) -> None:
        await self.aotx.register()
        self.space = (await self.aotx.create_space())["target"]
        self.con = (await self.aotx.create_conversation(self.space))["target"]
        await self.do_input()  # the conversation has an event for the event streams to read

    def note(self, receipt: dict[str, Any]) -> None:
        self.ops[int(receipt["sequence"])] = receipt["operation"]
        if receipt["terminal"]["saved"]:
            self.saved[receipt["operation"]] = receipt

    async def run(self, until: float) -> None:
        names = [name for name, _ in ACTIONS]
        weights = [weight for _, weight in ACTIONS]
        while time.monotonic() < until:
            action = self.rng.choices(names, weights)[0]
            self.counts.actions[action] += 1
            try:
                await asyncio.wait_for(getattr(self, "do_" + action.replace("-", "_"))(), REQUEST_SECONDS * 3)
            except ApiError as exc:
                if exc.status >= 500 or exc.status in (400, 404, 409, 410):  # the soak never sends these on purpose
                    self.counts.failures[f"{action}: {exc.status} {exc.code}"] += 1
            except (GaveUp, asyncio.TimeoutError) as exc:
                key = f"{action}: {type(exc).__name__}"
                if not self.counts.failures[key]:
                    import traceback
                    print(f"client {self.number}: {key}\n{traceback.format_exc()}", flush=True)
                self.counts.failures[key] += 1

    async def do_mutation(self) -> None:
        made = await self.aotx.create_conversation(self.space)
        self.note(made)
        self.note(await self.aotx.mutate(f"/conversations/{made['target']}/deletion", {}))

    async def _input(self, tokens: int) -> dict[str, Any]:
        receipt = await self.aotx.submit_input(self.con, f"soak {self.rng.random():.6f}: say something", self.model,
                                               max_output_tokens=tokens)
        self.inputs.add(receipt["operation"])
        self.note(receipt)
        return receipt

    async def do_input(self) -> None:
        receipt = await self._input(8)
        self.note(await self.aotx.wait(receipt["operation"], timeout=REQUEST_SECONDS))

    async def do_cancel(self) -> None:
        receipt = await self._input(64)
        self.note(await self.aotx.cancel(int(receipt["sequence"])))
        self.note(await self.aotx.wait(receipt["operation"], timeout=REQUEST_SECONDS))

    async def do_retire(self) -> None:
        """Retire up to the first receipt not yet known terminal and saved (checked now)."""
        floor = self.floor
        for sequence in sorted(s for s in self.ops if s >= floor):
            op = self.ops[sequence]
            if op not in self.saved:
                receipt = await self.aotx.receipt(op)
                if not receipt["terminal"]["saved"]:
                    break
                self.note(receipt)
            floor = sequence + 1
        if floor > self.floor:
            self.note(await self.aotx.retire(floor))
            for sequence in [s for s in self.ops if s < floor]:
                op = self.ops.pop(sequence)
                self.saved.pop(op, None)
                self.inputs.discard(op)
            self.floor = floor

    async def do_read(self) -> None:
        pick = self.rng.randrange(6)
        if pick == 0:
            await self.aotx.participant()
        elif pick == 1:
            await self.aotx.get("/operations", limit="20")
        elif pick == 2 and self.saved:
            op = self.rng.choice(list(self.saved))
            await self.aotx.receipt(op)
            if op in self.inputs:
                await self.aotx.result(op)
        elif pick == 3:
            await self.aotx.get(f"/conversations/{self.con}/events", limit="20")
        elif pick == 4:
            await self.aotx.get(f"/spaces/{self.space}/memory", limit="20")
        else:
            await self.aotx.capabilities()

    async def do_events(self) -> None:
        """An input, then the conversation's event stream until its event (retirements may have
        retired every earlier one), then closed."""
        receipt = await self._input(8)
        async for event in self.aotx.events(self.con):
            if isinstance(event.data, dict) and event.data.get("operation") == receipt["operation"]:
                break
        self.note(await self.aotx.wait(receipt["operation"], timeout=REQUEST_SECONDS))

    async def do_output(self) -> None:
        receipt = await self._input(8)
        async for event in self.aotx.output(receipt["operation"]):
            pass
        self.note(await self.aotx.wait(receipt["operation"], timeout=REQUEST_SECONDS))

    async def _chat(self, stream: bool) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": "say hello"}], "max_tokens": 8,
                "stream": stream}
        headers = {"Authorization": f"Bearer {self.token}"}
        http = self.aotx.http
        if stream:
            async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as reply:
                async for _ in reply.aiter_bytes():
                    pass
        else:
            await http.post("/v1/chat/completions", json=body, headers=headers)

    async def do_chat(self) -> None:
        await self._chat(False)

    async def do_chat_stream(self) -> None:
        await self._chat(True)


async def soak_clients(port: int, tokens: list[str], counts: Counts, model: str, seconds: float,
                       seed: int) -> list[Worker]:
    workers = [Worker(i, port, token, counts, model, random.Random(seed + i)) for i, token in enumerate(tokens)]
    try:
        await asyncio.gather(*(w.setup() for w in workers))
        until = time.monotonic() + seconds
        await asyncio.gather(*(w.run(until) for w in workers))
    finally:
        for w in workers:  # (each client lives on this loop: closed here)
            await w.aotx.close()
    return workers


async def read_back(port: int, workers: list[Worker], counts: Counts) -> tuple[int, list[str]]:
    """Every receipt seen saved and not retired, read again: the same admission and terminal saves."""
    checked, wrong = 0, []
    for w in workers:
        aotx = client(port, w.token, counts)
        try:
            for op, seen in w.saved.items():
                now = await aotx.receipt(op)
                checked += 1
                if now["admission"] != seen["admission"] or now["terminal"] != seen["terminal"]:
                    wrong.append(op)
        finally:
            await aotx.close()
    return checked, wrong


def run_soak(args: argparse.Namespace, runtime: Path, model: str, base: Path) -> dict[str, Any]:
    from tests.harness import Stack
    base.mkdir()
    copy = base / runtime.name
    shutil.copyfile(runtime, copy)  # the boots start from the file as it was, not as the soak left it
    stack = Stack(base, str(copy))
    stack.ready_seconds = START_SECONDS
    tokens = [stack.principal(f"soak-{i}") for i in range(args.clients)]
    stack.boot_device()
    stack.serve()
    counts = Counts()
    try:
        workers = asyncio.run(soak_clients(stack.port, tokens, counts, model, args.minutes * 60, args.seed))
        stack.device.kill()           # a crash: what was reported saved must survive it
        stack.boot_device()
        checked, wrong = asyncio.run(read_back(stack.port, workers, counts))
    finally:
        stack.stop()
    return {"counts": counts, "checked": checked, "wrong": wrong}


# ---- the boots --------------------------------------------------------------------------------

async def three_inputs(port: int, token: str, model: str, counts: Counts) -> bool:
    """Register, a space, a conversation, three inputs of 8 tokens; True once all three are terminal."""
    aotx = client(port, token, counts)
    try:
        await aotx.register()
        space = (await aotx.create_space())["target"]
        con = (await aotx.create_conversation(space))["target"]
        ops = [(await aotx.submit_input(con, f"input {n}: hello", model, max_output_tokens=8))["operation"]
               for n in range(3)]
        deadline = time.monotonic() + BOOT_SECONDS
        while time.monotonic() < deadline:
            receipts = [await aotx.receipt(op) for op in ops]
            if all(r["terminal"]["saved"] and r["terminal"]["status"] in TERMINAL for r in receipts):
                return True
            await asyncio.sleep(0.1)  # polling, as the client of the report did
        return False
    finally:
        await aotx.close()


def run_boots(args: argparse.Namespace, runtime: Path, model: str, base: Path) -> dict[str, Any]:
    from tests.harness import Stack
    counts = Counts()
    hangs: list[str] = []     # booted, and the three inputs not all terminal in BOOT_SECONDS
    no_start: list[str] = []  # the device or gateway not ready in START_SECONDS (or exited)
    seconds = []
    for n in range(args.boots):
        directory = base / f"boot-{n}"
        directory.mkdir()
        copy = directory / runtime.name
        shutil.copyfile(runtime, copy)
        stack = Stack(directory, str(copy))
        stack.ready_seconds = START_SECONDS
        token = stack.principal("boot")
        started = time.monotonic()
        outcome = "ok"
        try:
            try:
                stack.boot_device()
                stack.serve()
            except (AssertionError, RuntimeError) as exc:  # not ready in START_SECONDS, or exited
                outcome = "NO START"
                print(f"boot {n + 1}: {exc}", flush=True)
            else:
                if not asyncio.run(asyncio.wait_for(three_inputs(stack.port, token, model, counts),
                                                    BOOT_SECONDS + 60)):
                    outcome = "HANG"
        except (asyncio.TimeoutError, ApiError, GaveUp) as exc:
            outcome = "HANG"
            print(f"boot {n + 1}: {type(exc).__name__}: {exc}", flush=True)
        finally:
            stack.stop()
        seconds.append(time.monotonic() - started)
        if outcome == "ok":
            shutil.rmtree(directory, ignore_errors=True)
        else:
            kept = Path(tempfile.gettempdir()) / f"aotx-soak-{outcome.replace(' ', '-').lower()}-{n + 1}-device.log"
            shutil.copyfile(directory / "device.log", kept)
            (hangs if outcome == "HANG" else no_start).append(str(kept))
        print(f"boot {n + 1}/{args.boots}: {outcome} in {seconds[-1]:.1f} s", flush=True)
    return {"counts": counts, "hangs": hangs, "no_start": no_start, "seconds": seconds}


# ---- report -----------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--boots", type=int, default=50)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--runtime", help="the runtime file to copy (default: var/identity.aotxccir, else a tiny one)")
    parser.add_argument("--no-load", action="store_true", help="no dd and CPU load beside the stack")
    parser.add_argument("--only", choices=("soak", "boots"))
    parser.add_argument("--seed", type=int, default=35)
    args = parser.parse_args()

    from gpu_worker.pack import pack_tiny
    from gpu_worker.storage.runtime_file import RuntimeFile

    with tempfile.TemporaryDirectory(prefix="aotx-soak-") as tmp:
        base = Path(tmp)
        default = Path(ROOT) / "var" / "identity.aotxccir"
        runtime = base / "soak.aotxccir"
        if args.runtime or default.exists():
            shutil.copyfile(args.runtime or default, runtime)
        else:
            pack_tiny(str(runtime), shared=True)
        model = RuntimeFile.open(str(runtime)).json("gen/card")["name"]
        load = [] if args.no_load else start_load(base)
        started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        print(f"soak of {started}: model {model}, "
              f"{'no load beside' if args.no_load else 'dd fdatasync loop + a spinning core beside'}", flush=True)
        missed = []
        try:
            if args.only != "boots":
                if not report_soak(args, run_soak(args, runtime, model, base / "soak")):
                    missed.append("soak")
            if args.only != "soak":
                if not report_boots(args, run_boots(args, runtime, model, base)):
                    missed.append("boots")
        finally:
            stop_load(load)
    print("goals: " + ("met" if not missed else f"MISSED ({', '.join(missed)})"))
    return 1 if missed else 0


def report_soak(args: argparse.Namespace, soak: dict[str, Any]) -> bool:
    """Prints the soak's lines (as soon as it ends: the boots take long); True when its goals are met."""
    c: Counts = soak["counts"]
    fives = sum(n for status, n in c.status.items() if status >= 500)
    print(f"{args.minutes:g} min, {args.clients} clients: {sum(c.actions.values())} actions "
          f"({', '.join(f'{k} {v}' for k, v in sorted(c.actions.items()))})")
    print(f"  answers by status: {dict(sorted(c.status.items()))}")
    print(f"  without an answer: {sum(c.unanswered.values())} {dict(c.unanswered) or ''}; 5xx: {fives}; "
          f"device timeouts: {c.device_timeouts}")
    print(f"  saved receipts read back after a kill -9 and a boot: {soak['checked']}, differing: "
          f"{len(soak['wrong'])}; unexpected action errors: {dict(c.failures) or 0}", flush=True)
    return not (sum(c.unanswered.values()) or fives or c.device_timeouts or soak["wrong"] or c.failures)


def report_boots(args: argparse.Namespace, boots: dict[str, Any]) -> bool:
    secs = sorted(boots["seconds"])
    print(f"{args.boots} fresh boots of three inputs: {args.boots - len(boots['hangs']) - len(boots['no_start'])} ok, "
          f"{len(boots['hangs'])} hangs {boots['hangs'] or ''}, {len(boots['no_start'])} not started in "
          f"{START_SECONDS} s {boots['no_start'] or ''}; a boot took {secs[len(secs) // 2]:.1f} s (median), "
          f"{secs[-1]:.1f} s (max); answers by status {dict(sorted(boots['counts'].status.items()))}", flush=True)
    return not (boots["hangs"] or boots["no_start"] or sum(boots["counts"].unanswered.values()))


if __name__ == "__main__":
    sys.exit(main())
