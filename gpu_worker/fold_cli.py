"""The fold process of a checkpoint beside the ticks (gpu_worker/recovery/fold.py): the state of the runtime
file's checkpoint plus the journal segments in DIR (links to those the checkpoint folds), encoded
as the checkpoint's components on standard output.

    python -m gpu_worker.fold_cli --ccir F --journal DIR --through SEQ

(run by the device, not by hand.)
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys

from .device import Device
from .recovery.fold import encode
from .kinds import media
from .memory.forgetting import redactor
from .storage import checkpoint
from .storage.runtime_file import RuntimeFile


def _die_with_parent() -> None:
    """A device that stops (or crashes) mid-fold takes its fold with it (Linux: PR_SET_PDEATHSIG):
    nothing of the fold's is wanted by the next boot."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # (the device was gone before it was set)
        sys.exit(1)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_worker.fold_cli")
    parser.add_argument("--ccir", required=True)
    parser.add_argument("--journal", required=True)
    parser.add_argument("--through", type=int, required=True)
    args = parser.parse_args(argv)
    _die_with_parent()
    # (no grants: a replay does not ask them, and a grant file can be large)
    device = Device(RuntimeFile.open(args.ccir, verify=False), args.journal, None, serve=False, following=True)
    assert device.following is not None
    last_seq = device.following.next_seq - 1
    if last_seq != args.through:
        print(f"the folded segments end at transfer {last_seq}, not {args.through}", file=sys.stderr)
        return 1
    added, drop = media.checkpoint_components(device)
    out = sys.stdout.buffer
    made = checkpoint.components(device, last_seq, device.following.last_digest, added, beside=True,
                                 redact=redactor(device.state.memory.forgotten))
    for part in encode(made, drop):
        out.write(part)
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
