"""`python -m gpu_worker checkpoint --ccir F --journal DIR`: fold the journal into the runtime
file. A running device does it between two ticks (asked over its socket); with no device
running, the command opens the state itself (taking the journal lock)."""
import argparse
import json
import os
import socket
import sys

from .protocol import LENGTH, PROTOCOL_VERSION, decode_payload, encode_frame


def _ask_device(socket_path):
    """The running device's answer, or None when no device listens."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(600)
    try:
        sock.connect(socket_path)
    except OSError:
        sock.close()
        return None
    with sock:
        sock.sendall(encode_frame({"v": PROTOCOL_VERSION, "id": 1, "op": "checkpoint", "principal": None, "args": {}}))
        header = sock.recv(4, socket.MSG_WAITALL)
        (n,) = LENGTH.unpack(header)
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("device closed the connection")
            data += chunk
        return decode_payload(data)


def main(argv):
    parser = argparse.ArgumentParser(prog="python -m gpu_worker checkpoint")
    parser.add_argument("--ccir", required=True)
    parser.add_argument("--journal", required=True)
    args = parser.parse_args(argv)
    reply = _ask_device(os.path.join(args.journal, "service.sock"))
    if reply is not None:
        body = json.loads(reply["body"])
        if reply["status"] != 200:
            print(f"checkpoint: {body['error']['message']}", file=sys.stderr)
            return 1
        print(f"checkpoint (running device): {json.dumps(body, sort_keys=True)}")
        return 0
    from .device import Device
    from .journal import JournalError
    from .runtime_file import RuntimeFile, RuntimeFileError
    try:
        device = Device(RuntimeFile.open(args.ccir), args.journal, None, serve=False)
    except (JournalError, RuntimeFileError, OSError) as exc:
        print(f"checkpoint: {exc}", file=sys.stderr)
        return 2
    try:
        result = device.checkpoint() or {"generation": device.generation, "folded": 0}
    finally:
        device.close()
    print(f"checkpoint (offline): {json.dumps(result, sort_keys=True)}")
    return 0
