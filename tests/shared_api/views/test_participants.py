"""GET /aotx/v1/shared/participants/{participant} (`participants.get`)."""
import pytest

from .conftest import (BAD_AUTHORIZATIONS, BASE, HOLDER, OK_BODY, action_of, assert_error, assert_passed_through,
                       assert_request, assert_unauthenticated, bad_ids, lacking, participant_id)

OP = "participants.get"
ACTION = action_of(OP)


def path(participant):
    return f"{BASE}/participants/{participant}"


@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
def test_it_refuses_a_missing_malformed_or_unknown_token(gateway, device, people, authorization):
    assert_unauthenticated(gateway.get(path(participant_id()), authorization=authorization))
    assert device.requests == []


def test_it_refuses_a_revoked_principal(gateway, device, people):
    assert_unauthenticated(gateway.get(path(participant_id()), people["revoked"]))
    assert device.requests == []


@pytest.mark.parametrize("name", lacking(ACTION))
def test_it_refuses_a_principal_without_the_read_action(gateway, device, people, name):
    assert_error(gateway.get(path(participant_id()), people[name]), 403, "grant_missing")
    assert device.requests == []


def test_it_checks_the_grant_before_the_path_id(gateway, device, people):
    assert_error(gateway.get(path("nonsense"), people["nobody"]), 403, "grant_missing")


@pytest.mark.parametrize("bad", bad_ids("par"))
def test_it_rejects_a_malformed_participant_id(gateway, device, people, bad):
    assert_error(gateway.get(path(bad), people["reader"]), 400, "bad_id")
    assert device.requests == []


def test_it_rejects_unknown_query_parameters(gateway, device, people):
    assert_error(gateway.get(path(participant_id()) + "?x=1", people["reader"]), 400, "unknown_parameter")
    assert device.requests == []


def test_it_asks_the_device_for_that_participant(gateway, device, people):
    other = participant_id()
    persona = people[HOLDER[ACTION]]
    assert_passed_through(gateway.get(path(other), persona), 200, OK_BODY)
    assert_request(device.only_request(), OP, persona.principal_id, {"participant": other})


def test_it_passes_a_not_found_through(gateway, device, people):
    body = b'{"error":{"code":"participant_not_found","message":"no such registered participant"}}'
    device.answer(404, body)
    assert_passed_through(gateway.get(path(participant_id()), people["reader"]), 404, body)


def test_an_empty_participant_is_no_route(gateway, device, people):
    assert_error(gateway.get(f"{BASE}/participants/", people["reader"]), 404, "not_found")
    assert device.requests == []
