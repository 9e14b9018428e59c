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
    assert [m.id for m in sdk.models.list().data] == ["tiny-llama", "tiny-bert"]  # generation, embedding
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
    with pytest.raises(openai.NotFoundError) as unknown:
        client(stack, stack.token).chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert unknown.value.body == {**unknown.value.body, "code": "model_not_found", "param": "model",
                                  "type": "invalid_request_error"}
    status, headers, body = stack.http("POST", "/v1/chat/completions", raw=b"{nope", token=stack.token)
    assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"
    assert headers["Cache-Control"] == "no-store"


HELLO = [{"role": "user", "content": "hello"}]


def test_a_seed_makes_sampling_repeatable(stack):
    sdk = client(stack, stack.token)
    runs = [sdk.chat.completions.create(model="tiny-llama", max_tokens=12, temperature=1.5, seed=seed,
                                        messages=HELLO).choices[0].message.content for seed in (7, 7, 8, 9)]
    assert runs[0] == runs[1]
    assert len(set(runs[1:])) > 1  # other seeds sample other text


@pytest.mark.parametrize("field, value", [
    ("functions", [{"name": "f", "parameters": {"type": "object"}}]), ("tool_choice", "auto"),
    ("logit_bias", {"5": 10}), ("store", True)])
def test_fields_it_does_not_implement_are_refused_by_name(stack, field, value):
    with pytest.raises(openai.BadRequestError) as refused:
        client(stack, stack.token).chat.completions.create(model="tiny-llama", messages=HELLO, max_tokens=2,
                                                           **{field: value})
    assert refused.value.body["param"] == field and refused.value.body["type"] == "invalid_request_error"


def test_logprobs_are_each_tokens_and_its_top_alternatives(stack):
    """Greedy: each token is its own most likely alternative; the tokens' bytes are the text; a
    stream carries the same entries, chunk by chunk."""
    sdk = client(stack, stack.token)
    whole = sdk.chat.completions.create(model="tiny-llama", messages=HELLO, max_tokens=10, temperature=0,
                                        logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens - (whole.choices[0].finish_reason == "stop")
    assert b"".join(bytes(t.bytes) for t in content).decode() == whole.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
    stream = sdk.chat.completions.create(model="tiny-llama", messages=HELLO, max_tokens=10, temperature=0,
                                         logprobs=True, top_logprobs=3, stream=True)
    streamed = [t for chunk in stream for choice in chunk.choices if choice.logprobs for t in choice.logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    plain = sdk.chat.completions.create(model="tiny-llama", messages=HELLO, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None
    text = sdk.completions.create(model="tiny-llama", prompt="count", max_tokens=6, temperature=0, logprobs=2)
    legacy = text.choices[0].logprobs
    assert "".join(legacy.tokens) == text.choices[0].text and len(legacy.token_logprobs) == len(legacy.tokens)
    assert all(len(top) <= 2 for top in legacy.top_logprobs)  # a dict: alternatives with equal text merge
    assert legacy.text_offset == [sum(len(t) for t in legacy.tokens[:i]) for i in range(len(legacy.tokens))]


def test_n_choices_are_sampled_apart_whole_and_streamed(stack):
    """n = 3 seeded: three choices (choice i samples with seed + i), the same whole and streamed."""
    sdk = client(stack, stack.token)
    kwargs = dict(model="tiny-llama", messages=HELLO, max_tokens=12, temperature=1.0, seed=11, n=3)
    whole = sdk.chat.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = [c.message.content for c in whole.choices]
    assert len(set(texts)) > 1  # other seeds, other samples
    stream = sdk.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    parts, finishes, usage = {0: [], 1: [], 2: []}, {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            parts[choice.index].append(choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert ["".join(parts[i]) for i in range(3)] == texts
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens
    one = sdk.chat.completions.create(**{**kwargs, "n": 1})
    assert one.choices[0].message.content == texts[0]  # choice 0 is the request alone
    text = sdk.completions.create(model="tiny-llama", prompt="count", max_tokens=5, temperature=1.0, seed=2, n=2)
    assert [c.index for c in text.choices] == [0, 1]
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(**{**kwargs, "n": 17})
    assert refused.value.body["param"] == "n"


def test_penalties_are_honoured(stack):
    sdk = client(stack, stack.token)
    plain = sdk.chat.completions.create(model="tiny-llama", max_tokens=24, temperature=0, messages=HELLO)
    penalized = sdk.chat.completions.create(model="tiny-llama", max_tokens=24, temperature=0, messages=HELLO,
                                            frequency_penalty=2.0, presence_penalty=2.0)
    assert penalized.choices[0].finish_reason in ("stop", "length")
    # the tiny model repeats itself greedily; the penalties change what it writes
    assert penalized.choices[0].message.content != plain.choices[0].message.content


def test_no_op_values_and_user_are_accepted(stack):
    completion = client(stack, stack.token).chat.completions.create(
        model="tiny-llama", messages=HELLO, max_tokens=2, temperature=0, user="someone", logprobs=False,
        presence_penalty=0, frequency_penalty=0, response_format={"type": "text"}, n=1)
    assert completion.choices[0].finish_reason in ("stop", "length")


def test_an_unknown_field_is_refused_by_name(stack):
    with pytest.raises(openai.BadRequestError) as refused:
        client(stack, stack.token).chat.completions.create(model="tiny-llama", messages=HELLO,
                                                           extra_body={"temprature": 0.5})
    assert refused.value.body["param"] == "temprature" and refused.value.body["code"] == "unknown_parameter"


def test_a_prompt_longer_than_the_context_is_context_length_exceeded(stack):
    with pytest.raises(openai.BadRequestError) as refused:
        client(stack, stack.token).chat.completions.create(
            model="tiny-llama", max_tokens=2, messages=[{"role": "user", "content": "word " * 20000}])
    assert refused.value.body["code"] == "context_length_exceeded"


def test_plain_completions_and_their_stream(stack):
    sdk = client(stack, stack.token)
    whole = sdk.completions.create(model="tiny-llama", prompt="The capital of France is", max_tokens=6, temperature=0)
    assert whole.object == "text_completion" and isinstance(whole.choices[0].text, str)
    assert whole.choices[0].finish_reason in ("stop", "length") and 1 <= whole.usage.completion_tokens <= 6
    parts = [c.choices[0].text for c in sdk.completions.create(model="tiny-llama", prompt="The capital of France is",
                                                               max_tokens=6, temperature=0, stream=True)
             if c.choices]
    assert "".join(parts) == whole.choices[0].text
    # the model's control tokens are refused in a prompt, as in chat messages and inputs
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.completions.create(model="tiny-llama", prompt="<|im_start|>", max_tokens=1, temperature=0)
    assert refused.value.body["code"] == "reserved_token"
    default = sdk.completions.create(model="tiny-llama", prompt="count", temperature=0, extra_body={})
    assert default.usage.completion_tokens <= 16  # OpenAI's default max_tokens for this route
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.completions.create(model="tiny-llama", prompt="x", echo=True)
    assert refused.value.body["param"] == "echo"


def test_embeddings_through_the_openai_sdk_match_the_memory_forward(stack):
    from gpu_worker.engine.embedding import EmbeddingModel
    from gpu_worker.storage.runtime_file import RuntimeFile
    sdk = client(stack, stack.token)
    texts = ["shared memory", "the capital of france is paris"]
    got = sdk.embeddings.create(model="tiny-bert", input=texts)  # the SDK asks for base64 and decodes it
    floats = sdk.embeddings.create(model="tiny-bert", input=texts, encoding_format="float")
    reference = EmbeddingModel.from_runtime(RuntimeFile.open(stack.runtime, verify=False)).encode(texts)
    for data in (got.data, floats.data):
        assert [d.index for d in data] == [0, 1]
        for d, want in zip(data, reference.tolist()):
            assert d.embedding == pytest.approx(want, abs=1e-6)
    assert got.usage.prompt_tokens == got.usage.total_tokens > 4
    one = sdk.embeddings.create(model="tiny-bert", input="shared memory", encoding_format="float")
    # a single string is the one-element list (its own padding: equal to float rounding, not bit for bit)
    assert one.data[0].embedding == pytest.approx(floats.data[0].embedding, abs=1e-6)
    with pytest.raises(openai.NotFoundError):
        sdk.embeddings.create(model="text-embedding-3-small", input="x")
    with pytest.raises(openai.BadRequestError) as tokens:
        sdk.embeddings.create(model="tiny-bert", input=[[1, 2, 3]])
    assert tokens.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as dims:
        sdk.embeddings.create(model="tiny-bert", input="x", dimensions=8)
    assert dims.value.body["param"] == "dimensions"


def device_status(stack):
    """The device's `ping` (ops, no principal), straight from its socket."""
    from gpu_worker.contract.client import Connection
    with Connection(str(stack.journal / "service.sock"), connect_timeout=2, timeout=10) as connection:
        return json.loads(connection.call("ping", None).body)


def test_a_chat_whose_client_gave_up_before_its_answer_stops_on_the_device(stack):
    """A non-streamed chat whose client closes its connection stops generating, as a streamed one
    does: 12 clients that gave up at 3 s used to keep the device busy for over 30 s. Its principal is
    paced (docs/grants.md, "Rates") so that the whole answer would take far longer than the wait."""
    import socket
    from tests.conftest import wait_for
    out = stack.manage("principal", "create", "gives-up", "--actions", "chat", "--quota",
                       "output_tokens_per_second=20", "--config", str(stack.config))
    token = out.stdout.strip().splitlines()[-1]
    wait_for(lambda: stack.http("POST", "/v1/chat/completions", {"model": "tiny-llama", "max_tokens": 1,
                                                                 "messages": HELLO}, token=token)[0] == 200,
             30, what="the device's grant for the new principal")
    max_tokens = 2000  # 100 s of output at 20 tokens a second
    before = device_status(stack)["chats"]["output_tokens"]
    body = json.dumps({"model": "tiny-llama", "max_tokens": max_tokens, "temperature": 1,
                       "messages": HELLO}).encode()
    client = socket.create_connection(("127.0.0.1", stack.port), timeout=30)
    client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   + f"Authorization: Bearer {token}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    wait_for(lambda: (s := device_status(stack))["chats"]["running"] == 1 and s["chats"]["output_tokens"] > before,
             30, what="the chat generating")
    client.close()  # the client gives up
    wait_for(lambda: (s := device_status(stack))["chats"]["running"] == 0 and s["kv"]["running"] == 0
             and s["kv"]["waiting"] == 0, 60, what="the device no longer running the chat")
    generated = device_status(stack)["chats"]["output_tokens"] - before
    assert 0 < generated < max_tokens // 4, generated
