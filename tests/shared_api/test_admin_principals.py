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


def test_a_revoked_principal_reinstated_gets_a_new_token_and_the_old_one_stays_refused(admin):
    [old_token] = shown_tokens(add(admin, "alice", ["shared_read"]))
    alice = Principal.objects.get(name="alice")
    admin.post(LIST, {"action": "revoke", "_selected_action": [alice.pk]}, follow=True)
    assert Principal.for_token(old_token) is None
    rotated = admin.post(LIST, {"action": "rotate_tokens", "_selected_action": [alice.pk]}, follow=True)
    assert not shown_tokens(rotated)  # a revoked principal gets a token only by being reinstated
    reinstated = admin.post(LIST, {"action": "reinstate", "_selected_action": [alice.pk]}, follow=True)
    [new_token] = shown_tokens(reinstated)
    assert new_token != old_token and Principal.for_token(new_token) == alice
    assert Principal.for_token(old_token) is None
    assert grant_file(admin)[alice.principal_id] == {"shared_read"}
    # the change form too: unticking `active` kills the token, ticking it again issues another
    change = f"/admin/shared_api/principal/{alice.pk}/change/"
    admin.post(change, {"name": "alice", "actions": ["shared_read"], "quotas": "{}"}, follow=True)
    assert Principal.for_token(new_token) is None
    again = admin.post(change, {"name": "alice", "actions": ["shared_read"], "quotas": "{}", "active": "on"},
                       follow=True)
    [third] = shown_tokens(again)
    assert Principal.for_token(third) == alice and Principal.for_token(new_token) is None


def test_the_command_line_reinstates_with_a_new_token(admin, settings, capsys):
    call_command("principal", "create", "bob", "--actions", "shared_read", "--config", settings.AOTX_GATEWAY_CONFIG)
    first = capsys.readouterr().out.strip().splitlines()[-1]
    call_command("principal", "revoke", "bob", "--config", settings.AOTX_GATEWAY_CONFIG)
    with pytest.raises(CommandError, match="revoked"):
        call_command("principal", "rotate", "bob")
    call_command("principal", "grant", "bob", "--config", settings.AOTX_GATEWAY_CONFIG)
    second = capsys.readouterr().out.strip().splitlines()[-1]
    assert TOKEN.fullmatch(first) and TOKEN.fullmatch(second) and first != second
    assert Principal.for_token(first) is None and Principal.for_token(second).name == "bob"


def test_quotas_are_set_on_the_command_line_and_in_the_admin_and_reach_the_grant_file(admin, settings):
    call_command("principal", "create", "carol", "--actions", "shared_write", "--quota", "spaces=10",
                 "--quota", "kv_pages=32", "--config", settings.AOTX_GATEWAY_CONFIG)
    carol = Principal.objects.get(name="carol")
    _, quotas, _ = grantfile.parse_with_quotas(json.loads(admin.grants.read_text()))
    assert quotas[carol.principal_id] == {"kv_pages": 32, "spaces": 10}
    call_command("principal", "grant", "carol", "--quota", "spaces=unlimited", "--quota", "chats=2",
                 "--config", settings.AOTX_GATEWAY_CONFIG)
    _, quotas, _ = grantfile.parse_with_quotas(json.loads(admin.grants.read_text()))
    assert quotas[carol.principal_id] == {"chats": 2, "kv_pages": 32, "spaces": None}  # None: unlimited
    before = admin.grants.read_bytes()
    for bad in ("spaces=-1", "bogus=3", "spaces"):
        with pytest.raises(CommandError, match="--quota"):
            call_command("principal", "grant", "carol", "--quota", bad, "--config", settings.AOTX_GATEWAY_CONFIG)
    change = f"/admin/shared_api/principal/{carol.pk}/change/"
    response = admin.post(change, {"name": "carol", "actions": ["shared_write"], "quotas": '{"spaces": true}',
                                   "active": "on"}, follow=True)
    assert response.context["adminform"].form.errors  # refused by the form: nothing written
    assert admin.grants.read_bytes() == before
    admin.post(change, {"name": "carol", "actions": ["shared_write"], "quotas": '{"receipts": 5}', "active": "on"},
               follow=True)
    _, quotas, _ = grantfile.parse_with_quotas(json.loads(admin.grants.read_text()))
    assert quotas[carol.principal_id] == {"receipts": 5}
    assert "receipts=5" in admin.get(LIST).content.decode()  # the principal list shows them


def test_a_quota_the_device_could_not_read_is_never_written(admin, settings):
    add(admin, "alice", ["shared_read"])
    before = admin.grants.read_bytes()
    Principal.objects.filter(name="alice").update(quotas={"spaces": "ten"})  # damaged behind the admin's back
    with pytest.raises(CommandError, match="quota spaces"):
        call_command("write_grants", "--config", settings.AOTX_GATEWAY_CONFIG)
    assert admin.grants.read_bytes() == before


def test_a_principal_created_without_quotas_is_written_with_the_defaults_and_unlimited_only_when_said(
        admin, settings, capsys):
    config = settings.AOTX_GATEWAY_CONFIG
    call_command("principal", "create", "dora", "--actions", "shared_read", "--config", config)
    dora = Principal.objects.get(name="dora")
    doc = json.loads(admin.grants.read_text())
    assert doc["schema"] == grantfile.SCHEMA == "aotx.grants.v2"
    assert "quotas" not in doc["principals"][dora.principal_id]  # every quota and rate: its default
    assert grantfile.parse_with_quotas(doc)[1].get(dora.principal_id) is None
    call_command("principal", "grant", "dora", "--quota", "spaces=unlimited", "--quota", "requests_per_second=9",
                 "--config", config)
    doc = json.loads(admin.grants.read_text())
    assert doc["principals"][dora.principal_id]["quotas"] == {"requests_per_second": 9, "spaces": None}
    call_command("principal", "grant", "dora", "--quota", "requests_per_second=default", "--config", config)
    doc = json.loads(admin.grants.read_text())
    assert doc["principals"][dora.principal_id]["quotas"] == {"spaces": None}  # back to its default
    capsys.readouterr()
    call_command("principal", "list")
    assert capsys.readouterr().out.rstrip().endswith("spaces=unlimited, defaults for the rest")
    assert "spaces=unlimited, defaults for the rest" in admin.get(LIST).content.decode()
    with pytest.raises(CommandError, match="'unlimited' or 'default'"):
        call_command("principal", "grant", "dora", "--quota", "spaces=none")


def test_the_admin_form_takes_null_for_unlimited_and_an_empty_object_for_the_defaults(admin):
    add(admin, "erin", ["shared_read"])
    erin = Principal.objects.get(name="erin")
    assert erin.quotas == {} and "defaults" in admin.get(LIST).content.decode()
    change = f"/admin/shared_api/principal/{erin.pk}/change/"
    admin.post(change, {"name": "erin", "actions": ["shared_read"], "quotas": '{"chats": null, "spaces": 4}',
                        "active": "on"}, follow=True)
    _, quotas, _ = grantfile.parse_with_quotas(json.loads(admin.grants.read_text()))
    assert quotas[erin.principal_id] == {"chats": None, "spaces": 4}
