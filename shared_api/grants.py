"""Writing the deployment grant file from the gateway database (format: docs/grants.md). The
contract's writer checks the document as the device will read it, then replaces the file
atomically; no token or token hash is written."""
from __future__ import annotations

from gpu_worker.contract import grantfile

from . import config
from .models import Principal


def grant_document() -> dict[str, object]:
    principals = list(Principal.objects.all())
    return grantfile.document({p.principal_id: (p.name, sorted(p.current_actions())) for p in principals},
                              quotas={p.principal_id: p.quotas for p in principals})


def write_grant_file_for(config_path: str) -> tuple[str, int]:
    """Rewrite the grant file named in a gateway.json: (its path, principals written). ConfigError,
    GrantFileError or OSError say why nothing was written."""
    path = config.load(config_path)["grants_file"]
    return path, write_grant_file(path)


def write_grant_file(path: str) -> int:
    """Returns the number of principals written; GrantFileError (nothing written) for a database
    row the device could not accept."""
    return grantfile.write(path, grant_document())
