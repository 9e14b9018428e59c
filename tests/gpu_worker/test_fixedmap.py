"""gpu_worker/native/fixedmap.cpp's FixedMap against a dict: every operation the indexes use, on
keys of each layout they use, in tables small enough that clusters wrap around, entries shift back
on removal and the table grows; and the device's indexes keep no table that grows with the state
(a CPython dict rebuilds its whole table as it grows: docs/performance.md, "A checkpoint beside the
ticks")."""
import collections
import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.fixedmap import NativeFixedMap as FixedMap
from tests.conftest import ALL
from tests.gpu_worker.test_device import Rig

LAYOUTS = {
    "ii": st.tuples(st.integers(-3, 40), st.integers(0, 3)),
    "b16b16": st.tuples(st.sampled_from([bytes(16), b"\x01" * 16]), st.binary(min_size=16, max_size=16)
                        .map(lambda b: b[:1] + bytes(15))),
    "b20": st.integers(0, 60).map(lambda i: i.to_bytes(20, "little")),
    "i": st.integers(-(1 << 63), (1 << 63) - 1) | st.integers(0, 50),
}


def packed(layout, key):
    """A key as put_packed takes it (ints little-endian)."""
    parts = key if isinstance(key, tuple) else (key,)
    return b"".join(struct.pack("<q", p) if isinstance(p, int) else p for p in parts)


operations = st.lists(st.tuples(st.sampled_from(["set", "del", "pop", "pop_default", "get", "in",
                                                 "put_packed", "pop_packed", "update"]),
                                st.integers(0, 1000)), max_size=300)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@settings(max_examples=60, deadline=None)
@given(data=st.data(), ops=operations, capacity=st.integers(0, 20))
def test_a_fixed_map_answers_as_a_dict(layout, data, ops, capacity):
    mine, theirs = FixedMap(layout, capacity), {}
    for op, value in ops:
        key = data.draw(LAYOUTS[layout])
        if op == "set":
            mine[key] = theirs[key] = value
        elif op == "del":
            if key in theirs:
                del mine[key], theirs[key]
            else:
                with pytest.raises(KeyError):
                    del mine[key]
        elif op == "pop":
            if key in theirs:
                assert mine.pop(key) == theirs.pop(key)
            else:
                with pytest.raises(KeyError):
                    mine.pop(key)
        elif op == "pop_default":
            assert mine.pop(key, -7) == theirs.pop(key, -7)
        elif op == "get":
            assert mine.get(key) == theirs.get(key) and mine.get(key, "x") == theirs.get(key, "x")
        elif op == "in":
            assert (key in mine) == (key in theirs)
        elif op == "put_packed":
            keys = [key, data.draw(LAYOUTS[layout]), key]
            rows = [value, value + 1, value + 2]
            mine.put_packed(b"".join(packed(layout, k) for k in keys), np.array(rows, dtype=np.int64))
            theirs.update(zip(keys, rows))
        elif op == "pop_packed":
            keys, strict, expected = [key, data.draw(LAYOUTS[layout])], bool(value % 2), []
            for k in keys:  # strict: KeyError at the first missing, the keys before it removed
                if k not in theirs and strict:
                    break
                expected.append(theirs.pop(k, -1))
            every = b"".join(packed(layout, k) for k in keys)
            if len(expected) < len(keys):
                with pytest.raises(KeyError):
                    mine.pop_packed(every, strict)
            else:
                assert np.frombuffer(mine.pop_packed(every, strict), dtype=np.int64).tolist() == expected
        else:
            pairs = [(key, value), (data.draw(LAYOUTS[layout]), value + 3)]
            mine.update(pairs)
            theirs.update(pairs)
        assert len(mine) == len(theirs)
    assert mine == theirs and not mine != theirs
    assert sorted(mine.items()) == sorted(theirs.items()) and sorted(mine) == sorted(theirs)
    assert sorted(mine.keys()) == sorted(theirs) and sorted(mine.values()) == sorted(theirs.values())
    assert all(mine[k] == v for k, v in theirs.items())
    mine.clear()
    assert len(mine) == 0 and mine == {} and list(mine) == []


def test_a_table_sized_for_its_capacity_never_grows():
    """A device's index holds at most its table's rows: sized from them, it never rebuilds itself
    on the tick thread as a dict does (the whole-device case below)."""
    m = FixedMap("b16", 1024)
    slots = m.slots
    m.put_packed(np.random.default_rng(1).bytes(16 * 1024), np.arange(1024, dtype=np.int64))
    assert len(m) == 1024 and m.slots == slots == 2048
    m[bytes(16)] = 5  # past what it was sized for: it grows (and still answers)
    assert m.slots == 2 * slots and m[bytes(16)] == 5 and len(m) == 1025
    assert all(m[k] == v for k, v in m.items())


def test_a_map_made_in_memory_a_forked_child_filled_answers_as_the_child_left_it():
    """FixedMap(layout, capacity, memory, used): the table another map of this layout put entries
    into, in shared memory, from a forked child (the parent's hash seed: recovery/preload.py); a
    buffer of another size, a read-only one, or more entries than half its slots are refused; a map
    that grows leaves the buffer (its entries copied out) and goes on as any."""
    import mmap
    import os
    memory = mmap.mmap(-1, FixedMap.table_bytes("b16", 8))
    pid = os.fork()
    if pid == 0:
        child = FixedMap("b16", 8, memory)
        child.put_packed(bytes(range(48)), np.arange(3, dtype=np.int64))
        os._exit(0 if len(child) == 3 else 1)
    assert os.waitpid(pid, 0)[1] == 0
    made = FixedMap("b16", 8, memory, 3)
    assert dict(made.items()) == {bytes(range(16 * i, 16 * i + 16)): i for i in range(3)} and len(made) == 3
    assert made[bytes(range(16, 32))] == 1 and bytes(16) not in made
    size = FixedMap.table_bytes("b16", 8)
    for bad, used in ((mmap.mmap(-1, size - 1), 0), (bytes(size), 0), (memory, 9), (memory, -1)):
        with pytest.raises((ValueError, BufferError, TypeError)):
            FixedMap("b16", 8, bad, used)
    with pytest.raises(ValueError):
        FixedMap("b16", 8, None, 1)  # (entries need their memory)
    for i in range(3, 40):  # past half its slots: it grows out of the buffer
        made[i.to_bytes(16, "little")] = i
    assert made.slots > 16 and len(made) == 40 and made[bytes(range(32, 48))] == 2
    del made
    memory.close()  # (the map let go of it)


def test_keys_that_do_not_fit_the_layout_are_not_there_and_cannot_be_stored():
    m = FixedMap("b16b16", 4)
    key = (b"a" * 16, b"b" * 16)
    m[key] = 1
    for other in [(b"a" * 16,), (b"a" * 16, b"b" * 15), b"a" * 32, [b"a" * 16, b"b" * 16], None, 1 << 70]:
        assert other not in m and m.get(other) is None and m.pop(other, 3) == 3
        with pytest.raises(KeyError):
            m[other]
        with pytest.raises(TypeError):
            m[other] = 2
    i = FixedMap("i")
    assert (1 << 63) not in i and i.get(-(1 << 63) - 1) is None
    with pytest.raises(TypeError):
        i[1 << 63] = 1
    for row in (-1, (1 << 63) - 1, "1"):
        with pytest.raises((ValueError, TypeError, OverflowError)):
            m[key] = row
    assert m[key] == 1 and len(m) == 1
    with pytest.raises(ValueError):
        m.put_packed(b"x" * 31, np.zeros(1, dtype=np.int64))
    for layout in ("", "x", "b0", "b65", "b16b16b16b16b1", "i" * 5, "b99999999999999999999"):
        with pytest.raises(ValueError):
            FixedMap(layout)


def largest_tables(state):
    """Each index map of the device's state: its name and, for a FixedMap, its table's slots (it
    never grows when sized right), for a dict its entries."""
    for index in (state.participants, state.receipts, state.spaces, state.members, state.conversations, state.memory):
        for name in getattr(type(index), "__slots__", ()) or vars(index):
            value = getattr(index, name, None)
            if isinstance(value, dict):
                yield f"{type(index).__name__}.{name}", ("dicts", len(value))
            elif isinstance(value, FixedMap):
                yield f"{type(index).__name__}.{name}", ("slots", value.slots)


def test_no_index_of_the_device_keeps_a_dict_that_grows_with_its_tables(tiny_runtime, tmp_path):
    """A thousand registrations and a space each: every map the device keeps per participant,
    receipt and space holds them in a FixedMap sized for its table, which never grows, so no insert
    rebuilds a table of the whole state while the tick thread waits (it did: seven dicts of a
    million entries); what dicts it keeps do not grow with them."""
    n = 1000
    principals = [f"{i:032x}" for i in range(1, n + 1)]
    rig = Rig(tiny_runtime, tmp_path, {p: ALL for p in principals})
    try:
        def answers(messages):
            inbox, replies = collections.deque(("c", m) for m in messages), []
            while inbox:  # a tick gathers a bounded batch
                replies += [reply for _, reply in rig.device.committer.run_sync(inbox)]
            return replies

        booted = dict(largest_tables(rig.device.state))
        lineages = [json.loads(r.body)["lineage"] for r in answers(rig.msg("participant.get", p) for p in principals)]
        registrations = answers(rig.msg("participant.register", p, rig.register_args(p, lineage=lineage))
                                for p, lineage in zip(principals, lineages))
        assert [r.status for r in registrations] == [202] * n
        assert len(rig.device.state.participants.by_principal) == n
        assert len(rig.device.state.receipts.by_op) >= n
        tables = dict(largest_tables(rig.device.state))
        maps = {name for name, (kind, _) in tables.items() if kind == "slots"}
        assert {"ParticipantIndex.by_principal", "ReceiptIndex.by_op", "ReceiptIndex.by_sequence",
                "SpaceIndex.by_id", "MemoryTable.by_id"} <= maps
        assert all(tables[name] == booted[name] for name in maps)  # not one grew
        grown = {name: size for name, (kind, size) in tables.items() if kind == "dicts" and size > 16}
        assert not grown, grown
    finally:
        rig.device.close()
