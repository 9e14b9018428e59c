"""GET /aotx/v1/shared/spaces (`spaces.list`) and POST /aotx/v1/shared/spaces (`spaces.create`:
optional `id` (32 hex), `scope` (private, room, instance) and `memory_ttl_seconds` (a JSON integer
1..MAX_MEMORY_TTL_SECONDS))."""
import json

import pytest

from gpu_worker.contract.limits import MAX_MEMORY_TTL_SECONDS

from .conftest import (BAD_AUTHORIZATIONS, BAD_CURSORS, BAD_LIMITS, BASE, HOLDER, MALFORMED_BODIES, OK_BODY,
                       action_of, assert_error, assert_passed_through, assert_request, assert_unauthenticated,
                       canonical, envelope, hex32, lacking, mutation_args, operation_id, space_id)

PATH = f"{BASE}/spaces"
LIST_OP, CREATE_OP = "spaces.list", "spaces.create"
READ, WRITE = action_of(LIST_OP), action_of(CREATE_OP)


# ---- GET /spaces

@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
def test_list_refuses_a_missing_malformed_or_unknown_token(gateway, device, people, authorization):
    assert_unauthenticated(gateway.get(PATH, authorization=authorization))
    assert device.requests == []


def test_list_refuses_a_revoked_principal(gateway, device, people):
    assert_unauthenticated(gateway.get(PATH, people["revoked"]))
    assert device.requests == []


@pytest.mark.parametrize("name", lacking(READ))
def test_list_refuses_a_principal_without_the_read_action(gateway, device, people, name):
    assert_error(gateway.get(PATH, people[name]), 403, "grant_missing")
    assert device.requests == []


@pytest.mark.parametrize("limit", BAD_LIMITS)
def test_list_rejects_a_bad_limit(gateway, device, people, limit):
    assert_error(gateway.get(f"{PATH}?limit={limit}", people["reader"]), 400, "bad_limit")
    assert device.requests == []


@pytest.mark.parametrize("cursor", BAD_CURSORS)
def test_list_rejects_a_bad_cursor(gateway, device, people, cursor):
    assert_error(gateway.get(f"{PATH}?cursor={cursor}", people["reader"]), 400, "bad_field")
    assert device.requests == []


@pytest.mark.parametrize("query", ["scope=room", "limit=5&offset=3", "Limit=5"])
def test_list_rejects_unknown_query_parameters(gateway, device, people, query):
    assert_error(gateway.get(f"{PATH}?{query}", people["reader"]), 400, "unknown_parameter")
    assert device.requests == []


def test_list_sends_no_paging_args_when_none_are_given(gateway, device, people):
    persona = people[HOLDER[READ]]
    assert_passed_through(gateway.get(PATH, persona), 200, OK_BODY)
    assert_request(device.only_request(), LIST_OP, persona.principal_id, {})


@pytest.mark.parametrize("query, args", [
    ("cursor=12&limit=200", {"cursor": "12", "limit": 200}),
    ("limit=1", {"limit": 1}),
    ("cursor=0", {"cursor": "0"}),
])
def test_list_sends_the_cursor_as_a_string_and_the_limit_as_an_integer(gateway, device, people, query, args):
    body = b'{"items":[],"next_cursor":null}'
    device.answer(200, body)
    assert_passed_through(gateway.get(f"{PATH}?{query}", people["reader"]), 200, body)
    assert_request(device.only_request(), LIST_OP, people["reader"].principal_id, args)


def test_list_answers_503_device_timeout_when_the_device_is_silent(gateway, device, people):
    device.silent = True
    assert_error(gateway.get(PATH, people["reader"]), 503, "device_timeout")


# ---- POST /spaces

@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
def test_create_refuses_a_missing_malformed_or_unknown_token(gateway, device, people, authorization):
    assert_unauthenticated(gateway.post(PATH, body=envelope(), authorization=authorization))
    assert device.requests == []


def test_create_refuses_a_revoked_principal(gateway, device, people):
    assert_unauthenticated(gateway.post(PATH, people["revoked"], envelope()))
    assert device.requests == []


@pytest.mark.parametrize("name", lacking(WRITE))
def test_create_refuses_a_principal_without_the_write_action(gateway, device, people, name):
    assert_error(gateway.post(PATH, people[name], envelope(scope="room")), 403, "grant_missing")
    assert device.requests == []


@pytest.mark.parametrize("make, status, code", MALFORMED_BODIES)
def test_create_refuses_a_malformed_body(gateway, device, people, make, status, code):
    assert_error(gateway.post(PATH, people["writer"], raw=make(envelope(scope="room"))), status, code)
    assert device.requests == []


def test_create_rejects_unknown_fields(gateway, device, people):
    body = envelope(scope="room", name="team", owner="par-" + "a" * 32)
    assert_error(gateway.post(PATH, people["writer"], body), 400, "unknown_field", fields=["name", "owner"])
    assert device.requests == []


@pytest.mark.parametrize("scope", ["public", "Private", "", None, 1, ["room"]])
def test_create_rejects_an_unknown_scope(gateway, device, people, scope):
    assert_error(gateway.post(PATH, people["writer"], envelope(scope=scope)), 400, "bad_field")
    assert device.requests == []


@pytest.mark.parametrize("space", ["A" * 32, "a" * 31, "a" * 33, space_id(), 7, None])
def test_create_rejects_a_malformed_id(gateway, device, people, space):
    assert_error(gateway.post(PATH, people["writer"], envelope(id=space)), 400, "bad_field")
    assert device.requests == []


@pytest.mark.parametrize("ttl", [0, -1, "60", 60.0, 1.5, True, None, [60], MAX_MEMORY_TTL_SECONDS + 1], ids=repr)
def test_create_rejects_a_memory_ttl_that_is_not_an_integer_within_its_bounds(gateway, device, people, ttl):
    assert_error(gateway.post(PATH, people["writer"], envelope(memory_ttl_seconds=ttl)), 400, "bad_field")
    assert device.requests == []


@pytest.mark.parametrize("own", [{}, {"scope": "instance"}, {"id": hex32()}, {"id": hex32(), "scope": "private"},
                                 {"memory_ttl_seconds": 1}, {"scope": "room", "memory_ttl_seconds": 3600},
                                 {"memory_ttl_seconds": MAX_MEMORY_TTL_SECONDS}])
def test_create_sends_only_the_fields_the_caller_gave(gateway, device, people, own):
    body = envelope(**own)
    persona = people[HOLDER[WRITE]]
    assert gateway.post(PATH, persona, body).status_code == 200
    assert_request(device.only_request(), CREATE_OP, persona.principal_id, mutation_args(PATH, body, **own))


def test_create_canonicalises_the_body_whatever_its_spelling(gateway, device, people):
    body = envelope(scope="room")
    raw = ("{\n  " + ",\n  ".join(f'"{k}" : "{v}"' for k, v in reversed(list(body.items()))) + "\n}").encode()
    raw = raw.replace(b'"room"', b'"r\\u006fom"')
    assert json.loads(raw) == body
    assert gateway.post(PATH, people["writer"], raw=raw).status_code == 200
    assert device.only_request()["args"]["canonical"] == canonical(PATH, body)


def test_create_passes_a_new_receipt_through_with_its_location(gateway, device, people):
    location = f"{BASE}/operations/{operation_id()}"
    receipt = b'{"kind":"space.create","target":"' + space_id().encode() + b'"}'
    device.answer(202, receipt, {"Location": location})
    assert_passed_through(gateway.post(PATH, people["writer"], envelope()), 202, receipt, {"Location": location})


def test_create_answers_503_device_timeout_when_the_device_is_silent(gateway, device, people):
    device.silent = True
    assert_error(gateway.post(PATH, people["writer"], envelope()), 503, "device_timeout")
    assert device.only_request()["op"] == CREATE_OP


def test_create_answers_503_device_unavailable_when_the_device_is_stopped(gateway, device, people):
    device.stop()
    assert_error(gateway.post(PATH, people["writer"], envelope()), 503, "device_unavailable")
