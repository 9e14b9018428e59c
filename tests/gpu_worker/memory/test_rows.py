"""The 128-byte memory row: every field round-trips through its binary layout at its documented
offset, and a row that cannot be written is refused."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpu_worker.memory.rows import ROW, ZERO, Flag, Kind, MemoryRow

ids = st.binary(min_size=16, max_size=16)


@st.composite
def rows(draw):
    scope = draw(st.sampled_from([1, 2, 3]))
    room_lineage, room = (draw(ids), draw(ids)) if scope == 2 else (ZERO, ZERO)
    if scope == 2 and room_lineage == ZERO and room == ZERO:
        room = b"\x01" * 16
    owner = {1: draw(ids), 2: room, 3: ZERO}[scope]
    return MemoryRow(draw(ids), draw(ids), draw(st.integers(1, 2**64 - 1)), draw(st.sampled_from(list(Kind))), scope,
                     Flag(draw(st.integers(0, 3))), draw(st.integers(0, 2**32 - 1)), owner, room_lineage, room,
                     draw(ids), draw(ids))


@given(rows())
def test_a_row_round_trips_through_its_128_bytes(row):
    raw = row.pack()
    assert len(raw) == ROW.size == 128
    assert MemoryRow.unpack(raw) == row
    # the documented offsets (docs/memory.md)
    assert raw[0:16] == row.lineage and raw[16:32] == row.object
    assert int.from_bytes(raw[32:40], "little") == row.version
    assert int.from_bytes(raw[40:42], "little") == row.kind and raw[42] == row.scope and raw[43] == row.flags
    assert int.from_bytes(raw[44:48], "little") == row.byte_length
    assert raw[48:64] == row.owner and raw[64:80] == row.room_lineage and raw[80:96] == row.room
    assert raw[96:112] == row.source and raw[112:128] == row.actor
    shown = row.to_json()
    assert shown["object"] == f"mem-{row.lineage.hex()}-{row.object.hex()}"
    assert shown["version"] == str(row.version) and shown["byte_length"] == str(row.byte_length)
    assert (shown["room"] is None) == (row.scope != 2)
    assert shown["owner"] == {1: f"private-{row.owner.hex()}", 2: shown["room"], 3: "instance"}[row.scope]


def test_rows_that_cannot_be_written_are_refused():
    good = MemoryRow(b"\x01" * 16, b"\x02" * 16, 1, Kind.SOURCE, 1, Flag(0), 5, b"\x03" * 16, ZERO, ZERO,
                     b"\x04" * 16, b"\x05" * 16)
    good.pack()
    for change in ({"version": 0}, {"version": 2**64}, {"byte_length": 2**32}, {"scope": 4},
                   {"scope": 2}, {"room": b"\x06" * 16}, {"scope": 3},
                   {"scope": 2, "room": b"\x06" * 16}):
        with pytest.raises(ValueError):
            MemoryRow(**{**good.__dict__, **change}).pack()
