"""The grant file format is one module for both processes: what the writer writes, the device
reads; a document the device would refuse is never written."""
import json
import os
import stat

import pytest

from gpu_worker.contract import grantfile
from gpu_worker.contract.grantfile import GrantFileError, Grants

PID = "0123456789abcdef0123456789abcdef"


def test_a_written_file_reads_back_as_the_same_grants(tmp_path):
    path = str(tmp_path / "grants.json")
    doc = grantfile.document({PID: ("alice", ["shared_write", "shared_read", "shared_read"])}, 5)
    assert grantfile.write(path, doc) == 1
    grants = Grants(path)
    assert grants.actions(PID) == {"shared_read", "shared_write"} and grants.written_at_ns == 5
    assert grants.allows(PID, "shared_write") and not grants.allows(PID, "shared_manage")
    assert stat.S_IMODE(os.stat(path).st_mode) == grantfile.FILE_MODE


@pytest.mark.parametrize("principals", [
    {"": ("empty id", ["shared_read"])},
    {"ABCDEF0123456789ABCDEF0123456789": ("uppercase", [])},
    {PID: ("bogus action", ["bogus_action"])},
])
def test_the_writer_refuses_what_the_device_would_refuse_and_leaves_the_old_file(tmp_path, principals):
    path = str(tmp_path / "grants.json")
    grantfile.write(path, grantfile.document({PID: ("alice", ["chat"])}))
    before = open(path, "rb").read()
    with pytest.raises(GrantFileError):
        grantfile.write(path, grantfile.document(principals))
    assert open(path, "rb").read() == before and sorted(os.listdir(tmp_path)) == ["grants.json"]


@pytest.mark.parametrize("doc, message", [
    ({"schema": "other"}, "schema"),
    ({"schema": grantfile.SCHEMA, "written_at_ns": True, "principals": {}}, "written_at_ns"),
    ({"schema": grantfile.SCHEMA, "written_at_ns": 1, "principals": []}, "principals must be an object"),
    ({"schema": grantfile.SCHEMA, "written_at_ns": 1, "principals": {PID: {"actions": "chat"}}}, "subset"),
])
def test_a_malformed_document_names_what_is_wrong(doc, message):
    with pytest.raises(GrantFileError, match=message):
        grantfile.parse(doc)


def test_a_rewritten_file_is_picked_up_and_a_broken_one_keeps_nothing_half_read(tmp_path):
    path = tmp_path / "grants.json"
    grantfile.write(str(path), grantfile.document({PID: ("alice", ["chat"])}))
    grants = Grants(str(path))
    assert grants.reload() is False  # unchanged
    grantfile.write(str(path), grantfile.document({PID: ("alice", ["shared_read"])}))
    assert grants.reload() is True and grants.actions(PID) == {"shared_read"}
    path.write_text(json.dumps({"schema": grantfile.SCHEMA}))
    with pytest.raises(GrantFileError):
        grants.reload()
    assert grants.actions(PID) == {"shared_read"}  # the previous grants stay
