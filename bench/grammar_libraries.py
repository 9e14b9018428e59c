"""Which grammar library computes the engine's token masks (docs/engine.md, "Constrained decoding"):
llguidance, xgrammar and outlines-core on the packed model's own vocabulary, in one run.

    .venv/bin/python bench/grammar_libraries.py [--runtime var/identity.aotxccir] [--rounds 5]

Only llguidance is a requirement; `pip install xgrammar==0.2.8 outlines-core==0.2.14` into the
virtualenv to compare (a library that is not installed is skipped). For each library and schema:
the grammar's compile time (cold, per schema; the tokenizer's one-off preparation apart), and the
mask time per decoding step at 1 and 8 sequences — each sequence's mask computed in turn, as the
engine does (engine/grammar.fill_masks), while each matcher walks a valid answer token by token
(median over the steps of every round). Then which JSON-schema keywords each refuses rather than
ignores: a keyword a library ignores lets an answer it calls valid break the schema. Last, how a
mask reaches the logits (1 and 8 rows of this vocabulary, median of many calls): a boolean
`masked_fill` of a copy of the logits against the engine's way, an additive bias (made from the
bits by a byte-table lookup on the mask thread, `grammar.mask_biases`, then added on the engine's).
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)

import torch  # noqa: E402

from gpu_worker.storage.runtime_file import RuntimeFile  # noqa: E402

SCHEMAS = {
    "person": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {
        "type": "integer", "minimum": 0, "maximum": 150}, "email": {"type": "string"}, "tags": {
        "type": "array", "items": {"type": "string"}}}, "required": ["name", "age"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"]}),
    "order": ({"type": "object", "properties": {"id": {"type": "string"}, "status": {"enum": ["open", "paid", "shipped"]},
                                                "items": {"type": "array", "minItems": 1, "items": {
                                                    "type": "object", "properties": {
                                                        "sku": {"type": "string"}, "qty": {"type": "integer",
                                                                                           "minimum": 1},
                                                        "price": {"type": "number", "minimum": 0}},
                                                    "required": ["sku", "qty", "price"],
                                                    "additionalProperties": False}},
                                                "address": {"type": "object", "properties": {
                                                    "city": {"type": "string"},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                                    "required": ["city"]}},
               "required": ["id", "status", "items"], "additionalProperties": False},
              {"id": "A-17", "status": "paid", "items": [{"sku": "x1", "qty": 2, "price": 3.5},
                                                         {"sku": "y2", "qty": 1, "price": 10}],
               "address": {"city": "Paris", "zip": "75001"}}),
}
KEYWORDS = {"uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
            "not": {"not": {"type": "string"}}, "if/then": {"if": {"type": "string"}, "then": {"minLength": 2}},
            "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
            "type: widget": {"type": "widget"}}


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer_json, vocab, eos):
        import llguidance
        self.lib = llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)

    def compile(self, schema):
        grammar = self.lib.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={
            "whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
        is_error, messages = self.lib.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error or messages:
            raise ValueError("; ".join(messages))
        return grammar

    def matcher(self, compiled):
        return self.lib.LLMatcher(self.tokenizer, compiled, log_level=0)

    def fill(self, matcher, row):
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def accept(self, matcher, token):
        assert matcher.consume_token(token)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json, vocab, eos):
        import transformers
        import xgrammar
        from tokenizers import Tokenizer
        self.lib = xgrammar
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json))
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def matcher(self, compiled):
        return self.lib.GrammarMatcher(compiled)

    def fill(self, matcher, row):
        matcher.fill_next_token_bitmask(row.view(1, -1), 0)

    def accept(self, matcher, token):
        assert matcher.accept_token(token)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer_json, vocab, eos):
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        from gpu_worker.engine.tokenizer import Tokenizer
        self.lib, self.regex_of = outlines_core, build_regex_from_schema
        table = Tokenizer(tokenizer_json, "", vocab_size=vocab)
        pieces: dict[bytes, list[int]] = {}
        for token_id in range(vocab):
            raw = table.token_bytes(token_id)
            if token_id != eos and raw:
                pieces.setdefault(raw, []).append(token_id)
        self.vocabulary = outlines_core.Vocabulary(eos, pieces)

    def compile(self, schema):
        return self.lib.Index(self.regex_of(json.dumps(schema)), self.vocabulary)

    def matcher(self, compiled):
        return self.lib.Guide(compiled)

    def fill(self, matcher, row):
        matcher.write_mask_into(row.data_ptr(), row.numel(), 4)

    def accept(self, matcher, token):
        matcher.advance(token)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", default=str(ROOT / "var" / "identity.aotxccir"))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    runtime = RuntimeFile.open(args.runtime)
    card = runtime.json("gen/card")
    tokenizer_json = runtime.bytes("gen/tokenizer").tobytes().decode("utf-8")
    vocab, eos = card["vocab_size"], card["eos_token_id"]
    from tokenizers import Tokenizer
    encode = Tokenizer.from_str(tokenizer_json)
    libraries = []
    for kind in (Llguidance, Xgrammar, OutlinesCore):
        try:
            started = time.perf_counter()
            libraries.append(kind(tokenizer_json, vocab, eos))
            print(f"{kind.name}: tokenizer prepared in {(time.perf_counter() - started) * 1e3:.0f} ms")
        except ImportError as err:
            print(f"{kind.name}: skipped ({err})")
    words = (vocab + 31) // 32
    print(f"\n{card['name']}, vocabulary {vocab}; {args.rounds} rounds; torch threads {torch.get_num_threads()}")
    print(f"{'library':14} {'schema':8} {'compile ms':>11} {'mask us, 1 seq':>15} {'mask us, 8 seqs':>16}")
    for library in libraries:
        for name, (schema, answer) in SCHEMAS.items():
            ids = encode.encode(json.dumps(answer, separators=(",", ":"))).ids
            compile_ms, steps = [], {1: [], 8: []}
            for _ in range(args.rounds):
                started = time.perf_counter()
                compiled = library.compile(schema)
                compile_ms.append((time.perf_counter() - started) * 1e3)
                for batch in (1, 8):
                    matchers = [library.matcher(compiled) for _ in range(batch)]
                    masks = torch.empty(batch, words, dtype=torch.int32)
                    for token in ids:
                        started = time.perf_counter()
                        for i, matcher in enumerate(matchers):
                            library.fill(matcher, masks[i])
                        steps[batch].append((time.perf_counter() - started) * 1e6)
                        for matcher in matchers:
                            library.accept(matcher, token)
            print(f"{library.name:14} {name:8} {statistics.median(compile_ms):11.2f} "
                  f"{statistics.median(steps[1]):15.1f} {statistics.median(steps[8]):16.1f}")
    print("\nJSON-schema keywords: refused (names it) or ignored (an answer may break the schema)")
    for library in libraries:
        verdicts = []
        for keyword, schema in KEYWORDS.items():
            try:
                library.compile(schema)
                verdicts.append(f"{keyword}: ignored")
            except Exception:  # noqa: BLE001 - any refusal counts
                verdicts.append(f"{keyword}: refused")
        print(f"{library.name:14} " + ", ".join(verdicts))
    apply_cost(vocab, words)


def _median_us(work, calls: int = 300) -> float:
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        work()
        times.append((time.perf_counter() - started) * 1e6)
    return statistics.median(times)


def apply_cost(vocab: int, words: int) -> None:
    from gpu_worker.engine.grammar import apply_biases, mask_biases
    print("\nthe mask onto the logits, us a call (median)")
    print(f"{'rows':>5} {'masked_fill':>12} {'bias: make (mask thread)':>25} {'bias: add (engine)':>19}")
    for rows in (1, 8):
        logits = torch.randn(rows, vocab)
        bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (rows, words), dtype=torch.int32)
        allowed = mask_biases(bits, vocab) == 0
        biases = mask_biases(bits, vocab)
        every = list(range(rows))
        print(f"{rows:5} {_median_us(lambda: logits.clone().masked_fill_(~allowed, float('-inf'))):12.1f} "
              f"{_median_us(lambda: mask_biases(bits, vocab)):25.1f} "
              f"{_median_us(lambda: apply_biases(logits, every, biases)):19.1f}")


if __name__ == "__main__":
    main()
