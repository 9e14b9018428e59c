"""PUT /aotx/v1/media/{sha256} (`media.put`): raw bytes with Content-Type image/* or audio/*,
at most 8 MiB; the device checks the digest and records the owner."""
import hashlib

import pytest

from gpu_worker.contract.limits import MAX_MEDIA_BYTES

from .conftest import (BAD_AUTHORIZATIONS, HOLDER, action_of, assert_error, assert_passed_through, assert_request,
                       assert_unauthenticated, lacking)

OP = "media.put"
ACTION = action_of(OP)
DATA = b"\x89PNG\r\n\x1a\n" + bytes(range(256))
SHA = hashlib.sha256(DATA).hexdigest()


def path(sha256=SHA):
    return f"/aotx/v1/media/{sha256}"


def put(gateway, persona, data=DATA, sha256=SHA, content_type="image/png", **kwargs):
    return gateway.put(path(sha256), persona, raw=data, content_type=content_type, **kwargs)


@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
def test_it_refuses_a_missing_malformed_or_unknown_token(gateway, device, people, authorization):
    assert_unauthenticated(put(gateway, None, authorization=authorization))
    assert device.requests == []


def test_it_refuses_a_revoked_principal(gateway, device, people):
    assert_unauthenticated(put(gateway, people["revoked"]))
    assert device.requests == []


@pytest.mark.parametrize("name", lacking(ACTION))
def test_it_refuses_a_principal_without_the_write_action(gateway, device, people, name):
    assert_error(put(gateway, people[name]), 403, "grant_missing")
    assert device.requests == []


@pytest.mark.parametrize("sha256", [SHA.upper(), SHA[:-1], SHA + "0", "g" * 64, SHA + "%0A", f"sha256:{SHA}"],
                         ids=["uppercase", "short", "long", "non-hex", "trailing-newline", "prefixed"])
def test_it_rejects_a_path_that_is_not_a_lowercase_sha256(gateway, device, people, sha256):
    assert_error(put(gateway, people["writer"], sha256=sha256), 400, "bad_id")
    assert device.requests == []


@pytest.mark.parametrize("content_type", ["application/json", "text/plain", "application/octet-stream",
                                          "video/mp4", "imagex/png"])
def test_it_refuses_a_content_type_that_is_not_image_or_audio(gateway, device, people, content_type):
    assert_error(put(gateway, people["writer"], content_type=content_type), 415, "unsupported_media_type")
    assert device.requests == []


def test_it_refuses_a_source_over_8_mib(gateway, device, people):
    data = b"\0" * (MAX_MEDIA_BYTES + 1)
    response = put(gateway, people["writer"], data, hashlib.sha256(data).hexdigest())
    assert_error(response, 413, "media_too_large")
    assert device.requests == []


@pytest.mark.parametrize("content_type, kind", [("image/png", "image"), ("audio/wav", "audio"),
                                                ("image/jpeg; q=1", "image")])
def test_it_sends_the_digest_the_exact_bytes_and_the_media_type(gateway, device, people, content_type, kind):
    persona = people[HOLDER[ACTION]]
    body = b'{"length":264,"sha256":"' + SHA.encode() + b'","type":"' + kind.encode() + b'"}'
    device.answer(201, body)
    assert_passed_through(put(gateway, persona, content_type=content_type), 201, body)
    assert_request(device.only_request(), OP, persona.principal_id, {"sha256": SHA, "data": DATA, "type": kind})


def test_it_sends_a_source_of_exactly_8_mib(gateway, device, people, settings):
    settings.AOTX_DEVICE_TIMEOUT = 30  # 8 MiB to the fake device and back: on a loaded machine more than 0.3 s
    data = bytes(range(256)) * (MAX_MEDIA_BYTES // 256)
    sha = hashlib.sha256(data).hexdigest()
    assert put(gateway, people["writer"], data, sha, content_type="audio/ogg").status_code == 200
    assert device.only_request()["args"] == {"sha256": sha, "data": data, "type": "audio"}


def test_it_leaves_the_digest_check_to_the_device(gateway, device, people):
    body = b'{"error":{"code":"digest_mismatch","message":"the bytes do not hash to the path"}}'
    device.answer(400, body)
    other = "0" * 64
    assert_passed_through(put(gateway, people["writer"], sha256=other), 400, body)
    assert device.only_request()["args"]["sha256"] == other


def test_it_passes_already_owned_through(gateway, device, people):
    body = b'{"length":264,"sha256":"' + SHA.encode() + b'","type":"image"}'
    device.answer(200, body)
    assert_passed_through(put(gateway, people["writer"]), 200, body)


def test_it_answers_503_device_unavailable_when_the_device_is_stopped(gateway, device, people):
    device.stop()
    assert_error(put(gateway, people["writer"]), 503, "device_unavailable")


def test_it_has_no_post(gateway, device, people):
    response = gateway.post(path(), people["writer"], raw=DATA, content_type="image/png")
    assert_error(response, 405, "method_not_allowed")
    assert device.requests == []
