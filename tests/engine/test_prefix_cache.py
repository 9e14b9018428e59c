"""The prefix cache over full KV pages (block_manager.py): a conversation's next turn reuses the
pages of its earlier turns and prefills only what is new, with the same greedy tokens as a cold
engine; pages are shared only within one tenant; cached pages are evicted, least recently used
first, only when an allocation needs them; the admission budget stays every request's whole page
limit."""
import pytest

from gpu_worker.engine.block_manager import BlockManager, page_hashes
from gpu_worker.engine.engine import Engine


def conversation(engine, turns, tenant="alice", max_new_tokens=12):
    """Greedy turns of one conversation: (output ids, cached prompt tokens) per turn."""
    messages, out = [], []
    for n in range(turns):
        messages.append({"role": "user", "content": f"question number {n}: what is the capital of france?"})
        prompt = engine.tokenizer.encode_chat(messages)
        [seq] = engine.generate([prompt], max_new_tokens=max_new_tokens, tenant=tenant)
        out.append((seq.output_ids, seq.cached_tokens))
        messages.append({"role": "assistant", "content": engine.tokenizer.decode(seq.output_ids)})
    return out


def test_later_turns_reuse_the_earlier_pages_with_the_same_greedy_tokens(tiny_gen):
    warm, cold = Engine(tiny_gen), Engine(tiny_gen, prefix_cache=False)
    with_reuse, without = conversation(warm, 6), conversation(cold, 6)
    assert [ids for ids, _ in with_reuse] == [ids for ids, _ in without]
    assert with_reuse[0][1] == 0 and all(cached > 0 for _, cached in with_reuse[1:])
    assert all(cached == 0 for _, cached in without)
    # each later turn starts from at least the whole previous prompt's full pages
    assert [c for _, c in with_reuse] == sorted(c for _, c in with_reuse)
    assert warm.block_manager.hits > 0 and cold.block_manager.hits == 0


def test_pages_are_shared_only_within_a_tenant(tiny_gen):
    engine = Engine(tiny_gen)
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "the capital of france is paris " * 6}])
    [first] = engine.generate([prompt], max_new_tokens=2, tenant="alice")
    [other] = engine.generate([prompt], max_new_tokens=2, tenant="mallory")
    [again] = engine.generate([prompt], max_new_tokens=2, tenant="alice")
    assert first.cached_tokens == 0 and other.cached_tokens == 0 and again.cached_tokens > 0
    assert first.output_ids == other.output_ids == again.output_ids


def test_requests_in_flight_share_a_prefix_page(tiny_gen):
    engine = Engine(tiny_gen)
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "shared prefix " * 10}])
    a = engine.submit("a", prompt, max_new_tokens=20, tenant="t")
    engine.step()  # a is prefilled: its prompt pages are registered
    b = engine.submit("b", prompt, max_new_tokens=20, tenant="t")
    engine.step()
    assert b.cached_tokens > 0 and set(a.pages) & set(b.pages)
    while engine.has_work:
        engine.step()
    [cold] = Engine(tiny_gen, prefix_cache=False).generate([prompt], max_new_tokens=20, tenant="t")
    assert a.output_ids == b.output_ids == cold.output_ids
    assert engine.block_manager.num_allocated == 0  # every holder let go; the pages stay cached


def test_a_full_pool_evicts_cached_pages_and_the_budget_counts_whole_page_limits(small_pool):
    engine = Engine(small_pool)  # 8 pages of 16 tokens, a page grant of 4
    pool = engine.block_manager
    for n in range(6):  # each leaves up to 3 full pages cached
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": f"prompt {n} " * 8}])
        engine.generate([prompt[:40]], max_new_tokens=2, tenant=n)
    assert pool.evictions > 0 and pool.num_free == pool.num_pages and pool.num_allocated == 0
    # two requests of 4 pages fill the budget even when they could share pages
    prompt = list(range(3, 43))
    a = engine.submit("a", prompt, max_new_tokens=20, page_limit=4, tenant="x")
    engine.step()
    b = engine.submit("b", prompt, max_new_tokens=20, page_limit=4, tenant="x")
    c = engine.submit("c", prompt, max_new_tokens=20, page_limit=4, tenant="x")
    engine.step()
    assert engine.scheduler.budgeted == 8 and c.status.value == "waiting"
    assert b.cached_tokens == 32 and pool.num_allocated < 8  # b shares a's two full prompt pages
    while engine.has_work:
        engine.step()
    assert a.output_ids == b.output_ids == c.output_ids


def test_the_block_manager_reference_counts_and_evicts_least_recently_used():
    pool = BlockManager(3)
    tokens = list(range(8))
    hashes = page_hashes("t", tokens, 4, 2)
    pages = pool.allocate(2)
    pool.register(pages, hashes)
    assert pool.match(hashes) == pages  # a second holder
    pool.free(pages)
    assert pool.num_allocated == 2 and pool.num_free == 1
    pool.free(pages)
    assert pool.num_allocated == 0 and pool.num_free == 3 and pool.num_cached == 2
    assert pool.match(hashes[:1]) == pages[:1]
    pool.free(pages[:1])  # pages[0] is now the most recently used
    taken = pool.allocate(2)  # the free page, then the least recently used cached one
    assert pages[1] in taken and pages[0] not in taken and pool.evictions == 1
    assert pool.match(hashes) == [pages[0]]  # the chain breaks where a page was evicted
    with pytest.raises(RuntimeError):
        pool.free([taken[0], taken[0]])
    assert page_hashes("t", tokens, 4, 2) != page_hashes("u", tokens, 4, 2)  # salted per tenant
