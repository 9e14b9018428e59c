"""SmolLM2-135M-Instruct on CPU: greedy text from the engine, all prompts batched together, equals
transformers' generate run on each prompt alone with the same weights."""
import pytest
import torch

from gpu_worker.engine import Engine

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three colours of the rainbow, please.",
    "Explain in one sentence why the sky is blue. Answer briefly, please, in plain English.",
]
NEW_TOKENS = 30


@pytest.mark.real_model
def test_greedy_text_matches_transformers_generate(real_gen, real_reference):
    engine = Engine(real_gen)
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    assert len({len(p) for p in prompts}) == len(prompts)  # different lengths share every decode step
    seqs = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
    for prompt, seq in zip(prompts, seqs):
        with torch.no_grad():
            out = real_reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                                          max_new_tokens=NEW_TOKENS, do_sample=False)
        expected = out[0, len(prompt):].tolist()
        assert seq.output_ids == expected, engine.tokenizer.decode(seq.output_ids)
        if expected[-1] == engine.card["eos_token_id"]:
            assert seq.finish_reason == "stop"
            expected = expected[:-1]
        else:
            assert len(expected) == NEW_TOKENS and seq.finish_reason == "length"
        assert bytes(seq.output_bytes).decode("utf-8") == engine.tokenizer.decode(expected)
    assert "Paris" in bytes(seqs[0].output_bytes).decode()
