"""The one registry against the contract's command table: every kind and every command is found in
exactly one place, and anything unknown is an error, never a fallback."""
import collections
import secrets

import pytest
import rfc8785

from gpu_worker.kinds.kind import Admission
from gpu_worker.contract.vocabulary import COMMANDS
from gpu_worker.device import Device
from gpu_worker.kinds import registry
from gpu_worker.kinds.kind import Kind, OperationKind
from gpu_worker.contract.grantfile import Grants
from gpu_worker import derived as ids
from gpu_worker.storage.journal import JournalCorrupt, TransferKind
from gpu_worker.storage.runtime_file import RuntimeFile
from tests.conftest import ALL, write_grants


def test_every_kind_code_has_exactly_one_registry_row():
    assert sorted(registry.KINDS) == sorted(int(k) for k in Kind)
    assert all(kind.code == code for code, kind in registry.KINDS.items())


def test_every_mutation_command_of_the_contract_is_one_kind_and_nothing_else_is():
    mutations = {op for op, command in COMMANDS.items() if command.mutation}
    assert set(registry.MUTATIONS) == mutations
    names = [kind.name for kind in registry.KINDS.values()]
    assert len(set(names)) == len(names)
    for op, kind in registry.MUTATIONS.items():
        assert (kind.name, kind.action) == (COMMANDS[op].receipt_kind, COMMANDS[op].action)


def test_every_other_command_is_a_read_or_answered_later_and_the_registry_invents_none():
    others = {op for op, command in COMMANDS.items() if not command.mutation}
    assert set(registry.READS) | set(registry.LATER) == others
    assert not set(registry.MUTATIONS) & (set(registry.READS) | set(registry.LATER))


def test_a_kind_for_a_command_the_contract_does_not_call_a_mutation_is_refused():
    with pytest.raises(ValueError, match="not a mutation"):
        OperationKind(Kind.INPUT, "spaces.list", check=None, apply=None, target_id=None)  # type: ignore[arg-type]


@pytest.fixture
def device(tiny_runtime, tmp_path, principal_id):
    write_grants(str(tmp_path / "grants.json"), {principal_id: ALL})
    d = Device(RuntimeFile.open(tiny_runtime), str(tmp_path / "journal"), Grants(str(tmp_path / "grants.json")))
    yield d
    d.close()


def test_an_unknown_command_is_refused(device, principal_id):
    inbox = collections.deque([("c", {"v": 1, "id": 1, "op": "spaces.rename", "principal": principal_id,
                                      "args": {}})])
    [(_, reply)] = device.committer.run_sync(inbox)
    assert reply.status == 400 and b"unknown_command" in reply.body


def test_a_journaled_admission_of_an_unknown_kind_fails_closed_naming_file_and_offset(device, tiny_runtime, tmp_path,
                                                                                       principal_id):
    principal = bytes.fromhex(principal_id)
    body = {"schema": "aotx.shared.mutation.v1", "lineage": device.state.participants.lineage_of(principal).hex(),
            "operation_key": secrets.token_hex(16), "sequence": "1"}
    canonical = rfc8785.dumps({"method": "POST", "path": "/aotx/v1/shared/participant", "body": body})
    admission = Admission(99, principal, 1, b"\1" * 16, ids.operation(device.state.incarnation, 1), canonical, {})
    device.append(TransferKind.ADMISSION, admission.encode())
    device.committer.commit()
    device.close()
    write_grants(str(tmp_path / "grants.json"), {principal_id: ALL})
    with pytest.raises(JournalCorrupt, match=r"00000001\.journal: offset \d+: admission transfer seq \d+ has unknown "
                                             r"kind 99"):
        Device(RuntimeFile.open(tiny_runtime), str(tmp_path / "journal"), Grants(str(tmp_path / "grants.json")))
