"""Exact top-k recall over the memory table's embedding matrix, restricted to what the caller may
see.

The matrix holds one L2-normalised float32 vector per memory row (capacity rows, on the tables'
torch device). `owners` (int64) holds each row's memory owner as a number: 0 for a free row, else
the owner's slot + 1. A caller's visibility is a bool table indexed by that number, built from its
current grants ∩ membership, transitive through publication, by the caller of `recall`; one
gather turns it into the row mask. A free row is never recalled whatever the table says; an owner
number past the table is invisible to the native scan and an IndexError in torch. Then:

- on the CPU, one query at a time goes to the native scan `aotx_cpu.masked_top_k`
  (engine/recall_scan.cpp): a pass over the owner column that scores only the visible rows and keeps
  the k best per thread, without materialising a mask or a score per row;
- otherwise (a GPU, a batch of queries, or no native operators), when few rows are visible (at
  most `GATHER_FRACTION` of the table) only those rows are scored (index_select + matmul: work
  proportional to what is visible), else every row is scored with one matmul and the invisible
  ones are masked to -inf;
- the answer is exact: equal scores are ordered by row number (lower first), so it is also
  deterministic.

Scores are inner products, which for normalised vectors are cosine similarities."""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..engine.cpu_ops import ops as cpu_ops

GATHER_FRACTION = 0.25


class Recalled(NamedTuple):
    scores: torch.Tensor  # (queries, k) float32, best first; -inf pads where fewer rows are visible
    rows: torch.Tensor    # (queries, k) int64 row numbers; -1 pads


def visibility_table(owner_numbers: torch.Tensor, size: int) -> torch.Tensor:
    """The bool table `recall` takes: True at each given owner number (slot + 1), size entries."""
    table = torch.zeros(size, dtype=torch.bool, device=owner_numbers.device)
    table[owner_numbers] = True
    table[0] = False  # free rows are never visible
    return table


def recall(embeddings: torch.Tensor, owners: torch.Tensor, visibility: torch.Tensor,
           queries: torch.Tensor, k: int) -> Recalled:
    """The k most similar visible rows for each query ((queries, dim) or (dim,))."""
    if queries.dim() == 1:
        queries = queries.unsqueeze(0)
    n_queries = queries.shape[0]
    native = cpu_ops() if embeddings.device.type == "cpu" and n_queries == 1 else None
    if native is not None:
        scores, rows = native.masked_top_k(embeddings, owners, visibility, queries[0].contiguous(), k)
        return Recalled(scores.unsqueeze(0), rows.unsqueeze(0))
    return recall_torch(embeddings, owners, visibility, queries, k)


def recall_torch(embeddings: torch.Tensor, owners: torch.Tensor, visibility: torch.Tensor,
                 queries: torch.Tensor, k: int) -> Recalled:
    """`recall` in torch operators alone (any device, any number of queries)."""
    n_queries = queries.shape[0]
    mask = visibility[owners] & (owners > 0)
    rows = mask.nonzero().squeeze(1)
    count = int(rows.numel())
    take = min(k, count)
    scores = torch.full((n_queries, k), float("-inf"), dtype=torch.float32, device=embeddings.device)
    picked = torch.full((n_queries, k), -1, dtype=torch.int64, device=embeddings.device)
    if take == 0:
        return Recalled(scores, picked)
    if count <= GATHER_FRACTION * embeddings.shape[0]:
        candidate = queries @ torch.index_select(embeddings, 0, rows).T  # (queries, count)
        values, indices = _top(candidate, take)
        picked[:, :take] = rows[indices]
    else:
        every = queries @ embeddings.T  # (queries, capacity)
        every.masked_fill_(~mask, float("-inf"))
        values, indices = _top(every, take)
        picked[:, :take] = indices
    scores[:, :take] = values
    return Recalled(scores, picked)


def _top(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top k per row, equal scores by lower column. topk alone decides when the k (+1) best scores
    of every row are distinct; a row with a tie among them (rare with real embeddings) is ranked
    whole with a stable sort instead, which keeps equal scores in column order."""
    width = scores.shape[1]
    values, indices = torch.topk(scores, min(width, k + 1), dim=1, sorted=True)
    if values.shape[1] < 2 or not bool((values[:, 1:] == values[:, :-1]).any()):
        return values[:, :k], indices[:, :k]
    values, indices = torch.sort(scores, dim=1, descending=True, stable=True)
    return values[:, :k], indices[:, :k]
