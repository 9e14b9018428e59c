"""Fitting a conversation's turns into the model's input: the prompt of the most recent turns that
fit the room an input's page limit leaves (kinds/inputs.py says how that room is set). Used for
conversation inputs (execution.py) and for inputs with images (images.py), on helper threads.
Also the model's control tokens, which a caller's text may not carry (`ControlTokens`)."""
from __future__ import annotations

import json
import re
from typing import Protocol

from ..contract.commands import RESERVED_TOKENS


class ControlTokens:
    """The control tokens of the packed model, which submitted text may not carry (SPEC: reserved
    media control tokens in submitted text are refused before memory retention): every added token
    of the runtime's tokenizer spelled `<...>` (its special tokens: `<|im_start|>`, and a vision
    model's media tokens: SmolVLM's `<image>`, `<fake_token_around_image>`, `<global-img>`,
    `<row_1_col_1>` ...), with the families' media tokens the gateway refuses already
    (contract/commands.py RESERVED_TOKENS). `find` is one scan of a compiled alternation, and none
    at all for a text without '<' (most): an input's 2 KiB on the tick thread, a chat's messages on
    a helper thread."""

    def __init__(self, tokenizer_json: str) -> None:
        spec = json.loads(tokenizer_json)
        found = {t["content"] for t in spec.get("added_tokens", ())
                 if isinstance(t.get("content"), str) and t["content"].startswith("<") and t["content"].endswith(">")}
        self.tokens = tuple(sorted(found | set(RESERVED_TOKENS), key=lambda t: (-len(t), t)))
        self._pattern = re.compile("|".join(map(re.escape, self.tokens)))

    def find(self, text: str) -> str | None:
        """The first control token `text` holds, None when it holds none."""
        if "<" not in text:
            return None
        m = self._pattern.search(text)
        return m.group(0) if m else None


class ChatEncoder(Protocol):
    """What fits a prompt: a chat's messages as the model's prompt ids (engine/tokenizer.py
    `Tokenizer`, or images.py's with the prepared images' text)."""

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]: ...


def fit_prompt(tokenizer: ChatEncoder, messages: list[dict[str, str]], room: int,
               system: str | None = None) -> list[int] | None:
    """The prompt of the most recent turns that fit `room` tokens (turns are user + assistant
    pairs before the last message), with the recalled-memory system message, when there is one,
    between them and the input (after the turns, so a conversation's earlier turns stay the same
    prefix from one input to the next and keep their KV pages: engine/block_manager.py), or None
    when the input alone does not fit. Any thread: it reads nothing but its arguments.
    The number of oldest turns to drop is found by bisection (the prompt only shrinks as turns
    go), so a long history costs O(log turns) encodings, not one per dropped turn. When even the
    input alone does not fit beside the recalled memory, the memory goes first."""
    turns = (len(messages) - 1) // 2
    head = [{"role": "system", "content": system}] if system else []

    def encoded(dropped: int) -> list[int]:
        return tokenizer.encode_chat(messages[2 * dropped:-1] + head + messages[-1:])

    ids = encoded(0)
    if len(ids) <= room:
        return ids
    alone = encoded(turns)
    if len(alone) > room:
        return fit_prompt(tokenizer, messages, room) if head else None
    low, high = 0, turns  # encoded(low) does not fit, encoded(high) does
    best = alone
    while high - low > 1:
        middle = (low + high) // 2
        candidate = encoded(middle)
        if len(candidate) <= room:
            high, best = middle, candidate
        else:
            low = middle
    return best
