"""POST /aotx/v1/shared/retirements (`retirements.record`): required `retry_floor`, a positive
decimal string, sent to the device as an integer."""
import pytest

from .conftest import (BAD_AUTHORIZATIONS, BASE, HOLDER, MALFORMED_BODIES, action_of, assert_error,
                       assert_passed_through, assert_request, assert_unauthenticated, envelope, lacking,
                       mutation_args, operation_id, without)

PATH = f"{BASE}/retirements"
OP = "retirements.record"
ACTION = action_of(OP)


def valid(**changes):
    return envelope(**{"sequence": "5", "retry_floor": "4", **changes})


@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
def test_it_refuses_a_missing_malformed_or_unknown_token(gateway, device, people, authorization):
    assert_unauthenticated(gateway.post(PATH, body=valid(), authorization=authorization))
    assert device.requests == []


def test_it_refuses_a_revoked_principal(gateway, device, people):
    assert_unauthenticated(gateway.post(PATH, people["revoked"], valid()))
    assert device.requests == []


@pytest.mark.parametrize("name", lacking(ACTION))
def test_it_refuses_a_principal_without_the_write_action(gateway, device, people, name):
    assert_error(gateway.post(PATH, people[name], valid()), 403, "grant_missing")
    assert device.requests == []


@pytest.mark.parametrize("make, status, code", MALFORMED_BODIES)
def test_it_refuses_a_malformed_body(gateway, device, people, make, status, code):
    assert_error(gateway.post(PATH, people["writer"], raw=make(valid())), status, code)
    assert device.requests == []


def test_it_rejects_unknown_fields(gateway, device, people):
    body = valid(retry_floor_hint="3")
    assert_error(gateway.post(PATH, people["writer"], body), 400, "unknown_field", fields=["retry_floor_hint"])
    assert device.requests == []


def test_it_requires_a_retry_floor(gateway, device, people):
    body = without(valid(), "retry_floor")
    assert_error(gateway.post(PATH, people["writer"], body), 400, "missing_field", fields=["retry_floor"])
    assert device.requests == []


@pytest.mark.parametrize("floor", [4, 4.0, "4.0", "04", "-4", "", None, "1e3", str(1 << 63), ["4"]], ids=repr)
def test_it_rejects_a_retry_floor_that_is_not_a_decimal_string(gateway, device, people, floor):
    assert_error(gateway.post(PATH, people["writer"], valid(retry_floor=floor)), 400, "bad_field")
    assert device.requests == []


def test_it_rejects_a_zero_retry_floor(gateway, device, people):
    assert_error(gateway.post(PATH, people["writer"], valid(retry_floor="0")), 400, "bad_field")
    assert device.requests == []


@pytest.mark.parametrize("floor", ["1", "4", str((1 << 63) - 1)])
def test_it_sends_the_retry_floor_as_an_integer(gateway, device, people, floor):
    body = valid(retry_floor=floor)
    persona = people[HOLDER[ACTION]]
    assert gateway.post(PATH, persona, body).status_code == 200
    assert_request(device.only_request(), OP, persona.principal_id, mutation_args(PATH, body, retry_floor=int(floor)))


def test_it_passes_a_new_receipt_through_with_its_location(gateway, device, people):
    location = f"{BASE}/operations/{operation_id()}"
    receipt = b'{"kind":"retirement"}'
    device.answer(202, receipt, {"Location": location})
    assert_passed_through(gateway.post(PATH, people["writer"], valid()), 202, receipt, {"Location": location})


@pytest.mark.parametrize("status, code", [(409, "unfinished_operations"), (410, "below_retry_floor"),
                                          (409, "retry_floor_not_advanced")])
def test_it_passes_the_devices_refusal_through(gateway, device, people, status, code):
    body = b'{"error":{"code":"%s","message":"refused","retry_floor":"3"}}' % code.encode()
    device.answer(status, body)
    assert_passed_through(gateway.post(PATH, people["writer"], valid()), status, body)
