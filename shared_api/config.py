"""gateway.json: {"listen": "HOST:PORT", "socket": "<journal>/service.sock", "grants_file": PATH}."""
import json
from typing import Any


class ConfigError(Exception):
    pass


REQUIRED = ("listen", "socket", "grants_file")


def load(path: str) -> dict[str, Any]:
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
    return doc
