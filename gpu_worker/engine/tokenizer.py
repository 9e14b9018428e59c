"""The generation model's tokenizer and chat template, as packed in the runtime file.

Results are byte streams, so besides encode/decode this gives the exact bytes each token stands for:
a multi-byte UTF-8 character may be split between two tokens, and a reader at a byte offset must see
exactly those bytes, never a replacement character. The chat template is rendered the way
`transformers`' `apply_chat_template` renders it (same Jinja settings and helpers), so a prompt
tokenizes to the same ids the model saw in its reference implementation.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, Iterable, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

if TYPE_CHECKING:
    from jinja2.parser import Parser

    from gpu_worker.storage.runtime_file import RuntimeFile


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for every byte, inverted: byte-level BPE tokens are spelled in it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {chr(b if b in printable else next(extra)): b for b in range(256)}


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`: transformers' assistant-mask tag; it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers replaces Jinja's tojson, which HTML-escapes; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(template: str) -> jinja2.Template:
    """The template compiled in transformers' environment: sandboxed, trim_blocks and lstrip_blocks, loop controls."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


class Tokenizer:
    def __init__(self, tokenizer_json: str, chat_template: str, *, vocab_size: int,
                 bos_token_id: int | None = None, eos_token_id: int | None = None):
        self._tokenizer = _HFTokenizer.from_str(tokenizer_json)
        self._template = compile_chat_template(chat_template)
        self.vocab_size = vocab_size
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self._bytes = self._token_byte_table(json.loads(tokenizer_json), vocab_size)

    @classmethod
    def from_runtime(cls, runtime: RuntimeFile) -> "Tokenizer":
        card = runtime.json("gen/card")
        return cls(runtime.bytes("gen/tokenizer").tobytes().decode("utf-8"), runtime.text("gen/chat_template"),
                   vocab_size=card["vocab_size"], bos_token_id=card.get("bos_token_id"),
                   eos_token_id=card.get("eos_token_id"))

    def _token_byte_table(self, spec: dict[str, Any], vocab_size: int) -> list[bytes]:
        """Every id's raw bytes, computed once: byte-level BPE spells bytes in GPT-2's stand-in alphabet,
        SentencePiece with byte fallback spells them `<0xNN>` and spaces `▁`; added tokens are their text."""
        sentencepiece = bool(spec["model"].get("byte_fallback"))
        byte_of = _byte_decoder()
        table = []
        for token_id in range(vocab_size):
            piece = self._tokenizer.id_to_token(token_id)
            if piece is None:  # the model's vocabulary can be padded beyond the tokenizer's
                table.append(b"")
            elif sentencepiece:
                is_byte = len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")
                table.append(bytes([int(piece[3:5], 16)]) if is_byte else piece.replace("▁", " ").encode("utf-8"))
            elif all(ch in byte_of for ch in piece):
                table.append(bytes(byte_of[ch] for ch in piece))
            else:
                table.append(piece.encode("utf-8"))
        for added in spec.get("added_tokens", ()):
            if added["id"] < vocab_size:
                table[added["id"]] = added["content"].encode("utf-8")
        return table

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of `text`; special tokens written in the text are recognised (as the chat template relies on).
        No BOS by default: a rendered chat template already holds everything the model expects."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id]

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return b"".join(self._bytes[i] for i in ids)

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def _special_tokens(self) -> dict[str, str]:
        # transformers passes its special_tokens_map to the template; these two are what the card knows.
        names: dict[str, str] = {}
        for key, token_id in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id)):
            if token_id is not None and self._tokenizer.id_to_token(token_id) is not None:
                names[key] = self._tokenizer.id_to_token(token_id)  # type: ignore[assignment]  # not None: above
        return names

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The prompt text for `messages`, as `transformers` renders it with `tokenize=False`."""
        if not messages:
            raise ValueError("cannot apply the chat template to an empty conversation")
        # transformers drops None-valued keys so templates see a missing key rather than the text "None".
        messages = [{key: value for key, value in message.items() if value is not None} for message in messages]
        return self._template.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt,
                                     **{**self._special_tokens(), **kwargs})

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt))
