"""The Celery ops tasks as functions against the fake device: a capacity sample stored, hold
incidents recorded once with a WARNING line for a new one, checkpoint and audit export as thin
wrappers, a device that cannot be reached skips the run, one that refuses fails it."""
import logging

import pytest

from shared_api import tasks
from shared_api.models import CapacitySample, HoldIncident

pytestmark = pytest.mark.django_db
SINCE = 1_700_000_000_000_000_000


def test_sample_capacity_stores_the_ping(ops_device):
    result = tasks.sample_capacity()
    [sample] = CapacitySample.objects.all()
    assert result["sample"] == sample.pk
    assert sample.usage["receipts"] == 5 and sample.capacities["receipts"] == 1024
    assert sample.kv == {"pages": 512, "owned": 40, "pending": 8, "running": 2, "waiting": 1}
    assert (sample.executions_queued, sample.executions_running, sample.subscriptions) == (1, 2, 3)
    assert (sample.journal_bytes, sample.runtime_file_bytes, sample.boot) == (4096, 468428, 3)
    assert (sample.saved_transfers, sample.fdatasyncs, sample.fdatasync_seconds) == (120, 60, 0.12)
    assert sample.hold is False


def test_sample_capacity_skips_an_unreachable_device_with_a_warning(no_device, caplog):
    with caplog.at_level(logging.WARNING, "shared_api.tasks"):
        assert tasks.sample_capacity() is None
    assert "capacity sample skipped" in caplog.text and not CapacitySample.objects.exists()


def test_a_new_hold_incident_is_recorded_and_logged_once(ops_device, caplog):
    ops_device.status["journal"].update(hold=True, cause="file_cap", since_ns=SINCE)
    ops_device.status["hold_incidents"] = [{"cause": "file_cap", "since_ns": SINCE, "ended_ns": None,
                                            "disk_error": None, "pending_bytes": 12}]
    with caplog.at_level(logging.WARNING, "shared_api.ops"):
        result = tasks.detect_holds()
        again = tasks.detect_holds()
    assert result["new"] == [{"cause": "file_cap", "since_ns": SINCE, "ended_ns": None}] and result["hold"] is True
    assert again["new"] == []
    [incident] = HoldIncident.objects.all()
    assert (incident.cause, incident.ended_ns, incident.pending_bytes) == ("file_cap", None, 12)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "journal hold incident: file_cap" in warnings[0].getMessage()


def test_the_end_of_a_recorded_incident_is_recorded_too(ops_device, caplog):
    ops_device.status["hold_incidents"] = [{"cause": "low_disk", "since_ns": SINCE, "ended_ns": None,
                                            "disk_error": None, "pending_bytes": 0}]
    tasks.detect_holds()
    ops_device.status["hold_incidents"][0]["ended_ns"] = SINCE + 5
    with caplog.at_level(logging.WARNING, "shared_api.ops"):
        assert tasks.detect_holds()["new"] == []
    assert HoldIncident.objects.get().ended_ns == SINCE + 5 and "ended" in caplog.text


def test_a_disk_full_hold_that_could_not_journal_its_start_is_recorded_from_the_current_hold(ops_device):
    ops_device.status["journal"].update(hold=True, cause="disk_full", since_ns=SINCE, disk_error="ENOSPC: x",
                                        pending_bytes=99)
    tasks.detect_holds()
    incident = HoldIncident.objects.get()
    assert (incident.cause, incident.disk_error, incident.pending_bytes) == ("disk_full", "ENOSPC: x", 99)


def test_checkpoint_calls_the_device_command(ops_device):
    ops_device.ops["checkpoint"] = lambda args: (200, {"generation": 3, "folded": 12})
    assert tasks.checkpoint() == {"generation": 3, "folded": 12} and ops_device.calls("checkpoint") == [{}]


def test_a_refused_checkpoint_fails_the_task(ops_device):
    ops_device.ops["checkpoint"] = lambda args: (507, {"error": {"code": "checkpoint_failed", "message": "ENOSPC"}})
    with pytest.raises(tasks.DeviceCommandFailed, match="507 checkpoint_failed: ENOSPC"):
        tasks.checkpoint()


def test_the_audit_export_goes_to_a_new_file_under_the_audit_directory(ops_device, settings):
    ops_device.ops["audit.export"] = lambda args: (200, {"path": args["path"], "transfers": 4, "last_seq": 4,
                                                         "last_digest": "0" * 64})
    result = tasks.export_audit()
    [args] = ops_device.calls("audit.export")
    assert result["path"] == args["path"] and result["transfers"] == 4
    path = args["path"]
    assert path.startswith(str(settings.AOTX_AUDIT_DIR.resolve()) + "/audit-") and path.endswith(".jsonl")
    assert settings.AOTX_AUDIT_DIR.is_dir()  # made for the device to write into


def test_the_beat_schedule_runs_every_ops_task(settings):
    from aotx_site.celery import app
    scheduled = {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    assert scheduled == {"shared_api.tasks.sample_capacity", "shared_api.tasks.detect_holds",
                         "shared_api.tasks.checkpoint", "shared_api.tasks.export_audit"}
    app.loader.import_default_modules()
    assert scheduled <= set(app.tasks)


def test_beat_starts_its_schedule_once_the_device_answers(ops_device, settings, caplog):
    """Celery beat's first tick waits for the device's ping (aotx_site/celery.py): its first runs
    after a start find the device up instead of skipping with a warning."""
    from aotx_site.celery import _wait_for_the_device
    settings.AOTX_OPS_START_WAIT = 30
    with caplog.at_level(logging.INFO, "shared_api.tasks"):
        _wait_for_the_device()
    assert len(ops_device.calls("ping")) == 1 and "waiting up to 30s" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_beat_starts_its_schedule_anyway_when_the_device_does_not_answer_in_time(no_device, settings, caplog):
    from aotx_site.celery import _wait_for_the_device
    settings.AOTX_OPS_START_WAIT = 0
    with caplog.at_level(logging.WARNING, "shared_api.tasks"):
        _wait_for_the_device()
    assert "the device did not answer its ping within 0s; running the schedule anyway" in caplog.text
