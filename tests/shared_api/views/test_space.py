"""GET /aotx/v1/shared/spaces/{space} (`spaces.get`)."""
import pytest

from .conftest import (BAD_AUTHORIZATIONS, BASE, HOLDER, action_of, assert_error, assert_passed_through,
                       assert_request, assert_unauthenticated, bad_ids, envelope, lacking, space_id)

OP = "spaces.get"
ACTION = action_of(OP)


def path(space):
    return f"{BASE}/spaces/{space}"


@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
def test_it_refuses_a_missing_malformed_or_unknown_token(gateway, device, people, authorization):
    assert_unauthenticated(gateway.get(path(space_id()), authorization=authorization))
    assert device.requests == []


def test_it_refuses_a_revoked_principal(gateway, device, people):
    assert_unauthenticated(gateway.get(path(space_id()), people["revoked"]))
    assert device.requests == []


@pytest.mark.parametrize("name", lacking(ACTION))
def test_it_refuses_a_principal_without_the_read_action(gateway, device, people, name):
    assert_error(gateway.get(path(space_id()), people[name]), 403, "grant_missing")
    assert device.requests == []


@pytest.mark.parametrize("bad", bad_ids("spc"))
def test_it_rejects_a_malformed_space_id(gateway, device, people, bad):
    assert_error(gateway.get(path(bad), people["reader"]), 400, "bad_id")
    assert device.requests == []


def test_it_rejects_unknown_query_parameters(gateway, device, people):
    assert_error(gateway.get(path(space_id()) + "?rights=1", people["reader"]), 400, "unknown_parameter")
    assert device.requests == []


def test_it_asks_the_device_for_that_space(gateway, device, people):
    space = space_id()
    body = b'{"id":"' + space.encode() + b'","rights":["read"],"scope":"room"}'
    device.answer(200, body)
    persona = people[HOLDER[ACTION]]
    assert_passed_through(gateway.get(path(space), persona), 200, body)
    assert_request(device.only_request(), OP, persona.principal_id, {"space": space})


@pytest.mark.parametrize("status, code", [(404, "space_not_found"), (403, "right_missing")])
def test_it_passes_the_devices_refusal_through(gateway, device, people, status, code):
    body = b'{"error":{"code":"%s","message":"refused by the device"}}' % code.encode()
    device.answer(status, body)
    assert_passed_through(gateway.get(path(space_id()), people["reader"]), status, body)


def test_it_has_no_post(gateway, device, people):
    assert_error(gateway.post(path(space_id()), people["manager"], envelope()), 405, "method_not_allowed")
    assert device.requests == []
