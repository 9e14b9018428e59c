"""GET /aotx/v1/shared/operations (`operations.list`): the caller's own receipts, paged."""
import pytest

from .conftest import (BAD_AUTHORIZATIONS, BAD_CURSORS, BAD_LIMITS, BASE, HOLDER, OK_BODY, action_of, assert_error,
                       assert_passed_through, assert_request, assert_unauthenticated, envelope, lacking)

PATH = f"{BASE}/operations"
OP = "operations.list"
ACTION = action_of(OP)


@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
def test_it_refuses_a_missing_malformed_or_unknown_token(gateway, device, people, authorization):
    assert_unauthenticated(gateway.get(PATH, authorization=authorization))
    assert device.requests == []


def test_it_refuses_a_revoked_principal(gateway, device, people):
    assert_unauthenticated(gateway.get(PATH, people["revoked"]))
    assert device.requests == []


@pytest.mark.parametrize("name", lacking(ACTION))
def test_it_refuses_a_principal_without_the_read_action(gateway, device, people, name):
    assert_error(gateway.get(PATH, people[name]), 403, "grant_missing")
    assert device.requests == []


@pytest.mark.parametrize("limit", BAD_LIMITS)
def test_it_rejects_a_bad_limit(gateway, device, people, limit):
    assert_error(gateway.get(f"{PATH}?limit={limit}", people["reader"]), 400, "bad_limit")
    assert device.requests == []


@pytest.mark.parametrize("cursor", BAD_CURSORS)
def test_it_rejects_a_bad_cursor(gateway, device, people, cursor):
    assert_error(gateway.get(f"{PATH}?cursor={cursor}", people["reader"]), 400, "bad_field")
    assert device.requests == []


@pytest.mark.parametrize("query", ["kind=retirement", "cursor=1&sequence=2"])
def test_it_rejects_unknown_query_parameters(gateway, device, people, query):
    assert_error(gateway.get(f"{PATH}?{query}", people["reader"]), 400, "unknown_parameter")
    assert device.requests == []


def test_it_asks_the_device_for_the_callers_receipts(gateway, device, people):
    persona = people[HOLDER[ACTION]]
    assert_passed_through(gateway.get(PATH, persona), 200, OK_BODY)
    assert_request(device.only_request(), OP, persona.principal_id, {})


def test_it_sends_the_paging_args(gateway, device, people):
    body = b'{"items":[{"kind":"retirement"}],"next_cursor":"101"}'
    device.answer(200, body)
    assert_passed_through(gateway.get(f"{PATH}?limit=50&cursor=100", people["reader"]), 200, body)
    assert_request(device.only_request(), OP, people["reader"].principal_id, {"cursor": "100", "limit": 50})


def test_it_has_no_post(gateway, device, people):
    assert_error(gateway.post(PATH, people["writer"], envelope()), 405, "method_not_allowed")
    assert device.requests == []
