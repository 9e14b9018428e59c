"""Static files (the admin console's CSS and JS) are collected into STATIC_ROOT (`make setup`)
and served by the gateway through WhiteNoise (shared_api/http/middleware.py StaticFilesMiddleware),
with `Cache-Control: no-store` like every other response. The same through a real gateway process:
tests/e2e/test_static_files.py."""
import pytest
from asgiref.sync import async_to_sync
from django.core.management import call_command
from django.test import AsyncClient, Client

CSS = "/static/admin/css/base.css"


@pytest.fixture
def collected(settings, tmp_path):
    settings.STATIC_ROOT = tmp_path / "static"
    call_command("collectstatic", interactive=False, verbosity=0)
    return settings.STATIC_ROOT


def test_the_admin_css_is_served_with_a_css_type_and_no_store(collected):
    response = Client().get(CSS)
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/css")
    assert response["Cache-Control"] == "no-store"
    assert response.content == (collected / "admin" / "css" / "base.css").read_bytes()
    assert int(response["Content-Length"]) == len(response.content)
    again = Client().get(CSS, HTTP_IF_NONE_MATCH=response["ETag"])
    assert again.status_code == 304 and again["Cache-Control"] == "no-store"
    head = Client().head(CSS)
    assert head.status_code == 200 and head.content == b"" and head["Content-Type"].startswith("text/css")


def test_the_async_path_serves_it_too(collected):
    response = async_to_sync(AsyncClient().get)(CSS)  # the chain the server runs for Django
    assert response.status_code == 200 and response["Content-Type"].startswith("text/css")
    assert response["Cache-Control"] == "no-store"
    assert response.content == (collected / "admin" / "css" / "base.css").read_bytes()


@pytest.mark.parametrize("method, path", [("get", "/static/admin/css/missing.css"), ("post", CSS)])
def test_anything_else_under_static_gets_the_one_json_error_body(collected, method, path):
    response = getattr(Client(), method)(path)
    assert response.status_code in (404, 405)
    assert response["Content-Type"] == "application/json" and response["Cache-Control"] == "no-store"
    assert "error" in response.json()


def test_before_collectstatic_nothing_is_served(settings, tmp_path):
    settings.STATIC_ROOT = tmp_path / "never-collected"
    response = Client().get(CSS)
    assert response.status_code == 404 and response["Cache-Control"] == "no-store"
