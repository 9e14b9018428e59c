import os

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from shared_api import config


class Command(BaseCommand):
    help = "Serve the gateway with daphne on the listen address of gateway.json."

    def add_arguments(self, parser):
        parser.add_argument("--config", required=True)

    def handle(self, *args, **opts):
        try:
            cfg = config.load(opts["config"])
        except config.ConfigError as exc:
            raise CommandError(str(exc))
        path = os.path.abspath(opts["config"])
        os.environ["AOTX_GATEWAY_CONFIG"] = path
        settings.AOTX_GATEWAY_CONFIG = path
        from daphne.cli import CommandLineInterface
        self.stdout.write(f"gateway listening on http://{cfg['listen']}/aotx/v1/shared/ (device {cfg['socket']})")
        self.stdout.flush()
        CommandLineInterface().run(["-b", cfg["host"], "-p", str(cfg["port"]), "--access-log", "-",
                                    "aotx_site.asgi:application"])
