"""`python -m gpu_worker checkpoint --ccir F --journal DIR`: fold the journal into the runtime
file. A running device does it between two ticks (asked over its socket); with no device
running, the command opens the state itself (taking the journal lock and the runtime file's)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from .contract.client import Connection
from .contract.wire import Reply


def _ask_device(socket_path: str) -> Reply | None:
    """The running device's answer, or None when no device listens."""
    try:
        connection = Connection(socket_path, connect_timeout=5, timeout=600)
    except OSError:
        return None
    with connection:
        return connection.call("checkpoint", None)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_worker checkpoint")
    parser.add_argument("--ccir", required=True)
    parser.add_argument("--journal", required=True)
    args = parser.parse_args(argv)
    reply = _ask_device(os.path.join(args.journal, "service.sock"))
    if reply is not None:
        body = json.loads(reply.body)
        if reply.status != 200:
            print(f"checkpoint: {body['error']['message']}", file=sys.stderr)
            return 1
        print(f"checkpoint (running device): {json.dumps(body, sort_keys=True)}")
        return 0
    from .device import Device
    from .storage.journal import JournalError
    from .storage.runtime_file import RuntimeFile, RuntimeFileError
    from .storage.runtime_file_lock import FileLock
    try:
        lock = FileLock(args.ccir)  # the one writer of the file while it folds (a device elsewhere refuses)
    except RuntimeFileError as exc:
        print(f"checkpoint: {exc}", file=sys.stderr)
        return 2
    with lock:
        try:
            device = Device(RuntimeFile.open(args.ccir), args.journal, None, serve=False)
        except (JournalError, RuntimeFileError, OSError) as exc:
            print(f"checkpoint: {exc}", file=sys.stderr)
            return 2
        try:
            result = device.checkpoint() or {"generation": device.state.generation, "folded": 0}
        finally:
            device.close()
    print(f"checkpoint (offline): {json.dumps(result, sort_keys=True)}")
    return 0
