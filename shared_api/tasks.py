"""Celery ops tasks: thin wrappers over the device's ops commands (beat runs them on the schedule
in settings.CELERY_BEAT_SCHEDULE; each can also be called with .delay()).

- sample_capacity: `ping` -> one CapacitySample (the admin's capacity dashboard);
- detect_holds: `ping` -> HoldIncident rows; a new incident is logged at WARNING;
- checkpoint: `checkpoint` folds the journal into the runtime file;
- export_audit: `audit.export` writes the logical audit prefix to a file under the audit
  directory (settings.AOTX_AUDIT_DIR, var/audit by default); `manage.py verify_audit` checks it.

Beat's first run waits until the device answers (aotx_site/celery.py): a start does not skip. After
that, a device that cannot be reached skips a run with a WARNING line (it is down or restarting; the
next run tries again); a device that refuses a command fails the task with its error."""
from __future__ import annotations

import datetime
import logging
from pathlib import Path
from typing import Mapping

from celery import shared_task

from gpu_worker.contract.wire import JSONObject

log = logging.getLogger("shared_api.tasks")
PING_TIMEOUT = 10.0


class DeviceCommandFailed(RuntimeError):
    """The device answered an ops command with an error."""


def _ping(what: str) -> JSONObject | None:
    from . import ops
    status = ops.ping(PING_TIMEOUT)
    if status is None:
        log.warning("%s skipped: the device did not answer its ping", what)
    return status


def _command(op: str, args: Mapping[str, object] | None = None) -> JSONObject | None:
    from django.conf import settings

    from . import ops
    from .errors import ServiceError
    try:
        status, body = ops.call(op, args, settings.AOTX_OPS_TIMEOUT)
    except ServiceError as exc:
        log.warning("%s skipped: %s", op, exc.message)
        return None
    if status != 200:
        error = body.get("error", {}) if isinstance(body, dict) else {}
        raise DeviceCommandFailed(f"{op}: {status} {error.get('code')}: {error.get('message')}")
    result: JSONObject = body
    return result


@shared_task
def sample_capacity() -> JSONObject | None:
    """Store the device's table usage, KV pages, queue, journal and tick counters (once a minute)."""
    from . import ops
    status = _ping("capacity sample")
    if status is None:
        return None
    sample = ops.store_sample(status)
    log.info("capacity: %s; journal %s", status.get("usage"), status.get("journal"))
    return {"sample": sample.pk, "taken_at": sample.taken_at.isoformat(), "usage": sample.usage,
            "hold": sample.hold}


@shared_task
def detect_holds() -> JSONObject | None:
    """Record the device's journal hold incidents; a new one is logged at WARNING (ops.record_incidents)."""
    from . import ops
    status = _ping("hold detection")
    if status is None:
        return None
    new = ops.record_incidents(status)
    journal = ops.json_object(status.get("journal"))
    return {"new": [{"cause": i.cause, "since_ns": i.since_ns, "ended_ns": i.ended_ns} for i in new],
            "hold": bool(journal.get("hold")), "cause": journal.get("cause")}


@shared_task
def checkpoint() -> JSONObject | None:
    """Fold the journal into the runtime file (the device also does by itself past
    checkpoint_journal_bytes); a checkpoint also lifts a file_cap hold."""
    result = _command("checkpoint")
    if result is not None:
        log.info("checkpoint: generation %s, %s transfers folded", result.get("generation"), result.get("folded"))
    return result


def audit_path(now: datetime.datetime | None = None) -> Path:
    from django.conf import settings
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return Path(settings.AOTX_AUDIT_DIR).resolve() / f"audit-{now:%Y%m%dT%H%M%S%fZ}.jsonl"


@shared_task
def export_audit() -> JSONObject | None:
    """Have the device write the logical audit prefix (every saved transfer) to a new file under
    the audit directory; the answer is {"path", "transfers", "last_seq", "last_digest"}. The device
    writes the file itself, so its user needs write access to that directory."""
    path = audit_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    result = _command("audit.export", {"path": str(path)})
    if result is not None:
        log.info("audit export: %s transfers to %s (last seq %s)", result.get("transfers"), result.get("path"),
                 result.get("last_seq"))
    return result
