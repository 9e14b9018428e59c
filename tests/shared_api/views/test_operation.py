"""GET /aotx/v1/shared/operations/{operation} (`operations.get`): one receipt."""
import pytest

from .conftest import (BAD_AUTHORIZATIONS, BASE, HOLDER, action_of, assert_error, assert_passed_through,
                       assert_request, assert_unauthenticated, bad_ids, lacking, operation_id)

OP = "operations.get"
ACTION = action_of(OP)


def path(operation):
    return f"{BASE}/operations/{operation}"


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


def test_it_rejects_unknown_query_parameters(gateway, device, people):
    assert_error(gateway.get(path(operation_id()) + "?offset=0", people["reader"]), 400, "unknown_parameter")
    assert device.requests == []


def test_it_asks_the_device_for_that_receipt_and_passes_it_through(gateway, device, people):
    operation = operation_id()
    receipt = (b'{"kind":"space.create","operation":"' + operation.encode() + b'","schema":"aotx.shared.receipt.v1",'
               b'"sequence":"3"}')
    device.answer(200, receipt)
    persona = people[HOLDER[ACTION]]
    assert_passed_through(gateway.get(path(operation), persona), 200, receipt)
    assert_request(device.only_request(), OP, persona.principal_id, {"operation": operation})


@pytest.mark.parametrize("status, code", [(404, "operation_not_found"), (410, "operation_retired")])
def test_it_passes_the_devices_refusal_through(gateway, device, people, status, code):
    body = b'{"error":{"code":"%s","message":"refused"}}' % code.encode()
    device.answer(status, body)
    assert_passed_through(gateway.get(path(operation_id()), people["reader"]), status, body)


def test_it_answers_503_device_unavailable_when_the_device_is_stopped(gateway, device, people):
    device.stop()
    assert_error(gateway.get(path(operation_id()), people["reader"]), 503, "device_unavailable")
