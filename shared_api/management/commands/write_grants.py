from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from gpu_worker.contract.grantfile import GrantFileError
from shared_api import config
from shared_api.grants import write_grant_file_for


class Command(BaseCommand):
    help = "Write the deployment grant file named in gateway.json from the gateway database."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--config", required=True)

    def handle(self, *args: Any, **opts: Any) -> None:
        try:
            path, n = write_grant_file_for(opts["config"])
        except (config.ConfigError, GrantFileError, OSError) as exc:
            raise CommandError(f"nothing written: {exc}")
        self.stdout.write(f"wrote {n} principal(s) to {path}")
