"""The replication fault harness's small version (bench/nemesis.py runs it for as many rounds as you
like): three machines in network namespaces, each with an etcd member, a device and a gateway; SDK
clients given every gateway; every fault of the nemesis once — a partition of the primary, the
primary cut from etcd only, kill -9 and SIGSTOP of the primary, the leader key deleted, the standby
replaced by an empty one under load, the standby's disk full, a standby restarted behind a
checkpoint, an etcd member lost, and a primary killed with an etcd member — then the checker: every
receipt answered saved reads back as given from the last primary and through every gateway, no
(lineage, sequence) answered for two operations, no leadership generation held twice, no deposed
primary admitting, every exact retry answered its receipt."""
import pytest

from bench.nemesis import FAILOVERS, FAULTS, run
from tests.cluster import usable

pytestmark = pytest.mark.e2e


@pytest.mark.skipif(usable() is not None, reason=str(usable()))
def test_every_fault_once_loses_no_saved_receipt_and_makes_no_second_primary(tmp_path):
    lines = []
    rows, totals = run(len(FAULTS), tmp_path, report=lines.append)
    assert [r["fault"] for r in rows] == list(FAULTS), lines
    assert all(r["took"] is not None for r in rows if r["fault"] in FAILOVERS), lines
    assert not any(r["zombie"] for r in rows), lines
    assert totals["read_back"] == totals["saved"] > 0 and totals["through_gateways"] == 3 * totals["saved"]
    assert totals["exact_retries"] > 0
