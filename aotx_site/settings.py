"""Gateway settings. Embedded default: SQLite under var/, in-process channel layer, a
filesystem Celery broker. Production: DATABASE_URL (PostgreSQL) and REDIS_URL (Celery broker,
result backend and channels_redis layer)."""
import os
import secrets
from pathlib import Path

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("AOTX_VAR_DIR", BASE_DIR / "var"))
# What the gateway, its commands and Celery create under VAR_DIR is their user's alone (0600 files,
# 0700 directories): manage.py and Celery (aotx_site/celery.py) set umask 0o077, and what may be
# made before that (this module is read first) says its mode itself.
PRIVATE_DIR = 0o700
VAR_DIR.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)


def _secret_key():
    if os.environ.get("DJANGO_SECRET_KEY"):
        return os.environ["DJANGO_SECRET_KEY"]
    path = VAR_DIR / "secret_key"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(50))
    return path.read_text().strip()


SECRET_KEY = _secret_key()
DEBUG = os.environ.get("AOTX_DEBUG") == "1"
# The hosts the gateway answers to, on every route (the API's included: shared_api/http/front.py
# applies them before anything else, and adds the address it listens on when that names one)
ALLOWED_HOSTS = os.environ.get("AOTX_ALLOWED_HOSTS", "127.0.0.1,localhost,[::1],testserver").split(",")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "channels",
    "shared_api",
]

MIDDLEWARE = [
    "shared_api.http.metrics.RequestMetricsMiddleware",  # outermost: /metrics times the whole request
    "shared_api.http.middleware.NoStoreMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "shared_api.http.middleware.StaticFilesMiddleware",  # STATIC_ROOT (collectstatic) through WhiteNoise
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "aotx_site.urls"
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "DIRS": [BASE_DIR / "templates"],
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
        "shared_api.console.context_processors.journal_hold",  # the hold state on every admin page
    ]},
}]
ASGI_APPLICATION = "aotx_site.asgi.application"
WSGI_APPLICATION = None

DATABASES = {"default": dj_database_url.parse(
    os.environ.get("DATABASE_URL", f"sqlite:///{VAR_DIR / 'gateway.sqlite3'}"), conn_max_age=60)}
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # Under ASGI each request's sync code runs on a fresh thread, so persistent connections would
    # mean one new PostgreSQL connection per request: use psycopg's pool instead.
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    DATABASES["default"]["OPTIONS"] = {"pool": {"min_size": 2, "max_size": 32, "timeout": 10}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"  # collectstatic (make setup); served by shared_api.http.middleware.StaticFilesMiddleware
# Django's storage would chmod what it writes (the static files) 0644 whatever the umask: the
# gateway serves them itself, so they stay private like the rest of VAR_DIR
FILE_UPLOAD_PERMISSIONS = 0o600
FILE_UPLOAD_DIRECTORY_PERMISSIONS = PRIVATE_DIR

REDIS_URL = os.environ.get("REDIS_URL")
if REDIS_URL:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                                  "CONFIG": {"hosts": [REDIS_URL]}}}
    CELERY_BROKER_URL = REDIS_URL
    CELERY_RESULT_BACKEND: str | None = REDIS_URL
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    _broker = VAR_DIR / "celery"
    for _dir in (_broker, _broker / "out", _broker / "processed", _broker / "control"):
        _dir.mkdir(mode=PRIVATE_DIR, exist_ok=True)
    import aotx_site.broker  # noqa: F401  (registers the transport: kombu's filesystem one, messages written whole)
    CELERY_BROKER_URL = "aotx-filesystem://"
    CELERY_BROKER_TRANSPORT_OPTIONS = {"data_folder_in": str(_broker / "out"),
                                       "data_folder_out": str(_broker / "out"),
                                       "processed_folder": str(_broker / "processed"),
                                       "control_folder": str(_broker / "control")}
    CELERY_RESULT_BACKEND = None

# Ops tasks (shared_api/tasks.py) and how often beat runs them, in seconds.
AOTX_SAMPLE_INTERVAL = float(os.environ.get("AOTX_SAMPLE_INTERVAL", "60"))
AOTX_HOLD_CHECK_INTERVAL = float(os.environ.get("AOTX_HOLD_CHECK_INTERVAL", "15"))
AOTX_CHECKPOINT_INTERVAL = float(os.environ.get("AOTX_CHECKPOINT_INTERVAL", "3600"))
AOTX_AUDIT_EXPORT_INTERVAL = float(os.environ.get("AOTX_AUDIT_EXPORT_INTERVAL", "86400"))
AOTX_SAMPLE_RETENTION_DAYS = float(os.environ.get("AOTX_SAMPLE_RETENTION_DAYS", "30"))
AOTX_OPS_TIMEOUT = float(os.environ.get("AOTX_OPS_TIMEOUT", "600"))  # checkpoint and audit export replies
AOTX_OPS_START_WAIT = float(os.environ.get("AOTX_OPS_START_WAIT", "300"))  # beat's wait for the device at start
AOTX_METRICS_DEVICE_TIMEOUT = float(os.environ.get("AOTX_METRICS_DEVICE_TIMEOUT", "2"))  # /metrics, /healthz
AOTX_AUDIT_DIR = Path(os.environ.get("AOTX_AUDIT_DIR", VAR_DIR / "audit"))  # audit exports (the device writes them)
CELERY_BEAT_SCHEDULE = {
    "sample-capacity": {"task": "shared_api.tasks.sample_capacity", "schedule": AOTX_SAMPLE_INTERVAL},
    "detect-holds": {"task": "shared_api.tasks.detect_holds", "schedule": AOTX_HOLD_CHECK_INTERVAL},
    "checkpoint": {"task": "shared_api.tasks.checkpoint", "schedule": AOTX_CHECKPOINT_INTERVAL},
    "audit-export": {"task": "shared_api.tasks.export_audit", "schedule": AOTX_AUDIT_EXPORT_INTERVAL},
}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["shared_api.http.auth.BearerAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PARSER_CLASSES": ["shared_api.routes.strict.StrictJSONParser"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "EXCEPTION_HANDLER": "shared_api.errors.exception_handler",
    "UNAUTHENTICATED_USER": None,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "AOTX Shared",
    "VERSION": "1",
    "OAS_VERSION": "3.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
    "SERVE_AUTHENTICATION": [],  # the schema is public; a stray Authorization header is ignored
    "SCHEMA_PATH_PREFIX": "/aotx/v1/shared",
    "POSTPROCESSING_HOOKS": ["shared_api.routes.openapi.postprocess"],  # components: shared_api/routes/openapi/
}

# gateway.json: listen address, device socket, grant file (see README "Configuration")
AOTX_GATEWAY_CONFIG = os.environ.get("AOTX_GATEWAY_CONFIG", str(VAR_DIR / "gateway.json"))
AOTX_DEVICE_TIMEOUT = float(os.environ.get("AOTX_DEVICE_TIMEOUT", "30"))
AOTX_DEVICE_CONNECTIONS = int(os.environ.get("AOTX_DEVICE_CONNECTIONS", "4"))  # per gateway process
AOTX_DEVICE_WAITING = int(os.environ.get("AOTX_DEVICE_WAITING", "256"))  # requests waiting on the device, per process
AOTX_MAX_HEADER_BYTES = int(os.environ.get("AOTX_MAX_HEADER_BYTES", "16384"))  # a request's line and headers
AOTX_BODY_TIMEOUT = float(os.environ.get("AOTX_BODY_TIMEOUT", "30"))  # seconds a request body may stall
AOTX_GATEWAY_WORKERS = int(os.environ.get("AOTX_GATEWAY_WORKERS", "1"))  # processes sharing the per-principal rates
AOTX_PRINCIPAL_CACHE_SECONDS = float(os.environ.get("AOTX_PRINCIPAL_CACHE_SECONDS", "5"))
AOTX_SSE_KEEPALIVE = float(os.environ.get("AOTX_SSE_KEEPALIVE", "15"))  # seconds between keep-alive comments
# bytes of events an event stream may hold for a client that reads slower than they come; past it
# the stream ends (`stream_backlog`) and the client resumes with Last-Event-ID
AOTX_STREAM_BACKLOG_BYTES = int(os.environ.get("AOTX_STREAM_BACKLOG_BYTES", str(1 << 20)))
AOTX_CHAT_TIMEOUT = float(os.environ.get("AOTX_CHAT_TIMEOUT", "600"))  # a whole non-streamed completion
DATA_UPLOAD_MAX_MEMORY_SIZE = (8 << 20) + 4096  # media uploads (PUT /aotx/v1/media/{sha256})

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
}
