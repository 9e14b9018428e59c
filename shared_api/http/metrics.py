"""/metrics (Prometheus text format, prometheus-client) and /healthz.

- Requests: RequestMetricsMiddleware counts every request Django serves and times it, labelled by
  method, URL pattern (the route, never the raw path: `aotx/v1/shared/operations/<str:operation>`)
  and status. Requests no pattern matched are `<unmatched>`, static files `<static>`. Event
  streams are answered by Channels consumers before Django (aotx_site/asgi.py) and are not among
  them: the device's `aotx_device_subscriptions` counts them.
- The device: DeviceCollector asks the device's `ping` at each scrape (a short timeout) and turns
  it into gauges, counters and the tick I/O histogram; `aotx_device_up` is 0 when it cannot be
  reached (and nothing else of the device is reported then).

Neither route needs a token: /metrics is for the local scraper and /healthz for load balancers
(README "Operations"); keep /metrics off the public listener (a proxy's allow list)."""
from __future__ import annotations

import json
import threading
import time
from bisect import bisect_left
from itertools import accumulate
from typing import TYPE_CHECKING, Any, Iterator

from django.conf import settings
from django.db import connection
from django.http import HttpResponse
from django.views.decorators.csrf import csrf_exempt
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.utils import floatToGoString

from gpu_worker.contract.wire import JSONObject

from .. import ops
from ..errors import method_not_allowed
from .middleware import HybridMiddleware

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponseBase

REGISTRY = CollectorRegistry()
METHODS = frozenset(("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"))
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

ProcessCollector(namespace="aotx_gateway", registry=REGISTRY)


def route_of(request: HttpRequest) -> str:
    match = getattr(request, "resolver_match", None)
    if match is not None and match.route:
        return str(match.route)
    if request.path_info.startswith("/" + str(settings.STATIC_URL).lstrip("/")):
        return "<static>"
    return "<unmatched>"


class RequestStats:
    """The gateway's request counter (`aotx_http_requests_total{method,route,status}`) and latency
    histogram (`aotx_http_request_duration_seconds{method,route}`), kept as plain numbers under one
    lock and made into metric families at scrape time: prometheus-client's Counter and Histogram
    take three locks and walk the buckets in Python on every request (docs/performance.md). The
    key set is bounded: methods outside METHODS are "other", routes
    are URL patterns, statuses are the gateway's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str, int], int] = {}
        # (method, route) -> [count in each bucket, count above the largest bound, sum of seconds]
        self._latency: dict[tuple[str, str], list[float]] = {}

    def record(self, method: str, route: str, status: int, seconds: float) -> None:
        key = (method, route)
        bucket = bisect_left(LATENCY_BUCKETS, seconds)  # (the first bound >= seconds: Prometheus's "le")
        with self._lock:
            counts = self._latency.get(key)
            if counts is None:
                counts = self._latency[key] = [0.0] * (len(LATENCY_BUCKETS) + 2)
            counts[bucket] += 1
            counts[-1] += seconds
            full = (method, route, status)
            self._requests[full] = self._requests.get(full, 0) + 1

    def describe(self) -> list[Metric]:
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            requests = sorted(self._requests.items())
            latency = sorted((key, list(counts)) for key, counts in self._latency.items())
        counter = CounterMetricFamily("aotx_http_requests", "HTTP requests the gateway answered, by URL pattern",
                                      labels=["method", "route", "status"])
        for (method, route, status), count in requests:
            counter.add_metric([method, route, str(status)], count)
        yield counter
        histogram = HistogramMetricFamily("aotx_http_request_duration_seconds",
                                          "Time from request to response, by URL pattern", labels=["method", "route"])
        bounds = [*(floatToGoString(bound) for bound in LATENCY_BUCKETS), "+Inf"]
        for (method, route), counts in latency:
            cumulative = list(accumulate(counts[:-1]))
            histogram.add_metric([method, route], list(zip(bounds, cumulative)), sum_value=counts[-1])
        yield histogram


STATS = RequestStats()
REGISTRY.register(STATS)


def record(method: str, route: str, status: int, started: float) -> None:
    """One answered request (the HTTP front records the shared routes with this)."""
    STATS.record(method if method in METHODS else "other", route, status, time.perf_counter() - started)


class RequestMetricsMiddleware(HybridMiddleware[float]):
    """Counts and times every request Django serves (outermost, so the time includes the other
    middleware)."""

    def before(self, request: HttpRequest) -> float:
        return time.perf_counter()

    def after(self, request: HttpRequest, response: HttpResponseBase, started: float) -> None:
        record(str(request.method), route_of(request), response.status_code, started)


def _number(value: Any) -> float | None:
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def device_metrics(status: dict[str, Any] | None) -> Iterator[Metric]:
    """The device's `ping` as metric families (`aotx_device_up` alone when status is None)."""
    up = GaugeMetricFamily("aotx_device_up", "1 when the device answered this scrape's ping, else 0")
    up.add_metric([], 1.0 if status is not None else 0.0)
    yield up
    if status is None:
        return
    usage = GaugeMetricFamily("aotx_device_table_rows", "Rows in use per device table", labels=["table"])
    for table, rows in sorted((status.get("usage") or {}).items()):
        if _number(rows) is not None:
            usage.add_metric([table], float(rows))
    yield usage
    capacity = GaugeMetricFamily("aotx_device_table_capacity",
                                 "Capacity per device table (rows; command_bytes and result_bytes: bytes a row)",
                                 labels=["table"])
    for table, rows in sorted((status.get("capacities") or {}).items()):
        if _number(rows) is not None:
            capacity.add_metric([table], float(rows))
    yield capacity
    kv = status.get("kv")
    if isinstance(kv, dict):
        pages = GaugeMetricFamily("aotx_device_kv_pages", "KV cache pages of the engine's pool by state "
                                  "(total: the pool; owned: in use; pending: needed by queued sequences)",
                                  labels=["state"])
        for state, key in (("total", "pages"), ("owned", "owned"), ("pending", "pending")):
            if _number(kv.get(key)) is not None:
                pages.add_metric([state], float(kv[key]))
        yield pages
        sequences = GaugeMetricFamily("aotx_device_kv_sequences", "Engine sequences by state", labels=["state"])
        for state in ("running", "waiting"):
            if _number(kv.get(state)) is not None:
                sequences.add_metric([state], float(kv[state]))
        yield sequences
    executions = status.get("executions")
    if isinstance(executions, dict):
        queue = GaugeMetricFamily("aotx_device_executions", "Inputs admitted and waiting for a lease (queued) "
                                  "or running", labels=["state"])
        for state in ("queued", "running"):
            if _number(executions.get(state)) is not None:
                queue.add_metric([state], float(executions[state]))
        yield queue
    ticks = status.get("ticks")
    if isinstance(ticks, dict):
        if _number(ticks.get("saved_transfers")) is not None:
            saved = CounterMetricFamily("aotx_device_saved_transfers", "Transfers saved since the device booted")
            saved.add_metric([], float(ticks["saved_transfers"]))
            yield saved
        io = ticks.get("io_seconds")
        if isinstance(io, dict) and isinstance(io.get("buckets"), dict):
            hist = HistogramMetricFamily("aotx_device_tick_io_seconds",
                                         "Each tick's journal write + fdatasync, since the device booted")
            buckets = sorted(((b, float(n)) for b, n in io["buckets"].items()),
                             key=lambda item: float("inf") if item[0] == "+Inf" else float(item[0]))
            hist.add_metric([], [(b, n) for b, n in buckets], sum_value=float(io.get("sum") or 0.0))
            yield hist
    journal = status.get("journal") or {}
    hold = GaugeMetricFamily("aotx_device_journal_hold", "1 while a journal hold pauses new mutations (429)",
                             labels=["cause"])
    hold.add_metric([str(journal.get("cause") or "")], 1.0 if journal.get("hold") else 0.0)
    yield hold
    for name, key, text in (("aotx_device_journal_bytes", "bytes", "Bytes in the journal since the last checkpoint"),
                            ("aotx_device_journal_file_cap_bytes", "file_cap_bytes",
                             "Journal size at which a file_cap hold starts"),
                            ("aotx_device_journal_pending_bytes", "pending_bytes",
                             "Journal bytes queued and not yet saved")):
        value = _number(journal.get(key))
        if value is not None:
            gauge = GaugeMetricFamily(name, text)
            gauge.add_metric([], value)
            yield gauge
    incidents = GaugeMetricFamily("aotx_device_hold_incidents", "Journal hold incidents the device keeps")
    incidents.add_metric([], float(len(status.get("hold_incidents") or [])))
    yield incidents
    if _number(status.get("runtime_file_bytes")) is not None:
        runtime = GaugeMetricFamily("aotx_device_runtime_file_bytes", "Size of the runtime file")
        runtime.add_metric([], float(status["runtime_file_bytes"]))
        yield runtime
    grants = status.get("grants") or {}
    failed = GaugeMetricFamily("aotx_device_grant_reload_failed",
                               "1 while the device refuses the current grant file (it keeps its previous grants)")
    failed.add_metric([], 1.0 if grants.get("problem") else 0.0)
    yield failed
    if _number(status.get("subscriptions")) is not None:
        streams = GaugeMetricFamily("aotx_device_subscriptions", "Open device subscriptions (event streams, chats)")
        streams.add_metric([], float(status["subscriptions"]))
        yield streams
    pipeline = status.get("pipeline")
    if isinstance(pipeline, dict) and _number(pipeline.get("stalled_seconds")) is not None:
        stalled = GaugeMetricFamily("aotx_device_stalled_seconds",
                                    "Seconds the device has had commands or replies waiting with no progress of its "
                                    "tick pipeline (0 while it moves or is idle; its watchdog logs a stall past "
                                    "boot --stall-seconds)")
        stalled.add_metric([], float(pipeline["stalled_seconds"]))
        yield stalled
    replication = pipeline.get("replication") if isinstance(pipeline, dict) else None
    if isinstance(replication, dict):
        yield from _replication_metrics(replication)
    leadership = pipeline.get("leadership") if isinstance(pipeline, dict) else None
    if isinstance(leadership, dict) and _number(leadership.get("generation")) is not None:
        generation = GaugeMetricFamily("aotx_leadership_generation",
                                       "The etcd leader key's create revision this primary holds (boot --etcd)")
        generation.add_metric([], float(leadership["generation"]))
        yield generation
        fenced = GaugeMetricFamily("aotx_leadership_fenced",
                                   "1 while this primary admits nothing: its leadership lease may have lapsed")
        fenced.add_metric([], 1.0 if leadership.get("fenced") else 0.0)
        yield fenced
    if isinstance(status.get("failovers"), list):
        failovers = GaugeMetricFamily("aotx_device_failovers",
                                      "Takeovers of this journal by a standby that became the primary (the newest "
                                      "20 the ping reports)")
        failovers.add_metric([], float(len(status["failovers"])))
        yield failovers
    for name, key, text in (("aotx_device_boot", "boot", "The device's boot counter"),
                            ("aotx_device_generation", "generation",
                             "The runtime file's generation (each checkpoint and each takeover makes the next)")):
        value = _number(status.get(key))
        if value is not None:
            gauge = GaugeMetricFamily(name, text)
            gauge.add_metric([], value)
            yield gauge


def _replication_metrics(replication: dict[str, Any]) -> Iterator[Metric]:
    """A primary's journal shipping (docs/replication.md): its standby and how far behind it is."""
    for name, value, text in (
            ("aotx_replication_standby_connected", 1.0 if replication.get("standby") else 0.0,
             "1 while a standby follows this primary's journal"),
            ("aotx_replication_sync", 1.0 if replication.get("replication") == "sync" else 0.0,
             "1 when a transfer is saved only once the standby holds it too (sync replication)"),
            ("aotx_replication_alone", 1.0 if replication.get("alone") else 0.0,
             "1 while a sync primary saves alone (no standby past --standby-timeout)"),
            ("aotx_replication_lag_transfers", _number(replication.get("lag_transfers")),
             "Journal transfers handed to this primary's disk that the standby has not acknowledged"),
            ("aotx_replication_lag_bytes", _number(replication.get("lag_bytes")),
             "Journal bytes handed to this primary's disk that the standby has not acknowledged"),
            ("aotx_replication_queued_bytes", _number(replication.get("queued_bytes")),
             "Journal bytes queued for the standby and not yet sent"),
            ("aotx_replication_standby_losses", _number(replication.get("standby_losses")),
             "Standbys that left or were dropped since the device booted"),
            ("aotx_replication_catching_up", 1.0 if replication.get("catching_up") else 0.0,
             "1 while the standby catches up from this primary's runtime file (its copy was behind)"),
            ("aotx_replication_catch_ups", _number(replication.get("catch_ups")),
             "Standbys sent a catch-up from this primary's runtime file since the device booted")):
        if value is not None:
            gauge = GaugeMetricFamily(name, text)
            gauge.add_metric([], value)
            yield gauge


class DeviceCollector:
    """The device's status, asked at scrape time."""

    def describe(self) -> list[Metric]:
        return []  # nothing at registration: describing would ping the device

    def collect(self) -> Iterator[Metric]:
        yield from device_metrics(ops.ping(settings.AOTX_METRICS_DEVICE_TIMEOUT))


REGISTRY.register(DeviceCollector())


@csrf_exempt  # no session, no form: another method answers 405, not a CSRF 403
def metrics(request: HttpRequest) -> HttpResponse:
    """GET /metrics: the gateway's request metrics and the device's status, Prometheus text."""
    if request.method not in ("GET", "HEAD"):
        return method_not_allowed(request.method or "")
    return HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE_LATEST)


@csrf_exempt
def healthz(request: HttpRequest) -> HttpResponse:
    """GET /healthz: 200 when the gateway (and its database) is up, the device answers, its tick
    pipeline is not stalled (its watchdog's reading, in the ping) and the journal is not held; 503
    otherwise, saying which."""
    if request.method not in ("GET", "HEAD"):
        return method_not_allowed(request.method or "")
    body: dict[str, str] = {}
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        body["gateway"] = "up"
    except Exception as exc:  # any database failure is what this reports
        body["gateway"] = f"database unreachable: {type(exc).__name__}"
    status = ops.ping(settings.AOTX_METRICS_DEVICE_TIMEOUT)
    if status is None:
        body["device"], body["journal"] = "unreachable", "unknown"
    else:
        pipeline = ops.json_object(status.get("pipeline"))
        body["device"] = (f"stalled ({pipeline.get('stalled_seconds')} s without progress)" if pipeline.get("stalled")
                          else "reachable")
        journal = ops.json_object(status.get("journal"))
        body["journal"] = f"held ({journal.get('cause')})" if journal.get("hold") else "not held"
    healthy = body == {"gateway": "up", "device": "reachable", "journal": "not held"}
    body["role"] = _role(status)
    return HttpResponse(json.dumps(body, sort_keys=True), status=200 if healthy else 503,
                        content_type="application/json")


def _role(status: JSONObject | None) -> str:
    """The device this gateway serves: "primary" (it admits: no leadership, or one not fenced),
    "fenced" (a primary that may have lost its leadership: it admits nothing), or "unreachable"
    (no device answers here: a standby's machine, whose device serves once it takes over)."""
    if status is None:
        return "unreachable"
    leadership = ops.json_object(ops.json_object(status.get("pipeline")).get("leadership"))
    return "fenced" if leadership.get("fenced") else "primary"


@csrf_exempt
def healthz_primary(request: HttpRequest) -> HttpResponse:
    """GET /healthz/primary: 200 only while this gateway's device is the primary that admits (as
    Patroni's `GET /primary` for a load balancer's health check: clients and proxies send their
    requests to the machine that answers 200); 503 otherwise, with the role. No token."""
    if request.method not in ("GET", "HEAD"):
        return method_not_allowed(request.method or "")
    status = ops.ping(settings.AOTX_METRICS_DEVICE_TIMEOUT)
    role = _role(status)
    body: dict[str, object] = {"role": role}
    if status is not None:
        leadership = ops.json_object(ops.json_object(status.get("pipeline")).get("leadership"))
        body["generation"] = str(leadership.get("generation", 0))
    return HttpResponse(json.dumps(body, sort_keys=True), status=200 if role == "primary" else 503,
                        content_type="application/json")
