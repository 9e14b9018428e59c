"""Ordinary Chat Completions through the real gateway and device, driven by the official
`openai` package (tiny random-weight model)."""
import json

import openai
import pytest

from tests.harness import Stack

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tiny_runtime, tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("chat"), tiny_runtime)
    s.token = s.principal("chatter", actions="shared_read,chat")
    s.reader = s.principal("reader", actions="shared_read")
    s.boot_device()
    s.serve()
    yield s
    s.stop()


def client(stack, token):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.port}/v1", api_key=token, max_retries=0, timeout=60)


def test_the_openai_sdk_gets_a_completion(stack):
    sdk = client(stack, stack.token)
    assert [m.id for m in sdk.models.list().data] == ["tiny-llama"]
    completion = sdk.chat.completions.create(model="tiny-llama", max_tokens=8, temperature=0,
                                             messages=[{"role": "user", "content": "hello"}])
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= completion.usage.completion_tokens <= 8 and completion.usage.prompt_tokens > 3
    again = sdk.chat.completions.create(model="tiny-llama", max_tokens=8, temperature=0,
                                        messages=[{"role": "user", "content": "hello"}])
    assert again.choices[0].message.content == choice.message.content  # greedy is deterministic


def test_the_openai_sdk_streams_the_same_text(stack):
    sdk = client(stack, stack.token)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "stream please"}]
    whole = sdk.chat.completions.create(model="tiny-llama", max_tokens=12, temperature=0, messages=messages)
    stream = sdk.chat.completions.create(model="tiny-llama", max_tokens=12, temperature=0, messages=messages,
                                         stream=True, stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(parts) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_errors_use_the_openai_shape(stack):
    with pytest.raises(openai.AuthenticationError):
        client(stack, "aotx_wrong").chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.PermissionDeniedError) as denied:
        client(stack, stack.reader).chat.completions.create(model="tiny-llama",
                                                            messages=[{"role": "user", "content": "x"}])
    assert denied.value.body["code"] == "grant_missing"
    with pytest.raises(openai.BadRequestError) as bad:
        client(stack, stack.token).chat.completions.create(model="tiny-llama", messages=[])
    assert bad.value.body["code"] == "invalid_messages"
    with pytest.raises(openai.APIStatusError) as unknown:
        client(stack, stack.token).chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert unknown.value.status_code == 409 and unknown.value.body["code"] == "model_not_available"
    status, headers, body = stack.http("POST", "/v1/chat/completions", raw=b"{nope", token=stack.token)
    assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"
    assert headers["Cache-Control"] == "no-store"
