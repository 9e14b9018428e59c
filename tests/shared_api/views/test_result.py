"""GET /aotx/v1/shared/operations/{operation}/result (`operations.result`): query `offset`
(a non-negative integer, default 0), sent to the device as an integer."""
import pytest

from .conftest import (BAD_AUTHORIZATIONS, BASE, HOLDER, action_of, assert_error, assert_passed_through,
                       assert_request, assert_unauthenticated, bad_ids, lacking, operation_id)

OP = "operations.result"
ACTION = action_of(OP)


def path(operation):
    return f"{BASE}/operations/{operation}/result"


@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
def test_it_refuses_a_missing_malformed_or_unknown_token(gateway, device, people, authorization):
    assert_unauthenticated(gateway.get(path(operation_id()), authorization=authorization))
    assert device.requests == []


def test_it_refuses_a_revoked_principal(gateway, device, people):
    assert_unauthenticated(gateway.get(path(operation_id()), people["revoked"]))
    assert device.requests == []


@pytest.mark.parametrize("name", lacking(ACTION))
def test_it_refuses_a_principal_without_the_read_action(gateway, device, people, name):
    assert_error(gateway.get(path(operation_id()), people[name]), 403, "grant_missing")
    assert device.requests == []


@pytest.mark.parametrize("bad", bad_ids("op"))
def test_it_rejects_a_malformed_operation_id(gateway, device, people, bad):
    assert_error(gateway.get(path(bad), people["reader"]), 400, "bad_id")
    assert device.requests == []


@pytest.mark.parametrize("offset", ["-1", "1.5", "abc", "", "%C2%B2", "1" * 19, "0x10"])
def test_it_rejects_a_bad_offset(gateway, device, people, offset):
    assert_error(gateway.get(f"{path(operation_id())}?offset={offset}", people["reader"]), 400, "bad_offset")
    assert device.requests == []


@pytest.mark.parametrize("query", ["cursor=1", "offset=0&limit=5"])
def test_it_rejects_unknown_query_parameters(gateway, device, people, query):
    assert_error(gateway.get(f"{path(operation_id())}?{query}", people["reader"]), 400, "unknown_parameter")
    assert device.requests == []


@pytest.mark.parametrize("query, offset", [("", 0), ("?offset=0", 0), ("?offset=4096", 4096)])
def test_it_sends_the_operation_and_the_offset_as_an_integer(gateway, device, people, query, offset):
    operation = operation_id()
    body = b'{"bytes":"aGk=","complete":true,"length":2,"next_offset":2,"offset":0,"text":"hi"}'
    device.answer(200, body)
    persona = people[HOLDER[ACTION]]
    assert_passed_through(gateway.get(path(operation) + query, persona), 200, body)
    assert_request(device.only_request(), OP, persona.principal_id, {"operation": operation, "offset": offset})


@pytest.mark.parametrize("status, code", [(409, "no_result"), (504, "deadline_exceeded"), (400, "bad_offset")])
def test_it_passes_the_devices_refusal_through(gateway, device, people, status, code):
    body = b'{"error":{"code":"%s","message":"refused"}}' % code.encode()
    device.answer(status, body)
    assert_passed_through(gateway.get(path(operation_id()), people["reader"]), status, body)


def test_it_answers_503_device_timeout_when_the_device_is_silent(gateway, device, people):
    device.silent = True
    assert_error(gateway.get(path(operation_id()), people["reader"]), 503, "device_timeout")
