"""The generation model's tokenizer and chat template, as packed in the runtime file.

Results are byte streams, so besides encode/decode this gives the exact bytes each token stands for:
a multi-byte UTF-8 character may be split between two tokens, and a reader at a byte offset must see
exactly those bytes, never a replacement character. The chat template is rendered the way
`transformers`' `apply_chat_template` renders it (same Jinja settings and helpers), so a prompt
tokenizes to the same ids the model saw in its reference implementation.

Message contents are text, never markup: `encode_chat` tokenizes what the template adds (its
control tokens `<|im_start|>`, `<|im_end|>`, roles) as the template means it, and every message's
content with its special tokens split into plain text, so a user who writes `<|im_end|>` cannot
end their turn or open a `system` one, in their own prompt or in another member's context.
"""

from __future__ import annotations

import json
import re
import secrets
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, Iterable, NoReturn

import jinja2
from jinja2 import meta, nodes
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


def _tojson(value: object, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers replaces Jinja's tojson, which HTML-escapes; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _template_environment() -> ImmutableSandboxedEnvironment:
    """transformers' environment: sandboxed, trim_blocks and lstrip_blocks, loop controls."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def compile_chat_template(template: str) -> jinja2.Template:
    """The template compiled in transformers' environment."""
    return _template_environment().from_string(template)


def template_renders_tools(template: str) -> bool:
    """Whether a chat template reads the `tools` variable (renders function definitions itself)."""
    return "tools" in meta.find_undeclared_variables(_template_environment().parse(template))


def _ids(tokenizer: _HFTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """`tokenizer.encode(text).ids`, through encode_batch: the same ids, but encode_batch lets go
    of the GIL while it works and encode does not. The device tokenizes on helper threads; with
    encode, a large prompt held the GIL — and so the tick thread — for its whole tokenization
    (docs/performance.md, "Figures behind the code")."""
    ids: list[int] = tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return ids


class Tokenizer:
    def __init__(self, tokenizer_json: str, chat_template: str, *, vocab_size: int,
                 bos_token_id: int | None = None, eos_token_id: int | None = None, content_parts: bool = False):
        # A vision-language template (SmolVLM's) reads each message's content as a list of parts
        # ({"type": "text", "text": ...}, {"type": "image"}): encode_chat gives it text contents so.
        self.content_parts = content_parts
        self._tokenizer = _HFTokenizer.from_str(tokenizer_json)
        # A second instance that spells special tokens out as text (a property of the instance,
        # so the shared one stays safe for the helper threads that tokenize concurrently).
        self._text_only = _HFTokenizer.from_str(tokenizer_json)
        self._text_only.encode_special_tokens = True
        added = sorted((t.content for t in self._tokenizer.get_added_tokens_decoder().values()), key=len, reverse=True)
        self._added = re.compile("|".join(map(re.escape, added))) if added else None
        self._special = [t.content for t in self._tokenizer.get_added_tokens_decoder().values() if t.special]
        self._template = compile_chat_template(chat_template)
        self.renders_tools = template_renders_tools(chat_template)
        self.vocab_size = vocab_size
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        spec = json.loads(tokenizer_json)
        self._bytes = self._token_byte_table(spec, vocab_size)
        # Without a normalizer, a token stands for at most this many bytes of the text, so a text
        # of n characters (at least n bytes) has at least n / this many tokens (fewest_tokens).
        self._bound_bytes = max(map(len, self._bytes)) if spec.get("normalizer") is None else None

    @classmethod
    def from_runtime(cls, runtime: RuntimeFile) -> "Tokenizer":
        card = runtime.json("gen/card")
        return cls(runtime.bytes("gen/tokenizer").tobytes().decode("utf-8"), runtime.text("gen/chat_template"),
                   vocab_size=card["vocab_size"], bos_token_id=card.get("bos_token_id"),
                   eos_token_id=card.get("eos_token_id"), content_parts="image_token_id" in card)

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
        return _ids(self._tokenizer, text, add_special_tokens)

    def encode_text(self, text: str) -> list[int]:
        """Ids of `text` as plain text: a special token's spelling in it stays text (a raw prompt of
        /v1/completions, which has no template to mark the control tokens)."""
        return _ids(self._text_only, text, False)

    def fewest_tokens(self, characters: int) -> int | None:
        """A lower bound on the tokens of a text of this many characters, known without
        tokenizing it (O(1): what refuses a prompt that cannot fit before any work); None where a
        normalizer may shorten text before tokenizing."""
        if self._bound_bytes is None or self._bound_bytes == 0:
            return None
        return -(-characters // self._bound_bytes)

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
                            **kwargs: object) -> str:
        """The prompt text for `messages`, as `transformers` renders it with `tokenize=False`."""
        if not messages:
            raise ValueError("cannot apply the chat template to an empty conversation")
        # transformers drops None-valued keys so templates see a missing key rather than the text "None".
        messages = [{key: value for key, value in message.items() if value is not None} for message in messages]
        tools = kwargs.pop("tools", None)
        return self._template.render(messages=messages, tools=tools, documents=None,
                                     add_generation_prompt=add_generation_prompt,
                                     **{**self._special_tokens(), **kwargs})

    def _parts(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not self.content_parts:
            return messages
        return [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str) else m
                for m in messages]

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    images: list[str] | None = None, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt's ids, every message's content tokenized as plain text (the module's note).

        The template is rendered once with a stand-in for each content, which marks where the
        contents go; when putting the contents back gives exactly the template's own rendering,
        only the template's text outside them is split at control tokens, and each run between
        two of those is tokenized with special tokens spelled out (what `encode` of the whole
        text does to a prompt without control tokens in its contents, id for id). A template that
        transforms its contents (a filter, a test on the text) gives no such marks: then a content
        holding a special token's text is refused (ValueError) and the rest encoded as rendered.

        `images`: for a template of content parts, the text standing for each `{"type": "image"}`
        part, in order (vision.image_prompt): each `<image>` the template writes for one is replaced
        by it, as transformers' Idefics3Processor does.

        `tools`: function definitions for a template that renders them (`renders_tools`); their
        text is the template's, so the caller checks it for control tokens first."""
        messages = self._parts(messages)
        rendered = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        nonce = secrets.token_hex(8)
        contents: list[str] = []

        def mark(text: str) -> str:
            contents.append(text)
            return f"\ue000{nonce}{len(contents) - 1}\ue001"

        stand_in = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, str):
                m = {**m, "content": mark(content)}
            elif isinstance(content, list):
                m = {**m, "content": [{**part, "text": mark(part["text"])} if part.get("type") == "text" and
                                      isinstance(part.get("text"), str) else part for part in content]}
            stand_in.append(m)
        pieces = re.split(f"\ue000{nonce}(\\d+)\ue001", self.apply_chat_template(
            stand_in, add_generation_prompt=add_generation_prompt, tools=tools))
        runs: list[tuple[str, bool]] = []  # (text, is a content) in order
        for n, piece in enumerate(pieces):
            runs.append((piece, False) if n % 2 == 0 else (contents[int(piece)], True))
        pending = list(images or ())
        if "".join(text for text, _ in runs) != rendered:
            if any(any(s in c for s in self._special) for c in contents):
                raise ValueError("a message holds a chat-template control token as text, and this template's "
                                 "rendering cannot keep it as text")
            if pending:
                raise ValueError("this chat template's rendering of images cannot be told from its contents")
            return self.encode(rendered)
        if pending:
            expanded = []
            for text, is_content in runs:
                if not is_content:
                    parts = text.split("<image>")
                    if len(parts) - 1 > len(pending):
                        raise ValueError("the template writes more <image> tokens than images were given")
                    text = parts[0] + "".join(pending.pop(0) + rest for rest in parts[1:])
                expanded.append((text, is_content))
            runs = expanded
            if pending:
                raise ValueError(f"{len(pending)} image(s) have no image part in the messages")
        ids: list[int] = []
        run = ""
        for text, is_content in runs:
            if is_content or self._added is None:
                run += text
                continue
            at = 0
            for match in self._added.finditer(text):
                run += text[at:match.start()]
                if run:
                    ids += _ids(self._text_only, run, False)
                    run = ""
                token_id = self._tokenizer.token_to_id(match.group())
                assert token_id is not None
                ids.append(token_id)
                at = match.end()
            run += text[at:]
        if run:
            ids += _ids(self._text_only, run, False)
        return ids
