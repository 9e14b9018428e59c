"""Admission within the page budget, on a pool of 8 pages of 16 tokens with a page grant of 4."""
import pytest

from gpu_worker.engine import Engine, EngineRefusal, Status
from gpu_worker.engine.block_manager import BlockManager

PROMPT = list(range(10, 30))  # 20 tokens: two pages


@pytest.fixture
def engine(small_pool):
    engine = Engine(small_pool)
    assert (engine.pool.total, engine.page_grant, engine.page_size) == (8, 4, 16)
    return engine


def run_until_finished(engine, seq, limit=200):
    for _ in range(limit):
        if seq.is_finished:
            return
        engine.step()
    raise AssertionError(f"{seq.request_id} did not finish in {limit} steps")


def test_requests_beyond_the_budget_wait_for_a_later_group(engine):
    a = engine.submit("a", PROMPT, max_new_tokens=5, page_limit=4, ignore_eos=True)
    b = engine.submit("b", PROMPT, max_new_tokens=40, page_limit=4, ignore_eos=True)
    c = engine.submit("c", PROMPT, max_new_tokens=5, page_limit=3, ignore_eos=True)
    assert engine.pool.pending == 11
    events = engine.step()
    assert [event[0] for event in events] == ["a", "b"]  # one group: 4 + 4 pages; c's 3 more would exceed 8
    assert (a.status, b.status, c.status) == (Status.RUNNING, Status.RUNNING, Status.WAITING)
    pool = engine.pool
    assert (pool.owned, pool.free, pool.pending, pool.running, pool.waiting) == (8, 0, 3, 2, 1)
    assert (pool.used, pool.reserved) == (4, 4)  # 20 prompt tokens each fill two of their four pages
    run_until_finished(engine, a)
    assert c.status is Status.WAITING and engine.pool.free == 4  # a's pages came back the step it finished
    assert "c" in [event[0] for event in engine.step()]  # the next round admits c
    assert c.status is Status.RUNNING and engine.pool.owned == 7
    run_until_finished(engine, b)
    run_until_finished(engine, c)
    assert engine.pool.free == 8 and not engine.has_work


def test_admission_is_fifo_so_a_small_request_does_not_overtake_a_large_one(engine):
    engine.submit("big-running", PROMPT, max_new_tokens=30, page_limit=4, ignore_eos=True)
    engine.step()
    large = engine.submit("large", PROMPT, max_new_tokens=5, page_limit=4, ignore_eos=True)
    small = engine.submit("small", PROMPT, max_new_tokens=5, page_limit=2, ignore_eos=True)
    engine.step()
    assert large.status is Status.RUNNING and small.status is Status.WAITING  # 4 + 4 = 8 fits, 2 more does not
    engine.cancel("large")
    engine.step()
    assert small.status is Status.RUNNING


def test_a_waiting_request_blocks_later_ones_until_it_fits(engine):
    engine.submit("x", PROMPT, max_new_tokens=30, page_limit=3, ignore_eos=True)
    engine.submit("y", PROMPT, max_new_tokens=30, page_limit=3, ignore_eos=True)
    engine.step()
    large = engine.submit("large", PROMPT, max_new_tokens=5, page_limit=4, ignore_eos=True)
    small = engine.submit("small", PROMPT, max_new_tokens=5, page_limit=2, ignore_eos=True)
    engine.step()
    # 2 pages are free: small would fit, but large is ahead of it in the queue.
    assert (large.status, small.status) == (Status.WAITING, Status.WAITING)


def test_cancel_frees_a_running_requests_pages_at_once(engine):
    seq = engine.submit("a", PROMPT, max_new_tokens=50, page_limit=4, ignore_eos=True)
    engine.step()
    assert engine.pool.owned == 4
    assert engine.cancel("a") is True
    assert (seq.status, seq.finish_reason, seq.pages) == (Status.FINISHED, "cancelled", [])
    assert engine.pool.free == 8 and engine.pool.running == 0
    assert engine.cancel("a") is False
    assert engine.step() == []


def test_cancel_removes_a_waiting_request(engine):
    engine.submit("a", PROMPT, max_new_tokens=50, page_limit=4, ignore_eos=True)
    engine.submit("b", PROMPT, max_new_tokens=50, page_limit=4, ignore_eos=True)
    waiting = engine.submit("c", PROMPT, max_new_tokens=50, page_limit=4, ignore_eos=True)
    engine.step()
    assert engine.cancel("c") and waiting.finish_reason == "cancelled"
    assert engine.pool.waiting == 0 and engine.pool.pending == 0


def test_a_page_limit_larger_than_the_pool_is_refused(engine):
    with pytest.raises(EngineRefusal) as refused:
        engine.submit("a", PROMPT, max_new_tokens=5, page_limit=9)
    assert refused.value.code == "page_limit_exceeds_pool"
    assert "9" in refused.value.message and "8 pages" in refused.value.message
    assert not engine.has_work


def test_a_page_limit_larger_than_the_page_grant_is_refused(engine):
    with pytest.raises(EngineRefusal) as refused:
        engine.submit("a", PROMPT, max_new_tokens=5, page_limit=5)
    assert refused.value.code == "page_limit_exceeds_grant"


def test_a_prompt_longer_than_its_page_limit_is_refused(engine):
    with pytest.raises(EngineRefusal) as refused:
        engine.submit("a", list(range(3, 40)), max_new_tokens=5, page_limit=2)
    assert refused.value.code == "prompt_exceeds_page_limit"


@pytest.mark.parametrize("settings, code", [
    ({"max_new_tokens": 0}, "invalid_max_new_tokens"),
    ({"max_new_tokens": 5, "temperature": -1.0}, "invalid_temperature"),
    ({"max_new_tokens": 5, "temperature": float("nan")}, "invalid_temperature"),
    ({"max_new_tokens": 5, "top_p": 0.0}, "invalid_top_p"),
    ({"max_new_tokens": 5, "page_limit": 0}, "invalid_page_limit"),
])
def test_invalid_settings_are_refused(engine, settings, code):
    with pytest.raises(EngineRefusal) as refused:
        engine.submit("a", PROMPT, **settings)
    assert refused.value.code == code


def test_bad_prompts_and_duplicate_ids_are_refused(engine):
    for prompt, code in (([], "empty_prompt"), ([1, 10 ** 6], "token_out_of_range")):
        with pytest.raises(EngineRefusal) as refused:
            engine.submit("a", prompt, max_new_tokens=5)
        assert refused.value.code == code
    engine.submit("a", PROMPT, max_new_tokens=5)
    with pytest.raises(EngineRefusal) as refused:
        engine.submit("a", PROMPT, max_new_tokens=5)
    assert refused.value.code == "duplicate_request"


def test_a_request_ends_with_length_when_its_pages_are_full(engine):
    # One page holds 16 tokens: a 10-token prompt leaves room for 16 - 10 + 1 = 7 output tokens.
    seq = engine.submit("a", PROMPT[:10], max_new_tokens=100, page_limit=1, ignore_eos=True)
    run_until_finished(engine, seq)
    assert (len(seq.output_ids), seq.finish_reason) == (7, "length")


def test_the_default_page_limit_covers_prompt_and_output(engine):
    seq = engine.submit("a", PROMPT, max_new_tokens=13)
    assert seq.page_limit == 2  # 20 + 13 - 1 = 32 tokens: exactly two pages
    seq = engine.submit("b", PROMPT, max_new_tokens=14)
    assert seq.page_limit == 3


def test_block_manager_refuses_double_free_and_overdraw():
    pool = BlockManager(4)
    pages = pool.allocate(3)
    assert pool.num_free == 1 and sorted(pages) == [0, 1, 2]
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    pool.free(pages)
    with pytest.raises(RuntimeError):
        pool.free(pages[:1])
    assert pool.num_free == 4


def admitted_order(engine, steps=400):
    """Request ids in the order the scheduler admitted them, stepping until nothing is left."""
    order = []
    admit = engine.scheduler.admit

    def recording(*args):
        group = admit(*args)
        order.extend(seq.request_id for seq in group)
        return group
    engine.scheduler.admit = recording
    for _ in range(steps):
        if not engine.has_work:
            return order
        engine.step()
    raise AssertionError("requests did not finish")


def test_a_flooding_tenant_takes_one_turn_per_round_and_fifo_within_it(engine):
    # the pool holds two requests of 4 pages at once: a's flood of six, then b's single request
    for i in range(6):
        engine.submit(f"a{i}", PROMPT, max_new_tokens=3, page_limit=4, ignore_eos=True, tenant="a")
    engine.submit("b0", PROMPT, max_new_tokens=3, page_limit=4, ignore_eos=True, tenant="b")
    order = admitted_order(engine)
    assert order.index("b0") < order.index("a5")  # admitted before the flood drained
    assert order[:3] == ["a0", "b0", "a1"]  # a's turn, then b's: b waits behind one of a's, not five
    assert [r for r in order if r.startswith("a")] == [f"a{i}" for i in range(6)]  # FIFO within a tenant


def test_a_tenant_whose_head_does_not_fit_keeps_its_turn_and_nobody_overtakes_it(engine):
    engine.submit("r1", PROMPT, max_new_tokens=40, page_limit=3, ignore_eos=True, tenant="a")
    engine.submit("r2", PROMPT, max_new_tokens=40, page_limit=2, ignore_eos=True, tenant="b")
    engine.step()  # 5 of 8 pages owned
    big = engine.submit("big", PROMPT, max_new_tokens=5, page_limit=4, ignore_eos=True, tenant="c")
    small = engine.submit("small", PROMPT, max_new_tokens=5, page_limit=2, ignore_eos=True, tenant="a")
    engine.step()
    # c's turn comes first and its 4 pages do not fit; a's 2 would, but do not overtake it
    assert (big.status, small.status) == (Status.WAITING, Status.WAITING)
    engine.cancel("r2")
    engine.step()
    assert big.status is Status.RUNNING and small.status is Status.WAITING  # 3 + 4 owned; 2 more do not fit


# ---- fair shares under contention (shares.py) ------------------------------------------------------

def test_a_tenant_alone_fills_the_pool_and_gives_back_to_a_newcomer_below_its_share_first(engine):
    # a's four requests of 2 pages fill the 8-page pool while a is alone (no share binds then)
    a = [engine.submit(f"a{i}", PROMPT, max_new_tokens=n, page_limit=2, ignore_eos=True, tenant="a")
         for i, n in enumerate((3, 6, 60, 60))]
    engine.step()
    assert all(seq.status is Status.RUNNING for seq in a) and engine.pool.free == 0
    b = [engine.submit(f"b{i}", PROMPT, max_new_tokens=60, page_limit=2, ignore_eos=True, tenant="b") for i in range(2)]
    later = [engine.submit(f"a{i}", PROMPT, max_new_tokens=60, page_limit=2, ignore_eos=True, tenant="a")
             for i in (4, 5)]
    run_until_finished(engine, a[0])
    engine.step()
    assert b[0].status is Status.RUNNING  # b's turn comes first
    run_until_finished(engine, a[1])
    engine.step()
    # a holds 4 pages (its share of 8 between two), b 2: a's next request would pass its share, so
    # the pages a gave back go to b (round-robin alone would have given them to a, whose turn it was)
    assert b[1].status is Status.RUNNING and all(seq.status is Status.WAITING for seq in later)
    assert engine.scheduler.budgeted_by == {"a": 4, "b": 4}


def test_pages_never_stay_idle_while_a_tenant_at_its_share_waits(engine):
    engine.submit("b0", PROMPT, max_new_tokens=60, page_limit=2, ignore_eos=True, tenant="b")
    a = [engine.submit(f"a{i}", PROMPT, max_new_tokens=60, page_limit=2, ignore_eos=True, tenant="a")
         for i in range(3)]
    engine.step()
    # a's third request passes its share of 4 pages, but nobody below its share waits: it runs
    assert all(seq.status is Status.RUNNING for seq in a) and engine.pool.owned == 8
