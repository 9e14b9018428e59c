"""POST /v1/chat/completions (device command `chat.completions`, the `chat` action): plain JSON
and SSE streams built from the device's `more` frames; errors in OpenAI's shape
{"error": {"message", "type", "param", "code"}}."""
import base64
import json

import pytest
from asgiref.sync import async_to_sync

from gpu_worker.contract.limits import MAX_CHAT_BODY_BYTES
from tests import rsgi
from tests.conftest import wait_for

from .conftest import (BAD_AUTHORIZATIONS, DEVICE_TIMEOUT, HOLDER, WWW_AUTHENTICATE, action_of, assert_openai_error,
                       rsgi_request, assert_request, lacking)

PATH = "/v1/chat/completions"
OP = "chat.completions"
ACTION = action_of(OP)
MESSAGES = [{"role": "user", "content": "hello"}]
RESULT = {"text": "Hi there", "finish_reason": "stop", "prompt_tokens": 5, "completion_tokens": 3}
FINAL = {"finish_reason": "length", "prompt_tokens": 4, "completion_tokens": 2}


def chat(**fields):
    return {"model": "tiny-llama", "messages": MESSAGES, **fields}


def post(gateway, persona, body=None, raw=None, **kwargs):
    return gateway.post(PATH, persona, body, raw=raw, **kwargs)


def completes(result=RESULT):
    """A device handler answering a plain (non-streamed) chat."""
    return lambda req: (200, json.dumps(result).encode())


def streams(*pieces, final=FINAL, status=200):
    """A device handler answering a streamed chat: one `more` frame per piece, then the last frame."""
    def handler(req):
        frames = [{"status": 200, "body": piece, "more": True} for piece in pieces]
        return frames + [{"status": status, "body": final if isinstance(final, bytes) else json.dumps(final).encode()}]
    return handler


def stream(persona, body):
    """(response, the whole streamed body), through the gateway's application as the server
    runs it: the front sends an SSE stream's chunks as they come and ends it."""
    data = json.dumps(body).encode()
    headers = [(b"authorization", persona.authorization.encode()), (b"content-type", b"application/json"),
               (b"content-length", str(len(data)).encode())]
    response = async_to_sync(rsgi_request)("POST", PATH, headers, data)
    return response, response.content


def events(content):
    """The `data:` payloads of an SSE body, in order."""
    assert content.endswith(b"\n\n"), content[-50:]
    out = []
    for event in content.decode().split("\n\n")[:-1]:
        assert event.startswith("data: "), event
        out.append(event[len("data: "):])
    return out


# ---- refused before the device

@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
def test_it_refuses_a_missing_malformed_or_unknown_token(gateway, device, people, authorization):
    response = post(gateway, None, chat(), authorization=authorization)
    assert_openai_error(response, 401, "unauthenticated", "authentication_error")
    assert response["WWW-Authenticate"] == WWW_AUTHENTICATE
    assert device.requests == []


def test_it_refuses_a_revoked_principal(gateway, device, people):
    response = post(gateway, people["revoked"], chat())
    assert_openai_error(response, 401, "unauthenticated", "authentication_error")
    assert response["WWW-Authenticate"] == WWW_AUTHENTICATE
    assert device.requests == []


@pytest.mark.parametrize("name", lacking(ACTION))
def test_it_refuses_a_principal_without_the_chat_action(gateway, device, people, name):
    error = assert_openai_error(post(gateway, people[name], chat()), 403, "grant_missing", "permission_error")
    assert ACTION in error["message"]
    assert device.requests == []


def test_it_checks_the_token_before_the_body(gateway, device, people):
    assert_openai_error(post(gateway, people["reader"], raw=b"{nope"), 403, "grant_missing", "permission_error")
    assert device.requests == []


def test_it_refuses_get(gateway, device, people):
    response = gateway.get(PATH, people["chatter"])
    assert response.status_code == 405 and json.loads(response.content)["error"]["code"] == "method_not_allowed"
    assert response["Cache-Control"] == "no-store"
    assert device.requests == []


@pytest.mark.parametrize("raw", [b"{nope", b"\xff\xfe{}", b"[]", b'"hello"', b""],
                         ids=["not-json", "invalid-utf8", "an-array", "a-string", "empty"])
def test_it_rejects_a_body_that_is_not_a_json_object(gateway, device, people, raw):
    assert_openai_error(post(gateway, people["chatter"], raw=raw), 400, "invalid_json", "invalid_request_error")
    assert device.requests == []


def test_it_refuses_a_body_over_1_mib(gateway, device, people):
    body = chat(messages=[{"role": "user", "content": "x" * MAX_CHAT_BODY_BYTES}])
    response = post(gateway, people["chatter"], body)
    assert response.status_code == 413 and json.loads(response.content)["error"]["code"] == "body_too_large"
    assert device.requests == []


@pytest.mark.parametrize("body, code", [
    ({"messages": MESSAGES}, "invalid_model"),
    (chat(model=7), "invalid_model"),
    (chat(messages=[]), "invalid_messages"),
    (chat(messages="hello"), "invalid_messages"),
    (chat(messages=["hello"]), "invalid_messages"),
    (chat(messages=[{"role": "user"}]), "invalid_messages"),
    (chat(messages=[{"role": "user", "content": 5}]), "invalid_messages"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "invalid_image_url"),
    (chat(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}]),
     "invalid_messages"),
    (chat(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}]), "invalid_messages"),
    (chat(max_tokens=0), "invalid_max_tokens"),
    (chat(max_tokens=8.0), "invalid_max_tokens"),
    (chat(max_tokens="8"), "invalid_max_tokens"),
    (chat(max_tokens=True), "invalid_max_tokens"),
    (chat(max_completion_tokens=-1, max_tokens=8), "invalid_max_tokens"),
    (chat(temperature=2.5), "invalid_temperature"),
    (chat(temperature=-0.1), "invalid_temperature"),
    (chat(temperature="1"), "invalid_temperature"),
    (chat(top_p=0), "invalid_top_p"),
    (chat(top_p=1.01), "invalid_top_p"),
    (chat(stop=["a", "b", "c", "d", "e"]), "invalid_stop"),
    (chat(stop=[""]), "invalid_stop"),
    (chat(stop=3), "invalid_stop"),
    (chat(n=0), "invalid_n"),
    (chat(n=17), "invalid_n"),
    (chat(n=2.0), "invalid_n"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_it_rejects_an_invalid_request_without_calling_the_device(gateway, device, people, body, code):
    assert_openai_error(post(gateway, people["chatter"], body), 400, code, "invalid_request_error")
    assert device.requests == []


def test_it_rejects_stream_options_that_are_not_an_object(gateway, device, people):
    body = chat(stream=True, stream_options="include_usage")
    assert_openai_error(post(gateway, people["chatter"], body), 400, "invalid_stream_options", "invalid_request_error")
    assert device.requests == []


def test_it_rejects_a_max_tokens_the_device_frame_cannot_carry(gateway, device, people):
    assert_openai_error(post(gateway, people["chatter"], chat(max_tokens=1 << 64)), 400, "invalid_max_tokens",
                        "invalid_request_error")
    assert device.requests == []


def test_it_rejects_text_with_a_lone_surrogate(gateway, device, people):
    raw = b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\\ud800"}]}'
    assert_openai_error(post(gateway, people["chatter"], raw=raw), 400, "invalid_messages", "invalid_request_error")
    assert device.requests == []


# ---- plain completions

def test_it_sends_one_chat_request_with_the_parsed_args(gateway, device, people):
    device.handler = completes()
    persona = people[HOLDER[ACTION]]
    assert post(gateway, persona, chat()).status_code == 200
    assert_request(device.only_request(), OP, persona.principal_id,
                   {"model": "tiny-llama", "messages": MESSAGES, "stream": False})


def test_it_sends_sampling_options_as_the_device_expects_them(gateway, device, people):
    device.handler = completes()
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}]
    body = chat(messages=messages, max_tokens=99, max_completion_tokens=12, temperature=1, top_p=0.5, stop="\n",
                n=1, user="ignored")
    assert post(gateway, people["chatter"], body).status_code == 200
    assert_request(device.only_request(), OP, people["chatter"].principal_id, {
        "model": "tiny-llama", "stream": False, "max_tokens": 12, "temperature": 1.0, "top_p": 0.5, "stop": ["\n"],
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]})


def test_it_answers_a_chat_completion_with_usage(gateway, device, people):
    device.handler = completes()
    response = post(gateway, people["chatter"], chat())
    assert response.status_code == 200
    assert response["Content-Type"] == "application/json" and response["Cache-Control"] == "no-store"
    doc = json.loads(response.content)
    assert doc["object"] == "chat.completion" and doc["model"] == "tiny-llama"
    assert doc["id"].startswith("chatcmpl-") and isinstance(doc["created"], int)
    assert doc["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hi there"},
                               "finish_reason": "stop", "logprobs": None}]
    assert doc["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def test_an_unknown_model_is_openais_404_model_not_found(gateway, device, people):
    device.answer(409, json.dumps({"error": {"code": "model_not_available", "message": "no such model"}}).encode())
    error = assert_openai_error(post(gateway, people["chatter"], chat()), 404, "model_not_found",
                                "invalid_request_error")
    assert error["param"] == "model"


# ---- image parts

PNG = b"\x89PNG\r\n\x1a\n some image bytes"  # the device checks them; the gateway only decodes the URL


def image_part(url):
    return {"type": "image_url", "image_url": {"url": url}}


def test_image_parts_go_to_the_device_as_image_parts_and_their_bytes(gateway, device, people):
    device.handler = completes()
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "what is"}, image_part(url),
                                             {"type": "text", "text": " this?"},
                                             {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}]}]
    assert post(gateway, people["chatter"], chat(messages=messages)).status_code == 200
    assert_request(device.only_request(), OP, people["chatter"].principal_id, {
        "model": "tiny-llama", "stream": False, "images": [PNG, PNG],
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "what is"}, {"type": "image"},
                                                  {"type": "text", "text": " this?"}, {"type": "image"}]}]})


@pytest.mark.parametrize("url, code", [
    ("https://example.com/cat.png", "invalid_image_url"),  # never fetched
    ("data:text/plain;base64,aGVsbG8=", "invalid_image_url"),
    ("data:image/png,rawbytes", "invalid_image_url"),  # not base64
    ("data:image/png;base64,aGVsbG8", "invalid_image_data"),  # missing padding
    ("data:image/png;base64,aGV*bG8=", "invalid_image_data"),
], ids=["remote", "not-an-image-type", "not-base64", "bad-padding", "bad-alphabet"])
def test_an_image_url_that_is_not_a_base64_image_data_url_is_refused_without_calling_the_device(
        gateway, device, people, url, code):
    body = chat(messages=[{"role": "user", "content": [image_part(url)]}])
    error = assert_openai_error(post(gateway, people["chatter"], body), 400, code, "invalid_request_error")
    assert error["param"] == "messages"
    assert device.requests == []


@pytest.mark.parametrize("status, code", [(400, "model_lacks_media"), (415, "media_not_image"),
                                          (400, "media_truncated"), (413, "media_too_many_pixels")])
def test_the_devices_image_refusals_come_in_openais_shape(gateway, device, people, status, code):
    device.answer(status, json.dumps({"error": {"code": code, "message": "image 1: no"}}).encode())
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    body = chat(messages=[{"role": "user", "content": [image_part(url)]}])
    error = assert_openai_error(post(gateway, people["chatter"], body), status, code, "invalid_request_error")
    assert error["param"] == "messages" and error["message"] == "image 1: no"


@pytest.mark.parametrize("field, value", [
    ("functions", [{"name": "f"}]), ("function_call", "auto"),
    ("logit_bias", {"1": 1}), ("store", True),
    ("modalities", ["text", "audio"]), ("audio", {"voice": "x"}),
    ("prediction", {"type": "content"}), ("metadata", {"k": "v"}), ("service_tier", "flex"),
    ("reasoning_effort", "low"), ("web_search_options", {}), ("temprature", 1)])
def test_it_refuses_a_field_it_does_not_implement_naming_it(gateway, device, people, field, value):
    error = assert_openai_error(post(gateway, people["chatter"], chat(**{field: value})), 400,
                                "unknown_parameter" if field == "temprature" else "unsupported_parameter",
                                "invalid_request_error")
    assert error["param"] == field
    assert device.requests == []


F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("fields, status, code, param", [
    ({"tools": [{"type": "function"}]}, 400, "invalid_tools", "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, 400, "invalid_tools", "tools"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, 400, "invalid_tools", "tools"),
    ({"tools": [F, F]}, 400, "invalid_tools", "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, 400, "invalid_tools", "tools"),
    ({"tool_choice": "auto"}, 400, "invalid_tool_choice", "tool_choice"),
    ({"tools": [F], "tool_choice": "sometimes"}, 400, "invalid_tool_choice", "tool_choice"),
    ({"tools": [F], "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "invalid_tool_choice",
     "tool_choice"),
    ({"tools": [F], "parallel_tool_calls": "yes"}, 400, "invalid_parallel_tool_calls", "parallel_tool_calls"),
    ({"response_format": {"type": "json_schema"}}, 400, "invalid_response_format", "response_format"),
    ({"response_format": {"type": "xml"}}, 400, "invalid_response_format", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, 400, "invalid_response_format",
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "object"}}}, 400,
     "invalid_response_format", "response_format"),
    ({"response_format": {"type": "json_object"}, "stop": "}"}, 400, "invalid_stop", "stop"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "invalid_messages", "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}]},
     400, "invalid_messages", "messages")])
def test_it_refuses_malformed_structured_output_and_tool_fields_naming_them(gateway, device, people, fields, status,
                                                                             code, param):
    """Each malformed field is refused by the gateway before the device sees the request."""
    error = assert_openai_error(post(gateway, people["chatter"], chat(**fields)), status, code, "invalid_request_error")
    assert error["param"] == param
    assert device.requests == []


def test_a_schema_nested_too_deep_is_400_and_one_too_large_413(gateway, device, people):
    from gpu_worker.contract.limits import MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH
    deep: dict = {"type": "object"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "object", "properties": {"a": deep}}
    error = assert_openai_error(post(gateway, people["chatter"], chat(response_format={
        "type": "json_schema", "json_schema": {"name": "deep", "schema": deep}})), 400, "invalid_response_format",
        "invalid_request_error")
    assert "deeper" in error["message"]
    large = {"type": "object", "description": "x" * MAX_SCHEMA_BYTES}
    assert_openai_error(post(gateway, people["chatter"], chat(response_format={
        "type": "json_schema", "json_schema": {"name": "large", "schema": large}})), 413, "schema_too_large",
        "invalid_request_error")
    tools = [{"type": "function", "function": {"name": "f", "description": "x" * MAX_SCHEMA_BYTES}}]
    assert_openai_error(post(gateway, people["chatter"], chat(tools=tools)), 413, "schema_too_large",
                        "invalid_request_error")
    assert device.requests == []


def test_it_passes_penalties_and_refuses_them_out_of_range(gateway, device, people):
    device.handler = completes()
    assert post(gateway, people["chatter"], chat(presence_penalty=0.5, frequency_penalty=-1, seed=1)).status_code == 200
    args = device.only_request()["args"]
    assert (args["presence_penalty"], args["frequency_penalty"]) == (0.5, -1.0)
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", "1")):
        error = assert_openai_error(post(gateway, people["chatter"], chat(**{field: value})), 400, f"invalid_{field}",
                                    "invalid_request_error")
        assert error["param"] == field


def test_it_passes_logprobs_and_refuses_them_malformed(gateway, device, people):
    device.handler = completes()
    assert post(gateway, people["chatter"], chat(logprobs=True, top_logprobs=3)).status_code == 200
    assert device.only_request()["args"]["logprobs"] == 3
    device.requests.clear()
    assert post(gateway, people["chatter"], chat(logprobs=True)).status_code == 200
    assert device.only_request()["args"]["logprobs"] == 0  # the chosen token's alone
    device.requests.clear()
    for fields, param in (({"logprobs": 1}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
                          ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
                          ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")):
        error = assert_openai_error(post(gateway, people["chatter"], chat(**fields)), 400, f"invalid_{param}",
                                    "invalid_request_error")
        assert error["param"] == param
    assert device.requests == []


def test_n_choices_are_passed_and_rendered_each_with_its_index(gateway, device, people):
    result = {"finish_reason": "stop", "prompt_tokens": 5, "completion_tokens": 5, "text": "Paris.",
              "choices": [{"index": 0, "finish_reason": "stop", "text": "Paris."},
                          {"index": 1, "finish_reason": "length", "text": "Lyon"}]}
    device.handler = completes(result)
    doc = json.loads(post(gateway, people["chatter"], chat(n=2)).content)
    assert device.only_request()["args"]["n"] == 2
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in doc["choices"]] == [
        (0, "Paris.", "stop"), (1, "Lyon", "length")]
    assert doc["usage"]["completion_tokens"] == 5


def test_it_passes_a_seed(gateway, device, people):
    device.handler = completes()
    assert post(gateway, people["chatter"], chat(seed=42, logprobs=False, response_format={"type": "text"})
                ).status_code == 200
    assert device.only_request()["args"]["seed"] == 42
    assert_openai_error(post(gateway, people["chatter"], chat(seed=-1)), 400, "invalid_seed", "invalid_request_error")


@pytest.mark.parametrize("status, code, type_", [
    (400, "input_too_large", "invalid_request_error"),
    (429, "journal_hold", "rate_limit_error"),
    (503, "page_pool_exhausted", "server_error"),
])
def test_it_maps_a_device_error_to_the_openai_shape(gateway, device, people, status, code, type_):
    device.answer(status, json.dumps({"error": {"code": code, "message": f"device says {code}"}}).encode())
    error = assert_openai_error(post(gateway, people["chatter"], chat()), status, code, type_)
    assert error["message"] == f"device says {code}" and error["param"] is None


def test_it_answers_503_device_unavailable_when_the_device_is_stopped(gateway, device, people):
    device.stop()
    assert_openai_error(post(gateway, people["chatter"], chat()), 503, "device_unavailable", "server_error")


def test_it_answers_503_device_timeout_when_the_device_is_silent(gateway, device, people):
    device.silent = True
    assert_openai_error(post(gateway, people["chatter"], chat()), 503, "device_timeout", "server_error")
    # the chat, then the close that stops it (it may have been admitted and be using pages)
    wait_for(lambda: [r["op"] for r in device.requests] == [OP, "subscriptions.close"], timeout=5,
             what="the chat, then its close")


ACCEPTED = {"status": 200, "body": b"", "more": True, "event": "accepted"}


def test_a_plain_completion_waits_past_the_device_timeout_once_the_device_accepted_it(gateway, device, people):
    device.handler = lambda req: [ACCEPTED, DEVICE_TIMEOUT * 3, {"status": 200, "body": json.dumps(RESULT).encode()}]
    response = post(gateway, people["chatter"], chat())
    assert response.status_code == 200, response.content
    assert response.json()["choices"][0]["message"]["content"] == RESULT["text"]


def test_a_plain_completion_longer_than_the_chat_timeout_is_stopped(gateway, device, people, settings):
    settings.AOTX_CHAT_TIMEOUT = DEVICE_TIMEOUT * 2
    device.handler = lambda req: [ACCEPTED]  # and then nothing
    assert_openai_error(post(gateway, people["chatter"], chat()), 504, "deadline_exceeded", "server_error")
    wait_for(lambda: [r["op"] for r in device.requests] == [OP, "subscriptions.close"], timeout=5,
             what="the gateway to stop the chat")


def test_it_closes_its_device_connection_after_a_plain_completion(gateway, device, people):
    device.handler = completes()
    assert post(gateway, people["chatter"], chat()).status_code == 200
    wait_for(lambda: device.hangups == 1, timeout=5, what="the gateway to close its chat connection")


# ---- streams

def test_it_streams_sse_chunks_from_the_devices_more_frames_then_done(device, people):
    device.handler = streams(b"Hel", b"lo", b" world")
    response, content = stream(people["chatter"], chat(stream=True))
    assert response.status_code == 200
    assert response["Content-Type"] == "text/event-stream"
    assert response["Cache-Control"] == "no-store" and response["X-Accel-Buffering"] == "no"
    data = events(content)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"}, {"content": " world"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, None, "length"]
    assert all("usage" not in c for c in chunks)
    assert_request(device.only_request(), OP, people["chatter"].principal_id,
                   {"model": "tiny-llama", "messages": MESSAGES, "stream": True})


def test_it_adds_a_usage_chunk_when_asked(device, people):
    device.handler = streams(b"Hi")
    _, content = stream(people["chatter"], chat(stream=True, stream_options={"include_usage": True}))
    data = events(content)
    assert data[-1] == "[DONE]"
    usage = json.loads(data[-2])
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 4, "completion_tokens": 2,
                                                         "total_tokens": 6}


def test_it_joins_a_utf8_character_split_across_frames(device, people):
    device.handler = streams(b"caf\xc3", b"\xa9 \xe2\x82", b"\xac")  # "café €"
    _, content = stream(people["chatter"], chat(stream=True))
    text = "".join(json.loads(d)["choices"][0]["delta"].get("content", "") for d in events(content)[:-1])
    assert text == "café €"


def test_it_streams_a_reply_with_no_tokens(device, people):
    device.handler = streams(final={"finish_reason": "stop", "prompt_tokens": 4, "completion_tokens": 0})
    _, content = stream(people["chatter"], chat(stream=True))
    data = events(content)
    assert data[-1] == "[DONE]" and len(data) == 3
    assert json.loads(data[1])["choices"][0]["finish_reason"] == "stop"


def test_a_device_error_before_the_stream_is_an_openai_error(device, people):
    device.answer(409, b'{"error":{"code":"model_not_available","message":"no model gpt-9"}}')
    response, _ = stream(people["chatter"], chat(model="gpt-9", stream=True))
    assert_openai_error(response, 404, "model_not_found", "invalid_request_error")
    wait_for(lambda: device.hangups == 1, timeout=5, what="the gateway to close its chat connection")


def test_a_device_error_during_the_stream_ends_it_with_an_error_event(device, people):
    device.handler = streams(b"Hel", final=b'{"error":{"code":"cancelled","message":"the chat was cancelled"}}',
                             status=503)
    _, content = stream(people["chatter"], chat(stream=True))
    data = events(content)
    assert "[DONE]" not in data
    assert json.loads(data[-1]) == {"error": {"message": "the chat was cancelled", "code": "cancelled"}}
    assert json.loads(data[1])["choices"][0]["delta"] == {"content": "Hel"}


def test_a_stream_closes_its_device_connection_when_done(device, people):
    device.handler = streams(b"Hi")
    stream(people["chatter"], chat(stream=True))
    wait_for(lambda: device.hangups == 1, timeout=5, what="the gateway to close its chat connection")


def test_a_stream_answers_503_device_unavailable_when_the_device_is_stopped(device, people):
    device.stop()
    response, _ = stream(people["chatter"], chat(stream=True))
    assert_openai_error(response, 503, "device_unavailable", "server_error")


def test_a_stream_answers_503_device_timeout_when_the_device_is_silent(device, people):
    device.silent = True
    response, _ = stream(people["chatter"], chat(stream=True))
    assert_openai_error(response, 503, "device_timeout", "server_error")


def test_a_stream_that_goes_silent_ends_with_a_timeout_event(device, people):
    device.handler = lambda req: [{"status": 200, "body": b"Hel", "more": True}]  # and then nothing
    _, content = stream(people["chatter"], chat(stream=True))
    data = events(content)
    assert "[DONE]" not in data
    assert json.loads(data[-1])["error"]["code"] == "device_timeout"


# ---- through the HTTP front, as the server runs it

def test_the_front_answers_the_openai_routes_itself_not_through_djangos_handler(gateway, device, people, monkeypatch):
    """Django's ASGI handler and its sync middleware cost a thread per request: the front runs the
    async views on the event loop (a tenant looping on 429 slowed every other tenant's reads)."""
    from aotx_site.gateway import application

    async def no_django(scope, receive, send):
        raise AssertionError(f"{scope['path']} went to Django's handler")
    monkeypatch.setattr(application, "django", no_django)
    device.handler = completes()
    response = post(gateway, people["chatter"], chat())
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == RESULT["text"]
    assert response["Cache-Control"] == "no-store" and response["Content-Type"] == "application/json"
    assert_openai_error(gateway.get(PATH, people["chatter"]), 405, "method_not_allowed", "invalid_request_error")


def test_a_streamed_chat_whose_client_goes_away_is_closed_on_the_device(device, people):
    """The front's stream of a chat: the client's disconnect cancels it, and the device is told
    (`subscriptions.close`: the chat stops and frees its pages)."""
    import asyncio
    from aotx_site.gateway import application
    from shared_api import device_client
    device.handler = lambda req: [{"status": 200, "body": b"", "more": True, "event": "accepted"},
                                  {"status": 200, "body": b"Hel", "more": True}]  # and then nothing
    body = json.dumps(chat(stream=True)).encode()
    headers = [(b"authorization", people["chatter"].authorization.encode()), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    proto = rsgi.Protocol([body])
    proto.on_write = lambda data: proto.leave() if b"Hel" in data else None  # it goes away mid-stream

    async def go():
        try:
            await asyncio.wait_for(application.__rsgi__(rsgi.Scope("POST", PATH, headers), proto), 10)
        finally:
            await device_client.aclose_loop()
    async_to_sync(go)()
    assert proto.status == 200 and proto.streamed and dict(proto.headers)["content-type"] == "text/event-stream"
    assert any(b'"content": "Hel"' in chunk for chunk in proto.chunks)
    wait_for(lambda: [r["op"] for r in device.requests] == [OP, "subscriptions.close"], timeout=5,
             what="the chat, then its close")


def test_a_chat_whose_client_goes_away_before_its_answer_is_closed_on_the_device(device, people, monkeypatch):
    """A non-streamed chat waits for its whole answer; the client's disconnect meanwhile cancels
    the view (as Django's ASGI handler does), and the device is told as for a stream
    (`subscriptions.close`: the chat stops and frees its pages). Nothing is answered: no one reads it."""
    from shared_api import device_client

    def handler(req):
        if req["op"] == "subscriptions.close":
            return 200, b'{"closed": true}'
        return [{"status": 200, "body": b"", "more": True, "event": "accepted"}]  # and then nothing, for now

    device.handler = handler
    deliver = device_client.DeviceStream.deliver

    def delivered(stream, msg):  # the gateway has the device's "accepted": the client goes away
        deliver(stream, msg)
        if msg.event == "accepted":
            proto.leave()
    monkeypatch.setattr(device_client.DeviceStream, "deliver", delivered)
    proto = rsgi.Protocol([json.dumps(chat()).encode()])
    serve_once(people, proto)
    assert proto.status is None
    wait_for(lambda: [r["op"] for r in device.requests] == [OP, "subscriptions.close"], timeout=5,
             what="the chat, then its close")
    chat_id = device.requests[0]["id"]
    assert device.requests[1]["args"] == {"id": chat_id}


def test_a_chat_whose_client_goes_away_as_the_device_receives_it_is_closed_on_the_device(device, people):
    """The narrowest window: the client goes away while the device handles the request, before the
    gateway has its "accepted". The gateway still tells the device (`subscriptions.close`), and the
    frame goes out before the connection closes (the fake device reads on after a failed reply, as
    the device does)."""
    loop: list = []  # the request's event loop (the fake device's thread makes the client leave on it)

    def handler(req):
        if req["op"] == "subscriptions.close":
            return 200, b'{"closed": true}'
        loop[0].call_soon_threadsafe(proto.leave)  # (the fake device's thread)
        return [{"status": 200, "body": b"", "more": True, "event": "accepted"}]

    device.handler = handler
    proto = rsgi.Protocol([json.dumps(chat()).encode()])
    serve_once(people, proto, started=loop.append)
    assert proto.status is None
    wait_for(lambda: [r["op"] for r in device.requests] == [OP, "subscriptions.close"], timeout=5,
             what="the chat, then its close")
    assert device.requests[1]["args"] == {"id": device.requests[0]["id"]}


def serve_once(people, proto, started=None):
    """The front answers the chatter's POST of `proto`'s body on an event loop of its own (bounded),
    then the loop's device connections close; `started(loop)` runs first."""
    import asyncio
    from aotx_site.gateway import application
    from shared_api import device_client
    body = b"".join(proto.pieces)
    headers = [(b"authorization", people["chatter"].authorization.encode()), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]

    async def go():
        if started is not None:
            started(asyncio.get_running_loop())
        try:
            await asyncio.wait_for(application.__rsgi__(rsgi.Scope("POST", PATH, headers), proto), 10)
        finally:
            await device_client.aclose_loop()
    async_to_sync(go)()
