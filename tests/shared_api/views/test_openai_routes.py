"""POST /v1/completions (the device's `chat.completions` with a plain prompt) and POST
/v1/embeddings (`embeddings`) against the fake device: what each sends, how it renders OpenAI's
shapes, and what it refuses without calling the device."""
import base64
import json
import struct

import pytest

from .conftest import BAD_AUTHORIZATIONS, HOLDER, action_of, assert_openai_error, assert_request, lacking

VECTORS = [[0.5, -0.25, 1.0], [0.0, 2.0, -1.5]]


def embedded(vectors=VECTORS, tokens=7):
    raw = b"".join(struct.pack(f"<{len(v)}f", *v) for v in vectors)
    return lambda req: (200, json.dumps({"dim": len(vectors[0]), "prompt_tokens": tokens,
                                         "vectors": base64.b64encode(raw).decode()}).encode())


def completes(text="Paris."):
    return lambda req: (200, json.dumps({"text": text, "finish_reason": "stop", "prompt_tokens": 5,
                                         "completion_tokens": 2}).encode())


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/embeddings"])
@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
def test_they_refuse_a_bad_token(gateway, device, people, path, authorization):
    response = gateway.post(path, body={"model": "m"}, authorization=authorization)
    assert response.status_code == 401 and device.requests == []


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/embeddings"])
def test_they_need_the_chat_action(gateway, device, people, path):
    for name in lacking(action_of("embeddings")):
        assert_openai_error(gateway.post(path, people[name], {"model": "m"}), 403, "grant_missing",
                            "permission_error")
    assert device.requests == []


def test_a_completion_sends_the_prompt_with_the_default_of_16_tokens(gateway, device, people):
    device.handler = completes()
    persona = people[HOLDER[action_of("chat.completions")]]
    response = gateway.post("/v1/completions", persona, {"model": "tiny-llama", "prompt": ["The capital is"],
                                                         "seed": 3, "echo": False, "best_of": 1})
    assert response.status_code == 200
    assert_request(device.only_request(), "chat.completions", persona.principal_id,
                   {"model": "tiny-llama", "prompt": "The capital is", "max_tokens": 16, "seed": 3, "stream": False})
    doc = json.loads(response.content)
    assert doc["object"] == "text_completion" and doc["id"].startswith("cmpl-")
    assert doc["choices"] == [{"index": 0, "text": "Paris.", "finish_reason": "stop", "logprobs": None}]
    assert doc["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}


@pytest.mark.parametrize("body, code, param", [
    ({"model": "tiny-llama"}, "invalid_prompt", "prompt"),
    ({"model": "tiny-llama", "prompt": ["a", "b"]}, "invalid_prompt", "prompt"),
    ({"model": "tiny-llama", "prompt": [1, 2]}, "invalid_prompt", "prompt"),
    ({"model": "tiny-llama", "prompt": "x", "echo": True}, "unsupported_parameter", "echo"),
    ({"model": "tiny-llama", "prompt": "x", "logprobs": 6}, "invalid_logprobs", "logprobs"),
    ({"model": "tiny-llama", "prompt": "x", "logprobs": True}, "invalid_logprobs", "logprobs"),
    ({"model": "tiny-llama", "prompt": "x", "suffix": "y"}, "unsupported_parameter", "suffix"),
    ({"model": "tiny-llama", "prompt": "x", "best_of": 3}, "unsupported_parameter", "best_of"),
    ({"model": "tiny-llama", "prompt": "x", "messages": []}, "unknown_parameter", "messages"),
])
def test_a_completion_refuses_what_it_does_not_implement(gateway, device, people, body, code, param):
    error = assert_openai_error(gateway.post("/v1/completions", people["chatter"], body), 400, code,
                                "invalid_request_error")
    assert error["param"] == param and device.requests == []


def test_embeddings_send_the_texts_and_render_floats_or_base64(gateway, device, people):
    device.handler = embedded()
    persona = people[HOLDER[action_of("embeddings")]]
    response = gateway.post("/v1/embeddings", persona, {"model": "tiny-bert", "input": ["a", "b"],
                                                        "encoding_format": "float", "user": "u"})
    assert response.status_code == 200
    assert_request(device.only_request(), "embeddings", persona.principal_id,
                   {"model": "tiny-bert", "input": ["a", "b"]})
    doc = json.loads(response.content)
    assert doc["object"] == "list" and doc["model"] == "tiny-bert"
    assert [d["embedding"] for d in doc["data"]] == VECTORS and [d["index"] for d in doc["data"]] == [0, 1]
    assert doc["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    device.handler = embedded(VECTORS[:1])
    doc = json.loads(gateway.post("/v1/embeddings", persona, {"model": "tiny-bert", "input": "a",
                                                              "encoding_format": "base64"}).content)
    assert struct.unpack("<3f", base64.b64decode(doc["data"][0]["embedding"])) == tuple(VECTORS[0])


@pytest.mark.parametrize("body, code, param", [
    ({"model": "tiny-bert"}, "invalid_input", "input"),
    ({"model": "tiny-bert", "input": ""}, "invalid_input", "input"),
    ({"model": "tiny-bert", "input": [[1, 2]]}, "invalid_input", "input"),
    ({"model": "tiny-bert", "input": [1, 2]}, "invalid_input", "input"),
    ({"model": "tiny-bert", "input": "x", "encoding_format": "int8"}, "invalid_encoding_format", "encoding_format"),
    ({"model": "tiny-bert", "input": "x", "dimensions": "3"}, "invalid_dimensions", "dimensions"),
    ({"model": "tiny-bert", "input": "x", "extra": 1}, "unknown_parameter", "extra"),
    ({"input": "x"}, "invalid_model", "model"),
])
def test_embeddings_refuse_bad_requests_without_the_device(gateway, device, people, body, code, param):
    error = assert_openai_error(gateway.post("/v1/embeddings", people["chatter"], body), 400, code,
                                "invalid_request_error")
    assert error["param"] == param and device.requests == []


def test_embeddings_refuse_other_dimensions_and_map_an_unknown_model(gateway, device, people):
    device.handler = embedded()
    error = assert_openai_error(gateway.post("/v1/embeddings", people["chatter"],
                                             {"model": "tiny-bert", "input": ["a", "b"], "dimensions": 8}),
                                400, "invalid_dimensions", "invalid_request_error")
    assert error["param"] == "dimensions"
    device.handler = lambda req: (404, b'{"error":{"code":"model_not_found","message":"no"}}')
    error = assert_openai_error(gateway.post("/v1/embeddings", people["chatter"], {"model": "x", "input": "a"}),
                                404, "model_not_found", "invalid_request_error")
    assert error["param"] == "model"
