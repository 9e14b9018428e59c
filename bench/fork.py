"""A fork's first input against the same input in its source (issue 56: the fork shares the
source's KV pages for their common prefix; goal: its time to first token within 1.2x of the
source's), through the product:

    .venv/bin/python bench/fork.py [--rounds 5] [--turns 6] [--new-tokens 24] [--runtime F]

The service booted on the runtime (tests.harness.Stack: `python -m gpu_worker boot` behind `manage.py
serve`, the device on the CPU, default var/identity.aotxccir), one SDK client. Each round: a new
conversation of --turns turns (each a ~50-token message, its answer --new-tokens tokens at most,
greedy, memory context `plain` so no recall changes a prompt), forked at its last input
(`POST /conversations/{con}/forks {at}`); then one new message, the same text, as an input of the
fork and of the source, in turns (the fork first in odd rounds, the source first in even ones),
each time to first token taken from its operation's event stream (POST to the first output
event), as a client sees it. Both prompts hold the same turns, so each finds the same prefix in
the engine's prefix cache (the source's last turn put it there); the second of the pair finds its
own whole prompt too, which alternating the order spreads evenly.

Also, once: the same message as the first input of a new, empty conversation (no shared prefix),
for scale. Prints each round, the median ratio fork / source with its range, and the medians of
each in the same place of its pair (first against first, second against second).
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)  # not bench/: bench/http.py would shadow the standard library http

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from bench.conversation import user_message  # noqa: E402


def first_token_ms(aotx, conversation: str, text: str, model: str, tokens: int) -> float:
    started = time.perf_counter()
    op = aotx.submit_input(conversation, text, model=model, max_output_tokens=tokens, temperature=0,
                           context="plain")["operation"]
    first = None
    for event in aotx.output(op):
        if event.event != "terminal" and first is None:
            first = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{op} answered no output")
    aotx.wait(op)
    return (first - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtime", default=str(ROOT / "var" / "identity.aotxccir"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()

    from aotx_client import Client
    from tests.harness import Stack
    with tempfile.TemporaryDirectory(prefix="bench-fork-") as base:
        stack = Stack(base, args.runtime)
        token = stack.principal("fork-bench")
        stack.boot_device()
        stack.serve()
        aotx = Client(f"http://127.0.0.1:{stack.port}", token, timeout=600, retry_for=600)
        try:
            model = aotx.capabilities()["models"][0]["name"]
            aotx.register()
            space = aotx.create_space()["target"]
            ratios, rows = [], []
            for r in range(args.rounds):
                source = aotx.create_conversation(space)["target"]
                for turn in range(args.turns):
                    first_token_ms(aotx, source, user_message(100 * r + turn), model, args.new_tokens)
                fork = aotx.mutate(f"/conversations/{source}/forks", {"at": str(args.turns)})["target"]
                text = user_message(100 * r + 50)
                order = [("fork", fork), ("source", source)] if r % 2 == 0 else [("source", source), ("fork", fork)]
                ms = {name: first_token_ms(aotx, con, text, model, args.new_tokens) for name, con in order}
                ratios.append(ms["fork"] / ms["source"])
                rows.append((r + 1, order[0][0], ms["fork"], ms["source"]))
            empty = aotx.create_conversation(space)["target"]
            alone = first_token_ms(aotx, empty, user_message(999), model, args.new_tokens)
        finally:
            aotx.close()
            stack.stop()
    print(f"{args.rounds} rounds, {args.turns} turns before the fork, {args.new_tokens} tokens a turn, greedy, "
          "memory context plain; time to first token through the API, ms")
    print("round  first   fork ttft  source ttft  fork/source")
    for r, first, fork_ms, source_ms in rows:
        print(f"{r:5}  {first:6}  {fork_ms:9.1f}  {source_ms:11.1f}  {fork_ms / source_ms:11.2f}")
    print(f"median fork/source {statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f}); "
          f"goal 1.2; a first input of an empty conversation: {alone:.1f} ms")
    # the same position against the same position: the second of a pair also finds the first's whole prompt
    for place, fork_first in (("first", True), ("second", False)):
        forks = [f for _, first, f, _ in rows if (first == "fork") == fork_first]
        sources = [s for _, first, _, s in rows if (first == "source") == fork_first]
        if forks and sources:
            print(f"{place} of its pair: fork {statistics.median(forks):.1f} ms, source "
                  f"{statistics.median(sources):.1f} ms, {statistics.median(forks) / statistics.median(sources):.2f}x")


if __name__ == "__main__":
    main()
