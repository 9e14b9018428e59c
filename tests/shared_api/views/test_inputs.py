"""POST /aotx/v1/shared/conversations/{conversation}/inputs (`conversations.input`): required
`text` and `model` (strings); optional `max_output_tokens` and `pages` (JSON integers),
`temperature` and `top_p` (JSON numbers), `media` (at most 8 rows of {type, sha256}),
`memory_ttl_seconds` (a JSON integer 1..MAX_MEMORY_TTL_SECONDS)."""
import json

import pytest

from gpu_worker.contract.limits import MAX_MEMORY_TTL_SECONDS

from .conftest import (BAD_AUTHORIZATIONS, BASE, HOLDER, MALFORMED_BODIES, action_of, assert_error,
                       assert_passed_through, assert_request, assert_unauthenticated, bad_ids, conversation_id,
                       envelope, lacking, mutation_args, operation_id, without)

OP = "conversations.input"
ACTION = action_of(OP)
SHA = "ab" * 32


def path(conversation):
    return f"{BASE}/conversations/{conversation}/inputs"


def valid(**changes):
    return envelope(**{"text": "hello", "model": "tiny-llama", **changes})


def post(gateway, people, body, conversation=None):
    return gateway.post(path(conversation or conversation_id()), people["writer"], body)


@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
def test_it_refuses_a_missing_malformed_or_unknown_token(gateway, device, people, authorization):
    assert_unauthenticated(gateway.post(path(conversation_id()), body=valid(), authorization=authorization))
    assert device.requests == []


def test_it_refuses_a_revoked_principal(gateway, device, people):
    assert_unauthenticated(gateway.post(path(conversation_id()), people["revoked"], valid()))
    assert device.requests == []


@pytest.mark.parametrize("name", lacking(ACTION))
def test_it_refuses_a_principal_without_the_write_action(gateway, device, people, name):
    assert_error(gateway.post(path(conversation_id()), people[name], valid()), 403, "grant_missing")
    assert device.requests == []


@pytest.mark.parametrize("make, status, code", MALFORMED_BODIES)
def test_it_refuses_a_malformed_body(gateway, device, people, make, status, code):
    assert_error(gateway.post(path(conversation_id()), people["writer"], raw=make(valid())), status, code)
    assert device.requests == []


@pytest.mark.parametrize("bad", bad_ids("con"))
def test_it_rejects_a_malformed_conversation_id(gateway, device, people, bad):
    assert_error(gateway.post(path(bad), people["writer"], valid()), 400, "bad_id")
    assert device.requests == []


def test_it_rejects_unknown_fields(gateway, device, people):
    body = valid(stream=True, conversation=conversation_id())
    assert_error(post(gateway, people, body), 400, "unknown_field", fields=["conversation", "stream"])
    assert device.requests == []


@pytest.mark.parametrize("missing", [("text",), ("model",), ("text", "model")])
def test_it_lists_missing_fields(gateway, device, people, missing):
    assert_error(post(gateway, people, without(valid(), *missing)), 400, "missing_field", fields=list(missing))
    assert device.requests == []


@pytest.mark.parametrize("changes", [{"text": 1}, {"text": None}, {"text": ["hi"]}, {"model": 3}, {"model": None}],
                         ids=repr)
def test_it_rejects_text_or_model_that_are_not_strings(gateway, device, people, changes):
    assert_error(post(gateway, people, valid(**changes)), 400, "bad_field")
    assert device.requests == []


@pytest.mark.parametrize("changes", [
    {"max_output_tokens": 8.0}, {"max_output_tokens": "8"}, {"max_output_tokens": True},
    {"pages": 2.0}, {"pages": 1.5}, {"pages": False}, {"pages": [2]},
], ids=repr)
def test_it_rejects_floats_and_others_where_integers_belong(gateway, device, people, changes):
    assert_error(post(gateway, people, valid(**changes)), 400, "bad_field")
    assert device.requests == []


@pytest.mark.parametrize("changes", [{"temperature": "0.5"}, {"temperature": True}, {"top_p": [1]}, {"top_p": {}}],
                         ids=repr)
def test_it_rejects_non_numbers_where_numbers_belong(gateway, device, people, changes):
    assert_error(post(gateway, people, valid(**changes)), 400, "bad_field")
    assert device.requests == []


@pytest.mark.parametrize("name", ["max_output_tokens", "pages", "temperature", "top_p"])
def test_it_rejects_null_where_a_number_belongs(gateway, device, people, name):
    assert_error(post(gateway, people, valid(**{name: None})), 400, "bad_field")
    assert device.requests == []


@pytest.mark.parametrize("raw_field", [b'"temperature": 1e400', b'"max_output_tokens": 9007199254740993'],
                         ids=["infinite-temperature", "integer-beyond-2-to-the-53"])
def test_it_rejects_a_number_with_no_canonical_form(gateway, device, people, raw_field):
    raw = json.dumps(valid()).encode()[:-1] + b", " + raw_field + b"}"
    assert_error(gateway.post(path(conversation_id()), people["writer"], raw=raw), 400, "bad_field")
    assert device.requests == []


@pytest.mark.parametrize("media", [
    [{"type": "video", "sha256": SHA}],
    [{"type": "image", "sha256": SHA.upper()}],
    [{"type": "image", "sha256": SHA[:-1]}],
    [{"type": "image", "sha256": 7}],
    [{"type": "image"}],
    [{"type": "image", "sha256": SHA, "name": "cat.png"}],
    [f"media://{SHA}"],
    {"type": "image", "sha256": SHA},
    None,
], ids=lambda m: repr(m)[:40])
def test_it_rejects_malformed_media(gateway, device, people, media):
    assert_error(post(gateway, people, valid(media=media)), 400, "bad_field")
    assert device.requests == []


@pytest.mark.parametrize("rows", [
    [{"type": "image", "sha256": SHA}] * 9,
    [{"type": "image", "sha256": SHA}] * 8 + ["not even a row"],
    [{"type": "audio", "sha256": "cd" * 32}] * 50,
], ids=["nine", "eight-and-a-bad-one", "fifty"])
def test_more_than_eight_media_rows_are_too_many_media(gateway, device, people, rows):
    """The documented code for more than 8 media references is 400 `too_many_media` (it was
    `bad_field`): the count is checked before the rows' shape, as the device checks it."""
    error = assert_error(post(gateway, people, valid(media=rows)), 400, "too_many_media")
    assert "8" in error["message"]
    assert device.requests == []


def test_it_sends_the_conversation_and_the_callers_fields(gateway, device, people):
    conversation = conversation_id()
    media = [{"type": "image", "sha256": SHA}, {"sha256": "cd" * 32, "type": "audio"}]
    own = {"text": "héllo", "model": "tiny-llama", "max_output_tokens": 16, "pages": 2, "temperature": 0.7,
           "top_p": 1, "media": media}
    body = envelope(**own)
    persona = people[HOLDER[ACTION]]
    assert post(gateway, people, body, conversation).status_code == 200
    assert_request(device.only_request(), OP, persona.principal_id,
                   mutation_args(path(conversation), body, conversation=conversation, **own))


@pytest.mark.parametrize("ttl", [0, -1, "60", 60.0, 1.5, False, None, {}, MAX_MEMORY_TTL_SECONDS + 1], ids=repr)
def test_it_rejects_a_memory_ttl_that_is_not_an_integer_within_its_bounds(gateway, device, people, ttl):
    assert_error(post(gateway, people, valid(memory_ttl_seconds=ttl)), 400, "bad_field")
    assert device.requests == []


@pytest.mark.parametrize("ttl", [1, 86400, MAX_MEMORY_TTL_SECONDS])
def test_it_sends_the_inputs_own_memory_ttl(gateway, device, people, ttl):
    conversation = conversation_id()
    own = {"text": "remember this", "model": "tiny-llama", "memory_ttl_seconds": ttl}
    body = envelope(**own)
    persona = people[HOLDER[ACTION]]
    assert post(gateway, people, body, conversation).status_code == 200
    assert_request(device.only_request(), OP, persona.principal_id,
                   mutation_args(path(conversation), body, conversation=conversation, **own))


def test_it_sends_no_defaults_the_caller_did_not_give(gateway, device, people):
    conversation = conversation_id()
    body = valid(media=[{"type": "audio", "sha256": SHA}] * 8, text="")
    assert post(gateway, people, body, conversation).status_code == 200
    args = device.only_request()["args"]
    assert args == mutation_args(path(conversation), body, conversation=conversation, text="", model="tiny-llama",
                                 media=body["media"])
    assert not {"max_output_tokens", "pages", "temperature", "top_p", "memory_ttl_seconds"} & set(args)


def test_it_passes_a_new_receipt_through_with_its_location(gateway, device, people):
    location = f"{BASE}/operations/{operation_id()}"
    receipt = b'{"kind":"conversation.input","result":{"length":0}}'
    device.answer(202, receipt, {"Location": location})
    assert_passed_through(post(gateway, people, valid()), 202, receipt, {"Location": location})


@pytest.mark.parametrize("status, code", [(409, "model_not_available"), (400, "input_too_large"),
                                          (404, "media_not_found"), (429, "journal_hold")])
def test_it_passes_the_devices_refusal_through(gateway, device, people, status, code):
    body = b'{"error":{"code":"%s","message":"refused"}}' % code.encode()
    device.answer(status, body)
    assert_passed_through(post(gateway, people, valid()), status, body)


def test_it_answers_503_device_timeout_when_the_device_is_silent(gateway, device, people):
    device.silent = True
    assert_error(post(gateway, people, valid()), 503, "device_timeout")
    assert device.only_request()["op"] == OP
