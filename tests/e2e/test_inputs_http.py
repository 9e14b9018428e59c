"""A conversation input through the real gateway and device (tiny random-weight model)."""
import base64
import hashlib
import json

import pytest

from aotx_client import ApiError, Client
from tests.conftest import wait_for
from tests.harness import Stack

pytestmark = pytest.mark.e2e
BASE = "/aotx/v1/shared"


def mutate(stack, token, path, fields):
    """(status, receipt or error body) of a mutation sent through the client SDK, once: retry_for=0
    answers a refusal (a 429 quota, a journal hold's 429) at once instead of waiting it out, as the
    tests that check it need."""
    with Client(f"http://127.0.0.1:{stack.port}", token, timeout=60, retry_for=0) as aotx:
        try:
            return 202, aotx.mutate(path, fields)
        except ApiError as refused:
            return refused.status, {"error": {"code": refused.code, "message": refused.message, **refused.details}}


def writer_space(stack):
    """Device and gateway up, a registered writer with a space: (token, space id)."""
    token = stack.principal("writer")
    stack.boot_device()
    stack.serve()
    assert mutate(stack, token, "/participant", {})[0] == 202
    return token, mutate(stack, token, "/spaces", {})[1]["target"]


def new_conversation(stack, token, space):
    return mutate(stack, token, f"/spaces/{space}/conversations", {})[1]["target"]


def conversation_of(stack):
    """writer_space with a conversation in it: (token, conversation id)."""
    token, space = writer_space(stack)
    return token, new_conversation(stack, token, space)


def test_an_input_is_admitted_runs_and_reads_back(tiny_runtime, tmp_path):
    stack = Stack(tmp_path, tiny_runtime)
    try:
        token, conversation = conversation_of(stack)
        status, receipt = mutate(stack, token, f"/conversations/{conversation}/inputs",
                                 {"text": "hello", "model": "tiny-llama", "max_output_tokens": 16})
        assert status == 202 and receipt["kind"] == "conversation.input", receipt

        def done():
            out = json.loads(stack.http("GET", f"{BASE}/operations/{receipt['operation']}", token=token)[2])
            return out if out["terminal"]["saved"] else None
        final = wait_for(done, 60, interval=0.05, what="the input's terminal result")
        assert final["terminal"]["status"] == "succeeded" and 1 <= int(final["result"]["output_tokens"]) <= 16
        status, _, body = stack.http("GET", f"{BASE}/operations/{receipt['operation']}/result?offset=0", token=token)
        result = json.loads(body)
        assert status == 200 and result["complete"] and str(len(base64.b64decode(result["bytes"]))) == result["length"]
        assert result["length"] == final["result"]["length"]
        for bad in ({"text": "x", "model": "tiny-llama", "pages": 1.0}, {"text": "x", "model": "tiny-llama", "top_p": True},
                    {"text": "<|image|>", "model": "tiny-llama"}, {"text": 1, "model": "tiny-llama"}):
            assert mutate(stack, token, f"/conversations/{conversation}/inputs", bad)[0] == 400
        status, _, body = stack.http("GET", f"{BASE}/operations/{receipt['operation']}/result?offset=-1", token=token)
        assert status == 400 and json.loads(body)["error"]["code"] == "bad_offset"
        data = b"RIFF....WAVEfmt " * 4
        sha = hashlib.sha256(data).hexdigest()
        put = lambda raw, kind="audio/wav": stack.http("PUT", f"/aotx/v1/media/{sha}", raw=raw, token=token,
                                                       headers={"Content-Type": kind})
        assert put(data)[0] == 201 and put(data)[0] == 200
        assert put(data + b"!")[0] == 400 and put(data, "text/plain")[0] == 415
        status, out = mutate(stack, token, f"/conversations/{conversation}/inputs",
                             {"text": "listen", "model": "tiny-llama", "media": [{"type": "audio", "sha256": sha}]})
        assert status == 409 and out["error"]["code"] == "model_lacks_media"
    finally:
        stack.stop()


def test_a_deadline_exceeded_input_answers_504_on_its_result_and_on_its_event_stream(tmp_path):
    """SPEC: a request that exceeds its execution deadline returns 504. With a deadline of 1 ms
    (the least a runtime profile takes) an input is past it long before its completion can be
    journaled (its embedding, prompt and tokens each cross threads first, and the deadline covers
    publication); both reads of its result, `GET /operations/{op}/result` and
    `GET /operations/{op}/events`, answer 504 `deadline_exceeded` through the gateway."""
    from gpu_worker.pack import pack_tiny
    runtime = str(tmp_path / "deadline.aotxccir")
    pack_tiny(runtime, shared=True, runtime_profile={"deadline_ms": 1})
    stack = Stack(tmp_path, runtime)
    try:
        token, conversation = conversation_of(stack)
        _, receipt = mutate(stack, token, f"/conversations/{conversation}/inputs",
                            {"text": "too late", "model": "tiny-llama", "max_output_tokens": 16})
        operation = f"{BASE}/operations/{receipt['operation']}"

        def done():
            out = json.loads(stack.http("GET", operation, token=token)[2])
            return out if out["terminal"]["saved"] else None
        final = wait_for(done, 60, interval=0.05, what="the input's terminal result")
        assert final["terminal"]["status"] == "deadline_exceeded"
        for path in (f"{operation}/result", f"{operation}/events"):
            status, headers, body = stack.http("GET", path, token=token)
            assert (status, json.loads(body)["error"]["code"]) == (504, "deadline_exceeded"), path
            assert headers["Content-Type"] == "application/json" and headers["Cache-Control"] == "no-store"
    finally:
        stack.stop()
