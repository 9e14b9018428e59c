"""GET /aotx/v1/shared/spaces/{space}/members (`members.list`) and POST (`members.set`: required
`participant` and `permissions`; needs `shared_manage`)."""
import pytest

from .conftest import (BAD_AUTHORIZATIONS, BAD_CURSORS, BAD_LIMITS, BASE, HOLDER, MALFORMED_BODIES, OK_BODY,
                       action_of, assert_error, assert_passed_through, assert_request, assert_unauthenticated,
                       bad_ids, envelope, lacking, mutation_args, operation_id, participant_id, space_id, without)

LIST_OP, SET_OP = "members.list", "members.set"
READ, MANAGE = action_of(LIST_OP), action_of(SET_OP)


def path(space):
    return f"{BASE}/spaces/{space}/members"


def valid(**changes):
    return envelope(participant=participant_id(), permissions=["read", "write"], **changes)


# ---- GET members

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
    assert_error(gateway.get(f"{path(space_id())}?explicit=1", people["reader"]), 400, "unknown_parameter")
    assert device.requests == []


def test_list_sends_the_space_and_the_paging_args(gateway, device, people):
    space = space_id()
    persona = people[HOLDER[READ]]
    assert_passed_through(gateway.get(f"{path(space)}?limit=3&cursor=9", persona), 200, OK_BODY)
    assert_request(device.only_request(), LIST_OP, persona.principal_id, {"space": space, "cursor": "9", "limit": 3})


def test_list_sends_only_the_space_without_paging(gateway, device, people):
    space = space_id()
    assert gateway.get(path(space), people["reader"]).status_code == 200
    assert_request(device.only_request(), LIST_OP, people["reader"].principal_id, {"space": space})


# ---- POST members

@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
def test_set_refuses_a_missing_malformed_or_unknown_token(gateway, device, people, authorization):
    assert_unauthenticated(gateway.post(path(space_id()), body=valid(), authorization=authorization))
    assert device.requests == []


def test_set_refuses_a_revoked_principal(gateway, device, people):
    assert_unauthenticated(gateway.post(path(space_id()), people["revoked"], valid()))
    assert device.requests == []


@pytest.mark.parametrize("name", lacking(MANAGE))
def test_set_refuses_a_principal_without_the_manage_action(gateway, device, people, name):
    error = assert_error(gateway.post(path(space_id()), people[name], valid()), 403, "grant_missing")
    assert MANAGE in error["message"]
    assert device.requests == []


@pytest.mark.parametrize("make, status, code", MALFORMED_BODIES)
def test_set_refuses_a_malformed_body(gateway, device, people, make, status, code):
    assert_error(gateway.post(path(space_id()), people["manager"], raw=make(valid())), status, code)
    assert device.requests == []


@pytest.mark.parametrize("bad", bad_ids("spc"))
def test_set_rejects_a_malformed_space_id(gateway, device, people, bad):
    assert_error(gateway.post(path(bad), people["manager"], valid()), 400, "bad_id")
    assert device.requests == []


def test_set_rejects_unknown_fields(gateway, device, people):
    body = valid(space=space_id(), explicit=True)
    assert_error(gateway.post(path(space_id()), people["manager"], body), 400, "unknown_field",
                 fields=["explicit", "space"])
    assert device.requests == []


@pytest.mark.parametrize("missing, fields", [
    (("participant",), ["participant"]),
    (("permissions",), ["permissions"]),
    (("participant", "permissions", "sequence"), ["sequence", "participant", "permissions"]),
])
def test_set_lists_missing_fields(gateway, device, people, missing, fields):
    body = without(valid(), *missing)
    assert_error(gateway.post(path(space_id()), people["manager"], body), 400, "missing_field", fields=fields)
    assert device.requests == []


@pytest.mark.parametrize("participant", [f"par-{'A' * 32}", space_id(), "a" * 32, None, 3])
def test_set_rejects_a_malformed_participant(gateway, device, people, participant):
    body = {**valid(), "participant": participant}
    assert_error(gateway.post(path(space_id()), people["manager"], body), 400, "bad_id")
    assert device.requests == []


@pytest.mark.parametrize("permissions", [["admin"], ["read", "read"], "read", None, {"read": True}, ["Read"], [1]])
def test_set_rejects_bad_permissions(gateway, device, people, permissions):
    body = {**valid(), "permissions": permissions}
    assert_error(gateway.post(path(space_id()), people["manager"], body), 400, "bad_field")
    assert device.requests == []


@pytest.mark.parametrize("permissions", [[], ["manage"], ["write", "read", "manage"]])
def test_set_sends_the_space_participant_and_permissions(gateway, device, people, permissions):
    space, member = space_id(), participant_id()
    body = envelope(participant=member, permissions=permissions)
    persona = people[HOLDER[MANAGE]]
    assert gateway.post(path(space), persona, body).status_code == 200
    assert_request(device.only_request(), SET_OP, persona.principal_id,
                   mutation_args(path(space), body, space=space, participant=member, permissions=permissions))


def test_set_passes_a_new_receipt_through_with_its_location(gateway, device, people):
    location = f"{BASE}/operations/{operation_id()}"
    receipt = b'{"kind":"member.set"}'
    device.answer(202, receipt, {"Location": location})
    assert_passed_through(gateway.post(path(space_id()), people["manager"], valid()), 202, receipt,
                          {"Location": location})


def test_set_passes_a_device_refusal_through(gateway, device, people):
    body = b'{"error":{"code":"owner_rights_fixed","message":"the owner\'s rights cannot be changed"}}'
    device.answer(409, body)
    assert_passed_through(gateway.post(path(space_id()), people["manager"], valid()), 409, body)
