"""Settings of the baseline project. The middleware stack is the gateway's (aotx_site/settings.py)
so that both systems pay the same Django framework cost per request; the difference measured is
what happens after parsing: a device round trip against one PostgreSQL insert."""
import os

import dj_database_url

SECRET_KEY = "bench-baseline-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "rest_framework",
    "bench.baseline.ledger",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
ROOT_URLCONF = "bench.baseline.urls"
ASGI_APPLICATION = "bench.baseline.asgi.application"

# Under ASGI, Django runs each request's sync view on a thread of its own, so persistent
# per-thread connections (CONN_MAX_AGE) would leak one PostgreSQL connection per request. The
# documented setup is psycopg's connection pool (Django >= 5.1, needs psycopg-pool); without
# it, a connection per request (CONN_MAX_AGE=0), which is much slower, and bench/http.py says so.
# No ATOMIC_REQUESTS: the view's single INSERT runs in autocommit, i.e. it is its own transaction,
# committed with PostgreSQL's default synchronous_commit=on before the 202 is sent. That is the
# cheapest honest durable insert; BEGIN/SAVEPOINT/COMMIT around it would only add round trips.
try:
    import psycopg_pool  # noqa: F401
    POOLED = True
except ImportError:
    POOLED = False
DATABASES = {"default": dj_database_url.parse(os.environ["BASELINE_DATABASE_URL"], conn_max_age=0)}
if POOLED:
    DATABASES["default"]["OPTIONS"] = {"pool": {"min_size": 8, "max_size": 64, "timeout": 10}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["bench.baseline.ledger.auth.BearerTokenAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "UNAUTHENTICATED_USER": None,
}
LOGGING = {"version": 1, "disable_existing_loggers": False,
           "handlers": {"console": {"class": "logging.StreamHandler"}},
           "root": {"handlers": ["console"], "level": "WARNING"}}
