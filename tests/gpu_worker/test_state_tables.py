"""The whole-table passes a boot uses (state/tables.py, state/indexes.py) against the row-by-row
writes and lookups the device makes as it runs: the same bytes, the same lineages."""
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.state.indexes import ParticipantIndex
from gpu_worker.state.tables import Tables

CAPACITIES = {"participants": 4, "spaces": 4, "members": 4, "conversations": 4, "receipts": 64, "command_bytes": 48,
              "result_bytes": 8, "history_bytes": 32}


@settings(max_examples=80, deadline=None)
@given(lengths=st.dictionaries(st.integers(0, 63), st.integers(0, 48), max_size=40), seed=st.integers(0, 1000))
def test_put_packed_writes_each_row_exactly_as_put_bytes_does(lengths, seed):
    rows = np.array(sorted(lengths), dtype=np.int64)
    sizes = np.array([lengths[r] for r in rows.tolist()], dtype=np.int64)
    blob = np.random.default_rng(seed).integers(0, 256, int(sizes.sum()), dtype=np.uint8).tobytes()
    packed, by_row = Tables(CAPACITIES), Tables(CAPACITIES)
    packed.put_packed(packed.command_bytes, rows, sizes, blob)
    at = 0
    for r, n in zip(rows.tolist(), sizes.tolist()):
        by_row.put_bytes(by_row.command_bytes, r, blob[at:at + n])
        at += n
    assert torch.equal(packed.command_bytes, by_row.command_bytes)


@pytest.mark.parametrize("rows, lengths, blob, problem", [
    ([1, 2], [3, 3], 7, "given for rows holding"),  # a blob longer than the lengths
    ([1, 2], [3, 3], 5, "blob is shorter than the lengths"),
    ([64], [1], 1, "outside the table"),
    ([-1], [1], 1, "outside the table"),
    ([0], [49], 49, "does not fit a row"),
    ([0], [-1], 0, "does not fit a row"),
])
def test_put_packed_refuses_what_does_not_fit(rows, lengths, blob, problem):
    tables = Tables(CAPACITIES)
    with pytest.raises(ValueError, match=problem):
        tables.put_packed(tables.command_bytes, np.array(rows, dtype=np.int64), np.array(lengths, dtype=np.int64),
                          os.urandom(blob))


@settings(max_examples=60, deadline=None)
@given(starts=st.lists(st.integers(1, 50), max_size=4).map(sorted),
       pairs=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 60)), max_size=30))
def test_lineages_at_is_lineage_at_for_every_row(starts, pairs):
    """Every line of history a restore started (none, one, several, two at one counter), every
    counter before, at and after each line's first."""
    index = ParticipantIndex(b"i" * 16, 4)
    index.load_lineages([[first, bytes([n]) * 16] for n, first in enumerate(starts)])
    for prow in range(4):
        index.add(prow, bytes([prow + 100]) * 16)
    prows = np.array([p for p, _ in pairs], dtype=np.int64)
    counters = np.array([c for _, c in pairs], dtype=np.int64)
    assert [bytes(row) for row in index.lineages_at(prows, counters)] == [index.lineage_at(p, c) for p, c in pairs]


def test_the_accelerator_paths_write_exactly_what_the_host_paths_do():
    """On an accelerator the tables have no flat host views and every write goes through torch
    indexing (state/tables.py); run here with the views off, the same writes leave the same bytes."""
    from gpu_worker.pipeline.admission import _RECEIPT_ROW
    from gpu_worker.kinds.spaces import _ROW as SPACE_ROW
    host, accelerator = Tables(CAPACITIES), Tables(CAPACITIES)
    accelerator._flat = None
    rng = np.random.default_rng(7)
    rows = np.array([0, 1, 2, 5, 9], dtype=np.int64)
    lengths = np.array([3, 48, 0, 17, 1], dtype=np.int64)
    blob = os.urandom(int(lengths.sum()))
    values = rng.integers(-1 << 62, 1 << 62, (len(rows), 5))
    digests = rng.integers(0, 256, (2, 2, 32), dtype=np.uint8)
    for t in (host, accelerator):
        t.put_struct(t.receipts, 7, 0, _RECEIPT_ROW, 1, 2, 3, 4, b"k" * 16, b"o" * 16, 5, 6, 7, 0, 1, *range(8, 16))
        t.put_struct(t.spaces, 2, 0, SPACE_ROW, 1, 3, 2, b"i" * 16, 9, b"p" * 16)
        t.put_value(t.participants, 1, 2, -5)
        t.put_packed(t.command_bytes, rows, lengths, blob)
        t.put_rows(t.conversations, np.array([0, 1], dtype=np.int64), values[:2])
        t.put_rows(t.conversations, np.array([3], dtype=np.int64), values[2:3])  # not consecutive with those
        t.put_digest_block(np.array([9, 3]), digests)  # (a replay's run of admissions)
    for name in ("receipts", "spaces", "participants", "command_bytes", "conversations", "receipt_digests"):
        assert torch.equal(getattr(host, name), getattr(accelerator, name)), name
    assert host.receipt_digests[[9, 3]].numpy().tobytes() == digests.tobytes()
    assert (host.take(host.receipts, rows) == Tables.array(host.receipts)[rows]).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh runs it on a lent GPU)")
def test_tables_on_cuda_hold_what_host_tables_do():
    """The same writes and whole-table loads on CUDA tables and on host tables leave the same bytes."""
    from gpu_worker.pipeline.admission import _RECEIPT_ROW
    host, cuda = Tables(CAPACITIES), Tables(CAPACITIES, "cuda")
    rows = np.array([0, 1, 2, 5, 9], dtype=np.int64)
    lengths = np.array([3, 48, 0, 17, 1], dtype=np.int64)
    blob = os.urandom(int(lengths.sum()))
    values = np.random.default_rng(3).integers(-1 << 62, 1 << 62, (len(rows), 5))
    digests = np.random.default_rng(4).integers(0, 256, (2, 2, 32), dtype=np.uint8)
    for t in (host, cuda):
        t.put_struct(t.receipts, 7, 0, _RECEIPT_ROW, 1, 2, 3, 4, b"k" * 16, b"o" * 16, 5, 6, 7, 0, 1, *range(8, 16))
        t.put_value(t.participants, 1, 2, -5)
        t.put_packed(t.command_bytes, rows, lengths, blob)
        t.put_rows(t.conversations, rows, values)
        t.put_digest_block(np.array([9, 3]), digests)
    for name in ("receipts", "participants", "command_bytes", "conversations", "receipt_digests"):
        assert torch.equal(getattr(host, name), getattr(cuda, name).cpu()), name
    assert (cuda.take(cuda.receipts, rows) == Tables.array(host.receipts)[rows]).all()


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.integers(0, 63), max_size=80), seed=st.integers(0, 1000))
def test_a_cpu_tables_take_is_numpys_fancy_indexing(rows, seed):
    """Tables.take on the CPU (jcodec.cpp `gather`, the rows' lines prefetched): the rows numpy's
    indexing gives, repeated and in any order, as a writable array; a row past the table refused."""
    t = Tables(CAPACITIES)
    rng = np.random.default_rng(seed)
    t.receipts.copy_(torch.from_numpy(rng.integers(-1 << 62, 1 << 62, tuple(t.receipts.shape))))
    t.command_bytes.copy_(torch.from_numpy(rng.integers(0, 256, tuple(t.command_bytes.shape), dtype=np.uint8)))
    at = np.array(rows, dtype=np.int64)
    for table in (t.receipts, t.command_bytes):
        taken = t.take(table, at)
        assert taken.dtype == table.numpy().dtype and taken.flags.writeable
        assert taken.shape == (len(rows), table.shape[1]) and (taken == table.numpy()[at]).all()
    with pytest.raises(ValueError, match="outside the table"):
        t.take(t.receipts, np.array([64], dtype=np.int64))


def test_marking_a_fold_on_the_cpu_runs_no_torch_operator():
    """The tick thread marks a fold's receipts in slices between ticks; torch would run those
    element-wise passes on its intra-op threads, whose barrier waits for a core another process
    holds (docs/performance.md has the figures): on the CPU the mark goes through numpy,
    and marks exactly what torch marked."""
    from gpu_worker.state.tables import R, SOURCE_MASK, Source
    caps = dict(CAPACITIES, receipts=4096)
    tables = Tables(caps)
    rng = np.random.default_rng(3)
    tables.receipts[:, R.STATE] = torch.from_numpy(rng.integers(0, 2, 4096))
    tables.receipts[:, R.ADM_TRANSFER] = torch.from_numpy(rng.integers(0, 50, 4096))
    tables.receipts[:, R.TERM_TRANSFER] = torch.from_numpy(rng.integers(0, 50, 4096))
    expected = tables.receipts.clone()
    view = expected[100:3000]
    for transfer, source, generation in ((R.ADM_TRANSFER, R.ADM_SOURCE, R.ADM_GENERATION),
                                         (R.TERM_TRANSFER, R.TERM_SOURCE, R.TERM_GENERATION)):
        marked = (view[:, R.STATE] != 0) & (view[:, transfer] != 0) & (view[:, transfer] <= 30)
        view[marked, source] = (view[marked, source] & ~SOURCE_MASK) | int(Source.FILE)
        view[marked, generation] = 7
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        tables.mark_folded(7, 30, slice(100, 3000))
    # (what torch records of Tensor.numpy() itself: views of the same memory, no pass over it)
    assert {event.name for event in profile.events()} <= {"aten::detach", "detach", "aten::to", "aten::resolve_conj",
                                                          "aten::resolve_neg"}
    assert torch.equal(tables.receipts, expected)


def test_fresh_tables_index_as_a_rebuild_of_them_does():
    """rebuild_indexes(empty=True), the load of a journal with no checkpoint, reads no column:
    every row free, in the order a rebuild of the same empty tables hands them out."""
    from gpu_worker.state import DeviceState
    from gpu_worker.storage.runtime_file import DEFAULT_CAPACITIES
    scanned, fresh = (DeviceState(DEFAULT_CAPACITIES, "cpu", b"i" * 16, 1) for _ in range(2))
    scanned.rebuild_indexes(1)
    fresh.rebuild_indexes(1, empty=True)
    for name in ("participants", "receipts", "spaces", "members", "conversations"):
        assert getattr(fresh, name).free == getattr(scanned, name).free, name
    assert fresh.media == scanned.media == {}
