"""The declared types of the commands behind the OpenAI-compatible routes (/v1/chat/completions,
/v1/completions, /v1/embeddings): their refusals follow OpenAI's error codes (`invalid_<param>`),
which OpenAI's API reference documents, not this service's OpenAPI document."""
from __future__ import annotations

import json
import re
from typing import Any

from . import ids
from .args import Args, integer, number_in
from .errors import ServiceError
from .limits import MAX_CHOICES, MAX_MEDIA, MAX_SCHEMA_BYTES, MAX_TOOLS, MAX_TOP_LOGPROBS
from .structured import check_response_format, check_schema

ROLES = ("system", "user", "assistant", "tool")
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}", re.ASCII)  # OpenAI's function names
PENALTIES = ("presence_penalty", "frequency_penalty")  # OpenAI's, on tokens already generated
MAX_EMBEDDING_INPUTS = 256  # texts per embeddings request


class Embeddings(Args, kw_only=True, frozen=True):
    model: str
    input: list[str]

    @classmethod
    def error_code(cls, field: str | None) -> str:
        return "invalid_model" if field == "model" else "invalid_input"

    @classmethod
    def before(cls, raw: dict[str, object]) -> None:
        """OpenAI's null is "not given"."""

    def __post_init__(self) -> None:
        if (type(self.input) is not list or not 1 <= len(self.input) <= MAX_EMBEDDING_INPUTS
                or any(type(t) is not str or not t for t in self.input)):
            raise ServiceError(400, "invalid_input", f"input must be 1..{MAX_EMBEDDING_INPUTS} non-empty strings")


class Chat(Args, kw_only=True, frozen=True):
    """chat.completions: `messages` ({role, content}, content a string or text and image parts,
    each image part's bytes in `images` in order), or a plain `prompt` (/v1/completions)."""
    model: str
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    images: list[bytes] | None = None
    stream: bool = False
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] | None = None
    n: int = 1
    seed: int | None = None
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # structured outputs: {"type": "json_object"} or {"type": "json_schema", "schema": {...}}
    response_format: dict[str, Any] | None = None
    # function calling (contract/tool_calls.py): [{"name", "description"?, "parameters"?}], and
    # tool_choice "none" | "auto" | "required" | {"name": ...} (default "auto" with tools)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    @property
    def constrained(self) -> bool:
        """Whether its answer is held to a grammar (a schema, or tool calls)."""
        return self.response_format is not None and self.response_format.get("type") != "text" or (
            bool(self.tools) and self.tool_choice != "none")

    def __post_init__(self) -> None:
        if self.prompt is not None:
            if type(self.prompt) is not str or not self.prompt or self.messages is not None:
                raise ServiceError(400, "invalid_prompt", "prompt must be a non-empty string (and no messages)")
        elif (type(self.messages) is not list or not self.messages
                or any(type(m) is not dict or m.get("role") not in ROLES or not _content_ok(m.get("content"))
                       for m in self.messages)):
            raise ServiceError(400, "invalid_messages", "messages must be a non-empty list of {role, content}")
        elif any(not _turn_ok(m) for m in self.messages):
            raise ServiceError(400, "invalid_messages", "an assistant message's tool_calls are [{id, name, "
                                                        "arguments}] and a tool message names its tool_call_id")
        parts = 0 if self.messages is None else sum(1 for m in self.messages if type(m["content"]) is list
                                                    for p in m["content"] if p["type"] == "image")
        images = self.images
        if (images is not None or parts) and (
                type(images) is not list or not 1 <= len(images) <= MAX_MEDIA
                or any(type(data) is not bytes or not data for data in images) or len(images) != parts):
            raise ServiceError(400, "invalid_messages", f"images must be 1..{MAX_MEDIA} byte strings, one per image "
                                                        "part of the messages")
        if self.stop is not None and (type(self.stop) is not list or len(self.stop) > 4
                                      or any(type(s) is not str or not s for s in self.stop)):
            raise ServiceError(400, "invalid_stop", "stop must be a string or up to 4 strings")
        if self.seed is not None and (type(self.seed) is not int or not 0 <= self.seed < 1 << 63):
            raise ServiceError(400, "invalid_seed", "seed must be an integer 0..2^63-1")
        for name in PENALTIES:
            number_in(getattr(self, name), name, -2, 2, code=f"invalid_{name}")
        number_in(self.temperature, "temperature", 0, 2, code="invalid_temperature")
        number_in(self.top_p, "top_p", 0, 1, open_low=True, code="invalid_top_p")
        integer(self.logprobs, "logprobs", 0, MAX_TOP_LOGPROBS, code="invalid_logprobs")
        integer(self.n, "n", 1, MAX_CHOICES, code="invalid_n")
        integer(self.max_tokens, "max_tokens", 1, ids.MAX_COUNTER, code="invalid_max_tokens")
        check_response_format(self.response_format)
        _check_tools(self.tools, self.tool_choice)
        if self.stop and self.constrained:
            raise ServiceError(400, "invalid_stop", "stop cannot be combined with response_format or tools (a stop "
                                                    "string could cut the answer short of complete)")

    @classmethod
    def error_code(cls, field: str | None) -> str:
        """OpenAI's routes name the parameter in the code (`invalid_temperature`)."""
        return "invalid_messages" if field in (None, "images") else f"invalid_{field}"

    @classmethod
    def before(cls, raw: dict[str, object]) -> None:
        """OpenAI's null is "not given" (the routes leave nulls out already)."""


def _turn_ok(message: dict[str, Any]) -> bool:
    """The function-calling keys of a message: an assistant's calls, a tool result's call id."""
    extra = set(message) - {"role", "content"}
    if message["role"] == "assistant" and "tool_calls" in message:
        calls = message["tool_calls"]
        return extra == {"tool_calls"} and type(calls) is list and bool(calls) and all(
            type(c) is dict and set(c) == {"id", "name", "arguments"} and all(type(v) is str for v in c.values())
            for c in calls)
    if message["role"] == "tool":
        return extra == {"tool_call_id"} and type(message["tool_call_id"]) is str
    return not extra


def _check_tools(tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None) -> None:
    if tools is not None:
        if type(tools) is not list or not 1 <= len(tools) <= MAX_TOOLS or any(
                type(t) is not dict or not set(t) <= {"name", "description", "parameters"}
                or type(t.get("name")) is not str or not TOOL_NAME.fullmatch(t["name"])
                or type(t.get("description", "")) is not str for t in tools):
            raise ServiceError(400, "invalid_tools", f"tools must be 1..{MAX_TOOLS} functions {{name (letters, "
                                                     "digits, _ and -, at most 64), description?, parameters?}")
        if len({t["name"] for t in tools}) != len(tools):
            raise ServiceError(400, "invalid_tools", "two tools have the same name")
        if len(json.dumps(tools)) > MAX_SCHEMA_BYTES:
            raise ServiceError(413, "schema_too_large", f"the tools exceed {MAX_SCHEMA_BYTES} bytes as JSON")
        for t in tools:
            if "parameters" in t:
                check_schema(t["parameters"], f"tool {t['name']}'s parameters", "invalid_tools")
    if choice is None or choice in ("none", "auto", "required"):
        if choice in ("auto", "required") and not tools:
            raise ServiceError(400, "invalid_tool_choice", f"tool_choice {choice!r} needs tools")
        return
    if type(choice) is not dict or set(choice) != {"name"} or not any(t["name"] == choice["name"] for t in tools or ()):
        raise ServiceError(400, "invalid_tool_choice", "tool_choice is none, auto, required or {name} of one of the "
                                                       "tools")


def _content_ok(content: object) -> bool:
    """A message's content: a string, or text and image parts (`{"type": "image"}`, its bytes in
    `images`); an assistant's calls may come with none (the empty string)."""
    return type(content) is str or (type(content) is list and bool(content) and all(
        type(p) is dict and ((p.get("type") == "text" and type(p.get("text")) is str and len(p) == 2)
                             or (p.get("type") == "image" and len(p) == 1)) for p in content))
