from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import include, path
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.views import SpectacularJSONAPIView

from shared_api.http import metrics
from shared_api.console import pages as ops_admin
from shared_api.errors import method_not_allowed
from shared_api.routes.views import MediaView


@csrf_exempt  # no session, no form: another method answers 405, not a CSRF 403
def landing(request: HttpRequest) -> HttpResponse:
    """GET / (and HEAD): a page saying where to go next — the admin console, the API reference,
    /healthz, /metrics and a curl line for the capabilities — so that a browser pointed at the
    gateway, or the admin's "View site", finds more than a 404 (templates/aotx/landing.html)."""
    if request.method not in ("GET", "HEAD"):
        return method_not_allowed(request.method or "")
    return render(request, "aotx/landing.html",
                  {"capabilities_url": request.build_absolute_uri("/aotx/v1/shared/capabilities")})


urlpatterns = [
    path("", landing, name="landing"),  # the landing page (the admin's "View site")
    path("aotx/v1/shared/", include("shared_api.routes.urls")),
    path("aotx/v1/media/<str:sha256>", MediaView.as_view()),
    path("aotx/v1/openapi.json", SpectacularJSONAPIView.as_view(), name="openapi"),
    path("metrics", metrics.metrics, name="metrics"),  # Prometheus text, no token (README "Operations")
    path("healthz", metrics.healthz, name="healthz"),  # for load balancers: 200 or 503, no token
    path("healthz/primary", metrics.healthz_primary, name="healthz-primary"),  # 200 on the primary's machine only
    path("admin/ops/", include(ops_admin.urls())),  # the admin's operations pages (staff users)
    path("admin/", admin.site.urls),
]
handler404 = "shared_api.errors.not_found"
handler500 = "shared_api.errors.server_error"
