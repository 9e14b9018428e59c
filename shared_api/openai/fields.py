"""The OpenAI request fields beyond sampling, and the answers they change: text a UTF-8 string
can hold, structured outputs (`response_format`) and function calling (`tools`, `tool_choice`,
`parallel_tool_calls`, the messages' calls and results), in the device's words
(gpu_worker/contract/chat.Chat checks what they hold); and how an answer's calls go back to the
client, whole or streamed (the format is gpu_worker/contract/tool_calls.py's)."""
from __future__ import annotations

import secrets
from typing import Any, Mapping

from gpu_worker.contract import tool_calls
from gpu_worker.contract.chat import TOOL_NAME

from ..errors import ServiceError


def utf8_text(value: str, code: str, name: str) -> str:
    """JSON admits lone surrogates (\\ud800) that no UTF-8 text holds: refuse them here."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ServiceError(400, code, f"{name} holds a lone surrogate, which is not text") from None
    return value


def tool_fields(message: dict[str, Any]) -> dict[str, object]:
    """A message's function-calling fields in the device's words: an assistant's `tool_calls` as
    [{id, name, arguments}], a tool result's `tool_call_id` (400 `invalid_messages` when malformed)."""
    role = message.get("role")
    extra: dict[str, object] = {}
    if role == "assistant" and message.get("tool_calls") is not None:
        calls = message["tool_calls"]
        if not isinstance(calls, list) or not calls or any(
                not isinstance(c, dict) or c.get("type", "function") != "function" or not isinstance(c.get("id"), str)
                or not isinstance(c.get("function"), dict) or not isinstance(c["function"].get("name"), str)
                or not isinstance(c["function"].get("arguments"), str) for c in calls):
            raise ServiceError(400, "invalid_messages", "an assistant message's tool_calls are [{id, type: function, "
                                                        "function: {name, arguments}}]")
        extra["tool_calls"] = [{"id": utf8_text(c["id"], "invalid_messages", "a tool call's id"),
                                "name": utf8_text(c["function"]["name"], "invalid_messages", "a tool call's name"),
                                "arguments": utf8_text(c["function"]["arguments"], "invalid_messages",
                                                   "a tool call's arguments")} for c in calls]
    elif role == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise ServiceError(400, "invalid_messages", "a tool message needs tool_call_id")
        extra["tool_call_id"] = utf8_text(message["tool_call_id"], "invalid_messages", "tool_call_id")
    return extra


def structured_args(body: Mapping[str, Any]) -> dict[str, object]:
    """OpenAI's response_format, tools, tool_choice and parallel_tool_calls in the device's words
    (gpu_worker/contract/chat.Chat checks what they hold)."""
    args: dict[str, object] = {}
    response_format = body.get("response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind in ("text", "json_object") and len(response_format) == 1:
            args["response_format"] = {"type": kind}
        elif kind == "json_schema" and set(response_format) == {"type", "json_schema"}:
            spec = response_format["json_schema"]
            if (not isinstance(spec, dict) or not set(spec) <= {"name", "description", "schema", "strict"}
                    or not isinstance(spec.get("name"), str) or not TOOL_NAME.fullmatch(spec["name"])
                    or spec.get("strict") not in (None, True, False)):
                raise ServiceError(400, "invalid_response_format", "json_schema is {name (letters, digits, _ and -, "
                                                                   "at most 64), description?, schema?, strict?}")
            # strict or not, the answer is held to the schema (constrained decoding)
            args["response_format"] = {"type": "json_schema", "schema": spec.get("schema", {})}
        else:
            raise ServiceError(400, "invalid_response_format", "response_format is {type: text}, {type: json_object} "
                                                               "or {type: json_schema, json_schema: {...}}")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or any(
                not isinstance(t, dict) or set(t) != {"type", "function"} or t["type"] != "function"
                or not isinstance(t["function"], dict)
                or not set(t["function"]) <= {"name", "description", "parameters", "strict"}
                or t["function"].get("strict") not in (None, True, False) for t in tools):
            raise ServiceError(400, "invalid_tools", "tools are [{type: function, function: {name, description?, "
                                                     "parameters?, strict?}}]")
        if tools:  # ([] is no tools)
            args["tools"] = [{k: v for k, v in t["function"].items() if k != "strict"} for t in tools]
    choice = body.get("tool_choice")
    if choice is not None:
        if isinstance(choice, dict):
            function = choice.get("function")
            if (set(choice) != {"type", "function"} or choice["type"] != "function" or not isinstance(function, dict)
                    or set(function) != {"name"}):
                raise ServiceError(400, "invalid_tool_choice", "tool_choice is none, auto, required or {type: "
                                                               "function, function: {name}}")
            choice = {"name": function["name"]}
        elif choice not in ("none", "auto", "required"):
            raise ServiceError(400, "invalid_tool_choice", "tool_choice is none, auto, required or {type: function, "
                                                           "function: {name}}")
        if choice != "none" or "tools" in args:
            args["tool_choice"] = choice
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        if type(parallel) is not bool:
            raise ServiceError(400, "invalid_parallel_tool_calls", "parallel_tool_calls must be a boolean")
        args["parallel_tool_calls"] = parallel
    return args


def call_object(name: str, arguments: str) -> dict[str, object]:
    return {"id": "call_" + secrets.token_hex(12), "type": "function",
            "function": {"name": name, "arguments": arguments}}


class CallStream:
    """One streamed choice's text when tools may be called: text that can still turn out to be
    calls is held back; once it is calls, each call goes out as one `tool_calls` delta when its
    closing tag arrives (contract/tool_calls.py's format)."""

    def __init__(self) -> None:
        self.held = ""
        self.calls = 0  # calls sent so far
        self.is_calls = False

    def feed(self, text: str) -> tuple[str, list[dict[str, object]]]:
        """The text that may go out as content now, and the calls completed by `text`."""
        self.held += text
        if not self.is_calls:
            if tool_calls.may_become_calls(self.held) and not self.held.startswith(tool_calls.CALL_OPEN):
                return "", []
            if not self.held.startswith(tool_calls.CALL_OPEN):
                out, self.held = self.held, ""
                return out, []
            self.is_calls = True
        calls = []
        while (end := self.held.find(tool_calls.CALL_CLOSE)) >= 0:
            whole = self.held[:end + len(tool_calls.CALL_CLOSE)]
            parsed = tool_calls.parse(whole)
            if parsed is None:  # (the grammar allows only calls here: text after all)
                break
            self.held = self.held[len(whole):]
            for name, arguments in parsed:
                calls.append({"index": self.calls, **call_object(name, arguments)})
                self.calls += 1
        return "", calls

    def finish(self, reason: str) -> tuple[str, str]:
        """The text still held (an answer cut short), and the finish reason to report."""
        if self.calls and not self.held and reason == "stop":
            return "", "tool_calls"
        held, self.held = self.held, ""
        return held, reason
