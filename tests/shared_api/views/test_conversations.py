"""GET /aotx/v1/shared/spaces/{space}/conversations (`conversations.list`) and POST
(`conversations.create`: optional `id`, 32 hex)."""
import pytest

from .conftest import (BAD_AUTHORIZATIONS, BAD_CURSORS, BAD_LIMITS, BASE, HOLDER, MALFORMED_BODIES,
                       action_of, assert_error, assert_passed_through, assert_request, assert_unauthenticated,
                       bad_ids, conversation_id, envelope, hex32, lacking, mutation_args, operation_id, space_id)

LIST_OP, CREATE_OP = "conversations.list", "conversations.create"
READ, WRITE = action_of(LIST_OP), action_of(CREATE_OP)


def path(space):
    return f"{BASE}/spaces/{space}/conversations"


# ---- GET conversations

@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
def test_list_refuses_a_missing_malformed_or_unknown_token(gateway, device, people, authorization):
    assert_unauthenticated(gateway.get(path(space_id()), authorization=authorization))
    assert device.requests == []


def test_list_refuses_a_revoked_principal(gateway, device, people):
    assert_unauthenticated(gateway.get(path(space_id()), people["revoked"]))
    assert device.requests == []


@pytest.mark.parametrize("name", lacking(READ))
def test_list_refuses_a_principal_without_the_read_action(gateway, device, people, name):
    assert_error(gateway.get(path(space_id()), people[name]), 403, "grant_missing")
    assert device.requests == []


@pytest.mark.parametrize("bad", bad_ids("spc"))
def test_list_rejects_a_malformed_space_id(gateway, device, people, bad):
    assert_error(gateway.get(path(bad), people["reader"]), 400, "bad_id")
    assert device.requests == []


@pytest.mark.parametrize("limit", BAD_LIMITS)
def test_list_rejects_a_bad_limit(gateway, device, people, limit):
    assert_error(gateway.get(f"{path(space_id())}?limit={limit}", people["reader"]), 400, "bad_limit")
    assert device.requests == []


@pytest.mark.parametrize("cursor", BAD_CURSORS)
def test_list_rejects_a_bad_cursor(gateway, device, people, cursor):
    assert_error(gateway.get(f"{path(space_id())}?cursor={cursor}", people["reader"]), 400, "bad_field")
    assert device.requests == []


def test_list_rejects_unknown_query_parameters(gateway, device, people):
    assert_error(gateway.get(f"{path(space_id())}?slot=1", people["reader"]), 400, "unknown_parameter")
    assert device.requests == []


def test_list_sends_the_space_and_the_paging_args(gateway, device, people):
    space = space_id()
    body = b'{"items":[],"next_cursor":"4"}'
    device.answer(200, body)
    persona = people[HOLDER[READ]]
    assert_passed_through(gateway.get(f"{path(space)}?cursor=2&limit=2", persona), 200, body)
    assert_request(device.only_request(), LIST_OP, persona.principal_id, {"space": space, "cursor": "2", "limit": 2})


# ---- POST conversations

@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
def test_create_refuses_a_missing_malformed_or_unknown_token(gateway, device, people, authorization):
    assert_unauthenticated(gateway.post(path(space_id()), body=envelope(), authorization=authorization))
    assert device.requests == []


def test_create_refuses_a_revoked_principal(gateway, device, people):
    assert_unauthenticated(gateway.post(path(space_id()), people["revoked"], envelope()))
    assert device.requests == []


@pytest.mark.parametrize("name", lacking(WRITE))
def test_create_refuses_a_principal_without_the_write_action(gateway, device, people, name):
    assert_error(gateway.post(path(space_id()), people[name], envelope()), 403, "grant_missing")
    assert device.requests == []


@pytest.mark.parametrize("make, status, code", MALFORMED_BODIES)
def test_create_refuses_a_malformed_body(gateway, device, people, make, status, code):
    assert_error(gateway.post(path(space_id()), people["writer"], raw=make(envelope(id=hex32()))), status, code)
    assert device.requests == []


@pytest.mark.parametrize("bad", bad_ids("spc"))
def test_create_rejects_a_malformed_space_id(gateway, device, people, bad):
    assert_error(gateway.post(path(bad), people["writer"], envelope()), 400, "bad_id")
    assert device.requests == []


def test_create_rejects_unknown_fields(gateway, device, people):
    body = envelope(space=space_id(), title="hello")
    assert_error(gateway.post(path(space_id()), people["writer"], body), 400, "unknown_field",
                 fields=["space", "title"])
    assert device.requests == []


@pytest.mark.parametrize("conversation", ["F" * 32, "f" * 30, conversation_id(), 1, None])
def test_create_rejects_a_malformed_id(gateway, device, people, conversation):
    assert_error(gateway.post(path(space_id()), people["writer"], envelope(id=conversation)), 400, "bad_field")
    assert device.requests == []


@pytest.mark.parametrize("own", [{}, {"id": hex32()}])
def test_create_sends_the_space_from_the_path_and_the_callers_fields(gateway, device, people, own):
    space = space_id()
    body = envelope(**own)
    persona = people[HOLDER[WRITE]]
    assert gateway.post(path(space), persona, body).status_code == 200
    assert_request(device.only_request(), CREATE_OP, persona.principal_id,
                   mutation_args(path(space), body, space=space, **own))


def test_create_passes_a_new_receipt_through_with_its_location(gateway, device, people):
    location = f"{BASE}/operations/{operation_id()}"
    receipt = b'{"kind":"conversation.create"}'
    device.answer(202, receipt, {"Location": location})
    assert_passed_through(gateway.post(path(space_id()), people["writer"], envelope()), 202, receipt,
                          {"Location": location})


def test_create_answers_503_device_unavailable_when_the_device_is_stopped(gateway, device, people):
    device.stop()
    assert_error(gateway.post(path(space_id()), people["writer"], envelope()), 503, "device_unavailable")
