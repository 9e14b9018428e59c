"""gpu_worker/shards.py: a dict in shards answers as one dict does, and the device's indexes keep
no single table that grows with the state (a CPython dict rebuilds its whole table as it grows:
docs/performance.md, "Checkpoint")."""
import collections
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.shards import NativeFixedMap as FixedMap
from gpu_worker.shards import SHARDS, Shards
from tests.conftest import ALL, write_grants
from tests.gpu_worker.test_device import Rig

KEYS = st.one_of(st.integers(-(1 << 70), 1 << 70), st.binary(max_size=20),
                 st.tuples(st.binary(max_size=4), st.integers(0, 9)))
OPS = st.lists(st.tuples(st.sampled_from(["set", "del", "pop", "popd", "setdefault", "get", "in", "update", "popall",
                                          "popalld"]),
                         KEYS, st.integers()), max_size=80)


def pop_all(d, keys, *default):
    """What Shards.pop_all promises, in Python over a dict: each pop in order (a missing key
    raises after the pops before it)."""
    return [d.pop(key, *default) for key in keys]


@settings(max_examples=200, deadline=None)
@given(ops=OPS)
def test_shards_answer_every_call_as_a_dict_does(ops):
    mine, theirs = Shards(), {}
    for op, key, value in ops:
        if op == "set":
            mine[key] = value
            theirs[key] = value
        elif op in ("del", "pop"):
            outcomes = []
            for m in (mine, theirs):
                try:
                    outcomes.append(m.pop(key) if op == "pop" else m.__delitem__(key))
                except KeyError:
                    outcomes.append(KeyError)
            assert outcomes[0] == outcomes[1]
        elif op == "popd":
            assert mine.pop(key, "none") == theirs.pop(key, "none")
        elif op == "setdefault":
            assert mine.setdefault(key, value) == theirs.setdefault(key, value)
        elif op == "get":
            assert mine.get(key) == theirs.get(key) and mine.get(key, 7) == theirs.get(key, 7)
        elif op == "in":
            assert (key in mine) == (key in theirs)
        elif op in ("popall", "popalld"):  # (native: gpu_worker/native/shards.cpp)
            keys, default = [key, value, key], ("none",) if op == "popalld" else ()
            outcomes = []
            for m, pop in ((mine, Shards.pop_all), (theirs, pop_all)):
                try:
                    outcomes.append(pop(m, iter(keys), *default))
                except KeyError as exc:
                    outcomes.append(("KeyError", exc.args))
            assert outcomes[0] == outcomes[1]
        else:  # (native too)
            mine.update(iter([(key, value), [value, key]]))
            theirs.update([(key, value), (value, key)])
        assert len(mine) == len(theirs) and mine == theirs and dict(mine) == theirs
    assert sorted(map(repr, mine.items())) == sorted(map(repr, theirs.items()))
    assert sorted(map(repr, mine)) == sorted(map(repr, theirs.keys()))
    assert sorted(map(repr, mine.values())) == sorted(map(repr, theirs.values()))
    assert mine == Shards(theirs.items()) and (mine != Shards([(object(), 1)]))


def test_bulk_operations_refuse_what_a_python_loop_would():
    """update's pairs must be pairs of a hashable key; pop_all's missing key is a KeyError naming it."""
    shards = Shards([((1, 2), "a")])
    for pairs, error in (([(1, 2, 3)], ValueError), ([([1], 2)], TypeError), ([7], TypeError), (None, TypeError)):
        try:
            shards.update(pairs)
        except error:
            pass
        else:
            raise AssertionError(f"update({pairs!r}) raised nothing")
    assert dict(shards) == {(1, 2): "a"}  # (each refused at its first pair)
    try:
        shards.pop_all([(1, 2), (3, 4)])
    except KeyError as exc:
        assert exc.args == ((3, 4),)
    else:
        raise AssertionError("pop_all of a missing key raised nothing")
    assert dict(shards) == {}  # (the pops before it happened, as in the loop)
    try:
        shards.pop_all([[5]], None)
    except TypeError:
        pass
    else:
        raise AssertionError("pop_all of an unhashable key raised nothing")


def largest_tables(state):
    """Each index map of the device's state: its name and, for a FixedMap, its table's slots (it
    never grows when sized right), else the entries of its largest dict table."""
    for index in (state.participants, state.receipts, state.spaces, state.members, state.conversations, state.memory):
        for name in getattr(type(index), "__slots__", ()) or vars(index):
            value = getattr(index, name, None)
            if isinstance(value, Shards):
                yield f"{type(index).__name__}.{name}", ("dicts", max(map(len, value._shards)))
            elif isinstance(value, dict):
                yield f"{type(index).__name__}.{name}", ("dicts", len(value))
            elif isinstance(value, FixedMap):
                yield f"{type(index).__name__}.{name}", ("slots", value.slots)


def test_no_index_of_the_device_keeps_a_dict_that_grows_with_its_tables(tiny_runtime, tmp_path):
    """A thousand registrations and a space each: every map the device keeps per participant,
    receipt and space holds them in a FixedMap sized for its table, which never grows, or in
    shards of about 1/SHARDS each, so no insert rebuilds a table of the whole state while the tick
    thread waits (it did: seven dicts of a million entries)."""
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
        grown = {name: size for name, (kind, size) in tables.items() if kind == "dicts" and size > 4 * n // SHARDS}
        assert not grown, grown
    finally:
        rig.device.close()
