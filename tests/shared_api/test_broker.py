"""The Celery broker of a stack without Redis (aotx_site/broker.py): kombu's filesystem transport
with each message renamed into place once written, so a worker never takes a message half
written (kombu's own wrote into the name the worker takes: an empty message killed the worker,
and with it `make run`)."""
import json
import os
from queue import Empty

import pytest
from kombu import Connection

import aotx_site.broker as broker


@pytest.fixture
def channel(tmp_path):
    folders = {name: tmp_path / name for name in ("out", "processed", "control")}
    for folder in folders.values():
        folder.mkdir()
    options = {"data_folder_in": str(folders["out"]), "data_folder_out": str(folders["out"]),
               "processed_folder": str(folders["processed"]), "control_folder": str(folders["control"])}
    with Connection("aotx-filesystem://", transport_options=options) as connection:
        assert isinstance(connection.transport, broker.Transport)
        yield connection.default_channel, folders["out"]


def test_a_message_is_taken_whole_and_nothing_is_left_half_written(channel):
    chan, out = channel
    chan._put("ops", {"task": "sample", "args": list(range(100))})
    [name] = os.listdir(out)
    assert name.endswith(".ops.msg") and (out / name).stat().st_mode & 0o077 == 0
    assert chan._get("ops") == {"task": "sample", "args": list(range(100))}
    assert os.listdir(out) == []


def test_a_message_being_written_is_not_taken(channel):
    chan, out = channel
    (out / f"1_x.ops.msg{broker.PART}").write_bytes(json.dumps({"task": "half"})[:5].encode())
    with pytest.raises(Empty):
        chan._get("ops")
    chan._put("ops", {"task": "whole"})
    assert chan._get("ops") == {"task": "whole"}
