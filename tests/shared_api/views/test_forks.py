"""POST /aotx/v1/shared/conversations/{con}/forks (`conversations.fork`): what it sends to the
device and what it refuses without calling it."""
import pytest

from .conftest import (BAD_AUTHORIZATIONS, BASE, HOLDER, MALFORMED_BODIES, action_of, assert_error,
                       assert_passed_through, assert_request, assert_unauthenticated, bad_ids, conversation_id,
                       envelope, hex32, lacking, mutation_args, operation_id, space_id, without)

OP = "conversations.fork"


def path(conversation):
    return f"{BASE}/conversations/{conversation}/forks"


def fork(**changes):
    return envelope(**{"sequence": "7", "at": "3", **changes})


@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
def test_it_refuses_a_missing_malformed_or_unknown_token(gateway, device, people, authorization):
    assert_unauthenticated(gateway.post(path(conversation_id()), body=fork(), authorization=authorization))
    assert device.requests == []


def test_it_refuses_a_revoked_principal(gateway, device, people):
    assert_unauthenticated(gateway.post(path(conversation_id()), people["revoked"], fork()))
    assert device.requests == []


def test_it_needs_the_write_action(gateway, device, people):
    assert action_of(OP) == "shared_write"
    for name in lacking(action_of(OP)):
        assert_error(gateway.post(path(conversation_id()), people[name], fork()), 403, "grant_missing")
    assert device.requests == []


@pytest.mark.parametrize("make, status, code", MALFORMED_BODIES)
def test_it_refuses_a_malformed_body(gateway, device, people, make, status, code):
    assert_error(gateway.post(path(conversation_id()), people["writer"], raw=make(fork())), status, code)
    assert device.requests == []


@pytest.mark.parametrize("bad", bad_ids("con"))
def test_it_rejects_a_malformed_conversation_id(gateway, device, people, bad):
    assert_error(gateway.post(path(bad), people["writer"], fork()), 400, "bad_id")
    assert device.requests == []


def test_it_rejects_a_field_it_does_not_take(gateway, device, people):
    assert_error(gateway.post(path(conversation_id()), people["writer"], fork(space=space_id())), 400,
                 "unknown_field", fields=["space"])
    # the path names the source; the body cannot
    assert_error(gateway.post(path(conversation_id()), people["writer"], fork(conversation=conversation_id())), 400,
                 "unknown_field", fields=["conversation"])
    assert device.requests == []


def test_it_requires_at(gateway, device, people):
    assert_error(gateway.post(path(conversation_id()), people["writer"], without(fork(), "at")), 400,
                 "missing_field", fields=["at"])
    assert_error(gateway.post(path(conversation_id()), people["writer"], without(fork(id=hex32()), "at")), 400,
                 "missing_field", fields=["at"])
    assert device.requests == []


@pytest.mark.parametrize("at", [3, 1.0, "0", "03", "-1", "v3", "3.0", "", " 3", "3 ", "\u0663", "\uff13",
                                "1" * 20, str(1 << 63), "9" * 19, None, ["3"], {"at": "3"}, True], ids=repr)
def test_it_refuses_an_at_that_is_not_a_positive_decimal_string(gateway, device, people, at):
    """An event cursor: a JSON string of ASCII decimal digits, 1 or more, no leading zero, at most
    19 digits; a JSON number is refused (counters are strings in this API)."""
    assert_error(gateway.post(path(conversation_id()), people["writer"], fork(at=at)), 400, "bad_field")
    assert device.requests == []


@pytest.mark.parametrize("id", ["F" * 32, "f" * 30, "f" * 33, conversation_id(), "", 1, None, ["a" * 32]],
                         ids=repr)
def test_it_refuses_a_malformed_id(gateway, device, people, id):
    assert_error(gateway.post(path(conversation_id()), people["writer"], fork(id=id)), 400, "bad_field")
    assert device.requests == []


@pytest.mark.parametrize("at", ["1", "3", "9223372036854775807"])
def test_it_sends_the_source_and_at_without_an_id(gateway, device, people, at):
    conversation = conversation_id()
    body = fork(at=at)
    persona = people[HOLDER[action_of(OP)]]
    assert gateway.post(path(conversation), persona, body).status_code == 200
    request = device.only_request()
    assert "id" not in request["args"]
    assert_request(request, OP, persona.principal_id,
                   mutation_args(path(conversation), body, conversation=conversation, at=at))


def test_it_sends_the_source_at_and_id(gateway, device, people):
    conversation, id = conversation_id(), hex32()
    body = fork(at="12", id=id)
    persona = people[HOLDER[action_of(OP)]]
    assert gateway.post(path(conversation), persona, body).status_code == 200
    assert_request(device.only_request(), OP, persona.principal_id,
                   mutation_args(path(conversation), body, conversation=conversation, at="12", id=id))


def test_it_passes_the_receipt_and_the_devices_refusals_through(gateway, device, people):
    conversation = conversation_id()
    body = fork()
    persona = people[HOLDER[action_of(OP)]]
    location = f"{BASE}/operations/{operation_id()}"
    receipt = b'{"kind":"conversation.fork","target":"%s"}' % conversation_id().encode()
    device.answer(202, receipt, {"Location": location})
    assert_passed_through(gateway.post(path(conversation), persona, body), 202, receipt, {"Location": location})
    refusals = ((404, b'{"error":{"code":"conversation_not_found","message":"refused"}}'),
                (403, b'{"error":{"code":"right_missing","message":"refused"}}'),
                (409, b'{"error":{"code":"fork_point_past_end","message":"refused","inputs":"2"}}'),
                (409, b'{"error":{"code":"conversation_busy","message":"refused"}}'),
                (409, b'{"error":{"code":"conversation_exists","message":"refused"}}'),
                (429, b'{"error":{"code":"quota_exceeded","message":"refused","quota":"conversations",'
                      b'"limit":"4","used":"4"}}'),
                (507, b'{"error":{"code":"conversation_capacity","message":"refused"}}'))
    for status, refusal in refusals:
        device.answer(status, refusal)
        assert_passed_through(gateway.post(path(conversation), persona, body), status, refusal)
    assert len(device.requests) == 1 + len(refusals)
    for request in device.requests:
        assert_request(request, OP, persona.principal_id,
                       mutation_args(path(conversation), body, conversation=conversation, at=body["at"]))
