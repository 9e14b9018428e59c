"""Function calling: how tools, calls and their results are written into a prompt, and how an
answer's calls are read back (docs/api.md, "Tools and structured outputs").

The model writes each call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (the
Hermes format, which Qwen's and Hermes' templates use). The device constrains the answer to that
form (gpu_worker/engine/grammar.tool_grammar) and the gateway reads it back with `parse`, for a whole
answer or the stream's text so far.

A chat template that renders tools itself (it names `tools`) gets them and the messages' calls
and results in transformers' shape. Any other template gets this module's rendering: the tool
list and the call format as text in the system message, an assistant's calls as its content, and
each tool result as a `tool` turn wrapped in `<tool_response>`.
"""
from __future__ import annotations

import json
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"

TOOLS_PREAMBLE = ("You may call one or more functions to answer. The functions are given as JSON schemas "
                  "in <tools></tools>:\n<tools>\n{tools}\n</tools>\nTo call a function, answer with one "
                  "<tool_call></tool_call> block per call, each holding a JSON object with the function's "
                  "name and arguments:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
                  "<args-json-object>}}\n</tool_call>")


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (`arguments`: the call's JSON text, as OpenAI carries it)."""
    return CALL_OPEN + json.dumps({"name": name, "arguments": _arguments(arguments)}, ensure_ascii=False) + CALL_CLOSE


def parse(text: str) -> list[tuple[str, str]] | None:
    """The calls an answer holds, `(name, arguments as JSON text)` each, when the whole answer
    is calls; None when it is text (or not complete calls)."""
    calls: list[tuple[str, str]] = []
    rest = text
    while rest:
        if not rest.startswith(CALL_OPEN):
            return None
        end = rest.find(CALL_CLOSE)
        if end < 0:
            return None
        try:
            call = json.loads(rest[len(CALL_OPEN):end])
        except ValueError:
            return None
        if (not isinstance(call, dict) or not isinstance(call.get("name"), str)
                or not isinstance(call.get("arguments"), dict)):
            return None
        calls.append((call["name"], json.dumps(call["arguments"], ensure_ascii=False)))
        rest = rest[end + len(CALL_CLOSE):]
    return calls or None


def may_become_calls(text: str) -> bool:
    """Whether a streamed answer's text so far can still turn out to be calls (the gateway
    holds it back until it can tell)."""
    return CALL_OPEN.startswith(text) or text.startswith(CALL_OPEN)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages for a template that renders tools: calls in transformers' shape (arguments
    as an object)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{"type": "function", "id": c["id"], "function": {
                "name": c["name"], "arguments": _arguments(c["arguments"])}} for c in m["tool_calls"]]}
        out.append(m)
    return out


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The messages for a template that does not render tools: plain {role, content} turns."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            text = m.get("content") or ""
            text += "".join(call_text(c["name"], c["arguments"]) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            out.append({"role": "tool", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        listing = "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in tools)
        preamble = TOOLS_PREAMBLE.format(tools=listing)
        if out and out[0]["role"] == "system" and isinstance(out[0]["content"], str):
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + preamble}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


def _arguments(arguments: str) -> object:
    """A call's arguments as JSON, or kept as the string when a client's own history holds text
    that is not JSON (not refused)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
