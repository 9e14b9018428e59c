"""Writing a runtime file from component streams: the runtime and shared profiles (capacities,
journal limits) validated before anything is written, `_write` (profiles first, then the model
components, into a new file), `enable_shared` for an existing file with its check against what a
stored checkpoint needs, and the helpers every packer shares on the way there (chaining and
qualifying component streams, progress lines, a source record's hash, the summary). It imports no
other module of the package: the model modules and the command line build on it.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import os
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator

from tqdm import tqdm

from gpu_worker.storage import checkpoint, runtime_file_writer
from gpu_worker.storage.runtime_file import (DEFAULT_CAPACITIES, DEFAULT_RUNTIME_PROFILE, DEFAULT_SHARED_PROFILE,
                                     FEATURE_BASE, FEATURE_SHARED, RuntimeFile)


def _summary(path, started: float) -> dict:
    return {"path": os.fspath(path), "bytes": os.path.getsize(path), "seconds": time.monotonic() - started}


def _source(path: Path, distribution: str | None = None) -> dict:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    source = {"file": path.name, "sha256": digest.hexdigest()}
    if distribution:
        source["package"] = f"{distribution}=={importlib.metadata.version(distribution)}"
    return source


# ---- profiles ---------------------------------------------------------------------------------

def parse_capacity(text: str) -> dict:
    """'participants=2048,receipts=4096' -> the default capacities with those two replaced."""
    capacities, seen = dict(DEFAULT_CAPACITIES), set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in DEFAULT_CAPACITIES:
            raise ValueError(f"unknown capacity {key!r} (known: {', '.join(DEFAULT_CAPACITIES)})")
        if key in seen:
            raise ValueError(f"capacity {key} given twice")
        if not value.isdigit() or not 0 < int(value) < 2**31:
            raise ValueError(f"capacity {key} must be a positive integer below 2^31, not {value!r}")
        capacities[key] = int(value)
        seen.add(key)
    return capacities


def _capacities(capacity: dict | None) -> dict:
    merged = {**DEFAULT_CAPACITIES, **(capacity or {})}
    # Round-trip through the parser so a dict passed from code gets the same checks as the CLI text.
    return parse_capacity(",".join(f"{key}={value}" for key, value in merged.items()))


JOURNAL_LIMITS = ("journal_file_cap_bytes", "checkpoint_journal_bytes")


def shared_profile(capacity: dict | None = None, journal_limits: dict | None = None) -> dict:
    profile = copy.deepcopy(DEFAULT_SHARED_PROFILE)
    profile["capacities"] = _capacities(capacity)
    for key, value in (journal_limits or {}).items():
        if key not in JOURNAL_LIMITS or type(value) is not int or value <= 0:
            raise ValueError(f"journal limit {key}={value!r}: keys are {', '.join(JOURNAL_LIMITS)}, positive integers")
        profile[key] = value
    return profile


def _runtime_profile(overrides: dict | None) -> dict:
    profile = {**DEFAULT_RUNTIME_PROFILE, **(overrides or {})}
    for key, value in profile.items():
        if key not in DEFAULT_RUNTIME_PROFILE:
            raise ValueError(f"unknown runtime profile key {key!r}")
        if key != "schema" and (type(value) is not int or value <= 0):
            raise ValueError(f"runtime profile {key} must be a positive integer, not {value!r}")
    if profile["page_grant"] > profile["kv_pages"]:
        raise ValueError("runtime profile page_grant cannot exceed kv_pages")
    return profile


def _write(runtime_path, components: Iterable, *, shared: bool, capacity: dict | None,
           runtime_profile: dict | None, started: float, journal_limits: dict | None = None) -> dict:
    if capacity is not None and not shared:
        raise ValueError("capacity applies only to a shared profile")
    # Built (and so validated) before the file is created, not after the slow model components.
    profiles = [("runtime_profile", "json", _runtime_profile(runtime_profile))]
    if shared:
        profiles.append(("shared_profile", "json", shared_profile(capacity, journal_limits)))
    required = FEATURE_BASE | (FEATURE_SHARED if shared else 0)
    runtime_file_writer.create(runtime_path, _chain(profiles, components), required=required)
    return _summary(runtime_path, started)


def enable_shared(runtime_path, *, capacity: dict | None = None) -> bool:
    """Give an existing file a shared profile; False (and no write at all) when it already has a compatible one.

    Compatible means the same profile schema, FEATURE_SHARED already required, and the requested
    capacities (capacity=None keeps whatever is stored)."""
    with RuntimeFile.open(runtime_path) as current:
        existing = current.shared_profile
        feature_set = bool(current.required_features & FEATURE_SHARED)
        stored = checkpoint.stored_extent(current.bytes(checkpoint.STATE)) if current.has(checkpoint.STATE) else {}
    if existing is not None and existing.get("schema") == DEFAULT_SHARED_PROFILE["schema"]:
        requested = existing["capacities"] if capacity is None else _capacities(capacity)
        if feature_set and existing["capacities"] == requested:
            return False
        profile = {**existing, "capacities": requested}
    else:
        profile = shared_profile(capacity)
    _check_room(runtime_path, profile["capacities"], stored)
    runtime_file_writer.append(runtime_path, [("shared_profile", "json", profile)], set_required=FEATURE_SHARED)
    return True


def _check_room(runtime_path, capacities: dict, stored: dict[str, int]) -> None:
    """Refuse (ValueError, one line) capacities below what the file's checkpoint stores: a row table
    keeps each row at its index, so it needs the highest stored row + 1 rows; a receipt's command
    and result bytes need the longest stored one."""
    for key, needed in stored.items():
        if capacities[key] < needed:
            what = f"{needed} bytes for its longest stored receipt" if key.endswith("_bytes") else \
                f"{needed} rows (the highest stored row is {needed - 1})"
            raise ValueError(f"capacity {key}={capacities[key]} is below what the checkpoint in {runtime_path} "
                             f"stores: {key} needs {what}; a capacity can shrink only down to that")


# ---- component streams ----------------------------------------------------------------------

def _progress(items, *, desc: str, unit: str, enabled: bool) -> Iterable:
    """tqdm's bar on a terminal; on a pipe or a file (`make setup | tee log`), one line at every
    tenth instead of a bar's carriage returns."""
    if not enabled:
        return items
    if sys.stderr.isatty():
        return tqdm(items, desc=desc, unit=unit)
    return _progress_lines(list(items), desc, unit)


def _progress_lines(items: list, desc: str, unit: str) -> Iterator:
    total = len(items)
    step = max(1, total // 10)
    for done, item in enumerate(items, 1):
        yield item
        if done % step == 0 or done == total:
            print(f"pack: {desc} {done * 100 // total}% ({done}/{total} {unit}s)", file=sys.stderr, flush=True)


def _qualified(components: Iterable, automatic_memory: bool) -> Iterator:
    """The components, with the generation card's automatic-memory capability set when asked:
    the qualification retention mode 2 needs (docs/memory.md)."""
    for name, kind, value in components:
        if name == "gen/card" and automatic_memory:
            value = {**value, "capabilities": {**value["capabilities"], "automatic_memory": True}}
        yield name, kind, value


def _chain(*iterables: Iterable) -> Iterator:
    for iterable in iterables:
        yield from iterable
