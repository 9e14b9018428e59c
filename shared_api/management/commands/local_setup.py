"""`manage.py local_setup --config var/gateway.json --token-file var/local_token`: what `make run`
(scripts/run_local.sh) prepares before it starts the processes of the embedded default.

- the admin console user `admin`, created once with a random password printed once (reset it
  with `manage.py changepassword admin`);
- the API principal `local` (all actions) and its token, kept in the token file (mode 0600) so the
  same token works across restarts: it is issued once, and again only when the file is missing or
  no longer matches the principal (its token was rotated in the admin console, say);
- the grant file, rewritten from the database (docs/grants.md).

It prints nothing about the token: scripts/run_procfile.py prints it once the device answers.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from gpu_worker.contract.grantfile import GrantFileError
from gpu_worker.contract.vocabulary import ACTIONS
from gpu_worker.storage.filelayer import OsFileLayer
from shared_api import config
from shared_api.grants import write_grant_file_for
from shared_api.models import Principal, hash_token

ADMIN = "admin"
PRINCIPAL = "local"
TOKEN_MODE = 0o600


def read_token(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii").strip() or None
    except (FileNotFoundError, UnicodeDecodeError):
        return None


def write_token(path: Path, token: str) -> None:
    """Replace the token file atomically, readable by its owner only: a temporary file created
    0600 (a new one), fsynced, renamed into place, the directory fsynced (the file layer's
    `atomic_writer`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with OsFileLayer().atomic_writer(str(path), mode=TOKEN_MODE, tmp=str(tmp), exclusive=True) as f:
        os.fchmod(f.fileno(), TOKEN_MODE)  # whatever the umask
        f.pwrite(f"{token}\n".encode("ascii"), 0)


class Command(BaseCommand):
    help = ("Prepare the embedded default (make run): the admin user, the principal 'local' with its token "
            "kept in --token-file (0600, reused across restarts), and the grant file named in --config.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--config", required=True, help="gateway.json (its grant file is rewritten)")
        parser.add_argument("--token-file", required=True, help="where the local principal's token is kept")

    def handle(self, *args: Any, **opts: Any) -> None:
        User = get_user_model()
        if not User.objects.filter(username=ADMIN).exists():
            password = secrets.token_urlsafe(12)
            User.objects.create_superuser(ADMIN, "", password)
            self.stdout.write(f"admin console user: {ADMIN} / {password}  (shown once; to set another: "
                              f".venv/bin/python manage.py changepassword {ADMIN})")
        path = Path(opts["token_file"])
        token = read_token(path)
        principal = Principal.objects.filter(name=PRINCIPAL).first()
        if principal is None:
            principal, token = Principal.create(PRINCIPAL, list(ACTIONS))
            write_token(path, token)
        elif token is None or hash_token(token) != principal.token_hash:
            token = principal.rotate_token()  # the file is gone or stale: a new token, the same principal
            principal.save()
            write_token(path, token)
        else:
            os.chmod(path, TOKEN_MODE)  # kept; readable by its owner only, whatever happened to it
        if not principal.active:
            self.stderr.write(f"principal {PRINCIPAL} is revoked: its token is refused until it is reinstated "
                              "(admin console, or manage.py principal grant)")
        try:
            write_grant_file_for(opts["config"])
        except (config.ConfigError, GrantFileError, OSError) as exc:
            raise CommandError(f"grant file not written: {exc}")
