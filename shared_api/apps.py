from django.apps import AppConfig


class SharedApiConfig(AppConfig):
    name = "shared_api"
    verbose_name = "AOTX Shared"
