"""Recall (gpu_worker/memory/recall.py) is exact: the native CPU scan and the torch path both give
the brute-force answer — the k best visible rows by inner product, equal scores by lower row,
padded with -inf / -1 when fewer are visible — for every visibility pattern."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.engine.cpu_ops import ops
from gpu_worker.memory.recall import GATHER_FRACTION, recall, recall_torch, visibility_table

DIM = 16


def brute(embeddings, owners, visibility, query, k):
    hits = sorted(((float(embeddings[r] @ query), r) for r in range(len(owners))
                   if 0 <= int(owners[r]) < len(visibility) and bool(visibility[int(owners[r])])),
                  key=lambda h: (-h[0], h[1]))[:k]
    scores = [s for s, _ in hits] + [float("-inf")] * (k - len(hits))
    rows = [r for _, r in hits] + [-1] * (k - len(hits))
    return scores, rows


def paths():
    out = [("torch", lambda e, o, v, q, k: recall_torch(e, o, v, q.unsqueeze(0), k))]
    if ops() is not None:
        out.append(("native", lambda e, o, v, q, k: recall(e, o, v, q, k)))
    return out


def check(embeddings, owners, visibility, query, k):
    want_scores, want_rows = brute(embeddings, owners, visibility, query, k)
    for name, path in paths():
        got = path(embeddings, owners, visibility, query, k)
        assert got.rows[0].tolist() == want_rows, name
        assert torch.allclose(got.scores[0], torch.tensor(want_scores), atol=1e-5), name


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 120), owners=st.integers(1, 6), k=st.integers(1, 12), seed=st.integers(0, 2**31),
       grid=st.booleans())
def test_recall_is_the_brute_force_answer(rows, owners, k, seed, grid):
    g = torch.Generator().manual_seed(seed)
    vectors = torch.randn(rows, DIM, generator=g)
    if grid:  # coarse values: many exactly equal scores, so the tie order is exercised
        vectors = vectors.round()
    owner = torch.randint(0, owners + 1, (rows,), generator=g)  # 0: a free row
    visible = torch.randint(0, owners + 1, (max(1, owners // 2),), generator=g)
    check(vectors.contiguous(), owner, visibility_table(visible, owners + 1), torch.randn(DIM, generator=g), k)


def test_free_rows_and_owner_numbers_outside_the_table_are_never_recalled():
    vectors = torch.eye(DIM)[:6].contiguous()  # every row scores 1.0 against the query: ties by row
    table = torch.tensor([True, True, False])  # entry 0 set on purpose: free rows must stay out anyway
    query = torch.ones(DIM)
    for name, path in paths():
        owners = torch.tensor([0, 1, 2, 2, 1, 0])
        assert path(vectors, owners, table, query, 4).rows[0].tolist() == [1, 4, -1, -1], name
    if ops() is not None:  # the native scan also refuses an owner number past the table (9)
        got = recall(vectors, torch.tensor([0, 1, 2, 9, 1, 0]), table, query, 4)
        assert got.rows[0].tolist() == [1, 4, -1, -1]
    assert not bool(visibility_table(torch.tensor([0, 1]), 3)[0])


def test_nothing_visible_answers_padding_only():
    vectors = torch.randn(10, DIM)
    for name, path in paths():
        got = path(vectors, torch.ones(10, dtype=torch.long), visibility_table(torch.tensor([2]), 3), torch.randn(DIM), 3)
        assert got.rows[0].tolist() == [-1, -1, -1] and bool(torch.isinf(got.scores[0]).all()), name


@pytest.mark.parametrize("share", [0.05, 0.9])
def test_both_torch_strategies_gather_and_full_scan_agree(share):
    g = torch.Generator().manual_seed(7)
    rows = 2000
    vectors = torch.nn.functional.normalize(torch.randn(rows, DIM, generator=g), dim=1)
    owners = torch.randint(1, 101, (rows,), generator=g)
    visible = torch.arange(1, 1 + int(100 * share))
    table = visibility_table(visible, 101)
    assert (float(table[owners].float().mean()) <= GATHER_FRACTION) == (share < GATHER_FRACTION)
    queries = torch.randn(3, DIM, generator=g)
    batched = recall_torch(vectors, owners, table, queries, 5)
    for i in range(3):
        check(vectors, owners, table, queries[i], 5)
        single = recall(vectors, owners, table, queries[i], 5)
        assert single.rows[0].tolist() == batched.rows[i].tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_gpu_path_gives_the_cpu_answer():
    g = torch.Generator().manual_seed(5)
    embeddings = torch.nn.functional.normalize(torch.randn(20000, 384, generator=g), dim=1)
    owners = torch.randint(0, 201, (20000,), generator=g)
    visibility = visibility_table(torch.randint(1, 201, (60,), generator=g), 201)
    queries = torch.nn.functional.normalize(torch.randn(4, 384, generator=g), dim=1)
    cpu = recall(embeddings, owners, visibility, queries, 10)
    gpu = recall(embeddings.cuda(), owners.cuda(), visibility.cuda(), queries.cuda(), 10)
    assert gpu.rows.cpu().tolist() == cpu.rows.tolist()
    assert torch.allclose(gpu.scores.cpu(), cpu.scores, atol=1e-4)
