"""The admin console in a real browser (headless Chromium, Debian's, driven by Playwright) on a real
gateway and device: a superuser logs in, adds a principal whose token then works against the
API, takes its grant away (403) and revokes it (401); opens each ops page and sees its charts drawn
from samples the sampling task stored; filters the receipt browser and follows a receipt to its
result bytes; fills the journal to its (small) file cap and sees the hold on every page and the
incident on the holds page, then the checkpoint task lifting it.

A screenshot of each page is kept under var/screenshots/ (CI keeps var/ as artefacts)."""
import json
import re
import secrets

import pytest
from playwright.sync_api import sync_playwright

from tests.conftest import ROOT, wait_for
from tests.e2e.test_streams import mutate, say
from tests.e2e.test_streams_browser import CHROMIUM, FLAGS
from tests.harness import Stack

pytestmark = pytest.mark.e2e
BASE = "/aotx/v1/shared"
SCREENSHOTS = ROOT / "var" / "screenshots"
FILE_CAP = 24 << 10  # journal bytes: room for the tests before the last one, which fills it
TOKEN = re.compile(r"aotx_[A-Za-z0-9_-]{43}")
PASSWORD = secrets.token_urlsafe(12)


def shell(stack, code):
    """Python in the gateway's Django (its database and gateway.json): how the tasks run here."""
    out = stack.manage("shell", "-c", code)
    return out.stdout


@pytest.fixture(scope="module")
def admin_stack(tmp_path_factory):
    from gpu_worker.pack import pack_tiny
    base = tmp_path_factory.mktemp("admin-browser")
    runtime = base / "capped.aotxccir"
    pack_tiny(str(runtime), shared=True, journal_limits={"journal_file_cap_bytes": FILE_CAP})
    stack = Stack(base, str(runtime))
    stack.manage("collectstatic", "--noinput", "-v", "0")  # the admin's CSS, as make setup leaves it
    shell(stack, f"from django.contrib.auth import get_user_model; "
                 f"get_user_model().objects.create_superuser('root', '', {PASSWORD!r})")
    stack.token = stack.principal("seed")
    stack.boot_device()
    stack.serve()
    mutate(stack, stack.token, "/participant", {})
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(30_000)
            stack.page = page
            stack.url = lambda path: f"http://127.0.0.1:{stack.port}{path}"
            yield stack
        finally:
            browser.close()
            stack.stop()


def shot(page, name):
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def api(stack, token, method="GET", path="/participant", body=None):
    status, _, out = stack.http(method, BASE + path, body, token=token)
    return status, json.loads(out) if out else None


def charts(page):
    """{slug: (data-points, drawn lines and dots)} of the page's charts."""
    return page.eval_on_selector_all(
        "figure.aotx-chart", "figs => Object.fromEntries(figs.map(f => [f.dataset.chart, "
        "[Number(f.dataset.points), f.querySelectorAll('svg .aotx-series').length]]))")


def test_a_superuser_logs_in(admin_stack):
    page = admin_stack.page
    page.goto(admin_stack.url("/admin/login/?next=/admin/"))
    shot(page, "01-login")
    page.fill("#id_username", "root")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url(re.compile(r".*/admin/$"))
    assert page.locator("#aotx-ops").is_visible()
    for link in ("Device capacity", "Receipts", "Journal holds"):
        assert page.get_by_role("link", name=link, exact=True).count() == 1
    assert page.locator("#aotx-hold").get_attribute("data-state") == "not-held"
    shot(page, "02-index")


def test_a_principal_added_in_the_admin_gets_a_token_that_works_until_it_is_revoked(admin_stack):
    page = admin_stack.page
    page.goto(admin_stack.url("/admin/shared_api/principal/add/"))
    page.fill("#id_name", "browser-made")
    for action in ("shared_read", "shared_write"):
        page.check(f"input[name=actions][value={action}]")
    shot(page, "03-principal-add")
    page.click("input[name=_save]")
    page.wait_for_url(re.compile(r".*/admin/shared_api/principal/$"))
    [token] = TOKEN.findall(page.locator("ul.messagelist").inner_text())
    shot(page, "04-principal-token-shown-once")
    # the device reads the rewritten grant file on its next tick
    wait_for(lambda: api(admin_stack, token)[0] == 200, 30, what="the new principal's token accepted")
    status, receipt = api(admin_stack, token, "POST", "/participant", {
        "schema": "aotx.shared.mutation.v1", "lineage": api(admin_stack, token)[1]["lineage"],
        "operation_key": secrets.token_hex(16), "sequence": "1"})
    assert status == 202 and receipt["kind"] == "participant.register"

    # its read grant taken away in the change form: the API answers 403
    page.locator("#result_list").get_by_role("link", name="browser-made", exact=True).click()
    page.uncheck("input[name=actions][value=shared_read]")
    page.click("input[name=_save]")
    page.wait_for_url(re.compile(r".*/admin/shared_api/principal/$"))
    status, body = api(admin_stack, token)
    assert status == 403 and body["error"]["code"] == "grant_missing"

    # revoked with the list's action: the token is refused altogether (401, "unknown or revoked token")
    page.locator("#result_list tr", has_text="browser-made").locator("input.action-select").check()
    page.select_option("select[name=action]", "revoke")
    page.click("button[name=index]")
    page.wait_for_url(re.compile(r".*/admin/shared_api/principal/$"))
    shot(page, "05-principal-revoked")
    status, body = api(admin_stack, token)
    assert status == 401 and body["error"]["code"] == "unauthenticated"
    assert api(admin_stack, admin_stack.token)[0] == 200  # the others keep working


def test_the_capacity_dashboard_draws_the_sampled_usage(admin_stack):
    stack, page = admin_stack, admin_stack.page
    shell(stack, "from shared_api.tasks import sample_capacity; sample_capacity()")
    space = mutate(stack, stack.token, "/spaces", {})["target"]
    mutate(stack, stack.token, f"/spaces/{space}/conversations", {})
    shell(stack, "from shared_api.tasks import sample_capacity; sample_capacity()")
    page.goto(stack.url("/admin/ops/capacity/"))
    drawn = charts(page)
    for slug in ("table-participants", "table-spaces", "table-conversations", "table-members", "receipt-window",
                 "storage", "executions"):
        points, lines = drawn[slug]
        assert points >= 4 and lines >= 2, (slug, drawn[slug])  # two samples, in use and capacity
    assert drawn["fdatasync-rate"][0] >= 1  # ticks happened between the two samples
    box = page.locator('figure[data-chart="receipt-window"] svg').bounding_box()
    assert box["width"] > 0 and box["height"] > 0
    live = page.locator('#aotx-live-tables tr[data-table="spaces"] td').all_inner_texts()
    assert live[:2] == ["spaces", "1"]
    assert "2 samples" in page.locator("#aotx-ranges").inner_text()
    shot(page, "06-capacity")


def test_the_receipt_browser_filters_and_leads_to_a_receipt_and_its_result(admin_stack):
    stack, page = admin_stack, admin_stack.page
    space = mutate(stack, stack.token, "/spaces", {})["target"]
    con = mutate(stack, stack.token, f"/spaces/{space}/conversations", {})["target"]
    op = say(stack, stack.token, con, "hello from the browser test")["operation"]
    wait_for(lambda: api(stack, stack.token, path=f"/operations/{op}")[1]["terminal"]["saved"], 60,
             what="the input's terminal result saved")
    page.goto(stack.url("/admin/ops/receipts/"))
    assert page.locator("#aotx-receipts tbody tr[data-kind]").count() >= 6
    shot(page, "07-receipts")

    first_rows = page.eval_on_selector_all("#aotx-receipts tbody tr[data-kind] td:first-child", "tds => tds.map(t => t.innerText)")
    page.fill("#id_limit", "2")  # paged: two a page
    page.click("#aotx-receipt-filters input[type=submit]")
    page.wait_for_url(re.compile(r".*limit=2.*"))
    page.click("#aotx-next")
    page.wait_for_url(re.compile(r".*cursor=.*"))
    second = page.eval_on_selector_all("#aotx-receipts tbody tr[data-kind] td:first-child", "tds => tds.map(t => t.innerText)")
    assert second == first_rows[2:4] and "Page 2." in page.locator("#aotx-paging").inner_text()
    page.click("#aotx-prev")
    page.wait_for_url(re.compile(r"^(?!.*cursor=).*limit=2.*"))
    page.fill("#id_limit", "50")

    participant = page.locator("#aotx-receipts tbody tr[data-kind] td").nth(1).inner_text()
    page.fill("#id_participant", participant)
    page.click("#aotx-receipt-filters input[type=submit]")
    page.wait_for_url(re.compile(r".*participant=par-.*"))
    shown = page.eval_on_selector_all("#aotx-receipts tbody tr[data-kind] td:nth-child(2)", "tds => tds.map(t => t.innerText)")
    assert shown and set(shown) == {participant}
    page.fill("#id_participant", "")

    page.select_option("#id_kind", "space.create")
    page.click("#aotx-receipt-filters input[type=submit]")
    page.wait_for_url(re.compile(r".*kind=space.create.*"))
    kinds = page.eval_on_selector_all("#aotx-receipts tbody tr[data-kind]", "rows => rows.map(r => r.dataset.kind)")
    assert kinds and set(kinds) == {"space.create"}
    shot(page, "08-receipts-filtered-kind")

    page.select_option("#id_kind", "conversation.input")
    page.select_option("#id_status", "succeeded")
    page.select_option("#id_saved", "terminal")
    page.click("#aotx-receipt-filters input[type=submit]")
    page.wait_for_url(re.compile(r".*status=succeeded.*"))
    rows = page.locator("#aotx-receipts tbody tr[data-kind]")
    assert rows.count() == 1 and rows.first.get_attribute("data-saved") == "terminal"
    shot(page, "09-receipts-filtered-input")

    page.select_option("#id_status", "failed")
    page.click("#aotx-receipt-filters input[type=submit]")
    page.wait_for_url(re.compile(r".*status=failed.*"))
    assert page.locator("#aotx-no-receipts").is_visible()
    page.select_option("#id_status", "succeeded")
    page.click("#aotx-receipt-filters input[type=submit]")
    page.wait_for_url(re.compile(r".*status=succeeded.*"))

    page.get_by_role("link", name=op, exact=True).click()
    page.wait_for_url(re.compile(rf".*/admin/ops/receipts/{op}/$"))
    for field in ("save.commit_digest", "save.source", "save.generation"):
        assert page.locator(f'table[data-section="Terminal"] tr[data-field="{field}"]').count() == 1
    assert page.locator('table[data-section="Receipt"] tr[data-field="status"] td').inner_text() == "succeeded"
    shot(page, "10-receipt")

    page.click("#aotx-result-link")
    page.wait_for_url(re.compile(r".*/result/$"))
    result = api(stack, stack.token, path=f"/operations/{op}/result")[1]
    shown = page.locator("#aotx-result-bytes")
    if result["text"] is not None:
        assert shown.get_attribute("data-shown-as") == "text" and shown.text_content() == result["text"]
    else:
        assert shown.get_attribute("data-shown-as") == "base64" and shown.text_content() == result["bytes"]
    shot(page, "11-result")


def test_a_full_journal_shows_as_a_hold_on_every_page_and_an_incident_until_a_checkpoint(admin_stack):
    stack, page = admin_stack, admin_stack.page
    for _ in range(2000):  # fill the journal to its file cap: mutations until the first 429
        me = api(stack, stack.token)[1]
        status, body = api(stack, stack.token, "POST", "/spaces", {
            "schema": "aotx.shared.mutation.v1", "lineage": me["lineage"], "operation_key": secrets.token_hex(16),
            "sequence": me["next_sequence"]})
        if status != 202:
            break
    assert status == 429 and body["error"]["code"] == "journal_hold" and body["error"]["cause"] == "file_cap"

    page.goto(stack.url("/admin/ops/holds/"))
    assert page.locator("#aotx-hold").get_attribute("data-state") == "held"
    assert page.locator("#aotx-hold-now").get_attribute("data-state") == "held"
    incident = page.locator('#aotx-incidents tr[data-cause="file_cap"]')
    assert incident.count() == 1 and incident.get_attribute("data-open") == "yes"
    shot(page, "12-holds-held")
    page.goto(stack.url("/admin/shared_api/principal/"))  # the hold shows on every admin page
    assert "Journal hold (file_cap)" in page.locator("#aotx-hold").inner_text()
    shot(page, "13-principals-during-hold")

    shell(stack, "from shared_api.tasks import detect_holds; detect_holds()")  # recorded in the database
    shell(stack, "from shared_api.tasks import sample_capacity; sample_capacity()")
    page.goto(stack.url("/admin/ops/holds/"))
    assert page.locator('#aotx-incidents tr[data-cause="file_cap"] td').nth(6).inner_text() == "yes"

    out = shell(stack, "from shared_api.tasks import checkpoint; print(checkpoint())")
    assert "'folded'" in out
    wait_for(lambda: api(stack, stack.token, "GET", "/capabilities")[1]["journal"]["hold"] is False, 30,
             what="the hold lifted by the checkpoint")
    shell(stack, "from shared_api.tasks import detect_holds; detect_holds()")
    page.goto(stack.url("/admin/ops/holds/"))
    assert page.locator("#aotx-hold").get_attribute("data-state") == "not-held"
    ended = page.locator('#aotx-incidents tr[data-cause="file_cap"]')
    assert ended.count() == 1 and ended.get_attribute("data-open") == "no"
    shot(page, "14-holds-ended")
    page.goto(stack.url("/admin/ops/capacity/"))
    assert charts(page)["storage"][0] >= 6
    shot(page, "15-capacity-after-hold")
