"""The gateway never hangs on the device: a silent or absent device is a 503 with a clear code."""
import socket
import threading

import pytest

from shared_api.device_client import DeviceClient
from shared_api.errors import ServiceError


def test_it_answers_503_device_unavailable_when_no_device_listens(tmp_path):
    client = DeviceClient(str(tmp_path / "service.sock"), timeout=1)
    with pytest.raises(ServiceError) as err:
        client.call("ping", None)
    assert err.value.status == 503 and err.value.code == "device_unavailable"


def test_it_answers_503_device_timeout_when_the_device_is_silent(tmp_path):
    path = str(tmp_path / "service.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    accepted = []
    thread = threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True)
    thread.start()
    client = DeviceClient(path, timeout=0.3)
    with pytest.raises(ServiceError) as err:
        client.call("ping", None)
    assert err.value.status == 503 and err.value.code == "device_timeout"
    thread.join(5)
    server.close()
