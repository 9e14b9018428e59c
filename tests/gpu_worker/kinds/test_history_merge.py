"""A retirement folds its inputs' turns into each conversation's history in one pass
(kinds/history.py `merge`): the records must be exactly those of folding them one at a time,
sorted() with each new record and the oldest dropped while over the row's bound, as fold did
before it was batched."""
from hypothesis import given, settings, strategies as st

from gpu_worker.kinds.history import UNKNOWN, _encode, merge

LIMIT = 64


def one_at_a_time(records, new, limit):
    for record in new:
        records = sorted(records + [record])
        while sum(len(_encode(*r)) for r in records) > limit:
            records.pop(0)
    return records


record = st.tuples(st.integers(0, 40), st.sampled_from([UNKNOWN, 0, 1, 2]), st.binary(max_size=16),
                   st.binary(max_size=20))


@settings(max_examples=400, deadline=None)
@given(st.lists(record, max_size=8), st.lists(record, max_size=12), st.booleans())
def test_merge_is_folding_one_at_a_time(old, new, rising):
    stored = one_at_a_time([], old, LIMIT)  # a row as folds left it: sorted, within its bound
    if rising:  # a retirement's turns: one participant's inputs, their event orders ascending
        new = sorted(new, key=lambda r: r[0])
    assert merge(stored, new, LIMIT) == one_at_a_time(stored, new, LIMIT)
    assert sum(len(_encode(*r)) for r in merge(stored, new, LIMIT)) <= LIMIT
