"""GET /aotx/v1/shared/conversations/{conversation} (`conversations.get`)."""
import pytest

from .conftest import (BAD_AUTHORIZATIONS, BASE, HOLDER, OK_BODY, action_of, assert_error, assert_passed_through,
                       assert_request, assert_unauthenticated, bad_ids, conversation_id, lacking)

OP = "conversations.get"
ACTION = action_of(OP)


def path(conversation):
    return f"{BASE}/conversations/{conversation}"


@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
def test_it_refuses_a_missing_malformed_or_unknown_token(gateway, device, people, authorization):
    assert_unauthenticated(gateway.get(path(conversation_id()), authorization=authorization))
    assert device.requests == []


def test_it_refuses_a_revoked_principal(gateway, device, people):
    assert_unauthenticated(gateway.get(path(conversation_id()), people["revoked"]))
    assert device.requests == []


@pytest.mark.parametrize("name", lacking(ACTION))
def test_it_refuses_a_principal_without_the_read_action(gateway, device, people, name):
    assert_error(gateway.get(path(conversation_id()), people[name]), 403, "grant_missing")
    assert device.requests == []


@pytest.mark.parametrize("bad", bad_ids("con"))
def test_it_rejects_a_malformed_conversation_id(gateway, device, people, bad):
    assert_error(gateway.get(path(bad), people["reader"]), 400, "bad_id")
    assert device.requests == []


def test_it_rejects_unknown_query_parameters(gateway, device, people):
    assert_error(gateway.get(path(conversation_id()) + "?cursor=1", people["reader"]), 400, "unknown_parameter")
    assert device.requests == []


def test_it_asks_the_device_for_that_conversation(gateway, device, people):
    conversation = conversation_id()
    persona = people[HOLDER[ACTION]]
    assert_passed_through(gateway.get(path(conversation), persona), 200, OK_BODY)
    assert_request(device.only_request(), OP, persona.principal_id, {"conversation": conversation})


def test_it_passes_a_not_found_through(gateway, device, people):
    body = b'{"error":{"code":"conversation_not_found","message":"no such conversation"}}'
    device.answer(404, body)
    assert_passed_through(gateway.get(path(conversation_id()), people["reader"]), 404, body)
