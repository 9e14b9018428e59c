"""The Celery app of the ops tasks (shared_api/tasks.py), configured from Django's settings
(CELERY_*), and two things every Celery program of it does:

- files private: what the worker and beat create (the beat schedule, the filesystem broker's
  messages, the database's journals) is their user's alone, whatever umask they were started with;
- beat waits for the device: its schedule starts once the device answers a ping (at most
  AOTX_OPS_START_WAIT seconds), so the first runs after a start (`make run` starts device and Celery
  together, and a schedule kept from an earlier run has every task due at once) find the device up
  instead of skipping with a warning."""
import logging
import os

from celery import Celery, signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "aotx_site.settings")
app = Celery("aotx")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

log = logging.getLogger("shared_api.tasks")


@signals.import_modules.connect
def _private_files(**_: object) -> None:
    """Sent when a Celery program (worker, beat) loads its task modules, before it creates any file
    (its children inherit the umask). Only under Celery's command line (its click context): a
    process that merely uses this app (a test loading the task modules) keeps its umask."""
    import click
    if click.get_current_context(silent=True) is not None:
        os.umask(0o077)


@signals.beat_init.connect
def _wait_for_the_device(**_: object) -> None:
    """Beat's first tick waits until the device answers its ping, bounded by AOTX_OPS_START_WAIT.
    Runs in the beat process (with `worker -B`, its own child: a stop ends it by SIGTERM)."""
    from django.conf import settings

    from shared_api import ops
    limit = settings.AOTX_OPS_START_WAIT
    log.info("beat: waiting up to %gs for the device to answer before the first scheduled run", limit)
    if not ops.wait_for_device(limit):
        log.warning("beat: the device did not answer its ping within %gs; running the schedule anyway", limit)
