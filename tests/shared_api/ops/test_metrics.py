"""/metrics (Prometheus text) and /healthz: the gateway's requests by URL pattern, the device's
status collected from its ping at scrape time, no token, no caching."""
import pytest
from asgiref.sync import async_to_sync
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from tests.shared_api.ops.conftest import OLD_KEYS
from tests.shared_api.views.conftest import rsgi_request

pytestmark = pytest.mark.django_db


def scrape(client=None):
    response = (client or Client()).get("/metrics")
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    assert response["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))))


def test_metrics_report_the_devices_status_from_its_ping(ops_device):
    ops_device.status["grants"]["problem"] = "principal x: actions must be a subset"
    m = scrape()
    assert value(m, "aotx_device_up") == 1
    assert value(m, "aotx_device_table_rows", table="receipts") == 5
    assert value(m, "aotx_device_table_capacity", table="receipts") == 1024
    assert value(m, "aotx_device_table_rows", table="participants") == 2
    assert value(m, "aotx_device_kv_pages", state="total") == 512
    assert value(m, "aotx_device_kv_pages", state="owned") == 40
    assert value(m, "aotx_device_kv_pages", state="pending") == 8
    assert value(m, "aotx_device_kv_sequences", state="waiting") == 1
    assert value(m, "aotx_device_executions", state="queued") == 1
    assert value(m, "aotx_device_executions", state="running") == 2
    assert value(m, "aotx_device_saved_transfers_total") == 120
    assert value(m, "aotx_device_tick_io_seconds_bucket", le="0.001") == 30
    assert value(m, "aotx_device_tick_io_seconds_bucket", le="+Inf") == 60
    assert value(m, "aotx_device_tick_io_seconds_count") == 60
    assert value(m, "aotx_device_tick_io_seconds_sum") == pytest.approx(0.12)
    assert value(m, "aotx_device_journal_hold", cause="") == 0
    assert value(m, "aotx_device_journal_bytes") == 4096
    assert value(m, "aotx_device_grant_reload_failed") == 1
    assert value(m, "aotx_device_subscriptions") == 3
    assert value(m, "aotx_device_runtime_file_bytes") == 468428
    assert value(m, "aotx_device_stalled_seconds") == 0
    assert ops_device.calls("ping")  # asked at scrape time


def test_a_hold_shows_with_its_cause(ops_device):
    ops_device.status["journal"].update(hold=True, cause="file_cap", since_ns=1)
    assert value(scrape(), "aotx_device_journal_hold", cause="file_cap") == 1


def test_a_ping_without_the_newer_fields_still_scrapes(ops_device):
    for key in OLD_KEYS:
        del ops_device.status[key]
    m = scrape()
    assert value(m, "aotx_device_up") == 1 and value(m, "aotx_device_table_rows", table="spaces") == 1
    assert not [k for k in m if k[0].startswith(("aotx_device_kv", "aotx_device_tick_io", "aotx_device_executions"))]


def test_an_unreachable_device_is_up_0_and_nothing_else_of_it(no_device):
    m = scrape()
    assert value(m, "aotx_device_up") == 0
    assert [k for k in m if k[0].startswith("aotx_device_")] == [("aotx_device_up", ())]


def test_a_device_that_hangs_up_is_up_0(ops_device):
    ops_device.status = None
    assert value(scrape(), "aotx_device_up") == 0


def test_requests_are_counted_and_timed_by_url_pattern_not_path(ops_device):
    """Through the gateway's application, as the server runs it: the front counts the shared
    routes it answers, Django's middleware the rest."""
    client = Client()
    before = scrape(client)
    for n in range(3):  # 401: no token
        response = async_to_sync(rsgi_request)("GET", f"/aotx/v1/shared/operations/op-{n:032x}-{n:032x}", [], b"")
        assert response.status_code == 401
    assert async_to_sync(rsgi_request)("GET", "/no/such/route", [], b"").status_code == 404
    after = scrape(client)
    route = "aotx/v1/shared/operations/<str:operation>"
    key = dict(method="GET", route=route, status="401")
    assert (value(after, "aotx_http_requests_total", **key) or 0) - (value(before, "aotx_http_requests_total", **key)
                                                                      or 0) == 3
    assert (value(after, "aotx_http_request_duration_seconds_count", method="GET", route=route) or 0) - \
           (value(before, "aotx_http_request_duration_seconds_count", method="GET", route=route) or 0) == 3
    assert value(after, "aotx_http_requests_total", method="GET", route="<unmatched>", status="404") >= 1
    assert not [k for k in after if any("op-0" in v for _, v in k[1])]  # no raw path in any label
    assert value(after, "aotx_http_requests_total", method="GET", route="metrics", status="200") >= 1


def test_healthz_is_200_when_the_gateway_device_and_journal_are_fine(ops_device):
    response = Client().get("/healthz")
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    assert response.json() == {"gateway": "up", "device": "reachable", "journal": "not held", "role": "primary"}


def test_healthz_is_503_and_says_the_journal_is_held(ops_device):
    ops_device.status["journal"].update(hold=True, cause="low_disk", since_ns=1)
    response = Client().get("/healthz")
    assert response.status_code == 503
    assert response.json() == {"gateway": "up", "device": "reachable", "journal": "held (low_disk)", "role": "primary"}


def test_a_stalled_pipeline_is_exported_and_makes_healthz_503(ops_device):
    ops_device.status["pipeline"].update(stalled_seconds=12.5, stalled=True, inbox=3)
    assert value(scrape(), "aotx_device_stalled_seconds") == 12.5
    response = Client().get("/healthz")
    assert response.status_code == 503
    assert response.json() == {"gateway": "up", "device": "stalled (12.5 s without progress)", "journal": "not held",
                               "role": "primary"}


def test_healthz_is_503_when_the_device_is_unreachable(no_device):
    response = Client().get("/healthz")
    assert response.status_code == 503 and response["Cache-Control"] == "no-store"
    assert response.json() == {"gateway": "up", "device": "unreachable", "journal": "unknown", "role": "unreachable"}


def test_healthz_primary_answers_200_only_on_the_machine_whose_device_admits(ops_device):
    """Issue 52 (8): a load balancer or a client sends its requests where the primary is."""
    client = Client()
    response = client.get("/healthz/primary")
    assert response.status_code == 200 and response.json() == {"role": "primary", "generation": "0"}
    ops_device.status["pipeline"]["leadership"] = {"generation": 17, "fenced": None}
    assert client.get("/healthz/primary").json() == {"role": "primary", "generation": "17"}
    ops_device.status["pipeline"]["leadership"] = {"generation": 17, "fenced": "the leader key was deleted"}
    response = client.get("/healthz/primary")
    assert response.status_code == 503 and response.json()["role"] == "fenced"
    assert client.get("/healthz").json()["role"] == "fenced"


def test_healthz_primary_is_503_where_no_device_answers(no_device):
    response = Client().get("/healthz/primary")
    assert response.status_code == 503 and response.json() == {"role": "unreachable"}


def test_metrics_and_healthz_need_no_token_and_refuse_other_methods(ops_device):
    client = Client()
    assert client.get("/metrics").status_code == 200
    assert client.post("/metrics").status_code == 405 and client.post("/healthz").status_code == 405


def test_a_primarys_replication_is_exported(ops_device):
    """The ping's replication section (gpu_worker/replication/primary.py Shipper.state) as gauges."""
    ops_device.status["pipeline"]["replication"] = {
        "role": "primary", "replication": "sync", "alone": False, "address": "/run/r.sock", "standby": "b:7001",
        "acked_position": [1, 4096], "acked_seq": 40, "last_seq": 43, "lag_transfers": 3, "lag_bytes": 900, "queued_bytes": 512,
        "catching_up": False, "catch_ups": 4, "standbys": 2, "standby_losses": 1}
    m = scrape()
    assert value(m, "aotx_replication_standby_connected") == 1 and value(m, "aotx_replication_sync") == 1
    assert value(m, "aotx_replication_catching_up") == 0 and value(m, "aotx_replication_catch_ups") == 4
    assert value(m, "aotx_replication_alone") == 0 and value(m, "aotx_replication_lag_transfers") == 3
    assert value(m, "aotx_replication_queued_bytes") == 512 and value(m, "aotx_replication_lag_bytes") == 900 and value(m, "aotx_replication_standby_losses") == 1
    ops_device.status["pipeline"]["replication"].update(catching_up=True)
    assert value(scrape(), "aotx_replication_catching_up") == 1
    ops_device.status["pipeline"]["replication"].update(standby=None, alone=True, catching_up=False)
    m = scrape()
    assert value(m, "aotx_replication_standby_connected") == 0 and value(m, "aotx_replication_alone") == 1


def test_no_replication_gauges_without_replication(ops_device):
    assert not [name for name, _ in scrape() if name.startswith("aotx_replication_")]


def test_leadership_and_failovers_are_exported(ops_device):
    ops_device.status["pipeline"]["leadership"] = {"generation": 41, "lease_seconds": 3, "fenced": None,
                                                   "trusted_for": 1.5}
    ops_device.status["failovers"] = [{"boot": 5, "at_ns": 1, "position": [2, 96], "generation": 41}]
    m = scrape()
    assert value(m, "aotx_leadership_generation") == 41 and value(m, "aotx_leadership_fenced") == 0
    assert value(m, "aotx_device_failovers") == 1
    ops_device.status["pipeline"]["leadership"]["fenced"] = "the leadership lease was not renewed in time"
    assert value(scrape(), "aotx_leadership_fenced") == 1
