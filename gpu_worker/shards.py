"""A dictionary in shards, so that no single insert stops the tick thread for long.

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
from typing import Generic, TypeVar, overload

from . import native

K = TypeVar("K")
V = TypeVar("V")
D = TypeVar("D")

# A prime: an int key's hash is the int itself, and the indexes' int keys carry a participant row in
# their low bits (sequence << 32 | row), which a power of two would send to one shard.
SHARDS = 251
MISSING = object()
_native = native.load("shards")
_update, _pop_all = _native.update, _native.pop_all


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
