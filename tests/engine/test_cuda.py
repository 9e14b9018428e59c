"""The CUDA path (bfloat16, decode replayed from CUDA graphs); skipped where no GPU is present."""
import pytest
import torch

from gpu_worker.engine import Engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [list(range(20, 40)), list(range(50, 58)), list(range(100, 145)), [7]]


def test_cuda_graph_decode_matches_eager_decode(tiny_gen):
    settings = dict(max_new_tokens=40, ignore_eos=True)
    graphed = Engine(tiny_gen, device="cuda").generate(PROMPTS, **settings)
    eager = Engine(tiny_gen, device="cuda", cuda_graphs=False).generate(PROMPTS, **settings)
    assert [s.output_ids for s in graphed] == [s.output_ids for s in eager]


def test_cuda_float32_matches_cpu(tiny_gen):
    settings = dict(max_new_tokens=40, ignore_eos=True)
    cuda = Engine(tiny_gen, device="cuda", dtype=torch.float32).generate(PROMPTS, **settings)
    cpu = Engine(tiny_gen).generate(PROMPTS, **settings)
    assert [s.output_ids for s in cuda] == [s.output_ids for s in cpu]


def test_cuda_sampling_is_reproducible(tiny_gen):
    settings = dict(max_new_tokens=20, ignore_eos=True, temperature=30.0, top_p=0.9, seed=3)
    first = Engine(tiny_gen, device="cuda").generate(PROMPTS[:1], **settings)[0].output_ids
    again = Engine(tiny_gen, device="cuda").generate(PROMPTS[:1], **settings)[0].output_ids
    assert first == again and len(set(first)) > 3


def test_cuda_triton_kernels_are_used_and_match_pytorch_operators(tiny_gen):
    settings = dict(max_new_tokens=40, ignore_eos=True)
    fused = Engine(tiny_gen, device="cuda", dtype=torch.float32)
    assert fused.model.fused is not None, "triton_ops failed its self-check on this GPU (the log says why)"
    plain = Engine(tiny_gen, device="cuda", dtype=torch.float32, fused_kernels=False)
    assert [s.output_ids for s in fused.generate(PROMPTS, **settings)] == \
        [s.output_ids for s in plain.generate(PROMPTS, **settings)]


def test_cuda_constrained_decoding_holds_answers_to_their_schema_as_on_the_cpu(tiny_gen):
    """The grammar masks go to the logits' device: on CUDA (graphs, Triton kernels) in float32 the
    constrained tokens are the CPU's, and every complete answer is valid JSON of its schema."""
    import json

    from gpu_worker.engine.grammar import schema_grammar
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}}, "required": ["n", "ok"],
              "additionalProperties": False}
    answers = {}
    for device in ("cuda", "cpu"):
        engine = Engine(tiny_gen, device=device, dtype=torch.float32)
        grammar = engine.grammars.compile(schema_grammar(schema))
        answers[device] = engine.generate(PROMPTS, max_new_tokens=60, grammar=grammar)
    assert [s.output_ids for s in answers["cuda"]] == [s.output_ids for s in answers["cpu"]]
    for seq in answers["cuda"]:
        if seq.finish_reason == "stop":  # (no jsonschema on the lent device)
            answer = json.loads(bytes(seq.output_bytes))
            assert set(answer) == {"n", "ok"} and 0 <= answer["n"] <= 99 and isinstance(answer["ok"], bool)
