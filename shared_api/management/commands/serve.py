import os
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from shared_api import config


class Command(BaseCommand):
    help = "Serve the gateway (granian, shared_api/http/server.py) on the listen address of gateway.json."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--config", required=True)

    def handle(self, *args: Any, **opts: Any) -> None:
        os.umask(0o077)  # the gateway's database (tokens' digests, admin sessions) and grant files: ours alone
        try:
            cfg = config.load(opts["config"])
        except config.ConfigError as exc:
            raise CommandError(str(exc))
        path = os.path.abspath(opts["config"])
        os.environ["AOTX_GATEWAY_CONFIG"] = path
        settings.AOTX_GATEWAY_CONFIG = path
        settings.AOTX_BODY_TIMEOUT = cfg["body_timeout"]  # this process may be the only worker
        settings.AOTX_GATEWAY_WORKERS = cfg["workers"]
        from shared_api.http.server import serve
        device = (f"the primary the etcd key {cfg['etcd_key']} names" if cfg["etcd"] else f"device {cfg['socket']}")
        self.stdout.write(f"gateway listening on http://{cfg['listen']}/aotx/v1/shared/ ({device}, "
                          f"{cfg['workers']} worker{'s' if cfg['workers'] > 1 else ''})")
        self.stdout.flush()
        serve(cfg)
