"""POST /aotx/v1/shared/memory/{mem}/versions (`memory.versions`, a correction) and
/memory/{mem}/deletion (`memory.delete`, forgetting): what each sends to the device and what it
refuses without calling it."""
import pytest

from .conftest import (BAD_AUTHORIZATIONS, BASE, HOLDER, MALFORMED_BODIES, action_of, assert_error,
                       assert_passed_through, assert_request, assert_unauthenticated, bad_ids, envelope, lacking,
                       memory_id, mutation_args, operation_id, without)


def versions_path(memory):
    return f"{BASE}/memory/{memory}/versions"


def deletion_path(memory):
    return f"{BASE}/memory/{memory}/deletion"


def correction(**changes):
    return envelope(**{"sequence": "5", "text": "The meeting is on Tuesday.", "version": "2", **changes})


def forgetting(**changes):
    return envelope(**{"sequence": "6", **changes})


ROUTES = [("memory.versions", versions_path, correction), ("memory.delete", deletion_path, forgetting)]
IDS = [r[0] for r in ROUTES]


@pytest.mark.parametrize("op, path, valid", ROUTES, ids=IDS)
@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
def test_it_refuses_a_missing_malformed_or_unknown_token(gateway, device, people, op, path, valid, authorization):
    assert_unauthenticated(gateway.post(path(memory_id()), body=valid(), authorization=authorization))
    assert device.requests == []


@pytest.mark.parametrize("op, path, valid", ROUTES, ids=IDS)
def test_it_refuses_a_revoked_principal(gateway, device, people, op, path, valid):
    assert_unauthenticated(gateway.post(path(memory_id()), people["revoked"], valid()))
    assert device.requests == []


@pytest.mark.parametrize("op, path, valid", ROUTES, ids=IDS)
def test_it_needs_the_write_action(gateway, device, people, op, path, valid):
    assert action_of(op) == "shared_write"
    for name in lacking(action_of(op)):
        assert_error(gateway.post(path(memory_id()), people[name], valid()), 403, "grant_missing")
    assert device.requests == []


@pytest.mark.parametrize("op, path, valid", ROUTES, ids=IDS)
@pytest.mark.parametrize("make, status, code", MALFORMED_BODIES)
def test_it_refuses_a_malformed_body(gateway, device, people, op, path, valid, make, status, code):
    assert_error(gateway.post(path(memory_id()), people["writer"], raw=make(valid())), status, code)
    assert device.requests == []


@pytest.mark.parametrize("op, path, valid", ROUTES, ids=IDS)
@pytest.mark.parametrize("bad", bad_ids("mem"))
def test_it_rejects_a_malformed_memory_id(gateway, device, people, op, path, valid, bad):
    assert_error(gateway.post(path(bad), people["writer"], valid()), 400, "bad_id")
    assert device.requests == []


@pytest.mark.parametrize("op, path, valid", ROUTES, ids=IDS)
def test_it_rejects_a_field_it_does_not_take(gateway, device, people, op, path, valid):
    assert_error(gateway.post(path(memory_id()), people["writer"], valid(space="ab" * 16)), 400, "unknown_field",
                 fields=["space"])
    # the path names the object; the body cannot
    assert_error(gateway.post(path(memory_id()), people["writer"], valid(memory=memory_id())), 400, "unknown_field",
                 fields=["memory"])
    assert device.requests == []


# ---- memory.versions ------------------------------------------------------------------------

def test_a_correction_requires_text_and_version(gateway, device, people):
    path = versions_path(memory_id())
    assert_error(gateway.post(path, people["writer"], without(correction(), "text")), 400, "missing_field",
                 fields=["text"])
    assert_error(gateway.post(path, people["writer"], without(correction(), "version")), 400, "missing_field",
                 fields=["version"])
    assert_error(gateway.post(path, people["writer"], without(correction(), "text", "version")), 400,
                 "missing_field", fields=["text", "version"])
    assert device.requests == []


@pytest.mark.parametrize("version", [2, "0", "01", "-1", "v2", "2.0", "", " 2", "\u0662", None, ["2"],
                                     str(1 << 63), "9" * 19],
                         ids=repr)
def test_a_correction_refuses_a_version_that_is_not_a_positive_decimal_string(gateway, device, people, version):
    assert_error(gateway.post(versions_path(memory_id()), people["writer"], correction(version=version)), 400,
                 "bad_field")
    assert device.requests == []


@pytest.mark.parametrize("text", ["", None, 7, ["text"], {"text": "x"}], ids=repr)
def test_a_correction_refuses_text_that_is_not_a_non_empty_string(gateway, device, people, text):
    assert_error(gateway.post(versions_path(memory_id()), people["writer"], correction(text=text)), 400, "bad_field")
    assert device.requests == []


@pytest.mark.parametrize("text", ["x" * 2049, "\u00e9" * 1025, "\u20ac" * 683, "\U0001f600" * 513],
                         ids=["ascii", "two-byte", "three-byte", "four-byte"])
def test_a_correction_refuses_text_over_a_memory_objects_payload(gateway, device, people, text):
    """2048 UTF-8 bytes, counted as bytes: 1025 two-byte characters are over it."""
    assert_error(gateway.post(versions_path(memory_id()), people["writer"], correction(text=text)), 400,
                 "text_too_large")
    assert device.requests == []


@pytest.mark.parametrize("token", ["<image>", "<|image|>", "<|audio|>", "<start_of_image>"])
def test_a_correction_refuses_a_reserved_media_token(gateway, device, people, token):
    assert_error(gateway.post(versions_path(memory_id()), people["writer"], correction(text=f"see {token} here")),
                 400, "reserved_token")
    assert device.requests == []


@pytest.mark.parametrize("text", ["x" * 2048, "\u00e9" * 1024, "a"], ids=["2048-ascii", "2048-two-byte", "one"])
def test_a_correction_sends_the_memory_its_text_and_version(gateway, device, people, text):
    memory = memory_id()
    path = versions_path(memory)
    body = correction(text=text, version="17")
    persona = people[HOLDER[action_of("memory.versions")]]
    assert gateway.post(path, persona, body).status_code == 200
    assert_request(device.only_request(), "memory.versions", persona.principal_id,
                   mutation_args(path, body, memory=memory, text=text, version="17"))


def test_a_correction_passes_the_receipt_and_the_devices_refusals_through(gateway, device, people):
    memory = memory_id()
    path = versions_path(memory)
    body = correction()
    persona = people[HOLDER[action_of("memory.versions")]]
    location = f"{BASE}/operations/{operation_id()}"
    receipt = b'{"kind":"memory.version","target":"%s"}' % memory.encode()
    device.answer(202, receipt, {"Location": location})
    assert_passed_through(gateway.post(path, persona, body), 202, receipt, {"Location": location})
    for status, code in ((404, "memory_not_found"), (403, "right_missing"), (409, "stale_version"),
                         (409, "unsupported_kind"), (429, "quota_exceeded"), (503, "engine_unavailable"),
                         (500, "embedding_failed")):
        refusal = b'{"error":{"code":"%s","message":"refused","version":"3"}}' % code.encode()
        device.answer(status, refusal)
        assert_passed_through(gateway.post(path, persona, body), status, refusal)
    assert len(device.requests) == 8
    for request in device.requests:
        assert_request(request, "memory.versions", persona.principal_id,
                       mutation_args(path, body, memory=memory, text=body["text"], version=body["version"]))


# ---- memory.delete --------------------------------------------------------------------------

@pytest.mark.parametrize("reason", [5, None, ["why"], "x" * 257, "\u00e9" * 129], ids=repr)
def test_forgetting_refuses_a_reason_that_is_not_a_short_string(gateway, device, people, reason):
    assert_error(gateway.post(deletion_path(memory_id()), people["writer"], forgetting(reason=reason)), 400,
                 "bad_field")
    assert device.requests == []


def test_forgetting_sends_the_memory_alone_without_a_reason(gateway, device, people):
    memory = memory_id()
    path = deletion_path(memory)
    body = forgetting()
    persona = people[HOLDER[action_of("memory.delete")]]
    assert gateway.post(path, persona, body).status_code == 200
    request = device.only_request()
    assert "reason" not in request["args"]
    assert_request(request, "memory.delete", persona.principal_id, mutation_args(path, body, memory=memory))


@pytest.mark.parametrize("reason", ["it was wrong", "", "x" * 256, "\u00e9" * 128], ids=["short", "empty", "256",
                                                                                          "256-two-byte"])
def test_forgetting_sends_the_memory_and_its_reason(gateway, device, people, reason):
    memory = memory_id()
    path = deletion_path(memory)
    body = forgetting(reason=reason)
    persona = people[HOLDER[action_of("memory.delete")]]
    assert gateway.post(path, persona, body).status_code == 200
    assert_request(device.only_request(), "memory.delete", persona.principal_id,
                   mutation_args(path, body, memory=memory, reason=reason))


def test_forgetting_passes_the_receipt_and_the_devices_refusals_through(gateway, device, people):
    memory = memory_id()
    path = deletion_path(memory)
    persona = people[HOLDER[action_of("memory.delete")]]
    location = f"{BASE}/operations/{operation_id()}"
    receipt = b'{"kind":"memory.delete","target":"%s"}' % memory.encode()
    device.answer(202, receipt, {"Location": location})
    assert_passed_through(gateway.post(path, persona, forgetting()), 202, receipt, {"Location": location})
    for status, code in ((404, "memory_not_found"), (403, "right_missing")):
        refusal = b'{"error":{"code":"%s","message":"refused"}}' % code.encode()
        device.answer(status, refusal)
        assert_passed_through(gateway.post(path, persona, forgetting()), status, refusal)
    assert [request["op"] for request in device.requests] == ["memory.delete"] * 3
