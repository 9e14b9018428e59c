from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from gpu_worker.contract.grantfile import GrantFileError
from shared_api import config
from shared_api.grants import write_grant_file_for
from shared_api.models import Principal, parse_actions
from shared_api.streams import notify_principals


class Command(BaseCommand):
    help = ("Manage API principals: create NAME --actions a,b (prints the token once, alone on the "
            "last line) | grant NAME --actions a,b | revoke NAME [--actions a,b] | rotate NAME (new token, "
            "same principal id, printed once) | delete NAME | list. With --config, "
            "the grant file is rewritten afterwards (the device picks it up on its next tick).")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("verb", choices=("create", "grant", "revoke", "rotate", "delete", "list"))
        parser.add_argument("name", nargs="?")
        parser.add_argument("--actions", default="")
        parser.add_argument("--config", help="gateway.json; rewrite its grant file after the change")

    def handle(self, *args: Any, **opts: Any) -> None:
        verb, name = opts["verb"], opts["name"]
        try:
            actions = parse_actions(opts["actions"])
        except ValueError as exc:
            raise CommandError(str(exc))
        if verb == "list":
            for p in Principal.objects.all():
                self.stdout.write(f"{p.name}\t{p.principal_id}\t{','.join(p.actions)}\t{'active' if p.active else 'revoked'}")
            return
        if not name:
            raise CommandError(f"principal {verb} needs a NAME")
        token = None
        if verb == "create":
            if Principal.objects.filter(name=name).exists():
                raise CommandError(f"principal {name!r} already exists")
            _, token = Principal.create(name, actions)
        else:
            principal = Principal.objects.filter(name=name).first()
            if principal is None:
                raise CommandError(f"no principal named {name!r}")
            if verb == "delete":
                principal.delete()
            elif verb == "rotate":
                token = principal.rotate_token()
            elif verb == "grant":
                principal.actions = sorted(set(principal.actions) | set(actions))
                principal.active = True
            elif actions:
                principal.actions = sorted(set(principal.actions) - set(actions))
            else:
                principal.active = False
            if verb != "delete":
                principal.save()
            notify_principals([principal.principal_id])  # its open streams recheck in every gateway process
        if opts["config"]:
            try:
                write_grant_file_for(opts["config"])
            except (config.ConfigError, GrantFileError, OSError) as exc:
                raise CommandError(f"principal {name} changed, but the grant file was not rewritten: {exc}")
        if token:
            self.stdout.write(f"{verb}d principal {name}; the token is shown once:")
            self.stdout.write(token)
        else:
            self.stdout.write(f"principal {name} {'deleted' if verb == 'delete' else 'updated'}")
