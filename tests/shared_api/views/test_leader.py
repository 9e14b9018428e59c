"""gateway.json "etcd": the gateway follows the leader key to the current primary (shared_api/leader.py).

A real etcd member and two fake devices: the key names device A's socket; a request goes there.
A stops answering (a zombie), and B takes the key (a failover): the request A holds is answered
503 device_connection_lost at once (not after the device timeout), and the next goes to B."""
import asyncio
import json
import os
import shutil
import socket
import tempfile

import pytest
from asgiref.sync import async_to_sync

from gpu_worker.replication.lease import Etcd, Leadership
from shared_api import device_client, leader
from tests.conftest import wait_for
from tests.etcd import EtcdCluster

from .conftest import BASE, OK_BODY, FakeDevice, Gateway, assert_error, assert_passed_through, rsgi_request

KEY = b"/aotx/test/gateway-primary"


@pytest.fixture
def etcd(tmp_path):
    cluster = EtcdCluster(tmp_path, members=1).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def devices(settings, tmp_path, etcd):
    directory = tempfile.mkdtemp(prefix="aotx-lead-")  # AF_UNIX paths are short
    a = FakeDevice(os.path.join(directory, "a.sock")).start()
    b = FakeDevice(os.path.join(directory, "b.sock")).start()
    config = tmp_path / "gateway.json"
    config.write_text(json.dumps({"listen": "127.0.0.1:8000", "socket": os.path.join(directory, "none.sock"),
                                  "grants_file": str(tmp_path / "grants.json"),
                                  "etcd": ",".join(etcd.endpoints), "etcd_key": KEY.decode()}))
    settings.AOTX_GATEWAY_CONFIG = str(config)
    settings.AOTX_DEVICE_TIMEOUT = 60  # a 503 before it says the gateway let go of the old primary
    device_client.reset()
    try:
        yield a, b
    finally:
        device_client.reset()
        a.stop()
        b.stop()
        shutil.rmtree(directory, ignore_errors=True)


def primary(etcd, device, machine=None):
    holder = Leadership(Etcd(etcd.endpoints), KEY, ttl=3)
    holder.campaign(json.dumps({"socket": device.path, "machine": machine or socket.gethostname()}).encode())
    return holder


def test_the_gateway_follows_the_leader_key_to_the_new_primary(etcd, devices, people):
    a, b = devices
    holder = primary(etcd, a)
    path = f"{BASE}/capabilities"
    request = Gateway().request("GET", path, people["reader"])

    async def run():
        try:
            first = await rsgi_request(*request)
            a.silent = True  # A stops answering: the request it holds would wait the device timeout
            held = asyncio.get_running_loop().create_task(rsgi_request(*request))
            await asyncio.to_thread(wait_for, lambda: len(a.requests) == 2, 30, what="A to hold the request")
            holder.stop()  # a failover: A's key is gone, B takes it
            taker = await asyncio.to_thread(primary, etcd, b)
            lost = await asyncio.wait_for(held, 30)
            after = await rsgi_request(*request)
            return first, lost, after, taker
        finally:
            await device_client.aclose_loop()

    first, lost, after, taker = async_to_sync(run)()
    try:
        assert_passed_through(first, 200, OK_BODY)
        assert_error(lost, 503, "device_connection_lost")
        assert_passed_through(after, 200, OK_BODY)
        assert [r["op"] for r in b.requests] == ["capabilities"]
        assert leader._current is not None and leader._current[2].generation == taker.generation
    finally:
        taker.stop()


def test_a_gateway_whose_machine_is_not_the_primarys_answers_not_primary_and_reaches_no_device(
        etcd, devices, people, settings, tmp_path):
    """Issue 52 (8): the gateways read only the key's socket, a path on the primary's machine. Each
    machine's gateway serves its own device now, and while the key names a primary on another
    machine it answers 503 not_primary at once (clients given every gateway move on), sending
    nothing to this machine's device (a standby, or a deposed primary whose state lags)."""
    a, b = devices
    config = json.loads(open(settings.AOTX_GATEWAY_CONFIG).read())
    config["socket"] = b.path  # this gateway's machine has device B
    (tmp_path / "gateway.json").write_text(json.dumps(config))
    device_client.reset()
    holder = primary(etcd, a, machine="another-machine")

    async def run():
        try:
            return await rsgi_request(*Gateway().request("GET", f"{BASE}/capabilities", people["reader"]))
        finally:
            await device_client.aclose_loop()
    try:
        first = async_to_sync(run)()  # (the first request starts the watch: it reads the key at once)
        error = assert_error(async_to_sync(run)(), 503, "not_primary")
        assert "another-machine" in error["message"] and first.status_code == 503
        assert a.requests == [] and b.requests == []
    finally:
        holder.stop()


def test_a_reply_of_an_older_leadership_generation_is_answered_not_primary(etcd, devices, people):
    """Issue 52 (4): device replies carry the leadership generation; a gateway that saw a newer
    one in the leader key takes a reply of an older one for a deposed primary's."""
    a, _ = devices
    holder = primary(etcd, a)
    request = Gateway().request("GET", f"{BASE}/capabilities", people["reader"])

    async def run():
        try:
            return await rsgi_request(*request)
        finally:
            await device_client.aclose_loop()
    try:
        a.handler = lambda req: [{"status": 200, "body": OK_BODY, "g": holder.generation}]
        assert_passed_through(async_to_sync(run)(), 200, OK_BODY)
        a.handler = lambda req: [{"status": 200, "body": OK_BODY, "g": holder.generation - 1}]
        assert_error(async_to_sync(run)(), 503, "not_primary")
    finally:
        holder.stop()


def test_without_etcd_the_gateway_reaches_its_socket_and_a_bad_etcd_setting_is_refused(settings, tmp_path, people):
    config = tmp_path / "gateway.json"
    config.write_text(json.dumps({"listen": "127.0.0.1:8000", "socket": str(tmp_path / "s.sock"),
                                  "grants_file": str(tmp_path / "grants.json"), "etcd": "etcd-1:2379"}))
    settings.AOTX_GATEWAY_CONFIG = str(config)
    device_client.reset()
    error = assert_error(Gateway().get(f"{BASE}/capabilities", people["reader"]), 503, "gateway_misconfigured")
    assert "etcd must be etcd client URLs" in error["message"]
