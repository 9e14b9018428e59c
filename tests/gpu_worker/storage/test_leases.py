"""Lease layouts: offsets exactly as SPEC.md, a round trip per revision, whole-lease refusal."""
import struct

import pytest
from hypothesis import given, strategies as st

from gpu_worker.storage import leases
from gpu_worker.storage.leases import LeaseError, LeaseRow

rows = st.lists(st.builds(LeaseRow, st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
                          st.integers(0, 2**64 - 1), st.binary(min_size=16, max_size=16),
                          st.sampled_from([1, 2])), max_size=20)


def test_the_row_offsets_are_those_of_the_specification():
    row = LeaseRow(request_index=7, slot=9, sequence=2**40 + 3, actor=bytes(range(16)), retention_mode=2)
    data = leases.encode(3, [row])
    assert data[:8] == struct.pack("<II", 1, 3)
    body = data[8:]
    assert len(body) == 40
    assert struct.unpack_from("<I", body, 0)[0] == 7
    assert struct.unpack_from("<I", body, 4)[0] == 9
    assert struct.unpack_from("<Q", body, 8)[0] == 2**40 + 3
    assert body[16:32] == bytes(range(16))
    assert struct.unpack_from("<I", body, 32)[0] == 2
    assert struct.unpack_from("<I", body, 36)[0] == 0


@pytest.mark.parametrize("revision", [2, 3, 4, 5])
@given(rows=rows)
def test_revisions_two_to_five_round_trip_with_forty_byte_rows(revision, rows):
    data = leases.encode(revision, rows)
    assert len(data) == 8 + 40 * len(rows)
    assert leases.decode(data) == (revision, rows)


@pytest.mark.parametrize("revision", [0, 1])
@given(rows=rows)
def test_revisions_zero_and_one_keep_their_thirty_two_byte_rows(revision, rows):
    data = leases.encode(revision, rows)
    assert len(data) == 8 + 32 * len(rows)
    assert leases.decode(data) == (revision, [LeaseRow(r.request_index, r.slot, r.sequence, r.actor, None)
                                              for r in rows])


def test_a_lease_with_any_bad_row_is_refused_whole():
    good = LeaseRow(0, 1, 2, b"a" * 16, 1)
    data = bytearray(leases.encode(3, [good, good]))
    data[8 + 40 + 36] = 1  # reserved word of the second row
    with pytest.raises(LeaseError, match="row 1: reserved"):
        leases.decode(bytes(data))
    data = bytearray(leases.encode(3, [good, good]))
    data[8 + 40 + 32] = 3  # retention mode 3
    with pytest.raises(LeaseError, match="row 1: retention mode 3"):
        leases.decode(bytes(data))
    with pytest.raises(LeaseError, match="must be"):
        leases.decode(leases.encode(3, [good])[:-1])
    with pytest.raises(LeaseError, match="unknown lease revision"):
        leases.decode(struct.pack("<II", 0, 6))
