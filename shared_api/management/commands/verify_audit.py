"""`manage.py verify_audit`: check an audit export against the runtime file and the journal with
`python -m gpu_worker audit verify` (exit 0: the export's hash chain matches the commit digests;
1: it does not, with one line why; 2: it could not be read)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from shared_api import config


def latest_export() -> Path | None:
    exports = sorted(Path(settings.AOTX_AUDIT_DIR).glob("audit-*.jsonl"))
    return exports[-1] if exports else None


class Command(BaseCommand):
    help = ("Verify an audit export (default: the newest under the audit directory) against the runtime "
            "file and journal with `python -m gpu_worker audit verify`.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--export", help="the export file (default: the newest audit-*.jsonl in "
                                             "AOTX_AUDIT_DIR, var/audit)")
        parser.add_argument("--new", action="store_true", help="have the device write a new export first, "
                                                              "then verify it")
        parser.add_argument("--ccir", help="the runtime file (default: \"runtime\" in gateway.json, else "
                                           "<var>/identity.aotxccir)")
        parser.add_argument("--journal", help="the journal directory (default: the directory of the device "
                                              "socket named in gateway.json)")
        parser.add_argument("--config", help="gateway.json (default: AOTX_GATEWAY_CONFIG)")

    def handle(self, *args: Any, **opts: Any) -> None:
        cfg: dict[str, Any] = {}
        path = opts["config"] or settings.AOTX_GATEWAY_CONFIG
        if not (opts["ccir"] and opts["journal"]):
            try:
                cfg = dict(config.load(path))  # (and a "runtime" it may name)
            except config.ConfigError as exc:
                raise CommandError(f"{exc} (or pass --ccir and --journal)")
        journal = opts["journal"] or str(Path(cfg["socket"]).parent)
        runtime = opts["ccir"] or cfg.get("runtime") or str(Path(settings.VAR_DIR) / "identity.aotxccir")
        if opts["new"]:
            if opts["export"]:
                raise CommandError("--new writes a new export: give it or --export, not both")
            from shared_api.tasks import export_audit
            if opts["config"]:
                settings.AOTX_GATEWAY_CONFIG = str(Path(opts["config"]).resolve())
            result = export_audit()
            if result is None:
                raise CommandError("the device did not answer; no export was written")
            export = str(result["path"])
            self.stdout.write(f"audit export: {result['transfers']} transfers, last seq {result['last_seq']}, "
                              f"to {export}")
        else:
            found = opts["export"] or latest_export()
            if found is None:
                raise CommandError(f"no audit export in {settings.AOTX_AUDIT_DIR}; pass --export or --new")
            export = str(found)
        done = subprocess.run([sys.executable, "-m", "gpu_worker", "audit", "verify", "--export", export,
                               "--ccir", runtime, "--journal", journal], cwd=settings.BASE_DIR,
                              capture_output=True, text=True)
        if done.stdout:
            self.stdout.write(done.stdout.rstrip("\n"))
        if done.returncode != 0:
            raise CommandError((done.stderr or done.stdout).strip() or f"audit verify exited {done.returncode}",
                               returncode=done.returncode)
