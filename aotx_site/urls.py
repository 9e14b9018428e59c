from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularJSONAPIView

from shared_api import metrics, openai_views, ops_admin
from shared_api.views import MediaView

urlpatterns = [
    path("aotx/v1/shared/", include("shared_api.urls")),
    path("aotx/v1/media/<str:sha256>", MediaView.as_view()),
    path("aotx/v1/openapi.json", SpectacularJSONAPIView.as_view(), name="openapi"),
    *(path(route.lstrip("/"), view) for route, view in openai_views.ROUTES.items()),
    path("metrics", metrics.metrics, name="metrics"),  # Prometheus text, no token (README "Operations")
    path("healthz", metrics.healthz, name="healthz"),  # for load balancers: 200 or 503, no token
    path("admin/ops/", include(ops_admin.urls())),  # the admin's operations pages (staff users)
    path("admin/", admin.site.urls),
]
handler404 = "shared_api.errors.not_found"
handler500 = "shared_api.errors.server_error"
