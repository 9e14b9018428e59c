"""GET /aotx/v1/shared/participant (`participant.get`) and POST /aotx/v1/shared/participant
(`participant.register`: the mutation envelope and nothing else)."""
import json

import pytest

from .conftest import (BAD_AUTHORIZATIONS, BASE, HOLDER, MALFORMED_BODIES, action_of, assert_error,
                       assert_passed_through, assert_request, assert_unauthenticated, envelope, lacking,
                       mutation_args, operation_id, without)

PATH = f"{BASE}/participant"
GET_OP, POST_OP = "participant.get", "participant.register"
READ, WRITE = action_of(GET_OP), action_of(POST_OP)


# ---- GET /participant

@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
def test_get_refuses_a_missing_malformed_or_unknown_token(gateway, device, people, authorization):
    assert_unauthenticated(gateway.get(PATH, authorization=authorization))
    assert device.requests == []


def test_get_refuses_a_revoked_principal(gateway, device, people):
    assert_unauthenticated(gateway.get(PATH, people["revoked"]))
    assert device.requests == []


@pytest.mark.parametrize("name", lacking(READ))
def test_get_refuses_a_principal_without_the_read_action(gateway, device, people, name):
    assert_error(gateway.get(PATH, people[name]), 403, "grant_missing")
    assert device.requests == []


def test_get_rejects_unknown_query_parameters(gateway, device, people):
    assert_error(gateway.get(f"{PATH}?participant=par-{'a' * 32}", people["reader"]), 400, "unknown_parameter")
    assert device.requests == []


def test_get_asks_the_device_for_the_callers_own_participant(gateway, device, people):
    body = b'{"id":null,"lineage":"' + b"a" * 32 + b'","next_sequence":"1","registered":false,"retry_floor":null}'
    device.answer(200, body)
    persona = people[HOLDER[READ]]
    assert_passed_through(gateway.get(PATH, persona), 200, body)
    assert_request(device.only_request(), GET_OP, persona.principal_id, {})


def test_get_answers_503_device_unavailable_when_the_device_is_stopped(gateway, device, people):
    device.stop()
    assert_error(gateway.get(PATH, people["reader"]), 503, "device_unavailable")


# ---- POST /participant

@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
def test_post_refuses_a_missing_malformed_or_unknown_token(gateway, device, people, authorization):
    assert_unauthenticated(gateway.post(PATH, body=envelope(), authorization=authorization))
    assert device.requests == []


def test_post_refuses_a_revoked_principal(gateway, device, people):
    assert_unauthenticated(gateway.post(PATH, people["revoked"], envelope()))
    assert device.requests == []


@pytest.mark.parametrize("name", lacking(WRITE))
def test_post_refuses_a_principal_without_the_write_action(gateway, device, people, name):
    error = assert_error(gateway.post(PATH, people[name], envelope()), 403, "grant_missing")
    assert WRITE in error["message"]
    assert device.requests == []


def test_post_checks_the_grant_before_parsing_the_body(gateway, device, people):
    assert_error(gateway.post(PATH, people["reader"], raw=b"{nope"), 403, "grant_missing")
    assert device.requests == []


@pytest.mark.parametrize("make, status, code", MALFORMED_BODIES)
def test_post_refuses_a_malformed_body(gateway, device, people, make, status, code):
    assert_error(gateway.post(PATH, people["writer"], raw=make(envelope())), status, code)
    assert device.requests == []


def test_post_rejects_unknown_fields(gateway, device, people):
    body = envelope(name="alice", id="a" * 32)
    assert_error(gateway.post(PATH, people["writer"], body), 400, "unknown_field", fields=["id", "name"])
    assert device.requests == []


@pytest.mark.parametrize("missing", ["schema", "lineage", "operation_key", "sequence"])
def test_post_lists_a_missing_envelope_field(gateway, device, people, missing):
    body = without(envelope(), missing)
    assert_error(gateway.post(PATH, people["writer"], body), 400, "missing_field", fields=[missing])
    assert device.requests == []


def test_post_refuses_a_body_that_is_not_json_by_content_type(gateway, device, people):
    response = gateway.post(PATH, people["writer"], raw=json.dumps(envelope()).encode(), content_type="text/plain")
    assert_error(response, 415, "unsupported_media_type")
    assert device.requests == []


def test_post_sends_the_envelope_and_its_canonical_bytes(gateway, device, people):
    body = envelope(sequence="7")
    persona = people[HOLDER[WRITE]]
    assert gateway.post(PATH, persona, body).status_code == 200
    assert_request(device.only_request(), POST_OP, persona.principal_id, mutation_args(PATH, body))
    assert device.only_request()["args"]["sequence"] == 7


def test_post_passes_a_new_receipt_through_with_its_location(gateway, device, people):
    location = f"{BASE}/operations/{operation_id()}"
    receipt = b'{"kind":"participant.register","schema":"aotx.shared.receipt.v1"}'
    device.answer(202, receipt, {"Location": location})
    assert_passed_through(gateway.post(PATH, people["writer"], envelope()), 202, receipt, {"Location": location})


def test_post_passes_a_device_refusal_through(gateway, device, people):
    body = b'{"error":{"code":"already_registered","message":"the participant is already registered"}}'
    device.answer(409, body)
    assert_passed_through(gateway.post(PATH, people["writer"], envelope()), 409, body)


def test_post_answers_503_device_timeout_when_the_device_is_silent(gateway, device, people):
    device.silent = True
    error = assert_error(gateway.post(PATH, people["writer"], envelope()), 503, "device_timeout")
    assert "retry" in error["message"]
    assert device.only_request()["op"] == POST_OP


def test_post_answers_503_device_unavailable_when_the_device_is_stopped(gateway, device, people):
    device.stop()
    assert_error(gateway.post(PATH, people["writer"], envelope()), 503, "device_unavailable")
