"""The admin console's operations pages (Django staff users; linked from the admin index):

- capacity: charts over time from the stored CapacitySample rows (the Celery task
  `sample_capacity`), their legends labelled with the time of the sample their values come from,
  and the device's live reading from its `ping` at page load, labelled with that time;
- receipts: every live receipt through the device's `ops.receipts`, filtered by participant, kind,
  status and save state, paged; one receipt (`ops.receipt`) with its save fields; its result bytes
  (`ops.result`) as text when they are UTF-8, else base64;
- memory: a space's memory rows through the device's `ops.memory` (every row, whoever may read
  it), paged, each with a preview of its payload; a row's "Forget" asks for a reason and, on a
  POST (CSRF protected, as the admin's forms are), forgets it through `ops.memory.forget` as the
  device's operator participant, the reason and the staff user's name kept in the receipt's
  command bytes (docs/memory.md "Forgetting"), which a receipt's page shows (`ops.command`);
- holds: journal hold incidents (the database's, recorded by `detect_holds`, and the device's
  not yet recorded) and the current hold.

Every admin page also shows the current hold state (shared_api/console/context_processors.py and
templates/admin/base_site.html)."""
from __future__ import annotations

import datetime
import json
import re
from typing import Any, Callable

from django import forms
from django.conf import settings
from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.http import urlencode

from gpu_worker.contract.ids import MEMORY_ID
from gpu_worker.contract.limits import MAX_LIMIT, MAX_REASON_BYTES
from gpu_worker.contract.vocabulary import COMMANDS, TERMINAL_STATUSES
from gpu_worker.contract.wire import JSON

from .. import ops
from .charts import Chart, Series, human, sample_time, thin
from ..errors import ServiceError
from ..models import CapacitySample, ns_datetime

MAX_POINTS = 600  # a chart draws at most about this many samples (evenly thinned)
MAX_HOURS = 24 * 90
RECEIPT_KINDS = sorted({c.receipt_kind for c in COMMANDS.values() if c.receipt_kind})
RECEIPT_STATUSES = ("admitted", "running", *TERMINAL_STATUSES)
SAVE_STATES = ("unsaved", "admission", "terminal")
EXECUTING_KINDS = ("conversation.input",)  # kinds with result bytes (ops.result)
PAGE_SIZE = 50


def _context(request: HttpRequest, title: str, **extra: object) -> dict[str, object]:
    return {**admin.site.each_context(request), "title": title, **extra}


# ---- capacity --------------------------------------------------------------------------------

def _table_names(samples: list[CapacitySample], status: dict[str, Any] | None) -> list[str]:
    seen = {name for s in samples for name in s.usage}
    seen |= set((status or {}).get("usage") or {})
    return [t for t in ops.TABLES if t in seen] + sorted(seen - set(ops.TABLES))


def _rate(samples: list[CapacitySample], value: Callable[[CapacitySample], float | None],
          per: Callable[[CapacitySample], float | None] | None = None, scale: float = 1.0
          ) -> list[tuple[datetime.datetime, float | None]]:
    """Between consecutive samples of one device boot: d(value)/d(time), or d(value)/d(per)."""
    points: list[tuple[datetime.datetime, float | None]] = []
    prev: CapacitySample | None = None
    for s in samples:
        v: float | None = None
        now, before = value(s), value(prev) if prev is not None else None
        if prev is not None and prev.boot == s.boot and now is not None and before is not None and now >= before:
            if per is None:
                dt = (s.taken_at - prev.taken_at).total_seconds()
                v = (now - before) / dt * scale if dt > 0 else None
            else:
                p_now, p_before = per(s), per(prev)
                if p_now is not None and p_before is not None and p_now > p_before:
                    v = (now - before) / (p_now - p_before) * scale
        points.append((s.taken_at, v))
        prev = s
    return points


def _series(samples: list[CapacitySample], label: str, value: Callable[[CapacitySample], Any],
            dashed: bool = False) -> Series:
    return Series(label, [(s.taken_at, None if value(s) is None else float(value(s))) for s in samples],
                  dashed=dashed)


def _getter(field: str, table: str) -> Callable[[CapacitySample], Any]:
    return lambda s: getattr(s, field).get(table)


def capacity_charts(samples: list[CapacitySample], status: dict[str, Any] | None = None) -> list[Chart]:
    charts = []
    for table in _table_names(samples, status):
        title = ("Receipt window: receipts in use of capacity" if table == "receipts"
                 else f"{table.capitalize()}: rows in use of capacity")
        charts.append(Chart("receipt-window" if table == "receipts" else f"table-{table}", title, [
            _series(samples, "in use", _getter("usage", table)),
            _series(samples, "capacity", _getter("capacities", table), dashed=True)]))
    charts.append(Chart("kv-pages", "KV pages: in use and queued", [
        _series(samples, "in use", lambda s: (s.kv or {}).get("owned")),
        _series(samples, "queued", lambda s: (s.kv or {}).get("pending")),
        _series(samples, "pages", lambda s: (s.kv or {}).get("pages"), dashed=True)],
        note="the device reported no KV pool (no engine running) in these samples"))
    charts.append(Chart("executions", "Inputs: queued and running", [
        _series(samples, "queued", lambda s: s.executions_queued),
        _series(samples, "running", lambda s: s.executions_running)]))
    charts.append(Chart("storage", "Journal and runtime file size", [
        _series(samples, "journal", lambda s: s.journal_bytes),
        _series(samples, "runtime file", lambda s: s.runtime_file_bytes)], unit="bytes"))
    charts.append(Chart("fdatasync-rate", "Ticks saved: fdatasyncs and transfers per second", [
        Series("fdatasyncs", _rate(samples, lambda s: s.fdatasyncs)),
        Series("saved transfers", _rate(samples, lambda s: s.saved_transfers))], unit="/s",
        note="a rate needs two samples of one device boot"))
    charts.append(Chart("fdatasync-latency", "Mean write + fdatasync time per tick", [
        Series("mean", _rate(samples, lambda s: s.fdatasync_seconds, per=lambda s: s.fdatasyncs, scale=1000.0))],
        unit="ms", note="a mean needs two samples of one device boot with ticks between them"))
    charts.append(Chart("subscriptions", "Open event streams and chats (device subscriptions)", [
        _series(samples, "subscriptions", lambda s: s.subscriptions)]))
    return charts


def live_values(status: dict[str, Any]) -> dict[str, Any]:
    """The current values, from the ping at page load."""
    usage, capacities = status.get("usage") or {}, status.get("capacities") or {}
    tables = []
    for name in [t for t in ops.TABLES if t in usage] + sorted(set(usage) - set(ops.TABLES)):
        used, cap = usage.get(name), capacities.get(name)
        percent = f"{100 * int(used) / int(cap):.1f} %" if used is not None and cap else "-"
        tables.append({"name": name, "used": used, "capacity": cap if cap is not None else "-", "percent": percent})
    journal = status.get("journal") or {}
    kv, executions, ticks = status.get("kv"), status.get("executions") or {}, status.get("ticks") or {}
    io = ticks.get("io_seconds") or {}
    grants = status.get("grants") or {}
    facts = [
        ("boot", status.get("boot")), ("generation", status.get("generation")),
        ("journal", f"{human(int(journal.get('bytes') or 0), 'bytes')} of "
                    f"{human(int(journal.get('file_cap_bytes') or 0), 'bytes')} (file cap)"),
        ("journal pending bytes", journal.get("pending_bytes")),
        ("last checkpoint seq", journal.get("checkpoint_seq")),
        ("runtime file", human(int(status["runtime_file_bytes"]), "bytes")
         if status.get("runtime_file_bytes") is not None else "not reported"),
        ("KV pages", f"{kv.get('owned')} in use, {kv.get('pending')} queued of {kv.get('pages')} "
                     f"({kv.get('running')} running, {kv.get('waiting')} waiting)" if kv else "no engine running"),
        ("inputs", f"{executions.get('queued', '-')} queued, {executions.get('running', '-')} running"
         if executions else "not reported"),
        ("open streams", status.get("subscriptions", "not reported")),
        ("saved transfers since boot", ticks.get("saved_transfers", "not reported")),
        ("ticks written since boot", f"{io['count']} (mean {1000 * io['sum'] / io['count']:.3f} ms write + fdatasync)"
         if io.get("count") else io.get("count", "not reported")),
        ("grant file", f"{grants.get('path')}" + (f" — the device refused its reload: {grants['problem']}"
                                                   if grants.get("problem") else "")),
        ("replication", _replication(((status.get("pipeline") or {}).get("replication")))),
    ]
    return {"tables": tables, "facts": facts}


def _replication(state: dict[str, Any] | None) -> str:
    """A primary's journal shipping, in one line (docs/replication.md)."""
    if not state:
        return "none (no standby configured)"
    mode = state.get("replication")
    if state.get("standby") and state.get("catching_up"):
        return (f"primary, {mode}: standby {state['standby']} CATCHING UP from this primary's runtime file (its copy "
                f"was behind; it acknowledges nothing until it holds it); {state.get('standby_losses')} standby "
                "losses since boot")
    if state.get("standby"):
        return (f"primary, {mode}: standby {state['standby']} acknowledged through transfer {state.get('acked_seq')}, "
                f"{state.get('lag_transfers')} transfers ({state.get('lag_bytes')} bytes) behind, "
                f"{state.get('queued_bytes')} bytes queued for it; "
                f"{state.get('standby_losses')} standby losses since boot")
    held = ("saving alone (--standby-timeout passed)" if state.get("alone")
            else "holding: nothing is answered saved until a standby holds it" if mode == "sync"
            else "saving alone (async)")
    return f"primary, {mode}: NO STANDBY — {held}; {state.get('standby_losses')} standby losses since boot"


def capacity_view(request: HttpRequest) -> HttpResponse:
    try:
        hours = min(max(int(request.GET.get("hours", "24")), 1), MAX_HOURS)
    except ValueError:
        hours = 24
    since = timezone.now() - datetime.timedelta(hours=hours)
    samples = list(CapacitySample.objects.filter(taken_at__gte=since).order_by("taken_at"))
    count = len(samples)
    status = ops.request_status(request)
    loaded_at = timezone.now()  # the live reading's time: the ping is asked for this page
    charts = capacity_charts(thin(samples, MAX_POINTS), status)
    for chart in charts:  # legends say which sample their values come from (shared_api/console/charts.py)
        chart.now = loaded_at
    return render(request, "aotx/ops/capacity.html", _context(
        request, "Device capacity", charts=charts, live=live_values(status) if status else None, hours=hours,
        sample_count=count, ranges=(1, 6, 24, 24 * 7, 24 * 30),
        loaded_at=sample_time(loaded_at, loaded_at.date())))


# ---- receipts --------------------------------------------------------------------------------

def _choices(values: tuple[str, ...] | list[str]) -> list[tuple[str, str]]:
    return [("", "any"), *((v, v) for v in values)]


class ReceiptFilter(forms.Form):
    participant = forms.RegexField(regex=r"^par-[0-9a-f]{32}$", required=False, label="Participant",
                                   widget=forms.TextInput(attrs={"size": 40, "placeholder": "par-…"}))
    kind = forms.ChoiceField(choices=_choices(RECEIPT_KINDS), required=False)
    status = forms.ChoiceField(choices=_choices(RECEIPT_STATUSES), required=False)
    saved = forms.ChoiceField(choices=_choices(SAVE_STATES), required=False, label="Save state")
    limit = forms.IntegerField(min_value=1, max_value=MAX_LIMIT, required=False, initial=PAGE_SIZE)


def _device_error(exc_or_body: ServiceError | JSON, status: int | None = None) -> str:
    if isinstance(exc_or_body, ServiceError):
        return f"{exc_or_body.status} {exc_or_body.code}: {exc_or_body.message}"
    error = ops.json_object(exc_or_body.get("error")) if isinstance(exc_or_body, dict) else {}
    return f"{status} {error.get('code', 'error')}: {error.get('message', exc_or_body)}"


def _cursor(value: str | None) -> str | None:
    return value if value is not None and value.isascii() and value.isdigit() and len(value) <= 20 else None


def _trail(request: HttpRequest) -> tuple[str | None, list[str]]:
    """A paged list's cursor and its trail: the cursors of the pages before it ("0" the first)."""
    return (_cursor(request.GET.get("cursor")),
            [c for c in request.GET.get("trail", "").split(",") if _cursor(c) is not None or c == "0"])


def _pages(base: dict[str, Any], cursor: str | None, trail: list[str],
           next_cursor: str | None) -> tuple[str | None, str | None]:
    """(next page's URL, previous page's URL) of a paged list, its own query `base` kept."""
    next_url = prev_url = None
    if next_cursor is not None:
        next_url = "?" + urlencode({**base, "cursor": next_cursor, "trail": ",".join([*trail, cursor or "0"])})
    if cursor is not None:
        back = trail[-1] if trail else "0"
        prev_args = {**base, "trail": ",".join(trail[:-1])}
        if back != "0":
            prev_args["cursor"] = back
        prev_url = "?" + urlencode(prev_args)
    return next_url, prev_url


def _ask(op: str, args: dict[str, object], timeout: float = ops.STATUS_TIMEOUT,
         ok: tuple[int, ...] = (200,)) -> tuple[dict[str, Any] | None, str | None]:
    """An ops command's answer for a page: (its body, None) when its status is one of `ok`, else
    (None, the error the page shows)."""
    try:
        status, body = ops.call(op, args, timeout)
    except ServiceError as exc:
        return None, _device_error(exc)
    if status in ok and isinstance(body, dict):
        return body, None
    return None, _device_error(body, status)


def receipts_view(request: HttpRequest) -> HttpResponse:
    form = ReceiptFilter(request.GET or None)
    filters: dict[str, str] = {}  # (the form's choice fields)
    if form.is_bound and form.is_valid():
        filters = {k: v for k, v in form.cleaned_data.items() if v not in (None, "") and k != "limit"}
    limit = (form.cleaned_data.get("limit") if form.is_bound and form.is_valid() else None) or PAGE_SIZE
    cursor, trail = _trail(request)
    items: list[dict[str, Any]] = []
    error = next_url = prev_url = None
    if not form.is_bound or form.is_valid():
        args: dict[str, object] = {**filters, "limit": limit}
        if cursor is not None:
            args["cursor"] = cursor
        body, error = _ask("ops.receipts", args)
        if body is not None:
            items = body.get("items") or []
            next_url, prev_url = _pages({**filters, "limit": limit}, cursor, trail, body.get("next_cursor"))
    rows = [_receipt_row(r, filters.get("status")) for r in items]
    first_url = "?" + urlencode({**filters, "limit": limit})
    return render(request, "aotx/ops/receipts.html", _context(
        request, "Receipts", form=form, rows=rows, error=error, next_url=next_url, prev_url=prev_url,
        first_url=first_url if cursor is not None else None, page=len(trail) + 1,
        filtered=bool(filters)))


def _status_of(receipt: dict[str, Any], asked: str | None = None) -> str:
    """The terminal status; before it is saved a receipt does not say whether its input runs yet
    (`ops.receipts` filters on it: a list filtered by admitted or running says which)."""
    terminal = receipt.get("terminal") or {}
    if terminal.get("status"):
        return str(terminal["status"])
    return asked if asked in ("admitted", "running") else "not finished"


def _save_state(receipt: dict[str, Any]) -> str:
    if (receipt.get("terminal") or {}).get("saved"):
        return "terminal"
    if (receipt.get("admission") or {}).get("saved"):
        return "admission"
    return "unsaved"


def _receipt_row(receipt: dict[str, Any], asked: str | None) -> dict[str, Any]:
    operation = str(receipt.get("operation", ""))
    return {"operation": operation, "url": reverse("aotx-ops-receipt", args=[operation]),
            "participant": receipt.get("participant"), "sequence": receipt.get("sequence"),
            "kind": receipt.get("kind"), "target": receipt.get("target"), "status": _status_of(receipt, asked),
            "saved": _save_state(receipt),
            "source": ((receipt.get("terminal") or {}).get("save") or (receipt.get("admission") or {}).get("save")
                       or {}).get("source")}


def _save_fields(part: dict[str, Any] | None) -> list[tuple[str, Any]]:
    part = part or {}
    save = part.get("save") or {}
    rows: list[tuple[str, Any]] = [(k, v) for k, v in part.items() if k != "save"]
    return rows + [(f"save.{k}", v) for k, v in sorted(save.items())]


def receipt_view(request: HttpRequest, operation: str) -> HttpResponse:
    receipt, error = _ask("ops.receipt", {"operation": operation})
    sections: list[tuple[str, list[tuple[str, Any]]]] = []
    if receipt is not None:
        summary = [(k, receipt.get(k)) for k in ("operation", "participant", "sequence", "operation_key", "kind",
                                                  "target", "schema")]
        summary += [("status", _status_of(receipt)), ("save state", _save_state(receipt))]
        sections = [("Receipt", summary), ("Admission", _save_fields(receipt.get("admission"))),
                    ("Terminal", _save_fields(receipt.get("terminal"))),
                    ("Result", list((receipt.get("result") or {}).items())),
                    ("Device", [*((f"device.{k}", v) for k, v in (receipt.get("device") or {}).items()),
                                *((f"transport.{k}", v) for k, v in (receipt.get("transport") or {}).items()),
                                *((f"effective.{k}", v) for k, v in (receipt.get("effective") or {}).items()),
                                ("pending_bytes", receipt.get("pending_bytes")),
                                ("disk_error", receipt.get("disk_error")),
                                ("journal_hold", receipt.get("journal_hold"))])]
    command: str | None = None
    if receipt is not None:
        command, rows = _command(operation)
        sections.insert(1, ("Command", rows))
    has_result = receipt is not None and (receipt.get("kind") in EXECUTING_KINDS
                                          or int((receipt.get("result") or {}).get("length") or 0) > 0)
    return render(request, "aotx/ops/receipt.html", _context(
        request, f"Receipt {operation}", operation=operation, receipt=receipt, sections=sections, error=error,
        raw=json.dumps(receipt, indent=2, sort_keys=True) if receipt is not None else None, command=command,
        result_url=reverse("aotx-ops-result", args=[operation]) if has_result else None,
        participant_url=(reverse("aotx-ops-receipts") + "?" + urlencode({"participant": receipt["participant"]})
                         if receipt is not None and receipt.get("participant") else None)))


def _command(operation: str) -> tuple[str | None, list[tuple[str, Any]]]:
    """An operation's command bytes as its receipt keeps them (`ops.command`): their text, and
    their fields as rows (`body.reason` and `body.staff` of a staff forget among them)."""
    body, error = _ask("ops.command", {"operation": operation})
    if body is None:
        return None, [("error", error)]
    text = body.get("text")
    if not isinstance(text, str):
        return None, [("bytes", f"{body.get('length')} bytes, not UTF-8 (base64: {body.get('bytes')})")]
    try:
        doc = json.loads(text)
    except ValueError:
        return text, []
    if not isinstance(doc, dict):
        return text, []
    rows: list[tuple[str, Any]] = []
    for key, value in sorted(doc.items()):
        if key == "body" and isinstance(value, dict):
            rows += [(f"body.{k}", v if isinstance(v, str) else json.dumps(v, sort_keys=True))
                     for k, v in sorted(value.items())]
        else:
            rows.append((key, value if isinstance(value, str) else json.dumps(value)))
    return text, rows


def result_view(request: HttpRequest, operation: str) -> HttpResponse:
    try:
        offset = max(int(request.GET.get("offset", "0")), 0)
    except ValueError:
        offset = 0
    result, error = _ask("ops.result", {"operation": operation, "offset": offset})
    return render(request, "aotx/ops/result.html", _context(
        request, f"Result of {operation}", operation=operation, result=result, error=error, offset=offset,
        receipt_url=reverse("aotx-ops-receipt", args=[operation]),
        shown_as=("text" if result is not None and result.get("text") is not None else "base64")))


# ---- memory ----------------------------------------------------------------------------------

SPACE_ID = r"^spc-[0-9a-f]{32}-[0-9a-f]{32}\Z"


class MemorySpace(forms.Form):
    space = forms.RegexField(regex=SPACE_ID, label="Space", error_messages={"invalid": "a space ID: spc-…-…"},
                             widget=forms.TextInput(attrs={"size": 76, "placeholder": "spc-…"}))
    limit = forms.IntegerField(min_value=1, max_value=MAX_LIMIT, required=False, initial=PAGE_SIZE)


class ForgetForm(forms.Form):
    reason = forms.CharField(label="Reason", help_text=f"kept in the receipt; at most {MAX_REASON_BYTES} UTF-8 bytes",
                             widget=forms.Textarea(attrs={"rows": 3, "cols": 72}))
    space = forms.RegexField(regex=SPACE_ID, required=False, widget=forms.HiddenInput)

    def clean_reason(self) -> str:
        reason: str = self.cleaned_data["reason"]
        if len(reason.encode("utf-8", "surrogatepass")) > MAX_REASON_BYTES:
            raise forms.ValidationError(f"at most {MAX_REASON_BYTES} UTF-8 bytes")
        return reason


def _memory_row(item: dict[str, Any], space: str) -> dict[str, Any]:
    obj = str(item.get("object", ""))
    preview = item.get("preview") or {}
    text = preview.get("text")
    return {"object": obj, "kind": item.get("kind"), "version": item.get("version"), "scope": item.get("scope"),
            "actor": item.get("actor"), "byte_length": item.get("byte_length"),
            "expires": ns_datetime(item.get("expires_at_ns")),
            "published": bool(item.get("published")),
            "preview": text if text is not None else f"base64: {preview.get('bytes', '')}",
            "shown_as": "text" if text is not None else "base64", "complete": bool(preview.get("complete")),
            "forget_url": reverse("aotx-ops-memory-forget", args=[obj]) + "?" + urlencode({"space": space})}


def memory_view(request: HttpRequest) -> HttpResponse:
    """A space's memory rows (`ops.memory`), paged, each with its "Forget"."""
    form = MemorySpace(request.GET or None)
    rows: list[dict[str, Any]] = []
    error = next_url = prev_url = first_url = None
    space: str | None = None
    cursor, trail = _trail(request)
    if form.is_bound and form.is_valid():
        space = form.cleaned_data["space"]
        limit = form.cleaned_data.get("limit") or PAGE_SIZE
        args: dict[str, object] = {"space": space, "limit": limit}
        if cursor is not None:
            args["cursor"] = cursor
        body, error = _ask("ops.memory", args)
        if body is not None:
            rows = [_memory_row(item, space) for item in body.get("items") or []]
            base = {"space": space, "limit": limit}
            next_url, prev_url = _pages(base, cursor, trail, body.get("next_cursor"))
            first_url = "?" + urlencode(base) if cursor is not None else None
    return render(request, "aotx/ops/memory.html", _context(
        request, "Memory", form=form, space=space, rows=rows, error=error, next_url=next_url, prev_url=prev_url,
        first_url=first_url, page=len(trail) + 1))


def forget_view(request: HttpRequest, memory: str) -> HttpResponse:
    """A memory object's "Forget": the confirmation form (GET), then (POST) `ops.memory.forget`
    with the reason and the staff user's name; the receipt the device answers, linked."""
    receipt: dict[str, Any] | None = None
    error = None
    if request.method == "POST":
        form = ForgetForm(request.POST)
        if form.is_valid():
            args = {"memory": memory, "reason": form.cleaned_data["reason"], "staff": request.user.get_username()}
            # (it waits for the save, as a participant's forget does: the gateway's device timeout)
            receipt, error = _ask("ops.memory.forget", args, settings.AOTX_DEVICE_TIMEOUT, ok=(200, 202))
    else:
        form = ForgetForm(initial={"space": request.GET.get("space", "")})
        if not MEMORY_ID.match(memory):
            error = f"{memory} is not a memory object ID (mem-…-…)"
    space = form.cleaned_data.get("space") if form.is_bound and form.is_valid() else request.GET.get("space")
    back_url = (reverse("aotx-ops-memory") + "?" + urlencode({"space": space})
                if isinstance(space, str) and re.match(SPACE_ID, space) else reverse("aotx-ops-memory"))
    return render(request, "aotx/ops/memory_forget.html", _context(
        request, f"Forget {memory}", memory=memory, form=form, error=error, receipt=receipt, back_url=back_url,
        receipt_url=reverse("aotx-ops-receipt", args=[receipt["operation"]])
        if receipt is not None and receipt.get("operation") else None))


# ---- holds -----------------------------------------------------------------------------------

def holds_view(request: HttpRequest) -> HttpResponse:
    status = ops.request_status(request)
    return render(request, "aotx/ops/holds.html", _context(
        request, "Journal holds and failovers", incidents=ops.incident_rows(status), hold=ops.hold_state(status),
        journal=(status or {}).get("journal"), failovers=failover_rows(status)))


def failover_rows(status: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The device's takeovers of its journal (a standby that became the primary), newest first:
    saved state, reported by its ping (docs/replication.md)."""
    rows = []
    for failover in reversed((status or {}).get("failovers") or []):
        position = failover.get("position") or [None, None]
        rows.append({"boot": failover.get("boot"), "at": ns_datetime(failover.get("at_ns")),
                     "segment": position[0], "offset": position[1], "generation": failover.get("generation"),
                     # the runtime file generation it made (none in an incident from before takeovers made one)
                     "file_generation": failover.get("file_generation")})
    return rows


def urls() -> list[URLPattern]:
    """Mounted at admin/ops/ before the admin's own URLs; every page needs a staff user."""
    staff = admin.site.admin_view
    return [
        path("capacity/", staff(capacity_view), name="aotx-ops-capacity"),
        path("receipts/", staff(receipts_view), name="aotx-ops-receipts"),
        path("receipts/<str:operation>/", staff(receipt_view), name="aotx-ops-receipt"),
        path("receipts/<str:operation>/result/", staff(result_view), name="aotx-ops-result"),
        path("memory/", staff(memory_view), name="aotx-ops-memory"),
        path("memory/<str:memory>/forget/", staff(forget_view), name="aotx-ops-memory-forget"),
        path("holds/", staff(holds_view), name="aotx-ops-holds"),
    ]
