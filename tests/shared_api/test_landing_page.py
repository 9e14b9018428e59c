"""The gateway's landing page, GET / (aotx_site/urls.py `landing`, templates/aotx/landing.html):
a browser pointed at the gateway, or the admin's "View site" link, used to get a raw JSON 404.
It goes through the HTTP front as the server runs it (the front hands `/` to Django behind its
guard), needs no token and no device, carries `Cache-Control: no-store` like every response, and
answers GET and HEAD only. The same through a real gateway process: tests/e2e/test_readme_mutation.py."""
import html as html_text
import json
import re

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth import get_user_model
from django.test import Client

from shared_api import device_client
from tests.shared_api.views.conftest import rsgi_request

LINKS = ("/admin/", "/aotx/v1/openapi.json", "/healthz", "/metrics")


@pytest.fixture
def unserved_device(settings, tmp_path):
    """The gateway pointed at a socket nobody serves: the landing page must not need the device."""
    config = tmp_path / "gateway.json"
    config.write_text(json.dumps({"listen": "127.0.0.1:8000", "socket": str(tmp_path / "absent.sock"),
                                  "grants_file": str(tmp_path / "grants.json")}))
    settings.AOTX_GATEWAY_CONFIG = str(config)
    settings.AOTX_METRICS_DEVICE_TIMEOUT = 0.5
    device_client.reset()
    yield
    device_client.reset()


def front(method, path="/", headers=()):
    """One request through the gateway's application (the front, then Django)."""
    return async_to_sync(rsgi_request)(method, path, [(b"host", b"testserver"), *headers], b"")


def test_get_slash_answers_an_html_page_linking_the_admin_the_api_reference_health_and_metrics(db, unserved_device):
    response = front("GET")
    assert response.status_code == 200, response.content[:300]
    assert response["Content-Type"].startswith("text/html")
    assert response["Cache-Control"] == "no-store"
    html = response.content.decode()
    assert '<h1 id="aotx-service">AOTX Shared</h1>' in html
    hrefs = re.findall(r'href="([^"]+)"', html)
    assert all(link in hrefs for link in LINKS), hrefs
    assert "docs/api.md" in html  # the prose reference, in the repository


def test_the_landing_page_shows_a_curl_line_for_the_capabilities_on_the_host_it_was_asked_on(db, unserved_device):
    html = front("GET").content.decode()
    curl = re.search(r'<pre id="aotx-curl">([^<]*)</pre>', html)
    assert curl is not None, html
    assert html_text.unescape(curl.group(1)) == (
        'curl -H "Authorization: Bearer $TOKEN" http://testserver/aotx/v1/shared/capabilities')


def test_the_landing_page_runs_no_script_and_loads_nothing_from_elsewhere(db, unserved_device):
    html = front("GET").content.decode().lower()
    assert "<script" not in html and " on" + "load=" not in html
    assert not re.search(r'(src|href)="(https?:)?//', html)


def test_head_slash_answers_200_with_the_page_headers(db, unserved_device):
    response = front("HEAD")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/html") and response["Cache-Control"] == "no-store"
    assert Client().head("/").content == b""  # (the server drops a HEAD answer's body; Django's client too)


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
def test_another_method_on_slash_is_refused_405_with_the_one_error_body(db, unserved_device, method):
    response = front(method, headers=[(b"content-length", b"0")])
    assert response.status_code == 405
    assert response["Allow"] == "GET, HEAD"
    assert response["Content-Type"] == "application/json" and response["Cache-Control"] == "no-store"
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_a_path_that_is_not_slash_still_answers_the_json_404(db, unserved_device):
    response = front("GET", "/nothing-here")
    assert response.status_code == 404 and response["Content-Type"] == "application/json"
    assert response.json()["error"]["code"] == "not_found"


def test_the_admins_view_site_link_points_to_the_landing_page(db, unserved_device):
    get_user_model().objects.create_superuser("root", "", "pw")
    staff = Client()
    staff.login(username="root", password="pw")
    html = staff.get("/admin/").content.decode()
    assert '<a href="/">View site</a>' in html
