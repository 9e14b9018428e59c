"""POST /aotx/v1/shared/spaces/{spc}/deletion (`spaces.delete`) and
/conversations/{con}/deletion (`conversations.delete`): the mutation envelope only, the path's ID
passed to the device, the manage action checked at the gateway first."""
import pytest

from .conftest import (BAD_AUTHORIZATIONS, BASE, HOLDER, MALFORMED_BODIES, action_of, assert_error,
                       assert_passed_through, assert_request, assert_unauthenticated, conversation_id, envelope,
                       lacking, mutation_args, operation_id, space_id)

ROUTES = [("spaces.delete", "space", space_id, "spaces/{}/deletion"),
          ("conversations.delete", "conversation", conversation_id, "conversations/{}/deletion")]
IDS = [r[0] for r in ROUTES]


def route(spec):
    op, field, make_id, template = spec
    resource = make_id()
    return op, field, resource, f"{BASE}/{template.format(resource)}"


def valid(**changes):
    return envelope(**{"sequence": "3", **changes})


@pytest.mark.parametrize("spec", ROUTES, ids=IDS)
@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
def test_it_refuses_a_missing_malformed_or_unknown_token(gateway, device, people, spec, authorization):
    _, _, _, path = route(spec)
    assert_unauthenticated(gateway.post(path, body=valid(), authorization=authorization))
    assert device.requests == []


@pytest.mark.parametrize("spec", ROUTES, ids=IDS)
def test_it_refuses_a_revoked_principal(gateway, device, people, spec):
    _, _, _, path = route(spec)
    assert_unauthenticated(gateway.post(path, people["revoked"], valid()))
    assert device.requests == []


@pytest.mark.parametrize("spec", ROUTES, ids=IDS)
def test_it_refuses_a_principal_without_the_manage_action(gateway, device, people, spec):
    op, _, _, path = route(spec)
    for name in lacking(action_of(op)):
        assert_error(gateway.post(path, people[name], valid()), 403, "grant_missing")
    assert device.requests == []


@pytest.mark.parametrize("spec", ROUTES, ids=IDS)
@pytest.mark.parametrize("make, status, code", MALFORMED_BODIES)
def test_it_refuses_a_malformed_body(gateway, device, people, spec, make, status, code):
    _, _, _, path = route(spec)
    assert_error(gateway.post(path, people["manager"], raw=make(valid())), status, code)
    assert device.requests == []


@pytest.mark.parametrize("spec", ROUTES, ids=IDS)
def test_it_rejects_fields_beyond_the_envelope_and_a_bad_path_id(gateway, device, people, spec):
    op, _, _, path = route(spec)
    assert_error(gateway.post(path, people["manager"], valid(id="ab" * 16)), 400, "unknown_field", fields=["id"])
    bad = path.replace(path.split("/")[-2], "spc-nothex")
    assert_error(gateway.post(bad, people["manager"], valid()), 400, "bad_id")
    assert device.requests == []


@pytest.mark.parametrize("spec", ROUTES, ids=IDS)
def test_it_sends_the_path_id_with_the_envelope(gateway, device, people, spec):
    op, field, resource, path = route(spec)
    body = valid()
    persona = people[HOLDER[action_of(op)]]
    assert gateway.post(path, persona, body).status_code == 200
    assert_request(device.only_request(), op, persona.principal_id, mutation_args(path, body, **{field: resource}))


@pytest.mark.parametrize("spec", ROUTES, ids=IDS)
def test_it_passes_the_receipt_and_the_devices_refusals_through(gateway, device, people, spec):
    op, _, _, path = route(spec)
    location = f"{BASE}/operations/{operation_id()}"
    receipt = b'{"kind":"%s"}' % op.replace("s.delete", ".delete").encode()
    device.answer(202, receipt, {"Location": location})
    assert_passed_through(gateway.post(path, people["manager"], valid()), 202, receipt, {"Location": location})
    for status, code in ((409, "space_not_empty"), (409, "conversation_busy"), (429, "quota_exceeded")):
        body = b'{"error":{"code":"%s","message":"refused"}}' % code.encode()
        device.answer(status, body)
        assert_passed_through(gateway.post(path, people["manager"], valid()), status, body)
