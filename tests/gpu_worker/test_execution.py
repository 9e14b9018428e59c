"""Prompt building (gpu_worker/prompt.py fit_prompt): the most recent turns that fit, found by
bisection, the same prompt the one-turn-at-a-time drop gives, in a logarithmic number of encodings."""
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.pipeline.prompt import fit_prompt


class CountingTokenizer:
    """One token per character plus two per message (a stand-in for a chat template)."""

    def __init__(self):
        self.calls = 0

    def encode_chat(self, messages):
        self.calls += 1
        return [0] * sum(len(m["content"]) + 2 for m in messages)


def linear(tokenizer, messages, room):
    """The old way: drop the oldest turn until the prompt fits."""
    while True:
        ids = tokenizer.encode_chat(messages)
        if len(ids) <= room:
            return ids
        if len(messages) == 1:
            return None
        messages = messages[2:]


def history(lengths, last):
    messages = []
    for user, assistant in lengths:
        messages += [{"role": "user", "content": "u" * user}, {"role": "assistant", "content": "a" * assistant}]
    return messages + [{"role": "user", "content": "q" * last}]


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=40),
       last=st.integers(0, 80), room=st.integers(0, 600))
def test_bisection_gives_the_prompt_dropping_turn_by_turn_gives(lengths, last, room):
    messages = history(lengths, last)
    assert fit_prompt(CountingTokenizer(), messages, room) == linear(CountingTokenizer(), messages, room)


def test_a_long_history_costs_a_logarithmic_number_of_encodings():
    rng = random.Random(7)
    messages = history([(rng.randint(20, 60), rng.randint(20, 60)) for _ in range(400)], 30)
    counting = CountingTokenizer()
    ids = fit_prompt(counting, messages, 2000)
    assert ids is not None and len(ids) <= 2000
    assert counting.calls <= 2 + 10  # the whole, the input alone, then at most log2(400) + 1 halvings
