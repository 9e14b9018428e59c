from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from gpu_worker.contract.grantfile import GrantFileError
from shared_api import config
from shared_api.grants import write_grant_file_for
from shared_api.models import Principal, apply_quotas, describe_quotas, parse_actions, parse_quotas
from shared_api.streams.events import notify_principals


class Command(BaseCommand):
    help = ("Manage API principals: create NAME --actions a,b [--quota NAME=N|unlimited ...] (prints the token "
            "once, alone on the last line; every quota and rate not given has its default, a fair share: "
            "docs/grants.md) | grant NAME [--actions a,b] [--quota NAME=N|unlimited|default ...] (a revoked "
            "principal is reinstated with a NEW token, printed once) | revoke NAME [--actions a,b] (without "
            "--actions: no action and its token refused for good) | rotate NAME (new token, same principal id, "
            "printed once) | delete NAME | list. Quotas: docs/grants.md. With --config, the grant file is "
            "rewritten afterwards (the device picks it up on its next tick).")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("verb", choices=("create", "grant", "revoke", "rotate", "delete", "list"))
        parser.add_argument("name", nargs="?")
        parser.add_argument("--actions", default="")
        parser.add_argument("--quota", action="append", default=[], metavar="NAME=N",
                            help="a per-principal quota (receipts, spaces, conversations, media_bytes, chats, "
                                 "queued_inputs, kv_pages, memory_rows) or rate (requests_per_second, "
                                 "body_bytes_per_second, output_tokens_per_second); N=unlimited lifts it, "
                                 "N=default gives it back its default (the fair share every quota and rate "
                                 "not given has: docs/grants.md); repeatable")
        parser.add_argument("--config", help="gateway.json; rewrite its grant file after the change")

    def handle(self, *args: Any, **opts: Any) -> None:
        verb, name = opts["verb"], opts["name"]
        try:
            actions = parse_actions(opts["actions"])
            quotas = parse_quotas(opts["quota"])
        except ValueError as exc:
            raise CommandError(str(exc))
        if quotas and verb not in ("create", "grant"):
            raise CommandError("--quota goes with principal create or grant")
        if verb == "list":
            for p in Principal.objects.all():
                self.stdout.write(f"{p.name}\t{p.principal_id}\t{','.join(p.actions)}\t"
                                  f"{'active' if p.active else 'revoked'}\t{describe_quotas(p.quotas)}")
            return
        if not name:
            raise CommandError(f"principal {verb} needs a NAME")
        token = None
        if verb == "create":
            if Principal.objects.filter(name=name).exists():
                raise CommandError(f"principal {name!r} already exists")
            _, token = Principal.create(name, actions, apply_quotas({}, quotas))
        else:
            principal = Principal.objects.filter(name=name).first()
            if principal is None:
                raise CommandError(f"no principal named {name!r}")
            if verb == "delete":
                principal.delete()
            elif verb == "rotate":
                if not principal.active:
                    raise CommandError(f"principal {name!r} is revoked: `principal grant {name}` reinstates it "
                                       "with a new token")
                token = principal.rotate_token()
            elif verb == "grant":
                principal.actions = sorted(set(principal.actions) | set(actions))
                principal.quotas = apply_quotas(principal.quotas, quotas)
                if not principal.active:
                    token = principal.reinstate()
            elif actions:
                principal.actions = sorted(set(principal.actions) - set(actions))
            else:
                principal.revoke()
            if verb != "delete":
                principal.save()
            notify_principals([principal.principal_id])  # its open streams recheck in every gateway process
        if opts["config"]:
            try:
                write_grant_file_for(opts["config"])
            except (config.ConfigError, GrantFileError, OSError) as exc:
                raise CommandError(f"principal {name} changed, but the grant file was not rewritten: {exc}")
        if token:
            done = {"create": "created", "rotate": "rotated", "grant": "reinstated"}[verb]
            self.stdout.write(f"{done} principal {name}; the token is shown once:")
            self.stdout.write(token)
        else:
            self.stdout.write(f"principal {name} {'deleted' if verb == 'delete' else 'updated'}")
