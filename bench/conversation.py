"""Conversation turns with and without KV prefix reuse, beside llama.cpp's llama-server, in one run:

    .venv/bin/python bench/conversation.py [--turns 10] [--conversations 1,8] [--new-tokens 32]
                                           [--llama-server PATH]

A conversation of --turns turns on the CPU with the real model (SmolLM2-135M-Instruct from the
default runtime file, var/identity.aotxccir: `make run` builds it): each turn appends a ~50-token
user message to the history (and the previous answer) and generates exactly --new-tokens tokens
greedily. The same token ids go to three systems, turn by turn:

- reuse: the engine with its prefix cache (gpu_worker/engine/block_manager.py): turn k prefills
  only what is not in cached full pages of turn k-1;
- cold: the same engine with `prefix_cache=False`, which prefills the whole history every turn;
- product: the service itself (gateway and device, booted on the same runtime file): each turn an
  input POSTed to the conversation and its output read from the operation's event stream, as a
  client of the API would (the device builds the prompt from the conversation's history, with its
  template and memory context `plain`, so its prompt is the history plus what memory recall adds,
  and it stops at the end-of-sequence token: the run prints the output token counts);
- llama-server (when --llama-server names a binary: built from the llama-cpp-python sdist's
  vendored source, see docs/performance.md), on the same GGUF, 2 threads, its own prompt cache
  (`cache_prompt`), one slot per conversation, token ids sent as the prompt, streamed.

The in-process columns show the engine without any transport; the comparison with llama-server
is the product columns' (llama-server gets the engine's chat-template prompts of the same
messages, without recalled memory: no more work than the product does).

With --conversations 8 the eight conversations' turn k are submitted together (the engine batches
them; llama-server gets them concurrently). Reported per turn: time to first token (mean over the
conversations) and time to the last token, in ms; then turn 10's ratios. The engine's greedy tokens
with reuse are checked equal to its cold tokens."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)  # not bench/: bench/http.py would shadow the standard library http

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402

from bench.build_info import describe  # noqa: E402
from gpu_worker import pack  # noqa: E402
from gpu_worker.engine import Engine  # noqa: E402
from gpu_worker.storage.runtime_file import RuntimeFile  # noqa: E402

WORDS = ("the shared memory of a space keeps what members wrote and recalls it when a new question "
         "arrives so that the answer can use the earlier facts about the meeting the budget and the plan").split()


def user_message(turn: int) -> str:
    words = [WORDS[(turn * 7 + i) % len(WORDS)] for i in range(40)]
    return f"Turn {turn}: " + " ".join(words) + "?"


def engine_turns(engine: Engine, conversations: int, turns: int, new_tokens: int) -> tuple[list, list]:
    """Per turn: (mean time to first token, time to last token) in ms; and every turn's token ids."""
    histories = [[] for _ in range(conversations)]
    timings, outputs = [], []
    for turn in range(turns):
        prompts = []
        for c, messages in enumerate(histories):
            messages.append({"role": "user", "content": user_message(turn + c)})
            prompts.append(engine.tokenizer.encode_chat(messages))
        started = time.perf_counter()
        seqs = [engine.submit(f"c{c}-t{turn}", p, max_new_tokens=new_tokens, ignore_eos=True, tenant=c)
                for c, p in enumerate(prompts)]
        first: dict[int, float] = {}
        while engine.has_work:
            for request_id, *_ in engine.step():
                first.setdefault(id(engine_seq(seqs, request_id)), time.perf_counter())
        done = time.perf_counter()
        timings.append((sum(first[id(s)] - started for s in seqs) / len(seqs) * 1000, (done - started) * 1000))
        outputs.append([s.output_ids for s in seqs])
        for messages, seq in zip(histories, seqs):
            messages.append({"role": "assistant", "content": engine.tokenizer.decode(seq.output_ids)})
    return timings, outputs


def engine_seq(seqs, request_id):
    return next(s for s in seqs if s.request_id == request_id)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_turns(port: int, histories_prompts: list, new_tokens: int, conversations: int) -> list:
    """Per turn: (mean time to first token, time to last token) in ms, every conversation's turn
    sent at once to the server on `port` as llama-server's /completion takes it (token ids, greedy,
    streamed: one server-sent event per token), each on a connection of its own."""
    timings = []
    for turn_prompts in histories_prompts:
        firsts, counts, threads = [None] * conversations, [0] * conversations, []
        started = time.perf_counter()

        def run(c: int, prompt: list) -> None:
            body = json.dumps({"prompt": prompt, "n_predict": new_tokens, "temperature": 0, "ignore_eos": True,
                               "cache_prompt": True, "stream": True, "id_slot": c}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as response:
                for line in response:
                    if line.startswith(b"data: "):
                        if firsts[c] is None:
                            firsts[c] = time.perf_counter()
                        counts[c] += 1
        for c, prompt in enumerate(turn_prompts):
            threads.append(threading.Thread(target=run, args=(c, prompt)))
            threads[-1].start()
        for t in threads:
            t.join()
        done = time.perf_counter()
        if None in firsts or min(counts) < new_tokens:
            raise RuntimeError(f"a stream ended early: {counts} events for {new_tokens} tokens each")
        timings.append((sum(f - started for f in firsts) / conversations * 1000, (done - started) * 1000))
    return timings


def wait_for(port: int, what: str) -> None:
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
            return
        except OSError:
            if time.time() > deadline:
                raise RuntimeError(f"{what} did not start")
            time.sleep(0.2)


def llama_turns(binary: str, gguf: str, histories_prompts: list, new_tokens: int, conversations: int) -> list:
    """llama-server on the same prompts (token ids), one slot per conversation."""
    port = free_port()
    server = subprocess.Popen([binary, "-m", gguf, "-t", "2", "--port", str(port), "-np", str(conversations),
                               "-c", str(4096 * conversations), "--no-webui"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(port, "llama-server")
        return http_turns(port, histories_prompts, new_tokens, conversations)
    finally:
        server.terminate()
        server.wait(30)


def product_turns(runtime_path: str, conversations: int, turns: int, new_tokens: int) -> tuple[list, list]:
    """Per turn: (mean time to first token, time to last token) in ms, through the product: the
    service booted on the runtime (tests.harness.Stack: `python -m gpu_worker boot` behind
    `manage.py serve`), one SDK client per conversation, each turn an input POSTed to its
    conversation (greedy, --new-tokens at most, memory context `plain`) and its output read from
    the operation's event stream: the first output event is the first token, the terminal event
    the last. Every conversation's turn is sent at once. Also every turn's output token counts
    (the device stops at the end-of-sequence token: a turn may answer fewer)."""
    from aotx_client import Client
    from tests.harness import Stack
    with tempfile.TemporaryDirectory(prefix="bench-conversation-") as base:
        stack = Stack(base, runtime_path)
        tokens = [stack.principal(f"conversation-{c}") for c in range(conversations)]
        stack.boot_device()
        stack.serve()
        url = f"http://127.0.0.1:{stack.port}"
        clients = [Client(url, token, timeout=600) for token in tokens]
        try:
            model = clients[0].capabilities()["models"][0]["name"]
            rooms = []
            for aotx in clients:
                aotx.register()
                rooms.append(aotx.create_conversation(aotx.create_space()["target"])["target"])
            timings, counts = [], []
            for turn in range(turns):
                firsts: list = [None] * conversations
                lasts: list = [None] * conversations
                made: list = [0] * conversations
                started = time.perf_counter()

                def run(c: int) -> None:
                    aotx = clients[c]
                    op = aotx.submit_input(rooms[c], user_message(turn + c), model=model,
                                           max_output_tokens=new_tokens, temperature=0, context="plain")["operation"]
                    for event in aotx.output(op):
                        if event.event == "terminal":
                            lasts[c] = time.perf_counter()
                        elif firsts[c] is None:
                            firsts[c] = time.perf_counter()
                    made[c] = int(aotx.wait(op)["result"]["output_tokens"] or 0)
                threads = [threading.Thread(target=run, args=(c,)) for c in range(conversations)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                if None in firsts or None in lasts:
                    raise RuntimeError(f"turn {turn + 1}: an input answered no output")
                timings.append((sum(f - started for f in firsts) / conversations * 1000,
                                (max(lasts) - started) * 1000))
                counts.append(made)
            return timings, counts
        finally:
            for aotx in clients:
                aotx.close()
            stack.stop()


def prompts_of(engine: Engine, outputs: list, conversations: int, turns: int) -> list:
    """The token ids every turn sent (rebuilt from the answers), per turn, per conversation."""
    histories = [[] for _ in range(conversations)]
    out = []
    for turn in range(turns):
        row = []
        for c, messages in enumerate(histories):
            messages.append({"role": "user", "content": user_message(turn + c)})
            row.append(engine.tokenizer.encode_chat(messages))
            messages.append({"role": "assistant", "content": engine.tokenizer.decode(outputs[turn][c])})
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--conversations", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runtime", default=str(ROOT / "var" / "identity.aotxccir"))
    parser.add_argument("--llama-server", help="llama-server binary (same GGUF, its own prompt cache)")
    args = parser.parse_args()
    module, distribution, filename = pack.DEFAULT_GGUF
    gguf = str(pack._package_dir(module, distribution) / filename)
    runtime = RuntimeFile.open(args.runtime, verify=False)
    for conversations in [int(n) for n in args.conversations.split(",")]:
        warm, cold = Engine(runtime, prefix_cache=True), Engine(runtime, prefix_cache=False)
        engine_turns(warm, 1, 1, 2)  # warm-up (first-call allocations), then a clean cache
        warm.block_manager.clear_cache()
        engine_turns(cold, 1, 1, 2)
        reuse, reuse_out = engine_turns(warm, conversations, args.turns, args.new_tokens)
        plain, plain_out = engine_turns(cold, conversations, args.turns, args.new_tokens)
        same = reuse_out == plain_out
        prompts = prompts_of(warm, reuse_out, conversations, args.turns)
        served, made = product_turns(args.runtime, conversations, args.turns, args.new_tokens)
        llama = None
        if args.llama_server and os.path.exists(args.llama_server):
            print(f"llama-server: {describe(args.llama_server)}", flush=True)
            llama = llama_turns(args.llama_server, gguf, prompts, args.new_tokens, conversations)
        print(f"\n{conversations} conversation(s), {args.turns} turns, {args.new_tokens} new tokens each; "
              f"greedy tokens with reuse == without: {same}")
        print("in process: the engine stepped by the bench; product: an input POSTed through the gateway to the "
              "device and its output event stream; llama-server: its /completion, streamed")
        print(f"output tokens through the product, per turn: {made}")
        head = "turn  reuse ttft  cold ttft  reuse total  cold total  product ttft  product total"
        print(head + ("  llama ttft  llama total" if llama else ""))
        for turn in range(args.turns):
            line = (f"{turn + 1:4d}  {reuse[turn][0]:10.1f}  {plain[turn][0]:9.1f}  {reuse[turn][1]:11.1f}  "
                    f"{plain[turn][1]:10.1f}  {served[turn][0]:12.1f}  {served[turn][1]:13.1f}")
            if llama:
                line += f"  {llama[turn][0]:10.1f}  {llama[turn][1]:11.1f}"
            print(line)
        last = args.turns - 1
        summary = (f"turn {args.turns}: time to first token {plain[last][0] / reuse[last][0]:.2f}x better with reuse "
                   f"than without (in process)")
        if llama:
            summary += (f"; llama-server's time to first token / the product's {llama[last][0] / served[last][0]:.2f}, "
                        f"its time to the last token / ours {llama[last][1] / served[last][1]:.2f} "
                        "(above 1: ours is faster)")
        print(summary)
        if not same:
            raise SystemExit("reuse changed the greedy tokens")


if __name__ == "__main__":
    main()
