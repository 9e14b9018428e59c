"""gateway.json: {"listen": "HOST:PORT", "socket": "<journal>/service.sock", "grants_file": PATH}
and, optional, the server's (README "Configuration"): "workers" (processes, 1), "header_timeout"
(seconds to send a request's line and headers, the first or the next on a keep-alive connection,
10), "body_timeout" (seconds a body may stall, 30), "max_header_bytes" (16384). "idle_timeout" is
refused by name: an idle keep-alive connection is bounded by header_timeout. With a standby,
"etcd" (client URLs, comma-separated) and "etcd_key" (the leader key, "/aotx/primary"): the
gateway follows the primary the key names on its own machine (shared_api/leader.py); "socket" is
then where it goes until the key names one. "machine" (default: the host name) is this gateway's
machine, as its device's `boot --machine` says: a primary on another machine is not followed (each
machine's gateway serves its own device; clients given every gateway move to the primary's)."""
import json
import socket
from typing import TypedDict, cast


class ConfigError(Exception):
    pass


REQUIRED = ("listen", "socket", "grants_file")
OPTIONAL: dict[str, tuple[type, int | float, int | float]] = {  # name: (type, default, least)
    "workers": (int, 1, 1),
    "header_timeout": (float, 10.0, 0.1),
    "body_timeout": (float, 30.0, 0.1),
    "max_header_bytes": (int, 16384, 1024),
}


class GatewayConfig(TypedDict):
    """A checked gateway.json, its defaults filled in (and `listen` split into host and port)."""
    listen: str
    socket: str
    grants_file: str
    host: str
    port: int
    workers: int
    header_timeout: float
    body_timeout: float
    max_header_bytes: int
    etcd: str
    etcd_key: str
    machine: str


# name: default ("etcd" empty: no leader key to follow; "machine" empty: the host name)
STRINGS = {"etcd": "", "etcd_key": "/aotx/primary", "machine": ""}


def load(path: str) -> GatewayConfig:
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"gateway config {path} does not exist") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"gateway config {path} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"gateway config {path} must be a JSON object")
    missing = [k for k in REQUIRED if not isinstance(doc.get(k), str) or not doc.get(k)]
    if missing:
        raise ConfigError(f"gateway config {path} lacks string field(s): {', '.join(missing)}")
    host, sep, port = doc["listen"].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"gateway config {path}: listen must be HOST:PORT, got {doc['listen']!r}")
    doc["host"], doc["port"] = host.strip("[]"), int(port)
    if "idle_timeout" in doc:
        raise ConfigError(f"gateway config {path}: idle_timeout is no longer a setting: the server closes an idle "
                          "keep-alive connection when header_timeout passes without a whole request head")
    for name, text in STRINGS.items():
        doc[name] = doc.get(name, text)
        if not isinstance(doc[name], str):
            raise ConfigError(f"gateway config {path}: {name} must be a string")
    doc["machine"] = doc["machine"] or socket.gethostname()
    if doc["etcd"] and not all(u.startswith(("http://", "https://")) for u in doc["etcd"].split(",")):
        raise ConfigError(f"gateway config {path}: etcd must be etcd client URLs (http://HOST:PORT), comma-separated")
    for name, (kind, default, least) in OPTIONAL.items():
        value = doc.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and type(value) is not int) \
                or value < least:
            raise ConfigError(f"gateway config {path}: {name} must be a {kind.__name__} of at least {least}")
        doc[name] = kind(value)
    return cast(GatewayConfig, doc)  # (every field checked above)
