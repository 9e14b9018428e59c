"""One generation request: its prompt, its sampling settings, its pages and what it has produced.

Output is a byte stream. A stop string must not appear in it, yet the bytes before a stop string
are released as they are produced; so the bytes that could still begin a stop string are held back
until the next token settles it. Without stop strings every token's bytes are released at once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Hashable

import torch

FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED = "stop", "length", "cancelled"


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: object
    prompt_ids: list[int]
    max_new_tokens: int
    page_limit: int
    # Tokens whose keys and values fit in the page limit (and the model's trained context).
    token_capacity: int
    temperature: float = 0.0
    top_p: float = 1.0
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[bytes, ...] = ()
    seed: int = 0
    tenant: Hashable = None  # whose turn it takes in the scheduler's round-robin (scheduler.py)
    presence_penalty: float = 0.0   # OpenAI's penalties on tokens already generated (sampling.penalize)
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # OpenAI's logprobs: None off, else how many top alternatives (0..MAX_TOP_LOGPROBS)
    # constrained decoding (grammar.py): the llguidance matcher of its grammar, fed each sampled token
    matcher: Any = None

    output_ids: list[int] = field(default_factory=list)
    output_bytes: bytearray = field(default_factory=bytearray)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    pages: list[int] = field(default_factory=list)  # the block table, filled at admission
    # prefix cache (block_manager.py): the chained hashes of its full prompt pages, and how many of its
    # first tokens were found cached at admission (prefill starts there)
    page_hashes: list[bytes] = field(default_factory=list)
    cached_tokens: int = 0
    generator: torch.Generator | None = None  # set at admission when sampling is not greedy
    # images (vision.py): the prompt positions of its image tokens and their features `[n, hidden]`,
    # which the prefill puts in place of those tokens' embeddings
    image_positions: list[int] = field(default_factory=list)
    image_features: torch.Tensor | None = None
    cache_salt: Hashable = None  # what starts its prefix-cache hash chain: the tenant (and its images' digests)
    _held: bytes = b""

    def __post_init__(self) -> None:
        if self.cache_salt is None:
            self.cache_salt = self.tenant

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_cached(self) -> int:
        """Tokens whose keys and values are in the pool: the newest token is written by the next decode step."""
        if self.status is not Status.RUNNING or not self.output_ids:
            return 0
        return self.length - 1

    @property
    def max_output_tokens(self) -> int:
        # Producing output token k >= 2 first writes token k-1 at position len(prompt) + k - 2; the newest
        # token itself needs no slot. So a capacity of C slots allows C - len(prompt) + 1 output tokens.
        return min(self.max_new_tokens, self.token_capacity - len(self.prompt_ids) + 1)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append(self, token_id: int, token_bytes: bytes, complete: bool = False) -> tuple[bytes, str | None]:
        """Record a sampled token; returns the output bytes it releases and the finish reason, if any.
        `complete`: the token completes its grammar, which allows nothing after it ("stop")."""
        self.output_ids.append(token_id)
        released, reason = self._release(token_id, token_bytes)
        if complete and reason is None:
            released, reason = released + self._held, FINISH_STOP
            self._held = b""
        if reason is None and len(self.output_ids) >= self.max_output_tokens:
            released, reason = released + self._held, FINISH_LENGTH
            self._held = b""
        self.output_bytes += released
        if reason is not None:
            self.finish(reason)
        return released, reason

    def _release(self, token_id: int, token_bytes: bytes) -> tuple[bytes, str | None]:
        if token_id in self.stop_token_ids:
            # A stop token contributes no bytes; what was held is no stop string after all.
            held, self._held = self._held, b""
            return held, FINISH_STOP
        pending = self._held + token_bytes
        matches = [i for i in (pending.find(s) for s in self.stop_strings) if i >= 0]
        if matches:
            self._held = b""
            return pending[:min(matches)], FINISH_STOP
        keep = max((k for s in self.stop_strings for k in range(1, len(s)) if pending.endswith(s[:k])), default=0)
        self._held = pending[len(pending) - keep:] if keep else b""
        return pending[:len(pending) - keep], None

    def finish(self, reason: str) -> None:
        self.status, self.finish_reason = Status.FINISHED, reason
        self.generator = None
