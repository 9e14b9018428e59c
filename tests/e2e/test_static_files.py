"""The admin console's static files through a real gateway process (granian), as `make setup`
leaves them: collected into STATIC_ROOT (var/static), served with a CSS content type and, like
every response, `Cache-Control: no-store`."""
import pytest

from tests.harness import Stack

pytestmark = pytest.mark.e2e


def test_the_gateway_serves_the_admin_css_it_collected(tiny_runtime, tmp_path):
    stack = Stack(tmp_path, tiny_runtime)
    try:
        stack.manage("collectstatic", "--noinput", "-v", "0")  # what make setup runs
        stack.serve()
        status, headers, body = stack.http("GET", "/static/admin/css/base.css")
        assert status == 200, body[:300]
        assert headers["Content-Type"].startswith("text/css")
        assert headers["Cache-Control"] == "no-store"
        assert body == (tmp_path / "var" / "static" / "admin" / "css" / "base.css").read_bytes()
        status, headers, _ = stack.http("GET", "/admin/login/")
        assert status == 200 and headers["Cache-Control"] == "no-store"
        assert b"/static/admin/css/base.css" in stack.http("GET", "/admin/login/")[2]
        status, headers, _ = stack.http("GET", "/aotx/v1/shared/capabilities")
        assert status == 401 and headers["Cache-Control"] == "no-store"
        status, headers, body = stack.http("GET", "/static/admin/css/nothing-here.css")
        assert status == 404 and headers["Content-Type"] == "application/json"
        assert headers["Cache-Control"] == "no-store"
    finally:
        stack.stop()
