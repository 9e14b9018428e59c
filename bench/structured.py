"""Constrained decoding (a JSON schema's grammar) against unconstrained decoding, and the grammar
compile time per schema: the engine beside llama.cpp's llama-server on the same model, in one run.

    .venv/bin/python bench/structured.py [--rounds 5] [--new-tokens 128] [--sequences 1,8]
                                         [--schemas profile,order,event,review] [--llama-server PATH]

Issue 55's goal: constrained decoding at >= 0.9 of the unconstrained tokens/s, at 1 and at 8
sequences.

SmolLM2-135M-Instruct on the CPU. The engine from the default runtime file (var/identity.aotxccir:
`make run` builds it), torch's default thread count, its prefix cache off (every run prefills its
prompts, as llama-server does with `cache_prompt: false`). llama-server (--llama-server PATH; built
from the llama-cpp-python 0.3.36 sdist's vendored source as docs/performance.md says) on the GGUF
that runtime was packed from, 2 threads (`-t 2`), a slot per sequence, its GBNF grammars (the
JSON schema sent as `json_schema`), each request on a connection of its own, all of a run's
requests at once. Both get the same prompt token ids (the engine's chat template) and decode
greedily.

Schemas (SCHEMAS): four, between them nested objects, arrays of objects, enums, bounded integers,
patterns, booleans, optional properties, and long-ish fields (strings with a minLength, arrays
with minItems) so that most greedy answers run to --new-tokens rather than closing early (the
answers table says how many did). Every object has `additionalProperties: false` and only integers
carry bounds: llama.cpp's converter bounds integers and not numbers, so both sides enforce the same
language (though not the same text: llama.cpp's grammar lets the model indent, the engine's allows
no free whitespace, so their answers take different token counts). Each schema has eight prompts;
a run of n sequences takes the first n.

Decode rate. A pair of runs on the same prompts: constrained (the schema's grammar, at most
--new-tokens tokens a sequence; an answer ends when its grammar is complete or at that limit) and
unconstrained (no grammar, `ignore_eos`, each sequence generating exactly as many tokens as it did
constrained). Before the rounds a calibration run, constrained, per schema and sequence count and
per system, gives those counts (greedy: every constrained run repeats them; the run says if one did
not), and checks every complete answer against its schema (jsonschema). So both runs of a pair take
the same steps at the same batch sizes. The rate leaves prefill out: tokens after each sequence's
first, over the seconds from the first token to the last. The engine: a run's prompts are all
admitted and prefilled in its first `step()`, which gives each its first token; the clock runs from
the end of that step to the end of the last. llama-server: its response `timings` (predicted_ms
runs from a request's first token to its last; at one sequence the rate is its
predicted_per_second): the sum of (predicted_n - 1) over the requests over the longest predicted_ms.
A round runs every schema's pair at every count on each system, constrained first in even rounds
and unconstrained first in odd ones, so both modes meet the same moments of a shared machine. A
round's rate for a system, count and mode is its tokens over its seconds summed across the schemas;
its ratio is constrained / unconstrained. Reported: the median and range over the rounds, and each
schema's median ratio.

Compile time, per round and schema. The engine: a fresh `Grammars` as engine.py builds it, whose
llguidance tokenizer of the vocabulary is built on the first grammar (once per engine: reported on
its own), then its `compile` of `schema_grammar(schema)` cold (validation and the matcher's
template).
Then time to the first token, one sequence, the schema's first prompt, one new token: without a
grammar; with a new schema (that cold compile plus the first token, whose mask is the first the
grammar computes); with a known one (the engine's cached grammar: the digest lookup plus the first
token). llama-server: the same three, as the wall time of a one-token `/completion` request. It
keeps no compiled grammar between requests (each converts the schema to GBNF and parses it when
its slot starts), so a new and a known schema cost it the same, and their excess over no grammar
is its compile.
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)  # not bench/: bench/http.py would shadow the standard library http

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from typing import Callable  # noqa: E402

import jsonschema  # noqa: E402
import torch  # noqa: E402

from bench.build_info import describe  # noqa: E402
from bench.conversation import free_port, wait_for  # noqa: E402
from gpu_worker import pack  # noqa: E402
from gpu_worker.engine import Engine  # noqa: E402
from gpu_worker.engine.grammar import Grammar, Grammars, schema_grammar  # noqa: E402
from gpu_worker.storage.runtime_file import RuntimeFile  # noqa: E402

DEFAULT_RUNTIME = ROOT / "var" / "identity.aotxccir"


def _text(max_length: int, min_length: int = 0) -> dict:
    return {"type": "string", "maxLength": max_length, **({"minLength": min_length} if min_length else {})}


def _object(properties: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


# name: (schema, the request the prompts share, the eight subjects)
SCHEMAS: dict[str, tuple[dict, str, list[str]]] = {
    "profile": (  # a nested object, a bounded integer, a pattern, an optional field, a long string
        _object({"name": _text(40, 2),
                 "age": {"type": "integer", "minimum": 18, "maximum": 99},
                 "email": _text(60),
                 "address": _object({"street": _text(60), "city": _text(40),
                                     "postcode": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                    ["street", "city", "postcode"]),
                 "biography": _text(800, 200)},
                ["name", "age", "address", "biography"]),
        "Write a JSON profile, with a long biography, of a fictional",
        ["lighthouse keeper in Brittany", "jazz pianist in New Orleans", "beekeeper in the Alps",
         "ship's doctor in 1850", "watchmaker in Geneva", "glacier researcher in Greenland",
         "street food cook in Bangkok", "bookbinder in Edinburgh"]),
    "order": (  # an array of objects, enums, patterns, bounded integers, numbers, optional fields
        _object({"order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
                 "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
                 "customer": _object({"name": _text(40), "email": _text(60),
                                      "loyalty_tier": {"enum": ["none", "silver", "gold"]}}, ["name", "email"]),
                 "items": {"type": "array", "minItems": 4, "maxItems": 12,
                           "items": _object({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                             "description": _text(80),
                                             "quantity": {"type": "integer", "minimum": 1, "maximum": 50},
                                             "unit_price": {"type": "number"}},
                                            ["sku", "description", "quantity", "unit_price"])},
                 "gift_message": _text(200)},
                ["order_id", "status", "customer", "items"]),
        "Write the JSON record of an online order with several items for",
        ["a home bakery", "a school science lab", "a camping trip", "a new aquarium", "a wedding party",
         "a painter's studio", "a bicycle repair shop", "a small recording studio"]),
    "event": (  # enums, a date pattern, booleans, an optional nested object, arrays of objects and strings
        _object({"title": _text(80),
                 "category": {"enum": ["conference", "workshop", "concert", "festival", "meetup", "sports"]},
                 "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                 "capacity": {"type": "integer", "minimum": 10, "maximum": 5000},
                 "online": {"type": "boolean"},
                 "venue": _object({"name": _text(60), "city": _text(40), "indoor": {"type": "boolean"}},
                                  ["name", "city"]),
                 "attendees": {"type": "array", "minItems": 4, "maxItems": 12,
                               "items": _object({"name": _text(40),
                                                 "role": {"enum": ["speaker", "organiser", "volunteer", "guest"]},
                                                 "confirmed": {"type": "boolean"}}, ["name", "role", "confirmed"])},
                 "tags": {"type": "array", "minItems": 3, "maxItems": 8, "items": _text(24)}},
                ["title", "category", "date", "capacity", "online", "attendees", "tags"]),
        "Describe as JSON, with its attendees and tags, a planned",
        ["robotics conference", "pottery workshop", "open-air jazz concert", "kite festival",
         "chess meetup", "city marathon", "astronomy night", "food truck festival"]),
    "review": (  # arrays of bounded strings, an enum, a bounded integer, an optional number, a long string
        _object({"product": _text(60),
                 "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                 "sentiment": {"enum": ["negative", "mixed", "positive"]},
                 "pros": {"type": "array", "minItems": 3, "maxItems": 6, "items": _text(120, 10)},
                 "cons": {"type": "array", "minItems": 2, "maxItems": 6, "items": _text(120, 10)},
                 "would_recommend": {"type": "boolean"},
                 "price_paid": {"type": "number"},
                 "summary": _text(1000, 200)},
                ["product", "rating", "sentiment", "pros", "cons", "would_recommend", "summary"]),
        "Write a detailed JSON review, with pros, cons and a long summary, of",
        ["a folding electric bicycle", "a budget mechanical keyboard", "a cast iron frying pan",
         "a noise cancelling headset", "a beginner's telescope", "a robot vacuum cleaner",
         "a paperback mystery novel", "a family camping tent"]),
}
MAX_SEQUENCES = 8  # prompts per schema
FIRST_TOKEN = {"plain": "first token, no grammar", "new": "first token, new schema",
               "known": "first token, known schema"}


class Answer:
    """One sequence of a run, as either system reports it."""

    def __init__(self, tokens: int, complete: bool, text: bytes):
        self.tokens, self.complete, self.text = tokens, complete, text

    def valid(self, schema: dict) -> bool:
        try:
            jsonschema.validate(json.loads(self.text), schema)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True


# ---- the engine ---------------------------------------------------------------------------------

_request_ids = itertools.count()


def engine_run(engine: Engine, prompts: list[list[int]], limits: list[int],
               grammar: Grammar | None) -> tuple[int, float, list[Answer]]:
    """Tokens after each sequence's first, the seconds from the first token to the last, and the
    answers. With a grammar each sequence ends when it is complete or at its limit; without one it
    generates exactly its limit (`ignore_eos`)."""
    seqs = [engine.submit(f"structured-{next(_request_ids)}", prompt, max_new_tokens=limit, temperature=0.0,
                          ignore_eos=grammar is None, grammar=grammar)
            for prompt, limit in zip(prompts, limits)]
    engine.step()  # admission and prefill: every sequence's first token
    if not all(seq.output_ids for seq in seqs):
        raise RuntimeError("the first step did not prefill every prompt: the first-token clock would be wrong")
    started = time.perf_counter()
    while engine.has_work:
        engine.step()
        if engine.idle_for:
            time.sleep(engine.idle_for)
    seconds = time.perf_counter() - started
    answers = [Answer(len(seq.output_ids), seq.finish_reason == "stop", bytes(seq.output_bytes)) for seq in seqs]
    if grammar is not None and any(seq.finish_reason not in ("stop", "length") for seq in seqs):
        raise RuntimeError(f"a constrained sequence failed: {[seq.finish_reason for seq in seqs]}")
    return sum(a.tokens for a in answers) - len(answers), seconds, answers


def engine_first_token(engine: Engine, prompt: list[int], grammar: Callable[[], Grammar] | None = None) -> float:
    """Seconds to one token: `grammar()` (compile or look up, timed) and then one sequence's prefill."""
    started = time.perf_counter()
    compiled = grammar() if grammar is not None else None
    engine.generate([prompt], max_new_tokens=1, temperature=0.0, grammar=compiled)
    return time.perf_counter() - started


# ---- llama-server ---------------------------------------------------------------------------------

class LlamaServer:
    """llama-server on `gguf`, 2 threads, `slots` slots of `slot_tokens` context each."""

    def __init__(self, binary: str, gguf: str, slots: int, slot_tokens: int):
        self.port = free_port()
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen([binary, "-m", gguf, "-t", "2", "--port", str(self.port), "-np", str(slots),
                                         "-c", str(slots * slot_tokens), "--no-webui"],
                                        stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_for(self.port, "llama-server")
        except RuntimeError:
            self.close()
            raise

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(30)
        self.log.close()

    def request(self, body: dict) -> tuple[dict, float]:
        """`/completion`'s answer and the request's wall seconds."""
        data = json.dumps(body).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data,
                                         {"Content-Type": "application/json"})
        started = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as response:
            answer = json.load(response)
        return answer, time.perf_counter() - started

    def body(self, prompt: list[int], n_predict: int, schema: dict | None) -> dict:
        body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "cache_prompt": False}
        return {**body, "json_schema": schema} if schema is not None else {**body, "ignore_eos": True}

    def run(self, prompts: list[list[int]], limits: list[int],
            schema: dict | None) -> tuple[int, float, list[Answer]]:
        """As engine_run, all requests at once, from the server's own timings."""
        answers: list = [None] * len(prompts)
        errors: list = []

        def one(i: int) -> None:
            try:
                answers[i] = self.request(self.body(prompts[i], limits[i], schema))[0]
            except Exception as exc:  # noqa: BLE001 - reported below, with the run's others
                errors.append(exc)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise RuntimeError(f"llama-server failed a request: {errors[0]}")
        timings = [answer["timings"] for answer in answers]
        tokens = sum(t["predicted_n"] - 1 for t in timings)
        seconds = max(t["predicted_ms"] for t in timings) / 1000
        return tokens, seconds, [Answer(answer["timings"]["predicted_n"], answer.get("stop_type") == "eos",
                                        answer["content"].encode()) for answer in answers]

    def first_token(self, prompt: list[int], schema: dict | None) -> float:
        return self.request(self.body(prompt, 1, schema))[1]


# ---- the report -----------------------------------------------------------------------------------

def spread(values: list[float], digits: int = 1) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (median and range)")
    parser.add_argument("--new-tokens", type=int, default=128, help="most tokens a constrained answer may take")
    parser.add_argument("--sequences", default="1,8", help=f"comma-separated sequence counts (at most {MAX_SEQUENCES})")
    parser.add_argument("--schemas", default=",".join(SCHEMAS), help="comma-separated names of SCHEMAS")
    parser.add_argument("--runtime", default=str(DEFAULT_RUNTIME))
    parser.add_argument("--llama-server", metavar="PATH", help="llama-server binary: the same runs on the same GGUF")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.sequences.split(",")]
    names = args.schemas.split(",")
    if not all(1 <= n <= MAX_SEQUENCES for n in counts) or not all(name in SCHEMAS for name in names):
        parser.error(f"sequence counts lie in 1..{MAX_SEQUENCES}; schemas are {', '.join(SCHEMAS)}")

    runtime = RuntimeFile.open(args.runtime, verify=False)
    engine = Engine(runtime, prefix_cache=False)
    tokenizer_json = runtime.bytes("gen/tokenizer").tobytes().decode("utf-8")

    def fresh_grammars() -> Grammars:  # as engine.py builds its own
        return Grammars(tokenizer_json, engine.card["vocab_size"], engine.card.get("eos_token_id"))
    schemas = {name: SCHEMAS[name][0] for name in names}
    texts = {name: schema_grammar(schema) for name, schema in schemas.items()}
    prompts = {name: [engine.tokenizer.encode_chat([{"role": "user", "content": f"{task} {subject}."}])
                      for subject in subjects]
               for name, (_, task, subjects) in ((n, SCHEMAS[n]) for n in names)}
    known = {name: engine.grammars.compile(text) for name, text in texts.items()}  # the engine's cache
    systems = ["engine"]
    llama = None
    if args.llama_server:
        print(f"llama-server: {describe(args.llama_server)}", flush=True)
        module, distribution, filename = pack.DEFAULT_GGUF
        longest = max(len(p) for group in prompts.values() for p in group)
        slot_tokens = -(-(longest + args.new_tokens + 64) // 256) * 256
        llama = LlamaServer(args.llama_server, str(pack._package_dir(module, distribution) / filename),
                            max(counts), slot_tokens)
        systems.append("llama-server")
    print(f"model {engine.card['name']} on the CPU, engine with {torch.get_num_threads()} torch threads, "
          f"llama-server with 2; at most {args.new_tokens} new tokens; {args.rounds} rounds", flush=True)

    try:
        def run(system: str, name: str, n: int, limits: list[int], constrained: bool):
            if system == "engine":
                return engine_run(engine, prompts[name][:n], limits, known[name] if constrained else None)
            assert llama is not None  # systems names it only when it runs
            return llama.run(prompts[name][:n], limits, schemas[name] if constrained else None)

        # warm-up (first-call allocations), then the calibration: each constrained answer's length
        engine_run(engine, prompts[names[0]][:2], [4, 4], None)
        engine_run(engine, prompts[names[0]][:2], [4, 4], known[names[0]])
        limits: dict = {}
        answers: dict = {}
        for system in systems:
            for name in names:
                for n in counts:
                    found = run(system, name, n, [args.new_tokens] * n, True)[2]
                    answers[system, name, n] = found
                    limits[system, name, n] = [a.tokens for a in found]

        tokenizer_s: list[float] = []
        compile_s: dict = {name: [] for name in names}
        first_s: dict = {(system, name, key): [] for system in systems for name in names for key in FIRST_TOKEN}
        decode: dict = {(system, n, constrained): [{} for _ in range(args.rounds)]  # per round {name: (tokens, s)}
                        for system in systems for n in counts for constrained in (True, False)}
        drifted = 0
        for round_ in range(args.rounds):
            for name in names:
                grammars = fresh_grammars()
                started = time.perf_counter()
                grammars.tokenizer  # built on its first use: timed on its own
                tokenizer_s.append(time.perf_counter() - started)

                def cold(grammars: Grammars = grammars, text: str = texts[name], name: str = name) -> Grammar:
                    started = time.perf_counter()
                    grammar = grammars.compile(text)
                    compile_s[name].append(time.perf_counter() - started)
                    return grammar

                def cached(text: str = texts[name]) -> Grammar:
                    return engine.grammars.compile(text)
                prompt = prompts[name][0]
                for key, grammar in zip(FIRST_TOKEN, (None, cold, cached)):
                    first_s["engine", name, key].append(engine_first_token(engine, prompt, grammar))
                if llama:
                    for key, schema in zip(FIRST_TOKEN, (None, schemas[name], schemas[name])):
                        first_s["llama-server", name, key].append(llama.first_token(prompt, schema))
            modes = (True, False) if round_ % 2 == 0 else (False, True)
            for system in systems:
                for n in counts:
                    for name in names:
                        for constrained in modes:
                            tokens, seconds, found = run(system, name, n, limits[system, name, n], constrained)
                            if constrained and [a.tokens for a in found] != limits[system, name, n]:
                                drifted += 1
                            decode[system, n, constrained][round_][name] = (tokens, seconds)
            print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    finally:
        if llama:
            llama.close()

    def rate(system: str, n: int, constrained: bool, round_: int, only: str | None = None) -> float:
        parts = [v for k, v in decode[system, n, constrained][round_].items() if only in (None, k)]
        return sum(t for t, _ in parts) / sum(s for _, s in parts)

    rounds = range(args.rounds)
    print(f"\nanswers (calibration run; at most {args.new_tokens} tokens, complete = the grammar closed them; "
          f"constrained reruns that changed an answer's length: {drifted})")
    print(f"{'schema':<8} {'system':<13} {'seqs':>4}  {'tokens per answer':>17}  {'at the limit':>12}  "
          f"{'complete, valid':>15}")
    for name in names:
        for system in systems:
            for n in counts:
                found = answers[system, name, n]
                lengths = [a.tokens for a in found]
                complete = [a for a in found if a.complete]
                print(f"{name:<8} {system:<13} {n:>4}  {min(lengths):>8}-{max(lengths):<8}  "
                      f"{sum(t >= args.new_tokens for t in lengths):>6}/{n:<5}  "
                      f"{len(complete):>7}, {sum(a.valid(schemas[name]) for a in complete)}")

    print(f"\ndecode tokens/s after the first token, all schemas ({', '.join(names)}) together; "
          f"median (min-max) of {args.rounds} rounds")
    print(f"{'system':<13} {'seqs':>4}  {'unconstrained':<22} {'constrained':<22} {'ratio (goal >= 0.90)':<20}")
    for system in systems:
        for n in counts:
            free = [rate(system, n, False, r) for r in rounds]
            bound = [rate(system, n, True, r) for r in rounds]
            print(f"{system:<13} {n:>4}  {spread(free):<22} {spread(bound):<22} "
                  f"{spread([b / f for b, f in zip(bound, free)], 2):<20}")

    print("\nratio constrained / unconstrained per schema, median (min-max)")
    columns = [(system, n) for system in systems for n in counts]
    print(f"{'schema':<8} " + " ".join(f"{f'{system} {n}':<18}" for system, n in columns))
    for name in names:
        cells = [spread([rate(s, n, True, r, name) / rate(s, n, False, r, name) for r in rounds], 2)
                 for s, n in columns]
        print(f"{name:<8} " + " ".join(f"{cell:<18}" for cell in cells))

    print(f"\ngrammar compile and time to the first token (1 sequence, prefill included), ms, median (min-max) of "
          f"{args.rounds}")
    print(f"engine: llguidance tokenizer build, once per engine: {spread([s * 1000 for s in tokenizer_s])}")
    print(f"{'schema':<8} {'measure':<26} " + " ".join(f"{system:<24}" for system in systems))
    for name in names:
        cells = [spread([s * 1000 for s in compile_s[name]])] + ["-"] * (len(systems) - 1)
        print(f"{name:<8} {'compile (cold)':<26} " + " ".join(f"{cell:<24}" for cell in cells))
        for key, label in FIRST_TOKEN.items():
            cells = [spread([s * 1000 for s in first_s[system, name, key]]) for system in systems]
            print(f"{'':<8} {label:<26} " + " ".join(f"{cell:<24}" for cell in cells))
    print("(engine, new schema: a cold compile and the first token; llama-server compiles every request's schema)")

if __name__ == "__main__":
    main()
