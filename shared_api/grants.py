"""Writing the deployment grant file from the gateway database (format: docs/grants.md).
Written to a temporary file, fsynced, renamed over the old one and the directory fsynced, so
the device never reads a half-written file. No token or token hash is written."""
import json
import os
import time

from gpu_worker.grants import SCHEMA

from .models import Principal


def grant_document():
    principals = {p.principal_id: {"name": p.name, "actions": sorted(p.current_actions())}
                  for p in Principal.objects.all()}
    return {"schema": SCHEMA, "written_at_ns": time.time_ns(), "principals": principals}


def write_grant_file(path):
    doc = grant_document()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, sort_keys=True, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return len(doc["principals"])
