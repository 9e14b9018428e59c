"""The gateway's side of the device socket: one connection per thread, bounded waits.

Device down or silent -> ApiError 503 with a clear code, never a hang. A timed-out mutation
may still have been admitted; the receipt answers an exact retry, so the client can retry."""
import itertools
import socket
import threading

from django.conf import settings
from django.http import HttpResponse

from gpu_worker.protocol import LENGTH, PROTOCOL_VERSION, ProtocolError, decode_payload, encode_frame

from . import config
from .errors import ApiError

CONNECT_TIMEOUT = 2.0


class DeviceClient:
    """A pool of device connections: a request borrows one and returns it when its reply has
    arrived (daphne may run each request on a new thread, so per-thread sockets would mean a
    new connection per request)."""

    def __init__(self, socket_path, timeout):
        self.socket_path = socket_path
        self.timeout = timeout
        self._idle = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def _connect(self):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(CONNECT_TIMEOUT)
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            raise ApiError(503, "device_unavailable",
                           f"the device is not reachable at {self.socket_path}: {exc.strerror or exc}") from None
        sock.settimeout(self.timeout)
        return sock

    def _recv_exact(self, sock, n):
        chunks, remaining = [], n
        while remaining:
            chunk = sock.recv(remaining)
            if not chunk:
                raise ConnectionError("device closed the connection")
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)

    def call(self, op, principal_id, args=None):
        """Returns the device reply map {"status", "body", "headers"?}."""
        req_id = next(self._ids)
        frame = encode_frame({"v": PROTOCOL_VERSION, "id": req_id, "op": op, "principal": principal_id,
                              "args": args or {}})
        for attempt in (0, 1):
            with self._lock:
                sock = self._idle.pop() if self._idle else None
            fresh = sock is None
            if fresh:
                sock = self._connect()
            try:
                sock.sendall(frame)
                (n,) = LENGTH.unpack(self._recv_exact(sock, 4))
                msg = decode_payload(self._recv_exact(sock, n))
                if msg.get("id") != req_id:
                    raise ProtocolError("reply id does not match request")
            except socket.timeout:
                sock.close()
                raise ApiError(503, "device_timeout",
                               f"the device did not answer within {self.timeout:g}s; retry the exact request") from None
            except (OSError, ConnectionError, ProtocolError) as exc:
                sock.close()
                # a pooled connection may have gone stale across a device restart: retry once on a
                # fresh one (safe: an exact retry of a mutation answers its existing receipt)
                if fresh or attempt:
                    raise ApiError(503, "device_unavailable", f"the device connection failed: {exc}") from None
                with self._lock:  # the device restarted: every pooled connection is stale
                    stale, self._idle = self._idle, []
                for other in stale:
                    other.close()
                continue
            with self._lock:
                self._idle.append(sock)
            return msg


_client = None
_lock = threading.Lock()


def client():
    """Opened lazily per process: daphne runs no ASGI lifespan."""
    global _client
    if _client is None:
        with _lock:
            if _client is None:
                try:
                    cfg = config.load(settings.AOTX_GATEWAY_CONFIG)
                except config.ConfigError as exc:
                    raise ApiError(503, "gateway_misconfigured", str(exc)) from None
                _client = DeviceClient(cfg["socket"], settings.AOTX_DEVICE_TIMEOUT)
    return _client


def device_response(op, request, args=None):
    """Call the device for this request's principal and pass its exact reply bytes through."""
    msg = client().call(op, request.user.principal_id, args)
    response = HttpResponse(msg["body"], status=msg["status"], content_type="application/json")
    for name, value in (msg.get("headers") or {}).items():
        response[name] = value
    return response
