"""The gateway's side of the device's ops commands (no principal; docs/protocol.md): one call
helper, the device status (`ping`) as the admin pages, /metrics and /healthz read it, and what the
Celery tasks store from it — capacity samples and journal hold incidents (shared_api/models.py).

Calls go through the process's blocking device client (shared_api/device_client.py), with the
gateway's config read at each call (a changed socket path is followed; a broken config is 503
gateway_misconfigured) and the timeout the caller gives."""
from __future__ import annotations

import datetime
import json
import logging
import time
from typing import Any, Mapping

from django.conf import settings
from django.http import HttpRequest
from django.utils import timezone

from gpu_worker.contract.wire import JSON, JSONObject

from . import device_client
from .errors import ServiceError
from .models import CapacitySample, HoldIncident, ns_datetime

log = logging.getLogger("shared_api.ops")

STATUS_TIMEOUT = 2.0  # seconds a page, /metrics or /healthz waits for the device's ping
TABLES = ("participants", "spaces", "conversations", "members", "receipts", "memory")


def call(op: str, args: Mapping[str, object] | None = None, timeout: float = STATUS_TIMEOUT) -> tuple[int, Any]:
    """(status, parsed body) of one ops command; ServiceError 503 when the device cannot be
    reached or the gateway config cannot be read."""
    msg = device_client.blocking(device_client.configured_socket()).call(op, None, args, timeout)
    return msg.status, json.loads(msg.body)


def ping(timeout: float = STATUS_TIMEOUT) -> JSONObject | None:
    """The device's status, None when it cannot be reached (or answers something else)."""
    try:
        status, body = call("ping", None, timeout)
    except ServiceError:
        return None
    return body if status == 200 and isinstance(body, dict) else None


def wait_for_device(limit: float, interval: float = 0.5) -> bool:
    """Whether the device answered a ping within `limit` seconds, asked every `interval` (Celery
    beat waits so before its first run: aotx_site/celery.py)."""
    deadline = time.monotonic() + limit
    while ping() is None:
        if time.monotonic() + interval > deadline:
            return False
        time.sleep(interval)
    return True


def request_status(request: HttpRequest) -> JSONObject | None:
    """The device's status once per request (the hold banner and a page may both want it)."""
    if not hasattr(request, "_aotx_device_status"):
        setattr(request, "_aotx_device_status", ping())
    status: JSONObject | None = getattr(request, "_aotx_device_status")
    return status


def json_object(value: JSON) -> JSONObject:
    """A member of the status that should be an object: itself, or {} (absent, null, another type)."""
    return value if isinstance(value, dict) else {}


def hold_state(status: JSONObject | None) -> dict[str, object]:
    """What the banner on every admin page says: reachable, held, cause, since."""
    if status is None:
        return {"reachable": False, "hold": None, "cause": None, "since": None}
    journal = json_object(status.get("journal"))
    return {"reachable": True, "hold": bool(journal.get("hold")), "cause": journal.get("cause"),
            "since": ns_datetime(_int(journal.get("since_ns"))), "disk_error": journal.get("disk_error"),
            "pending_bytes": journal.get("pending_bytes")}


def _int(value: JSON) -> int | None:
    """Counters come as numbers or decimal strings (the journal's byte counts)."""
    if not isinstance(value, (int, float, str)):
        return None
    try:
        return int(value)
    except ValueError:
        return None


# ---- capacity samples ------------------------------------------------------------------------

def store_sample(status: JSONObject) -> CapacitySample:
    """One CapacitySample from a ping; samples older than the retention are dropped."""
    ticks = json_object(status.get("ticks"))
    io = json_object(ticks.get("io_seconds"))
    executions = json_object(status.get("executions"))
    journal = json_object(status.get("journal"))
    seconds = io.get("sum")
    sample = CapacitySample.objects.create(
        taken_at=timezone.now(), boot=_int(status.get("boot")) or 0,
        usage={k: _int(v) for k, v in json_object(status.get("usage")).items()},
        capacities={k: _int(v) for k, v in json_object(status.get("capacities")).items()},
        kv=status.get("kv"), executions_queued=_int(executions.get("queued")),
        executions_running=_int(executions.get("running")),
        journal_bytes=_int(journal.get("bytes")) or 0, runtime_file_bytes=_int(status.get("runtime_file_bytes")),
        saved_transfers=_int(ticks.get("saved_transfers")), fdatasyncs=_int(io.get("count")),
        fdatasync_seconds=seconds if isinstance(seconds, (int, float, str)) else None,
        subscriptions=_int(status.get("subscriptions")),
        hold=bool(journal.get("hold")))
    cutoff = timezone.now() - datetime.timedelta(days=settings.AOTX_SAMPLE_RETENTION_DAYS)
    CapacitySample.objects.filter(taken_at__lt=cutoff).delete()
    return sample


# ---- journal hold incidents ------------------------------------------------------------------

def device_incidents(status: JSONObject) -> list[JSONObject]:
    """The device's incidents, oldest first, with the current hold when it is not among them (a
    hold on a full disk cannot journal its start)."""
    held = status.get("hold_incidents")
    incidents = [dict(i) for i in held or [] if isinstance(i, dict)] if isinstance(held, list) else []
    journal = json_object(status.get("journal"))
    since = _int(journal.get("since_ns"))  # (a decimal string in the journal state, a number in incidents)
    if journal.get("hold") and since is not None and all(_int(i.get("since_ns")) != since for i in incidents):
        incidents.append({"cause": journal.get("cause"), "since_ns": since, "ended_ns": None,
                          "disk_error": journal.get("disk_error"), "pending_bytes": journal.get("pending_bytes")})
    return incidents


def record_incidents(status: JSONObject) -> list[HoldIncident]:
    """Store the device's incidents in the database (HoldIncident, keyed by start); each new one
    is logged at WARNING. Returns the new ones."""
    new = []
    for incident in device_incidents(status):
        since = _int(incident.get("since_ns"))
        if since is None:
            continue
        fields = {"cause": str(incident.get("cause") or "unknown"), "ended_ns": _int(incident.get("ended_ns")),
                  "disk_error": incident.get("disk_error"), "pending_bytes": _int(incident.get("pending_bytes"))}
        row, created = HoldIncident.objects.get_or_create(since_ns=since, defaults=fields)
        if created:
            new.append(row)
            log.warning("journal hold incident: %s since %s%s (pending %s bytes)%s", row.cause,
                        row.since.isoformat() if row.since else since,
                        f", ended {row.ended.isoformat()}" if row.ended else ", still held",
                        row.pending_bytes, f"; disk error: {row.disk_error}" if row.disk_error else "")
        elif any(getattr(row, k) != v for k, v in fields.items() if v is not None):
            was_open = row.ended_ns is None
            for k, v in fields.items():
                if v is not None:
                    setattr(row, k, v)
            row.save()
            if was_open and row.ended_ns is not None:
                log.warning("journal hold incident ended: %s since %s, ended %s", row.cause,
                            row.since.isoformat() if row.since else since, row.ended.isoformat() if row.ended else "")
    return new


def incident_rows(status: JSONObject | None, limit: int = 500) -> list[dict[str, Any]]:
    """The holds page: the database's incidents and the device's not yet recorded, newest first."""
    rows: dict[int, dict[str, Any]] = {}
    for stored in HoldIncident.objects.order_by("-since_ns")[:limit]:
        rows[stored.since_ns] = {"cause": stored.cause, "since_ns": stored.since_ns, "ended_ns": stored.ended_ns,
                                 "disk_error": stored.disk_error, "pending_bytes": stored.pending_bytes,
                                 "recorded": True}
    for incident in device_incidents(status) if status else []:
        since = _int(incident.get("since_ns"))
        if since is None:
            continue
        known = rows.get(since)
        if known is None:
            rows[since] = {**{k: incident.get(k) for k in ("cause", "ended_ns", "disk_error", "pending_bytes")},
                           "since_ns": since, "recorded": False}
        elif known["ended_ns"] is None and incident.get("ended_ns") is not None:
            known["ended_ns"] = _int(incident["ended_ns"])  # ended since the detection task last ran
    out = sorted(rows.values(), key=lambda r: r["since_ns"], reverse=True)[:limit]
    for row in out:
        row["since"], row["ended"] = ns_datetime(row["since_ns"]), ns_datetime(_int(row["ended_ns"]))
        row["seconds"] = ((row["ended"] - row["since"]).total_seconds()
                          if row["ended"] is not None and row["since"] is not None else None)
    return out
