"""Constrained decoding (engine/grammar.py) on the tiny random model: whatever its weights prefer,
an answer under a grammar is valid, a complete answer finishes "stop" and one cut short "length",
and rows without a grammar in the same batch are untouched."""
import json

import jsonschema
import pytest

from gpu_worker.contract import tool_calls
from gpu_worker.engine import engine as engine_module
from gpu_worker.engine.engine import FINISH_GRAMMAR_FAILED, Engine
from gpu_worker.engine.grammar import CACHED_GRAMMARS, GrammarError, schema_grammar, tool_grammar

# varied shapes: nested objects, arrays, enums, bounded numbers, optional fields, recursion
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "nick": {"type": "string", "maxLength": 6}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"enum": ["open", "paid", "shipped"]},
                                      "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                                          "type": "object", "properties": {
                                              "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                                              "price": {"type": "number", "minimum": 0, "maximum": 100}},
                                          "required": ["qty", "price"], "additionalProperties": False}}},
     "required": ["status", "items"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4},
    {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer", "minimum": 0, "maximum": 9},
        "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}}},
        "required": ["v"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
    {"anyOf": [{"type": "string", "enum": ["yes", "no"]}, {"type": "integer", "minimum": -5, "maximum": 5}]},
]


@pytest.fixture(scope="module")
def engine(tiny_gen):
    return Engine(tiny_gen, prefix_cache=False)


def prompt(engine, text="hello"):
    return engine.tokenizer.encode(text)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_complete_answer_is_valid_json_of_its_schema(engine, temperature):
    grammars = [engine.grammars.compile(schema_grammar(s)) for s in SCHEMAS]
    seqs = []
    for i, (schema, grammar) in enumerate(zip(SCHEMAS, grammars)):
        seqs.append((schema, engine.submit(f"g{temperature}-{i}", prompt(engine, f"answer {i}"), max_new_tokens=160,
                                           temperature=temperature, grammar=grammar)))
    while engine.has_work:
        engine.step()
    complete = 0
    for schema, seq in seqs:
        assert seq.finish_reason in ("stop", "length"), seq.finish_reason
        if seq.finish_reason == "stop":  # never invalid JSON reported as complete
            jsonschema.validate(json.loads(bytes(seq.output_bytes)), schema)
            complete += 1
    assert complete >= len(SCHEMAS) - 1  # bounded schemas: the random model cannot run on forever


def test_an_answer_cut_short_by_max_tokens_finishes_length(engine):
    grammar = engine.grammars.compile(schema_grammar({"type": "array", "items": {"type": "integer"}, "minItems": 50}))
    (seq,) = engine.generate([prompt(engine)], max_new_tokens=8, grammar=grammar)
    assert seq.finish_reason == "length" and len(seq.output_ids) == 8
    with pytest.raises(ValueError):
        json.loads(bytes(seq.output_bytes))


def test_rows_without_a_grammar_sample_as_they_would_alone(engine):
    alone = engine.generate([prompt(engine, "free text")], max_new_tokens=12, ignore_eos=True, temperature=0.7,
                            seed=5)[0].output_ids
    grammar = engine.grammars.compile(schema_grammar(SCHEMAS[1]))
    free = engine.submit("free", prompt(engine, "free text"), max_new_tokens=12, ignore_eos=True, temperature=0.7,
                         seed=5)
    held = [engine.submit(f"held-{i}", prompt(engine, f"json {i}"), max_new_tokens=40, grammar=grammar)
            for i in range(3)]
    while engine.has_work:
        engine.step()
    assert free.output_ids == alone
    assert all(seq.finish_reason in ("stop", "length") for seq in held)


def test_tool_call_grammars_answer_calls_of_the_named_or_required_tools(engine):
    tools = [{"name": "get_weather", "parameters": {"type": "object", "properties": {
                 "city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"], "additionalProperties": False}},
             {"name": "add", "parameters": {"type": "object", "properties": {
                 "a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9}},
                 "required": ["a", "b"], "additionalProperties": False}}]
    for choice, parallel in (("required", False), ("required", True), ({"name": "add"}, True)):
        grammar = engine.grammars.compile(tool_grammar(tools, choice, parallel))
        seqs = engine.generate([prompt(engine, f"call {i}") for i in range(4)], max_new_tokens=200, grammar=grammar,
                               temperature=1.0)
        for seq in seqs:
            if seq.finish_reason == "length":
                continue
            calls = tool_calls.parse(bytes(seq.output_bytes).decode())
            assert calls, bytes(seq.output_bytes)
            assert parallel or len(calls) == 1
            for name, arguments in calls:
                assert name == choice["name"] if isinstance(choice, dict) else name in ("get_weather", "add")
                jsonschema.validate(json.loads(arguments), next(t for t in tools if t["name"] == name)["parameters"])


def test_a_failing_mask_thread_fails_only_the_constrained_sequences(engine, monkeypatch):
    grammar = engine.grammars.compile(schema_grammar(SCHEMAS[0]))

    def broken(matchers, words):
        raise RuntimeError("injected mask failure")
    monkeypatch.setattr(engine_module, "fill_masks", broken)
    held = engine.submit("held", prompt(engine), max_new_tokens=20, grammar=grammar)
    free = engine.submit("free", prompt(engine), max_new_tokens=5, ignore_eos=True)
    events = []
    while engine.has_work:
        events += engine.step()
    assert held.finish_reason == FINISH_GRAMMAR_FAILED and len(held.output_ids) == 0
    assert [e for e in events if e[0] == "held"] == [("held", None, b"", FINISH_GRAMMAR_FAILED, None)]
    assert free.finish_reason == "length" and len(free.output_ids) == 5
    assert engine.block_manager.num_free == engine.block_manager.num_pages  # the failed one's pages came back


@pytest.mark.parametrize("schema, named", [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"), ({"not": {"type": "string"}}, "not"),
    ({"type": "string", "if": {"minLength": 2}, "then": {"maxLength": 3}}, "if"),
    ({"type": "widget"}, "widget")])
def test_a_schema_it_cannot_enforce_is_refused_naming_what(engine, schema, named):
    with pytest.raises(GrammarError) as refused:
        engine.grammars.compile(schema_grammar(schema))
    assert named in str(refused.value)


def test_compiled_grammars_are_kept_by_digest_within_a_bound(engine):
    first = engine.grammars.compile(schema_grammar({"type": "object", "properties": {"x": {"type": "integer"}}}))
    assert engine.grammars.compile(schema_grammar({"type": "object", "properties": {"x": {"type": "integer"}}})) \
        is first
    for i in range(CACHED_GRAMMARS):
        engine.grammars.compile(schema_grammar({"const": i}))
    again = engine.grammars.compile(schema_grammar({"type": "object", "properties": {"x": {"type": "integer"}}}))
    assert again is not first and again.digest == first.digest


def test_stop_strings_cannot_be_combined_with_a_grammar(engine):
    from gpu_worker.engine.scheduler import EngineRefusal
    grammar = engine.grammars.compile(schema_grammar({"type": "object"}))
    with pytest.raises(EngineRefusal) as refused:
        engine.submit("stop+grammar", prompt(engine), max_new_tokens=4, stop=["}"], grammar=grammar)
    assert refused.value.code == "grammar_with_stop"


def test_a_gpus_biases_from_the_bits_are_the_cpus():
    """The GPU path (device_biases: torch operators) and the CPU's (a numpy table lookup) read a
    mask's bits alike: bit j of word w is token 32 w + j, least significant first."""
    import torch

    from gpu_worker.engine.grammar import device_biases, mask_biases
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, 5), dtype=torch.int32)
    cpu, torch_ops = mask_biases(bits, 150), device_biases(bits, 150)
    assert torch.equal(cpu, torch_ops) and cpu.shape == (3, 150)
    token = 32 * 2 + 7
    assert (cpu[1, token] == 0) == bool((int(bits[1, 2]) >> 7) & 1)
