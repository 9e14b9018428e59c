from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularJSONAPIView

urlpatterns = [
    path("aotx/v1/shared/", include("shared_api.urls")),
    path("aotx/v1/openapi.json", SpectacularJSONAPIView.as_view(), name="openapi"),
    path("admin/", admin.site.urls),
]
handler404 = "shared_api.errors.not_found"
handler500 = "shared_api.errors.server_error"
