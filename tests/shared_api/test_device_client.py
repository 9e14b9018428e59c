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


def test_a_reply_after_its_call_timed_out_is_dropped_and_the_connection_keeps_serving(tmp_path):
    """DeviceMux.call: the first call times out (503 device_timeout); its reply, arriving later on
    the same connection, is dropped, and the next call on that connection gets its own reply."""
    import asyncio

    from gpu_worker.contract.wire import FrameReader, encode_frame, reply
    from shared_api.device_client import DeviceMux

    path = str(tmp_path / "service.sock")

    async def device(reader, writer):
        frames = FrameReader()
        held = None
        while data := await reader.read(65536):
            for msg in frames.feed(data):
                if msg["op"] == "slow":
                    held = msg  # answered only after the next request arrives
                    continue
                if held is not None:
                    writer.write(encode_frame(reply(held["id"], 200, b'"late"')))
                    held = None
                writer.write(encode_frame(reply(msg["id"], 200, b'"fast"')))
                await writer.drain()

    async def go():
        server = await asyncio.start_unix_server(device, path)
        mux = DeviceMux(path, timeout=0.2)
        try:
            with pytest.raises(ServiceError) as err:
                await mux.call("slow", None)
            answer = await mux.call("fast", None)
            again = await mux.call("fast", None)
            return err.value, answer, again, mux._abandoned
        finally:
            await mux.aclose()
            server.close()
    err, answer, again, abandoned = asyncio.run(go())
    assert err.status == 503 and err.code == "device_timeout"
    assert answer["body"] == b'"fast"' and again["body"] == b'"fast"'
    assert abandoned == set()  # the late reply was the abandoned id's last frame
