"""`manage.py local_setup` (what `make run` prepares, scripts/run_local.sh): the admin user once,
the principal "local" whose token is kept in a 0600 file and reused at every start, and the grant
file. The whole `make run` start, Ctrl-C through a pipe included: tests/e2e/test_make_run.py."""
import json
import os
import stat

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command

from gpu_worker.contract import grantfile
from gpu_worker.contract.vocabulary import ACTIONS
from shared_api.models import Principal


@pytest.fixture
def local(db, tmp_path):
    config = tmp_path / "gateway.json"
    config.write_text(json.dumps({"listen": "127.0.0.1:8000", "socket": str(tmp_path / "journal" / "service.sock"),
                                  "grants_file": str(tmp_path / "grants.json")}))
    token_file = tmp_path / "var" / "local_token"

    def run():
        call_command("local_setup", "--config", str(config), "--token-file", str(token_file))
        return token_file.read_text().strip()
    run.token_file = token_file
    run.grants = tmp_path / "grants.json"
    return run


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_token_is_issued_once_kept_0600_and_reused_at_every_start(local, capsys):
    token = local()
    assert mode(local.token_file) == 0o600
    principal = Principal.for_token(token)
    assert principal is not None and principal.name == "local" and set(principal.actions) == set(ACTIONS)
    first_out = capsys.readouterr().out
    assert "admin console user: admin / " in first_out and "changepassword admin" in first_out
    assert token not in first_out  # printed by the launcher, once the device answers
    for _ in range(2):
        assert local() == token
        assert Principal.for_token(token).principal_id == principal.principal_id
    assert capsys.readouterr().out == ""  # the admin password was shown once
    assert get_user_model().objects.filter(username="admin").count() == 1
    principals, _ = grantfile.parse(json.loads(local.grants.read_text()), "test")
    assert principals == {principal.principal_id: frozenset(ACTIONS)}


def test_a_missing_or_stale_token_file_gets_a_new_token_for_the_same_principal(local):
    token = local()
    principal_id = Principal.for_token(token).principal_id
    local.token_file.unlink()
    second = local()
    assert second != token and Principal.for_token(token) is None
    assert Principal.for_token(second).principal_id == principal_id and mode(local.token_file) == 0o600
    p = Principal.objects.get(name="local")  # rotated elsewhere (the admin console): the file is stale
    p.rotate_token()
    p.save()
    third = local()
    assert third not in (token, second) and Principal.for_token(third).principal_id == principal_id


def test_a_kept_token_file_is_made_0600_again(local):
    token = local()
    os.chmod(local.token_file, 0o644)
    assert local() == token and mode(local.token_file) == 0o600
