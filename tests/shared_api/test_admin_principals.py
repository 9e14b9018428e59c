"""Principals in the admin console: a new principal gets a token shown once, its actions are the
valid ones only, every change rewrites the grant file the device reads, and nothing the admin
does can write a grant file the device would refuse."""
import json
import re

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.test import Client

from gpu_worker.contract import grantfile
from shared_api import device_client
from shared_api.models import Principal

ADD = "/admin/shared_api/principal/add/"
LIST = "/admin/shared_api/principal/"
TOKEN = re.compile(r"aotx_[A-Za-z0-9_-]{43}")


@pytest.fixture
def admin(db, settings, tmp_path):
    grants = tmp_path / "grants.json"
    config = tmp_path / "gateway.json"
    config.write_text(json.dumps({"listen": "127.0.0.1:8000", "socket": str(tmp_path / "no-device.sock"),
                                  "grants_file": str(grants)}))
    settings.AOTX_GATEWAY_CONFIG = str(config)
    settings.AOTX_DEVICE_TIMEOUT = 0.5
    device_client.reset()
    get_user_model().objects.create_superuser("root", "", "pw")
    client = Client()
    client.login(username="root", password="pw")
    client.grants = grants
    yield client
    device_client.reset()


def grant_file(client):
    principals, _ = grantfile.parse(json.loads(client.grants.read_text()), "test")
    return principals


def add(client, name, actions, active=True):
    data = {"name": name, "actions": actions}
    if active:
        data["active"] = "on"
    return client.post(ADD, data, follow=True)


def shown_tokens(response):
    return [TOKEN.search(str(m)).group(0) for m in response.context["messages"] if TOKEN.search(str(m))]


def test_adding_a_principal_issues_a_token_once_and_writes_the_grant_file(admin):
    response = add(admin, "alice", ["shared_read", "shared_write"])
    assert response.status_code == 200
    [token] = shown_tokens(response)
    alice = Principal.objects.get(name="alice")
    assert re.fullmatch(r"[0-9a-f]{32}", alice.principal_id) and alice.token_hash != token
    assert token not in json.dumps(list(Principal.objects.values()), default=str)  # never stored in clear
    assert Principal.for_token(token) == alice
    assert grant_file(admin) == {alice.principal_id: frozenset({"shared_read", "shared_write"})}
    assert not shown_tokens(admin.get(LIST))  # shown once


def test_a_second_principal_can_be_added_too(admin):
    add(admin, "alice", ["shared_read"])
    response = add(admin, "bob", ["chat"])
    assert response.status_code == 200 and len(shown_tokens(response)) == 1
    assert set(grant_file(admin)) == {p.principal_id for p in Principal.objects.all()}


def test_an_unknown_action_or_an_empty_name_is_refused_and_nothing_is_written(admin):
    add(admin, "alice", ["shared_read"])
    before = admin.grants.read_bytes()
    for name, actions in (("mallory", ["bogus_action"]), ("", ["shared_read"])):
        response = add(admin, name, actions)
        assert response.status_code == 200 and response.context["adminform"].form.errors
    assert Principal.objects.count() == 1 and admin.grants.read_bytes() == before


def test_editing_revoking_rotating_and_deleting_each_rewrite_the_grant_file(admin):
    [old_token] = shown_tokens(add(admin, "alice", ["shared_read"]))
    alice = Principal.objects.get(name="alice")
    change = f"/admin/shared_api/principal/{alice.pk}/change/"
    admin.post(change, {"name": "alice", "actions": ["shared_read", "shared_manage"], "active": "on"}, follow=True)
    assert grant_file(admin)[alice.principal_id] == {"shared_read", "shared_manage"}

    rotated = admin.post(LIST, {"action": "rotate_tokens", "_selected_action": [alice.pk]}, follow=True)
    [new_token] = shown_tokens(rotated)
    assert Principal.for_token(old_token) is None and Principal.for_token(new_token) == alice
    assert grant_file(admin)[alice.principal_id] == {"shared_read", "shared_manage"}  # same principal id

    admin.post(LIST, {"action": "revoke", "_selected_action": [alice.pk]}, follow=True)
    assert grant_file(admin)[alice.principal_id] == frozenset() and Principal.for_token(new_token) is None

    admin.post(f"/admin/shared_api/principal/{alice.pk}/delete/", {"post": "yes"}, follow=True)
    assert grant_file(admin) == {} and not Principal.objects.exists()


def test_the_command_line_deletes_a_principal_and_rewrites_the_grant_file(admin, settings):
    add(admin, "alice", ["shared_read"])
    add(admin, "bob", ["chat"])
    call_command("principal", "delete", "alice", "--config", settings.AOTX_GATEWAY_CONFIG)
    assert [p.name for p in Principal.objects.all()] == ["bob"]
    assert set(grant_file(admin)) == {Principal.objects.get(name="bob").principal_id}


def test_a_row_the_device_could_not_read_is_never_written(admin, settings):
    add(admin, "alice", ["shared_read"])
    before = admin.grants.read_bytes()
    Principal.objects.filter(name="alice").update(actions=["bogus_action"])  # damaged behind the admin's back
    with pytest.raises(CommandError, match="actions must be a subset"):
        call_command("write_grants", "--config", settings.AOTX_GATEWAY_CONFIG)
    assert admin.grants.read_bytes() == before
