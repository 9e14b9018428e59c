"""Celery ops tasks: thin wrappers over device commands."""
import logging

from celery import shared_task

log = logging.getLogger("shared_api.tasks")


@shared_task
def sample_capacity():
    """Log the device's table usage and journal state once a minute (beat schedule)."""
    from django.conf import settings

    from . import config
    from .device_client import DeviceClient
    cfg = config.load(settings.AOTX_GATEWAY_CONFIG)
    msg = DeviceClient(cfg["socket"], 10).call("ping", None)
    log.warning("device ping: %s %s", msg["status"], msg["body"][:200])
    return msg["status"]
