from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from shared_api import config
from shared_api.grants import write_grant_file


class Command(BaseCommand):
    help = "Write the deployment grant file named in gateway.json from the gateway database."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--config", required=True)

    def handle(self, *args: Any, **opts: Any) -> None:
        try:
            cfg = config.load(opts["config"])
        except config.ConfigError as exc:
            raise CommandError(str(exc))
        n = write_grant_file(cfg["grants_file"])
        self.stdout.write(f"wrote {n} principal(s) to {cfg['grants_file']}")
