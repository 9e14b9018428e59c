"""GET /aotx/v1/shared/capabilities (device command `capabilities`). Also where the gateway's
handling of the device connection itself is checked: pooling, reconnecting, odd replies."""
import pytest

from gpu_worker.contract.wire import reply

from .conftest import (BAD_AUTHORIZATIONS, BASE, HANG_UP, HOLDER, OK_BODY, action_of, assert_error,
                       assert_passed_through, assert_request, assert_unauthenticated, lacking)

PATH = f"{BASE}/capabilities"
OP = "capabilities"
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
    error = assert_error(gateway.get(PATH, people[name]), 403, "grant_missing")
    assert ACTION in error["message"]
    assert device.requests == []


@pytest.mark.parametrize("query", ["verbose=1", "cursor=1", "limit=5"])
def test_it_rejects_unknown_query_parameters(gateway, device, people, query):
    assert_error(gateway.get(f"{PATH}?{query}", people["reader"]), 400, "unknown_parameter")
    assert device.requests == []


def test_it_refuses_a_method_the_route_does_not_have(gateway, device, people):
    assert_error(gateway.call("DELETE", PATH, people["manager"]), 405, "method_not_allowed")
    assert device.requests == []


def test_it_sends_one_capabilities_request_for_the_callers_principal(gateway, device, people):
    persona = people[HOLDER[ACTION]]
    assert_passed_through(gateway.get(PATH, persona), 200, OK_BODY)
    assert_request(device.only_request(), OP, persona.principal_id, {})


def test_it_passes_the_device_reply_through_byte_for_byte(gateway, device, people):
    # spacing and raw UTF-8 the gateway's own JSON rendering would not produce
    body = b'{"schema":"aotx.shared.capabilities.v1",  "models":[ ],"z":"\xc3\xa9"}'
    device.answer(200, body, {"X-Aotx-Probe": "42"})
    assert_passed_through(gateway.get(PATH, people["reader"]), 200, body, {"X-Aotx-Probe": "42"})


def test_it_passes_a_device_error_through_unchanged(gateway, device, people):
    body = b'{"error":{"code":"protocol_version","message":"unsupported device protocol version; expected 1"}}'
    device.answer(400, body)
    assert_passed_through(gateway.get(PATH, people["reader"]), 400, body)


def test_it_answers_503_device_unavailable_when_the_device_is_stopped(gateway, device, people):
    device.stop()
    assert_error(gateway.get(PATH, people["reader"]), 503, "device_unavailable")
    assert device.requests == []


def test_it_answers_503_device_timeout_when_the_device_is_silent(gateway, device, people):
    device.silent = True
    assert_error(gateway.get(PATH, people["reader"]), 503, "device_timeout")
    assert device.only_request()["op"] == OP


def test_it_answers_503_gateway_misconfigured_when_gateway_json_is_missing(gateway, device, people, settings,
                                                                           tmp_path):
    settings.AOTX_GATEWAY_CONFIG = str(tmp_path / "absent.json")
    assert_error(gateway.get(PATH, people["reader"]), 503, "gateway_misconfigured")
    assert device.connections == 0


def test_it_reuses_one_device_connection_for_consecutive_requests(gateway, device, people, settings):
    settings.AOTX_DEVICE_CONNECTIONS = 1
    answers = gateway.session([gateway.request("GET", PATH, people["reader"]) for _ in range(3)])
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert len(device.requests) == 3 and device.connections == 1
    assert len({r["id"] for r in device.requests}) == 3  # each request has its own id


def test_it_reconnects_once_when_the_device_restarted(gateway, device, people, settings):
    settings.AOTX_DEVICE_CONNECTIONS = 1
    first, second = gateway.session([gateway.request("GET", PATH, people["reader"]),
                                     device.restart,  # the pooled connection is now stale
                                     gateway.request("GET", PATH, people["reader"])])
    assert first.status_code == 200
    assert_passed_through(second, 200, OK_BODY)
    assert len(device.requests) == 2 and device.connections == 2


def test_it_answers_503_when_the_device_reply_answers_another_request(gateway, device, people):
    device.handler = lambda req: [reply(req["id"] + 1000, 200, OK_BODY)]
    # the request reached the device: whatever it did, the gateway cannot say it did nothing
    assert_error(gateway.get(PATH, people["reader"]), 503, "device_connection_lost")


def test_it_answers_503_when_the_device_closes_the_connection_without_answering(gateway, device, people):
    device.handler = lambda req: HANG_UP
    assert_error(gateway.get(PATH, people["reader"]), 503, "device_connection_lost")
    assert device.only_request()["op"] == OP


def test_it_reads_a_reply_that_arrives_in_pieces(gateway, device, people):
    body = b'{"big":"' + b"x" * 200_000 + b'"}'  # several recv() calls on the gateway side
    device.answer(200, body)
    assert_passed_through(gateway.get(PATH, people["reader"]), 200, body)
