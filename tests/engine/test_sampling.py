import pytest
import torch

from gpu_worker.engine import Engine
from gpu_worker.engine.sampling import sample, top_p_filter


def test_temperature_zero_is_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    assert sample(logits, [0.0] * 4, [1.0] * 4, [None] * 4) == logits.argmax(-1).tolist()


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.1, 0.5, 0.3, 0.1]])
    kept = top_p_filter(probs, torch.tensor([0.6, 0.5]))
    assert (kept > 0).tolist() == [[False, True, True, False], [False, True, False, False]]
    assert torch.equal(kept[kept > 0], probs[kept > 0])


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(20000, 1)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.tensor(sample(logits, [1.0] * 20000, [1.0] * 20000, [generator] * 20000))
    frequencies = torch.bincount(tokens, minlength=4).float() / 20000
    assert torch.allclose(frequencies, probs, atol=0.015)


def test_top_p_excludes_tokens_outside_the_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(5000, 1)
    generator = torch.Generator().manual_seed(2)
    tokens = set(sample(logits, [1.0] * 5000, [0.7] * 5000, [generator] * 5000))
    assert tokens == {0, 1}


@pytest.fixture
def engine(tiny_gen):
    return Engine(tiny_gen, seed=7)


PROMPTS = [list(range(20, 40)), list(range(50, 61)), list(range(100, 131))]
# The tiny random model's tied head scores the current token about 64 and the rest a few units, so
# only a high temperature makes its samples vary.
HOT = 30.0


def test_a_seeded_request_samples_the_same_tokens_alone_or_in_a_batch(engine, tiny_gen):
    settings = dict(max_new_tokens=24, temperature=HOT, top_p=0.9, ignore_eos=True)
    alone = engine.submit("x", PROMPTS[0], seed=1234, **settings)
    while not alone.is_finished:
        engine.step()
    other = Engine(tiny_gen, seed=99)
    together = [other.submit(f"r{i}", prompt, seed=1234 if i == 0 else i, **settings)
                for i, prompt in enumerate(PROMPTS)]
    while not all(seq.is_finished for seq in together):
        other.step()
    assert len(set(alone.output_ids)) > 5
    assert together[0].output_ids == alone.output_ids
    assert together[1].output_ids != alone.output_ids


def test_the_engine_seed_and_request_id_fix_an_unseeded_request(tiny_gen):
    def run(seed, request_id):
        engine = Engine(tiny_gen, seed=seed)
        seq = engine.submit(request_id, PROMPTS[1], max_new_tokens=24, temperature=HOT, ignore_eos=True)
        while not seq.is_finished:
            engine.step()
        return seq.output_ids
    assert run(3, "a") == run(3, "a")
    assert run(3, "a") != run(4, "a")


def test_a_tiny_top_p_is_greedy(engine):
    greedy = engine.generate([PROMPTS[2]], max_new_tokens=16, ignore_eos=True)[0]
    nucleus = engine.generate([PROMPTS[2]], max_new_tokens=16, temperature=5.0, top_p=1e-6, ignore_eos=True)[0]
    assert nucleus.output_ids == greedy.output_ids


def test_penalties_lower_the_logits_of_generated_tokens_as_openai_defines():
    from gpu_worker.engine.sampling import penalize
    logits = torch.zeros(2, 6)
    out = penalize(logits, [(1, [2, 2, 5], 0.5, 1.0)])
    assert out[0].tolist() == [0.0] * 6  # row 0 has no penalty
    assert out[1].tolist() == [0.0, 0.0, -2.5, 0.0, 0.0, -1.5]  # 2 * 1.0 + 0.5, 1 * 1.0 + 0.5
    assert logits.abs().sum() == 0  # a copy: the forward's buffer is left as it was


def test_a_large_frequency_penalty_keeps_greedy_decoding_from_repeating_a_token(tiny_gen):
    from gpu_worker.engine.engine import Engine
    engine = Engine(tiny_gen, prefix_cache=False)
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "hello hello hello"}])
    [plain] = engine.generate([prompt], max_new_tokens=40, ignore_eos=True)
    [penalized] = engine.generate([prompt], max_new_tokens=40, ignore_eos=True, frequency_penalty=1000.0)
    assert len(set(plain.output_ids)) < len(plain.output_ids)  # the tiny model repeats itself
    assert len(set(penalized.output_ids)) == len(penalized.output_ids)
