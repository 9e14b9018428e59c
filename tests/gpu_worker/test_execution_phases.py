"""An input's life as a state machine (gpu_worker/state/executions.py): one phase, changed only by
`Execution.move` / `end`, along MOVES. The whole life runs through the engine in
tests/gpu_worker/kinds/test_inputs.py, test_cancellations, test_memory and the deadline tests; here,
the table itself."""
from __future__ import annotations

import pytest

from gpu_worker.state.executions import (BEFORE_THE_ENGINE, IN_THE_ENGINE, MOVES, READY_TO_COMPLETE, Execution,
                                         IllegalMove, Phase)
from gpu_worker.state.tables import Finish


def reachable(start: Phase) -> set[Phase]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in MOVES[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_every_phase_is_reached_from_the_lease_and_every_one_reaches_the_completion() -> None:
    assert reachable(Phase.MEMORY) == set(Phase)
    assert all(Phase.COMPLETING in reachable(phase) for phase in Phase)
    assert MOVES[Phase.COMPLETING] == frozenset()


def test_every_phase_before_the_end_can_end() -> None:
    """A cancellation or a deadline can end an input wherever it is until its end is known."""
    for phase in (Phase.MEMORY, Phase.QUEUED, Phase.GENERATING, Phase.INTERPRETING, Phase.ENDED):
        assert Phase.ENDED in MOVES[phase], phase


def test_the_named_groups_follow_the_table() -> None:
    assert BEFORE_THE_ENGINE < IN_THE_ENGINE
    assert not (IN_THE_ENGINE | {Phase.INTERPRETING}) & READY_TO_COMPLETE
    assert all(Phase.COMPLETING in MOVES[phase] for phase in READY_TO_COMPLETE)


@pytest.mark.parametrize("phase", list(Phase))
def test_a_move_the_table_does_not_allow_is_refused_and_changes_nothing(phase: Phase) -> None:
    for target in set(Phase) - MOVES[phase]:
        execution = Execution(1, 0, phase, Finish.STOP)
        with pytest.raises(IllegalMove, match=f"{phase.name} -> {target.name}"):
            execution.move(target, Finish.FAILED)
        assert (execution.phase, execution.finish) == (phase, Finish.STOP)


def test_a_life_with_an_interpretation_keeps_the_turns_finish() -> None:
    execution = Execution(7, 0)
    assert execution.prompted([1, 2, 3], None, {"max_new_tokens": 4})
    assert (execution.phase, execution.input_tokens) == (Phase.QUEUED, 3)
    execution.move(Phase.GENERATING)
    execution.move(Phase.INTERPRETING, Finish.LENGTH)
    execution.end()  # the interpretation is written: the turn's finish stays
    assert (execution.phase, execution.finish) == (Phase.ENDED, Finish.LENGTH)
    execution.move(Phase.CONTROLLED)
    execution.move(Phase.COMPLETING)


def test_a_prompt_for_an_input_that_ended_meanwhile_changes_nothing() -> None:
    execution = Execution(7, 0)
    execution.end(Finish.CANCELLED)
    assert not execution.prompted([1], None, {})
    assert (execution.phase, execution.finish, execution.input_tokens) == (Phase.ENDED, Finish.CANCELLED, 0)


@pytest.mark.parametrize("ids, error", [(None, None), ([1], RuntimeError("tokenizer failed"))])
def test_a_prompt_that_failed_or_does_not_fit_ends_the_input_failed(ids: list[int] | None,
                                                                    error: BaseException | None) -> None:
    execution = Execution(7, 0)
    assert not execution.prompted(ids, error, {})
    assert (execution.phase, execution.finish) == (Phase.ENDED, Finish.FAILED)


def test_a_deadline_overtakes_a_generated_turn_still_flushing() -> None:
    execution = Execution(7, 0, Phase.ENDED, Finish.STOP)
    execution.end(Finish.DEADLINE)
    assert (execution.phase, execution.finish) == (Phase.ENDED, Finish.DEADLINE)
