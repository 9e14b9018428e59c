"""A blocking connection to the device socket: one request at a time, its reply read through the
one ReplyReader. The gateway pools these (shared_api/device_client.py); ops commands
(`python -m gpu_worker checkpoint`) use one directly. Failures are OSError (TimeoutError when the
device is silent) or ProtocolError; callers decide what they mean."""
from __future__ import annotations

import itertools
import socket
from typing import Mapping

from .commands import Args, request
from .wire import ProtocolError, Reply, ReplyReader


class Connection:
    _ids = itertools.count(1)

    def __init__(self, path: str, *, connect_timeout: float, timeout: float) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(connect_timeout)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            raise
        sock.settimeout(timeout)
        self.sock = sock
        self.reader = ReplyReader()

    def call(self, op: str, principal: str | None, args: Args | Mapping[str, object] | None = None) -> Reply:
        return self.receive(self.send(op, principal, args))

    def send(self, op: str, principal: str | None, args: Args | Mapping[str, object] | None = None) -> int:
        """Send one request; its id. A failure here means the device has no whole request."""
        req_id = next(self._ids)
        self.sock.sendall(request(req_id, op, principal, args))
        return req_id

    def receive(self, req_id: int) -> Reply:
        """The next reply, which must answer req_id."""
        while True:
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("the device closed the connection")
            messages = self.reader.feed(data)
            if messages:
                if len(messages) > 1 or self.reader.pending or messages[0].id != req_id:
                    raise ProtocolError("the device's reply does not answer the request")
                return messages[0]

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
