"""GET /v1/models (device command `models.list`, the `chat` action): the served generation
models in OpenAI's list shape; errors in OpenAI's shape."""
import json

import pytest

from .conftest import (BAD_AUTHORIZATIONS, HOLDER, WWW_AUTHENTICATE, action_of, assert_openai_error,
                       assert_request, lacking)

PATH = "/v1/models"
OP = "models.list"
ACTION = action_of(OP)


@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
def test_it_refuses_a_missing_malformed_or_unknown_token(gateway, device, people, authorization):
    response = gateway.get(PATH, authorization=authorization)
    assert_openai_error(response, 401, "unauthenticated", "authentication_error")
    assert response["WWW-Authenticate"] == WWW_AUTHENTICATE
    assert device.requests == []


def test_it_refuses_a_revoked_principal(gateway, device, people):
    response = gateway.get(PATH, people["revoked"])
    assert_openai_error(response, 401, "unauthenticated", "authentication_error")
    assert device.requests == []


@pytest.mark.parametrize("name", lacking(ACTION))
def test_it_refuses_a_principal_without_the_chat_action(gateway, device, people, name):
    assert_openai_error(gateway.get(PATH, people[name]), 403, "grant_missing", "permission_error")
    assert device.requests == []


def test_it_refuses_post(gateway, device, people):
    response = gateway.post(PATH, people["chatter"], {})
    assert response.status_code == 405 and json.loads(response.content)["error"]["code"] == "method_not_allowed"
    assert device.requests == []


def test_it_lists_the_devices_models_in_the_openai_shape(gateway, device, people):
    device.answer(200, b'{"models":[{"name":"tiny-llama","digest":"' + b"a" * 64 + b'"},{"name":"other"}]}')
    persona = people[HOLDER[ACTION]]
    response = gateway.get(PATH, persona)
    assert response.status_code == 200
    assert response["Content-Type"] == "application/json" and response["Cache-Control"] == "no-store"
    assert json.loads(response.content) == {"object": "list", "data": [
        {"id": "tiny-llama", "object": "model", "created": 0, "owned_by": "aotx"},
        {"id": "other", "object": "model", "created": 0, "owned_by": "aotx"}]}
    assert_request(device.only_request(), OP, persona.principal_id, {})


def test_it_lists_no_models(gateway, device, people):
    device.answer(200, b'{"models":[]}')
    assert json.loads(gateway.get(PATH, people["chatter"]).content) == {"object": "list", "data": []}


def test_it_maps_a_device_error_to_the_openai_shape(gateway, device, people):
    device.answer(403, b'{"error":{"code":"grant_missing","message":"the grant file lacks chat"}}')
    error = assert_openai_error(gateway.get(PATH, people["chatter"]), 403, "grant_missing", "permission_error")
    assert error["message"] == "the grant file lacks chat"


def test_it_answers_503_device_unavailable_when_the_device_is_stopped(gateway, device, people):
    device.stop()
    assert_openai_error(gateway.get(PATH, people["chatter"]), 503, "device_unavailable", "server_error")


def test_it_answers_503_device_timeout_when_the_device_is_silent(gateway, device, people):
    device.silent = True
    assert_openai_error(gateway.get(PATH, people["chatter"]), 503, "device_timeout", "server_error")
