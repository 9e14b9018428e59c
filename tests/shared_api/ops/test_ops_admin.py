"""The admin's operations pages against the fake device: staff only, linked from the index, the
hold state on every admin page, capacity charts from stored samples with the current values, the
receipt browser's filters and paging, a receipt's save fields and result bytes, hold incidents."""
import base64
import copy
import datetime
import re

import pytest
from django.test import Client
from django.utils import timezone

from shared_api import ops
from shared_api.models import CapacitySample, HoldIncident
from tests.shared_api.ops.conftest import OLD_KEYS, PING

CAPACITY, RECEIPTS, HOLDS = "/admin/ops/capacity/", "/admin/ops/receipts/", "/admin/ops/holds/"
OP = "op-" + "a" * 32 + "-" + "b" * 32
PAR = "par-" + "c" * 32
SAVE = {"boot": "3", "commit_digest": "d" * 64, "file_incarnation": "e" * 32, "generation": "2", "source": "journal"}


def receipt(n=1, kind="conversation.input", status="succeeded", length=5):
    return {"admission": {"save": SAVE, "saved": True}, "device": {"committed": True}, "disk_error": None,
            "effective": {"max_output_tokens": "32", "model_digest": "f" * 64, "page_limit": "4",
                          "response_format_digest": None}, "journal_hold": None,
            "kind": kind,
            "operation": OP if n == 1 else f"op-{n:032x}-{n:032x}", "operation_key": f"{n:032x}",
            "participant": PAR, "pending_bytes": "0",  # counters as the device writes them: decimal strings
            "result": {"finish": "stop", "input_tokens": "3", "length": str(length), "output_tokens": "2"},
            "schema": "aotx.shared.receipt.v1", "sequence": str(n), "target": "con-" + "1" * 32 + "-" + "2" * 32,
            "terminal": {"save": SAVE, "saved": status is not None, "status": status},
            "transport": {"accepted": True}}


def charts(response):
    """{chart slug: plotted points} of a page."""
    return {slug: int(n) for slug, n in re.findall(r'data-chart="([^"]+)" data-points="(\d+)"',
                                                   response.content.decode())}


def sample_at(minutes_ago, **changes):
    status = copy.deepcopy(PING)
    for key, value in changes.items():
        status[key] = value
    sample = ops.store_sample(status)
    CapacitySample.objects.filter(pk=sample.pk).update(taken_at=timezone.now() - datetime.timedelta(minutes=minutes_ago))
    return sample


@pytest.mark.parametrize("page", [CAPACITY, RECEIPTS, HOLDS, f"{RECEIPTS}{OP}/", f"{RECEIPTS}{OP}/result/"])
def test_every_ops_page_needs_a_staff_login(db, ops_device, page):
    response = Client().get(page)
    assert response.status_code == 302 and response["Location"].startswith("/admin/login/")
    assert not ops_device.calls("ops.receipts") and not ops_device.calls("ping")


def test_the_admin_index_links_every_ops_page(staff, ops_device):
    html = staff.get("/admin/").content.decode()
    for page in (CAPACITY, RECEIPTS, HOLDS):
        assert f'href="{page}"' in html


def test_every_admin_page_shows_the_hold_state(staff, ops_device):
    page = staff.get("/admin/shared_api/principal/").content.decode()
    assert 'id="aotx-hold" data-state="not-held"' in page and "Journal: not held" in page
    since_ns = 1_700_000_000_000_000_000
    ops_device.status["journal"].update(hold=True, cause="file_cap", since_ns=since_ns)
    page = staff.get("/admin/").content.decode()
    since = datetime.datetime.fromtimestamp(since_ns / 1e9, tz=datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    assert 'data-state="held"' in page and f"Journal hold (file_cap) since {since} UTC" in page


def test_the_hold_state_says_when_the_device_is_unreachable(staff, no_device):
    page = staff.get("/admin/").content.decode()
    assert 'data-state="unreachable"' in page


def test_the_login_page_does_not_ask_the_device(db, ops_device):
    assert Client().get("/admin/login/").status_code == 200 and not ops_device.calls("ping")


def test_the_capacity_dashboard_draws_the_stored_samples_and_the_current_values(staff, ops_device):
    sample_at(30)
    later = copy.deepcopy(PING["ticks"])
    later["io_seconds"].update(count=120, sum=0.3)
    later["saved_transfers"] = 300
    sample_at(20, ticks=later, usage={**PING["usage"], "receipts": 9})
    response = staff.get(CAPACITY)
    assert response.status_code == 200
    drawn = charts(response)
    for table in ("participants", "spaces", "conversations", "members"):
        assert drawn[f"table-{table}"] == 4  # in use and capacity, two samples each
    assert drawn["receipt-window"] == 4 and drawn["kv-pages"] == 6 and drawn["storage"] == 4
    assert drawn["fdatasync-rate"] == 2 and drawn["fdatasync-latency"] == 1  # one interval between two samples
    assert "table-memory" not in drawn  # not reported
    html = response.content.decode()
    assert html.count("<polyline") >= 10 and not re.search(r'src="(https?:)?//', html)  # nothing from elsewhere
    assert re.search(r'<tr data-table="receipts"><td>receipts</td><td>5</td><td>1024</td><td>0.5 %</td></tr>', html)
    assert "2 samples in the last 24 hours" in html
    assert "40 in use, 8 queued of 512" in html  # KV pages now


def legend(html, slug):
    """The legend entries of one chart of a page, as text (tags dropped)."""
    figure = re.search(rf'<figure class="aotx-chart" data-chart="{slug}".*?</figure>', html, re.S)
    assert figure is not None, slug
    entries = re.search(r'<ul class="aotx-legend">(.*?)</ul>', figure.group(0), re.S)
    assert entries is not None, figure.group(0)
    return [re.sub(r"<[^>]+>", "", entry) for entry in re.findall(r"<li\b[^>]*>(.*?)</li>", entries.group(1))]


def utc_labels(t):
    """How a sample's time may read: its time of day, or with its date when the page was not on
    the same UTC day (a test running across midnight)."""
    t = t.astimezone(datetime.timezone.utc)
    return t.strftime("%H:%M:%S UTC"), t.strftime("%Y-%m-%d %H:%M:%S UTC")


def test_the_legends_name_the_sample_their_values_come_from_and_now_is_the_live_reading(staff, ops_device):
    """The legend's last value (a stored sample) and the Now table (the ping at page load) disagree
    when the device moved on since the sample: each says which it is, so the page explains it."""
    sample_at(30)
    newest = sample_at(20, usage={**PING["usage"], "receipts": 9})  # the live ping says 5
    taken = CapacitySample.objects.get(pk=newest.pk).taken_at
    response = staff.get(CAPACITY)
    html = response.content.decode()
    *values, when = legend(html, "receipt-window")
    assert values == ["in use: 9", "capacity: 1,024"]
    assert when in {f"(last sample {label})" for label in utc_labels(taken)}
    assert re.search(r"<h2 id=\"aotx-live-heading\">Now <span class=\"quiet\">\(the device's live reading at page "
                     r"load, \d\d:\d\d:\d\d UTC\)</span></h2>", html), html[:2000]
    assert '<tr data-table="receipts"><td>receipts</td><td>5</td>' in html  # the live reading
    assert "the live reading above is newer, so the two may differ" in html


def test_a_legend_whose_series_end_at_different_samples_labels_each_value_with_its_own_time():
    """A series whose last samples lack a value (a rate's first sample, a key the device stopped
    reporting) ends earlier than its neighbours: its value is labelled with its own sample's time,
    with the date when that is not the page's day."""
    from shared_api.console.charts import Chart, Series
    now = datetime.datetime(2025, 3, 4, 10, 45, 0, tzinfo=datetime.timezone.utc)
    earlier, later = now - datetime.timedelta(days=1, minutes=3), now - datetime.timedelta(minutes=3)
    chart = Chart("c", "c", [Series("a", [(earlier, 1.0), (later, 2.0)]), Series("b", [(earlier, 5.0), (later, None)])],
                  now=now)
    assert legend(chart.svg(), "c") == ["a: 2 (last sample 10:42:00 UTC)", "b: 5 (last sample 2025-03-03 10:42:00 UTC)"]


def test_the_fdatasync_rate_is_the_difference_of_two_samples_over_their_time(staff, ops_device):
    sample_at(2)
    later = copy.deepcopy(PING["ticks"])
    later["io_seconds"]["count"] += 120  # 120 more ticks in 60 s: 2 a second
    sample_at(1, ticks=later)
    points = ops_admin_rate()
    assert points == [pytest.approx(2.0, rel=0.01)]


def ops_admin_rate():
    from shared_api.console.pages import _rate
    samples = list(CapacitySample.objects.order_by("taken_at"))
    return [v for _, v in _rate(samples, lambda s: s.fdatasyncs) if v is not None]


def test_a_rate_is_not_drawn_across_a_device_restart(staff, ops_device):
    sample_at(2)
    sample_at(1, boot="4")
    assert ops_admin_rate() == []


def test_memory_is_drawn_once_the_device_reports_it_and_kv_may_be_absent(staff, ops_device):
    sample_at(5, usage={**PING["usage"], "memory": 7}, capacities={**PING["capacities"], "memory": 100}, kv=None)
    for key in OLD_KEYS:
        del ops_device.status[key]
    response = staff.get(CAPACITY)
    drawn = charts(response)
    assert drawn["table-memory"] == 2 and drawn["kv-pages"] == 0
    assert "no KV pool" in response.content.decode() and "no engine running" in response.content.decode()


def test_the_dashboard_without_samples_or_device_still_renders(staff, no_device):
    response = staff.get(CAPACITY)
    assert response.status_code == 200 and set(charts(response).values()) == {0}
    assert 'id="aotx-live-unreachable"' in response.content.decode()


def test_old_samples_are_dropped_past_the_retention(staff, ops_device, settings):
    settings.AOTX_SAMPLE_RETENTION_DAYS = 1
    old = sample_at(0)
    CapacitySample.objects.filter(pk=old.pk).update(taken_at=timezone.now() - datetime.timedelta(days=2))
    ops.store_sample(PING)
    assert CapacitySample.objects.count() == 1


def test_the_receipt_browser_passes_its_filters_and_pages_with_the_cursor(staff, ops_device):
    ops_device.ops["ops.receipts"] = lambda args: (200, {"items": [receipt(1), receipt(2, kind="space.create",
                                                                                      length=0)],
                                                        "next_cursor": "17" if "cursor" not in args else None})
    response = staff.get(RECEIPTS, {"participant": PAR, "kind": "conversation.input", "status": "succeeded",
                                    "saved": "terminal", "limit": "2"})
    assert response.status_code == 200
    assert ops_device.calls("ops.receipts")[-1] == {"participant": PAR, "kind": "conversation.input",
                                                    "status": "succeeded", "saved": "terminal", "limit": 2}
    html = response.content.decode()
    assert f'href="{RECEIPTS}{OP}/"' in html and html.count('data-kind="') == 2
    [next_url] = re.findall(r'href="(\?[^"]+)" id="aotx-next"', html)
    page2 = staff.get(RECEIPTS + next_url.replace("&amp;", "&"))
    assert ops_device.calls("ops.receipts")[-1]["cursor"] == "17"
    assert ops_device.calls("ops.receipts")[-1]["participant"] == PAR
    html2 = page2.content.decode()
    assert 'id="aotx-next"' not in html2 and 'id="aotx-prev"' in html2 and "Page 2." in html2
    [prev_url] = re.findall(r'href="(\?[^"]+)" id="aotx-prev"', html2)
    staff.get(RECEIPTS + prev_url.replace("&amp;", "&"))
    assert "cursor" not in ops_device.calls("ops.receipts")[-1]


def test_an_unfiltered_receipt_browser_asks_for_a_page_of_everything(staff, ops_device):
    ops_device.ops["ops.receipts"] = lambda args: (200, {"items": [], "next_cursor": None})
    html = staff.get(RECEIPTS).content.decode()
    assert ops_device.calls("ops.receipts") == [{}] and "No live receipts." in html  # limit 50, the default, left out


def test_a_bad_filter_is_refused_before_the_device_is_asked(staff, ops_device):
    response = staff.get(RECEIPTS, {"participant": "par-nothex", "status": "bogus"})
    assert response.status_code == 200 and response.context["form"].errors
    assert not ops_device.calls("ops.receipts")


def test_the_receipt_browser_says_what_the_device_answered(staff, ops_device):
    ops_device.ops["ops.receipts"] = lambda args: (400, {"error": {"code": "bad_field", "message": "nope"}})
    assert "400 bad_field: nope" in staff.get(RECEIPTS).content.decode()


def test_the_receipt_browser_without_a_device_says_so(staff, no_device):
    html = staff.get(RECEIPTS).content.decode()
    assert 'id="aotx-device-error"' in html and "device_unavailable" in html


def test_a_receipt_shows_its_save_fields_and_links_its_result(staff, ops_device):
    ops_device.ops["ops.receipt"] = lambda args: (200, receipt(1)) if args == {"operation": OP} else \
        (404, {"error": {"code": "operation_not_found", "message": "no"}})
    html = staff.get(f"{RECEIPTS}{OP}/").content.decode()
    for field in ("save.commit_digest", "save.generation", "save.source", "save.boot", "save.file_incarnation"):
        assert f'data-field="{field}"' in html
    assert "d" * 64 in html and f'href="{RECEIPTS}{OP}/result/" id="aotx-result-link"' in html
    assert "bad_id" in staff.get(f"{RECEIPTS}op-x/").content.decode()  # refused before it is sent


def test_a_receipt_without_result_bytes_has_no_result_link(staff, ops_device):
    ops_device.ops["ops.receipt"] = lambda args: (200, receipt(1, kind="space.create", length=0))
    assert 'id="aotx-result-link"' not in staff.get(f"{RECEIPTS}{OP}/").content.decode()


def result_body(data, offset=0):
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    return {"operation": OP, "offset": str(offset), "length": str(len(data)), "next_offset": str(offset + len(data)),
            "bytes": base64.b64encode(data).decode(), "text": text, "complete": True, "status": "succeeded",
            "finish": "stop", "input_tokens": "3", "output_tokens": "2"}


def test_a_result_is_shown_as_text_when_it_is_utf8_else_as_base64(staff, ops_device):
    ops_device.ops["ops.result"] = lambda args: (200, result_body("héllo <b>".encode()))
    html = staff.get(f"{RECEIPTS}{OP}/result/").content.decode()
    assert ops_device.calls("ops.result") == [{"operation": OP}]  # offset 0, the default, is left out
    assert 'data-shown-as="text">\nhéllo &lt;b&gt;</pre>' in html
    ops_device.ops["ops.result"] = lambda args: (200, result_body(b"\xff\xfe", offset=args["offset"]))
    html = staff.get(f"{RECEIPTS}{OP}/result/", {"offset": "2"}).content.decode()
    assert ops_device.calls("ops.result")[-1] == {"operation": OP, "offset": 2}
    assert 'data-shown-as="base64">\n//4=</pre>' in html


def test_the_holds_page_lists_recorded_and_device_incidents_newest_first(staff, ops_device):
    HoldIncident.objects.create(since_ns=1_000_000_000_000_000_000, ended_ns=1_000_000_005_000_000_000,
                                cause="low_disk", pending_bytes=0)
    ops_device.status["hold_incidents"] = [
        {"cause": "low_disk", "since_ns": 1_000_000_000_000_000_000, "ended_ns": 1_000_000_005_000_000_000,
         "disk_error": None, "pending_bytes": 0},
        {"cause": "file_cap", "since_ns": 1_700_000_000_000_000_000, "ended_ns": None, "disk_error": None,
         "pending_bytes": 321}]
    ops_device.status["journal"].update(hold=True, cause="file_cap", since_ns="1700000000000000000")  # as the device writes it
    html = staff.get(HOLDS).content.decode()
    rows = re.findall(r'<tr data-cause="(\w+)" data-open="(\w+)">', html)
    assert rows == [("file_cap", "yes"), ("low_disk", "no")]
    assert "321" in html and "5.0 s" in html and "not yet (the hold detection task records it)" in html
    assert 'id="aotx-hold-now" data-state="held"' in html


def test_the_holds_page_without_incidents(staff, ops_device):
    assert 'id="aotx-no-incidents"' in staff.get(HOLDS).content.decode()


def test_the_live_reading_shows_the_primarys_standby_or_its_absence(staff, ops_device):
    assert "<th scope=\"row\">replication</th><td>none (no standby configured)</td>" in staff.get(CAPACITY).content.decode()
    ops_device.status["pipeline"]["replication"] = {
        "role": "primary", "replication": "sync", "alone": False, "address": "/run/r.sock", "standby": "b:7001",
        "acked_position": [1, 4096], "acked_seq": 40, "last_seq": 43, "lag_transfers": 3, "lag_bytes": 900, "queued_bytes": 512,
        "standbys": 2, "standby_losses": 1}
    html = staff.get(CAPACITY).content.decode()
    assert ("primary, sync: standby b:7001 acknowledged through transfer 40, 3 transfers (900 bytes) behind, "
            "512 bytes queued for it; 1 standby losses since boot") in html
    ops_device.status["pipeline"]["replication"].update(catching_up=True)
    html = staff.get(CAPACITY).content.decode()
    assert "primary, sync: standby b:7001 CATCHING UP from this primary&#x27;s runtime file" in html
    ops_device.status["pipeline"]["replication"].update(standby=None, catching_up=False)
    html = staff.get(CAPACITY).content.decode()
    assert "primary, sync: NO STANDBY — holding: nothing is answered saved until a standby holds it" in html


def test_the_holds_page_lists_the_devices_failovers_newest_first(staff, ops_device):
    html = staff.get(HOLDS).content.decode()
    assert 'id="aotx-no-failovers"' in html
    ops_device.status["failovers"] = [
        {"boot": 3, "at_ns": 1_700_000_000_000_000_000, "position": [1, 4096], "generation": None},
        {"boot": 5, "at_ns": 1_700_000_100_000_000_000, "position": [2, 96], "generation": 41, "file_generation": 7}]
    html = staff.get(HOLDS).content.decode()
    rows = re.findall(r'<tr data-boot="(\d+)"><td>([^<]+)</td><td>\d+</td><td>([^<]+)</td><td>([^<]+)</td>'
                      r'<td>([^<]+)</td></tr>', html)
    assert rows == [("5", "2023-11-14 22:15:00", "segment 2, offset 96", "7", "41"),
                    ("3", "2023-11-14 22:13:20", "segment 1, offset 4096", "-", "- (no etcd)")]
