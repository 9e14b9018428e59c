"""Constrained decoding: the token masks that keep an answer inside a grammar (a JSON schema, a
set of tool calls).

A small model does not emit valid JSON on its own, so at every step of a constrained sequence
the tokens its grammar cannot take next are masked out of the logits before sampling (greedy and
sampled alike), and each sampled token is fed back to the grammar's matcher. llguidance computes
the masks (docs/engine.md says why it, not xgrammar or outlines-core): a JSON schema it cannot
enforce is refused by name rather than silently loosened, and its mask computation lets go of
the GIL, so the engine prepares a step's masks on a thread of their own while the forward runs.

`Grammars` belongs to one engine: the llguidance tokenizer of the model's vocabulary (built on
first use) and the compiled grammars, kept by the digest of their text. Compilation and
validation run on the device's helper threads (they grow with the schema), never the tick thread.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
import torch

from ..contract.structured import JSON_OPTIONS, grammar_text
from ..contract.tool_calls import CALL_CLOSE, CALL_OPEN  # the format gateway and device share

CACHED_GRAMMARS = 256  # compiled grammars kept by digest (least recently used goes first)


class GrammarError(ValueError):
    """A grammar or schema that cannot be enforced: the message names what (a keyword, a type)."""


@dataclass(frozen=True)
class Grammar:
    """A compiled, validated grammar: `matcher()` gives a fresh matcher at its start."""
    digest: str  # sha256 hex of the grammar's text
    template: llguidance.LLMatcher

    def matcher(self) -> llguidance.LLMatcher:
        return self.template.deep_copy()


def schema_grammar(schema: dict[str, Any]) -> str:
    """llguidance's grammar text of a JSON schema (`{"type": "object"}` is any JSON object)."""
    try:
        return grammar_text(schema)
    except ValueError as err:
        raise GrammarError(f"the schema is not a JSON object: {err}") from None


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": tool["name"]},
                                             "arguments": tool.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_grammar(tools: list[dict[str, Any]], choice: str | dict[str, str], parallel: bool,
                 text_schema: dict[str, Any] | None = None) -> str:
    """llguidance's Lark grammar of an answer under `tools` (contract/tool_calls.py's format):
    `required` one call (or several, when `parallel`) of any tool; a named tool (`{"name": ...}`)
    exactly one call of it; `auto` those calls or text (JSON of `text_schema` when given)."""
    if isinstance(choice, dict):
        called, repeat = [t for t in tools if t["name"] == choice["name"]], ""
    else:
        called, repeat = tools, "+" if parallel else ""
    body = {"anyOf": [_call_schema(t) for t in called], "x-guidance": JSON_OPTIONS}
    rules = [f"calls: call{repeat}", f"call: {json.dumps(CALL_OPEN)} body {json.dumps(CALL_CLOSE)}",
             f"body: %json {json.dumps(body)}"]
    if choice == "auto":
        if text_schema is not None:
            rules += ["start: calls | text", f"text: %json {json.dumps({**text_schema, 'x-guidance': JSON_OPTIONS})}"]
        else:
            rules += ["start: calls | TEXT", "TEXT: /(?s:.+)/"]
    else:
        rules.append("start: calls")
    return "\n".join(rules) + "\n"


class Grammars:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int | None):
        self._tokenizer_json, self.vocab_size, self._eos = tokenizer_json, vocab_size, eos_token_id
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()  # helper threads compile concurrently

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:  # costly (it walks the whole vocabulary): on first use
                self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                         eos_token=self._eos)
            return self._tokenizer

    def compile(self, grammar: str) -> Grammar:
        """The grammar validated against the vocabulary and ready to match, from the cache when
        its digest was compiled before. GrammarError names what cannot be enforced: llguidance's
        warnings (a keyword it does not implement) refuse the grammar as its errors do."""
        digest = hashlib.sha256(grammar.encode("utf-8")).hexdigest()
        with self._lock:
            found = self._compiled.get(digest)
            if found is not None:
                self._compiled.move_to_end(digest)
                return found
        tokenizer = self.tokenizer
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error or messages:
            raise GrammarError("; ".join(messages) or "the grammar is not valid")
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(template.get_error())
        compiled = Grammar(digest, template)
        with self._lock:
            self._compiled[digest] = compiled
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled


def fill_masks(matchers: list[llguidance.LLMatcher], words: int) -> torch.Tensor:
    """Each matcher's allowed next tokens as bits (int32 `[n, words]`, on the CPU, least
    significant bit first). llguidance lets go of the GIL while it computes."""
    out = torch.empty(len(matchers), words, dtype=torch.int32)
    for i, matcher in enumerate(matchers):
        row = out[i]
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), words * 4)
    return out


# a mask's byte -> the additive biases of its 8 tokens (0 allowed, -inf not), least significant bit first
_BIAS_OF_BYTE = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, np.float32(0),
                         np.float32(-np.inf)).astype(np.float32)
_BIAS_ON: dict[torch.device, torch.Tensor] = {}


def mask_biases(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Masks as additive logit biases `[n, vocab]` float32 on the bits' device: one table lookup
    per byte (a boolean mask_fill of the logits costs far more than adding a bias, see
    docs/engine.md)."""
    if bits.device.type == "cpu":
        table = np.take(_BIAS_OF_BYTE, bits.numpy().view(np.uint8), axis=0)
        return torch.from_numpy(table.reshape(bits.shape[0], -1)[:, :vocab])
    return device_biases(bits, vocab)


def device_biases(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """mask_biases with torch operators, on whatever device holds the bits (a GPU's)."""
    on = _BIAS_ON.get(bits.device)
    if on is None:
        on = _BIAS_ON[bits.device] = torch.from_numpy(_BIAS_OF_BYTE).to(bits.device)
    return on[bits.view(torch.uint8).long()].reshape(bits.shape[0], -1)[:, :vocab]


def apply_biases(logits: torch.Tensor, rows: list[int], biases: torch.Tensor) -> torch.Tensor:
    """`logits` `[n, vocab]` with row rows[i]'s disallowed tokens at -inf (a copy: the forward's
    output may be a static CUDA-graph buffer). `biases`: mask_biases on the CPU, or the bits
    themselves, made biases here on the logits' device."""
    if biases.dtype == torch.int32:
        biases = mask_biases(biases.to(logits.device, non_blocking=True), logits.shape[1])
    logits = logits.float().clone()
    if len(rows) == logits.shape[0]:
        logits += biases
    else:
        index = torch.tensor(rows, device=logits.device)
        logits[index] += biases
    return logits


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
