"""/metrics and /healthz on a real gateway in front of a real device: the device's tables and
tick counters as the scraper sees them, requests by URL pattern, and both answering (without a
token) when the device has gone."""
import json
import signal

from prometheus_client.parser import text_string_to_metric_families
import pytest

from tests.e2e.test_streams import mutate
from tests.harness import Stack

pytestmark = pytest.mark.e2e


def scrape(stack):
    status, headers, body = stack.http("GET", "/metrics")
    assert status == 200 and headers["Cache-Control"] == "no-store"
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def test_metrics_and_healthz_follow_the_device(tiny_runtime, tmp_path):
    stack = Stack(tmp_path, tiny_runtime)
    try:
        token = stack.principal("ops")
        stack.boot_device()
        stack.serve()
        mutate(stack, token, "/participant", {})
        mutate(stack, token, "/spaces", {})
        m = scrape(stack)
        assert m[("aotx_device_up", ())] == 1
        assert m[("aotx_device_table_rows", (("table", "participants"),))] == 1
        assert m[("aotx_device_table_rows", (("table", "spaces"),))] == 1
        assert m[("aotx_device_table_capacity", (("table", "receipts"),))] > 0
        assert m[("aotx_device_journal_hold", (("cause", ""),))] == 0
        post = (("method", "POST"), ("route", "aotx/v1/shared/spaces"), ("status", "202"))
        assert m[("aotx_http_requests_total", post)] == 1
        if ("aotx_device_saved_transfers_total", ()) in m:  # the device's tick counters, once it reports them
            assert m[("aotx_device_saved_transfers_total", ())] >= 3
            assert m[("aotx_device_tick_io_seconds_count", ())] >= 1
        status, headers, body = stack.http("GET", "/healthz")
        assert status == 200 and headers["Cache-Control"] == "no-store"
        assert json.loads(body) == {"gateway": "up", "device": "reachable", "journal": "not held", "role": "primary"}

        stack.device.kill(signal.SIGTERM)
        status, _, body = stack.http("GET", "/healthz")
        assert status == 503 and json.loads(body) == {"gateway": "up", "device": "unreachable", "journal": "unknown",
                                                      "role": "unreachable"}
        m = scrape(stack)
        assert m[("aotx_device_up", ())] == 0 and not [k for k in m if k[0] == "aotx_device_table_rows"]
    finally:
        stack.stop()
