"""Output-token pacing per tenant (engine/pacing.py): a paced tenant's sequences step only while its
bucket holds tokens, an unpaced tenant's never wait, and a held engine says how long to sleep."""
import pytest

from gpu_worker.engine import Engine, Status
from gpu_worker.engine.pacing import TokenPacer
from tests.conftest import Clock


def test_a_tenant_is_held_once_its_seconds_worth_is_spent_and_goes_on_as_it_refills():
    clock = Clock()
    pacer = TokenPacer({"slow": 4}.get, clock)
    assert pacer.held(["slow", "fast", None]) == set()
    pacer.charge(["slow"] * 4)
    assert pacer.held(["slow", "fast"]) == {"slow"}
    assert pacer.wait({"slow"}) == pytest.approx(0.25)  # one token's refill
    pacer.charge(["slow"] * 2)  # two sequences stepped together: into debt
    clock.now += 0.5
    assert pacer.held(["slow"]) == {"slow"}  # -2 + 2: no token yet
    assert pacer.wait({"slow"}) == pytest.approx(0.25)
    clock.now += 0.26
    assert pacer.held(["slow"]) == set()
    assert TokenPacer().held(["slow"]) == set()  # no rates at all: nobody is held


@pytest.fixture
def engine(tiny_gen):
    return Engine(tiny_gen)


def test_the_engine_steps_a_held_tenants_sequences_only_as_its_rate_allows(engine):
    clock = Clock()
    engine.pacer = TokenPacer({"paced": 3}.get, clock)
    paced = engine.submit("p", list(range(20, 30)), max_new_tokens=12, ignore_eos=True, tenant="paced")
    free = engine.submit("f", list(range(40, 50)), max_new_tokens=12, ignore_eos=True, tenant="free")
    for _ in range(8):  # the clock stands still: the paced tenant gets its three tokens, no more
        engine.step()
    assert len(paced.output_ids) == 3 and len(free.output_ids) == 8
    while free.status is not Status.FINISHED:
        engine.step()
    assert len(paced.output_ids) == 3
    engine.step()  # only the held tenant has work: nothing runs, and the engine says how long to wait
    assert len(paced.output_ids) == 3 and engine.idle_for == pytest.approx(1 / 3, rel=1e-3)
    clock.now += 1.0  # a second later: three more
    for _ in range(5):
        engine.step()
    assert len(paced.output_ids) == 6
    assert paced.pages  # held, it kept its pages; it finishes as it is paced
    engine.cancel("p")
    assert engine.pool.free == engine.pool.total


def test_a_default_rate_binds_only_while_another_tenant_is_active(engine):
    from gpu_worker.contract.rates import Pace
    from gpu_worker.engine.shares import ACTIVE_SECONDS, Activity

    clock = Clock()
    engine.pacer = TokenPacer({"shared": Pace(3, False), "capped": Pace(3, True)}.get, clock)
    engine.activity = Activity(clock)
    alone = engine.submit("s", list(range(20, 30)), max_new_tokens=40, ignore_eos=True, tenant="shared")
    for _ in range(8):  # the clock stands still: alone, the default rate does not bind
        engine.step()
    assert len(alone.output_ids) == 8
    other = engine.submit("o", list(range(40, 50)), max_new_tokens=4, ignore_eos=True, tenant="other")
    for _ in range(8):  # another tenant has work: its bucket starts full (3 tokens), then holds it
        engine.step()
    assert len(alone.output_ids) == 8 + 3 and other.status is Status.FINISHED
    clock.now += ACTIVE_SECONDS / 2  # the other tenant left, but is still counted active a while
    engine.step()
    assert len(alone.output_ids) == 11 + 1  # refilled 1.5 tokens: one step, then held again
    clock.now += ACTIVE_SECONDS
    for _ in range(4):  # the window passed: alone again, unpaced
        engine.step()
    assert len(alone.output_ids) == 12 + 4
    capped = engine.submit("c", list(range(60, 70)), max_new_tokens=8, ignore_eos=True, tenant="capped")
    engine.cancel("s")
    for _ in range(6):  # a rate the grant file sets binds alone too
        engine.step()
    assert len(capped.output_ids) == 3
