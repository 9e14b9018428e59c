"""Celery ops tasks: thin wrappers over device commands."""
from __future__ import annotations

import json
import logging
from typing import Any

from celery import shared_task

log = logging.getLogger("shared_api.tasks")


@shared_task
def sample_capacity() -> dict[str, Any] | None:
    """Log the device's table usage and journal state once a minute (beat schedule)."""
    from django.conf import settings

    from . import config
    from .device_client import DeviceClient
    from .errors import ServiceError
    cfg = config.load(settings.AOTX_GATEWAY_CONFIG)
    try:
        msg = DeviceClient(cfg["socket"], 10).call("ping", None)
    except ServiceError as exc:  # the device is starting or down: say so, try again next minute
        log.warning("capacity sample skipped: %s", exc.message)
        return None
    status: dict[str, Any] = json.loads(msg["body"])
    log.warning("capacity: %s; journal %s", status["usage"], status["journal"])
    return status
