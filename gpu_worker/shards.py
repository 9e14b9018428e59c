"""The host indexes' maps, so that no single insert stops the tick thread for long.

Two kinds. `FixedMap` (gpu_worker/native/fixedmap.cpp) maps keys of one fixed layout (16 bytes, a
pair of ints, a pair of 16-byte IDs) to rows: a native open-addressing table sized from the table
it indexes, so it never grows in service, and whose entries are no Python objects (a million of
them cost a fraction of a dict's to build at boot; docs/performance.md, "Replay"). Every map of
IDs to rows is one. `Shards` holds what a FixedMap cannot, a map whose values are Python objects
(a conversation's list of inputs).

A CPython dict grows by rebuilding its whole table when it fills, which at a million entries stops
the thread that inserts for tens of milliseconds (docs/performance.md, "A checkpoint beside the
ticks", has the figures). `Shards` spreads its keys over `SHARDS` small dicts by the key's hash:
each grows at 1/SHARDS of the size, so the longest insert is 1/SHARDS of a whole dict's, and the
growth of different shards falls on different inserts. Its bulk operations (`update`, `pop_all`)
run natively (gpu_worker/native/shards.cpp), exactly as their Python loops would: boot indexes a
million rows through them.

It answers the part of the dict API the indexes use (get, [], in, del, pop, setdefault, update,
items/keys/values, len, ==). Iteration is shard by shard: no order is promised, and none of its
users depends on one.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Generic, Protocol, TypeVar, overload

from . import native

K = TypeVar("K")
V = TypeVar("V")
D = TypeVar("D")

# A prime: an int key's hash is the int itself, and int keys often differ in their high bits alone
# (a row in the low bits), which a power of two would send to one shard.
SHARDS = 251
MISSING = object()
_native = native.load("shards")
_update, _pop_all = _native.update, _native.pop_all
NativeFixedMap: Any = native.load("fixedmap").FixedMap  # the type (isinstance)


class Shards(Generic[K, V]):
    __slots__ = ("_shards",)

    def __init__(self, pairs: Iterable[tuple[K, V]] = ()) -> None:
        self._shards: list[dict[K, V]] = [{} for _ in range(SHARDS)]
        self.update(pairs)

    def __getitem__(self, key: K) -> V:
        return self._shards[hash(key) % SHARDS][key]

    def __setitem__(self, key: K, value: V) -> None:
        self._shards[hash(key) % SHARDS][key] = value

    def __delitem__(self, key: K) -> None:
        del self._shards[hash(key) % SHARDS][key]

    def __contains__(self, key: object) -> bool:
        return key in self._shards[hash(key) % SHARDS]

    @overload
    def get(self, key: K) -> V | None: ...
    @overload
    def get(self, key: K, default: V | D) -> V | D: ...

    def get(self, key: K, default: object = None) -> object:
        return self._shards[hash(key) % SHARDS].get(key, default)

    @overload
    def pop(self, key: K) -> V: ...
    @overload
    def pop(self, key: K, default: V | D) -> V | D: ...

    def pop(self, key: K, default: object = MISSING) -> object:
        shard: dict[K, object] = self._shards[hash(key) % SHARDS]  # type: ignore[assignment]
        return shard.pop(key) if default is MISSING else shard.pop(key, default)

    def setdefault(self, key: K, default: V) -> V:
        return self._shards[hash(key) % SHARDS].setdefault(key, default)

    @property
    def dicts(self) -> list[dict[K, V]]:
        """The shards themselves: a key is in dicts[hash(key) % SHARDS] (native writers of a
        replay insert through them: pipeline/admission.py `replay_stretch`)."""
        return self._shards

    def update(self, pairs: Iterable[tuple[K, V]]) -> None:
        """self[key] = value for each pair, in order."""
        _update(self._shards, pairs)

    def pop_all(self, keys: Iterable[K], default: object = MISSING) -> list[V]:
        """[pop(key) or pop(key, default) for key in keys], in one call (a retirement removes
        hundreds)."""
        if default is MISSING:
            return _pop_all(self._shards, keys)
        return _pop_all(self._shards, keys, default)

    def clear(self) -> None:
        for shard in self._shards:
            shard.clear()

    def __len__(self) -> int:
        return sum(map(len, self._shards))

    def __iter__(self) -> Iterator[K]:
        for shard in self._shards:
            yield from shard

    def keys(self) -> Iterator[K]:
        return iter(self)

    def values(self) -> Iterator[V]:
        for shard in self._shards:
            yield from shard.values()

    def items(self) -> Iterator[tuple[K, V]]:
        for shard in self._shards:
            yield from shard.items()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Shards):
            return self._shards == other._shards  # the same key is in the same shard in both
        if isinstance(other, dict):
            return len(self) == len(other) and all(other.get(k, MISSING) == v for k, v in self.items())
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Shards({dict(self.items())!r})"


class FixedMap(Protocol[K]):
    """What a native FixedMap (gpu_worker/native/fixedmap.cpp) answers: a hash table of keys of
    one fixed layout to rows, sized from the table it indexes so that no insert ever rebuilds it
    (what `Shards` only spreads over its dicts), its entries kept without a Python object each.
    Made by `fixed_map`."""

    slots: int

    def __getitem__(self, key: K) -> int: ...
    def __setitem__(self, key: K, row: int) -> None: ...
    def __delitem__(self, key: K) -> None: ...
    def __contains__(self, key: object) -> bool: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[K]: ...
    @overload
    def get(self, key: K) -> int | None: ...
    @overload
    def get(self, key: K, default: D) -> int | D: ...
    @overload
    def pop(self, key: K) -> int: ...
    @overload
    def pop(self, key: K, default: D) -> int | D: ...
    def setdefault(self, key: K, row: int) -> int: ...
    def update(self, pairs: Iterable[tuple[K, int]]) -> None: ...
    def pop_all(self, keys: Iterable[K], default: object = ...) -> list[Any]: ...
    def put_packed(self, keys: Any, rows: Any) -> None: ...
    def pop_packed(self, keys: Any, strict: bool = ...) -> bytearray: ...
    def keys(self) -> list[K]: ...
    def values(self) -> list[int]: ...
    def items(self) -> list[tuple[K, int]]: ...
    def clear(self) -> None: ...


def fixed_map(layout: str, capacity: int) -> FixedMap[Any]:
    """A FixedMap of keys laid out as `layout` ("b16": 16 bytes; "ii": a tuple of two ints, each
    kept in int64; "b16b16": a tuple of two 16-byte strings), room for `capacity` entries without
    growing: the rows of the table it indexes. A key of another shape is one that is not there."""
    made: FixedMap[Any] = NativeFixedMap(layout, capacity)
    return made
