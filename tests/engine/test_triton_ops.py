"""The Triton kernels of triton_ops against PyTorch's computation of the same thing, one by one and
as the model's forward. On CUDA they run compiled; elsewhere in Triton's interpreter on CPU tensors
(tests/engine/conftest.py sets TRITON_INTERPRET=1), in float32."""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.engine import Engine, cpu_ops
from gpu_worker.engine.model import rotate_half
from tests.engine.test_cpu_ops import gathered_attention
from tests.engine.test_model_logits import admit, assert_logits_close, prompts_for, reference_logits

triton_ops = pytest.importorskip("gpu_worker.engine.triton_ops")
if triton_ops.triton is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def close(got, expected, tolerance=1e-5):
    expected = expected.to(torch.float64)
    scale = expected.abs().max().item() or 1.0
    return (got.to(torch.float64) - expected).abs().max().item() <= tolerance * scale


def test_ops_pass_their_self_check_here():
    assert triton_ops.ops(DEVICE) is triton_ops


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 16), (3, 1, 24)])
def test_rope_write_kv_rotates_queries_and_keys_and_writes_the_pool(heads, kv_heads, dim):
    tokens, slots_total = 7, 40
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim, seed=dim)
    cos, sin = randn(50, dim, seed=1), randn(50, dim, seed=2)
    positions = torch.tensor([0, 1, 2, 17, 49, 3, 3], device=DEVICE)
    slots = torch.tensor([39, 0, 5, 6, 21, 22, 8], device=DEVICE)
    k_pool = torch.full((slots_total, kv_heads, dim), 7.0, device=DEVICE)
    v_pool = torch.full((slots_total, kv_heads, dim), 7.0, device=DEVICE)
    q = triton_ops.rope_write_kv(qkv, cos, sin, positions, slots, k_pool, v_pool, heads, kv_heads)

    parts = qkv.view(tokens, heads + 2 * kv_heads, dim)
    qk = parts[:, :heads + kv_heads]
    rotated = qk * cos[positions, None] + rotate_half(qk) * sin[positions, None]  # the model's PyTorch path
    assert q.shape == (tokens, heads, dim) and close(q, rotated[:, :heads])
    assert close(k_pool[slots], rotated[:, heads:]) and torch.equal(v_pool[slots], parts[:, heads + kv_heads:])
    untouched = [s for s in range(slots_total) if s not in slots.tolist()]
    assert (k_pool[untouched] == 7).all() and (v_pool[untouched] == 7).all()


@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("heads,kv_heads,dim,lengths", [(9, 3, 64, [1, 16, 17, 40, 70]), (4, 4, 16, [33]),
                                                        (6, 1, 24, [5, 64, 2, 130])])
def test_paged_decode_attention_reads_each_rows_pages(heads, kv_heads, dim, lengths, splits):
    """One program per row and KV head, three sharing each row's keys (the merging kernel; some of them
    with no keys at all for short rows), and the split the wrapper chooses."""
    page_size, num_pages = 16, 48
    k_pool, v_pool = randn(num_pages * page_size, kv_heads, dim, seed=1), randn(num_pages * page_size, kv_heads, dim,
                                                                                seed=2)
    q = randn(len(lengths), heads, dim, seed=3)
    pages = max(-(-n // page_size) for n in lengths) + 1  # one spare entry: beyond every row's length
    g = torch.Generator().manual_seed(heads)
    block_tables = torch.randperm(num_pages, generator=g)[:len(lengths) * pages].view(len(lengths), pages)
    got = triton_ops.paged_decode_attention(q, k_pool, v_pool, block_tables.to(DEVICE),
                                            torch.tensor(lengths, device=DEVICE), page_size, dim ** -0.5, splits)
    expected = gathered_attention(q.cpu(), k_pool.cpu(), v_pool.cpu(), block_tables, torch.tensor(lengths), page_size)
    assert close(got.cpu(), expected, 1e-5 * math.sqrt(dim))


@pytest.mark.parametrize("shape", [(1, 576), (2, 3, 64), (5, 40)])
def test_add_rms_norm_is_the_residual_sum_and_its_norm(shape):
    x, delta, weight = randn(*shape, seed=1) * 3, randn(*shape, seed=2), randn(shape[-1], seed=3)
    total, normed = triton_ops.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(total, x + delta)
    assert close(normed, F.rms_norm(x + delta, weight.shape, weight, 1e-5))


@pytest.mark.parametrize("shape", [(1, 2 * 1536), (2, 3, 2 * 64), (4, 2 * 1100)])
def test_silu_mul_multiplies_silu_of_the_gate_by_up(shape):
    gate_up = randn(*shape, seed=4) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    assert close(triton_ops.silu_mul(gate_up), F.silu(gate) * up)


@torch.inference_mode()
def test_the_forward_on_triton_kernels_matches_transformers(tiny_gen, tiny_reference, tiny_stored_reference):
    """Prompts of different lengths prefilled together, then 20 batched decode steps across pages,
    each row against transformers on its whole sequence (tests/engine/test_model_logits.py's bound),
    holding the weights the products use (on CPU the engine's quantized blocks)."""
    reference = tiny_reference if DEVICE.type == "cpu" else tiny_stored_reference
    engine = Engine(tiny_gen, device=DEVICE, dtype=torch.float32, fused_kernels=True, cuda_graphs=False)
    assert engine.model.fused is triton_ops and engine.model.cpu_ops is None
    vocab, steps = engine.card["vocab_size"], 20
    prompts = prompts_for(vocab, [5, 16, 17, 60], seed=1)  # the longest needs two attention splits
    continuations = prompts_for(vocab, [steps] * len(prompts), seed=2)
    seqs = admit(engine, prompts)
    assert triton_ops.attention_splits(len(seqs), engine.card["num_kv_heads"], 80) == 2
    logits = [engine.runner.prefill(seqs).cpu()]
    for step in range(steps):
        for seq, continuation in zip(seqs, continuations):
            seq.append(continuation[step], b"")
        logits.append(engine.runner.decode(seqs).cpu())
    for i, (prompt, continuation) in enumerate(zip(prompts, continuations)):
        expected = reference_logits(reference, prompt + continuation)[len(prompt) - 1:]
        for step, batch in enumerate(logits):
            assert_logits_close(batch[i], expected[step])


def test_the_kernels_are_on_by_default_on_cuda_only(tiny_gen):
    """On CUDA triton_ops' kernels; on CPU their counterparts in cpu_ops (where it builds)."""
    if DEVICE.type == "cuda":
        assert Engine(tiny_gen, device="cuda").model.fused is triton_ops
    assert Engine(tiny_gen).model.fused is cpu_ops.ops()


# ---- the compiled kernels -------------------------------------------------------------------------

def test_each_kernel_compiles_for_the_h200(tmp_path):
    """Triton's own compiler (front end, MLIR passes, LLVM, its bundled ptxas) builds every kernel for
    sm_90, the H200, in bfloat16 and float32, with no GPU present: what the interpreter cannot check
    (types across branches and loops, layouts, registers) is checked on every machine. In a process of
    its own: the interpreter leaves Triton's language patched in the process that ran it."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled here, not found in a cache
    result = subprocess.run([sys.executable, "-m", "gpu_worker.engine.triton_ops", "90"], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    built = [line for line in result.stdout.splitlines() if line.startswith("sm_90 ")]
    variants = sum(len(variants) for _, *variants in triton_ops.SIGNATURES.values())
    assert len(built) == 2 * variants, result.stdout


def test_the_kernels_refuse_strided_views():
    """They index row-major: a strided view would be read wrong without a word, so it is refused."""
    columns = torch.zeros(4, 6, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous"):
        triton_ops.rope_write_kv(randn(4, 8 * 16), randn(10, 16), randn(10, 16), columns[:, 1], columns[:, 2],
                                 randn(12, 2, 16), randn(12, 2, 16), 4, 2)
    with pytest.raises(ValueError, match="contiguous"):
        triton_ops.silu_mul(randn(6, 4).T)
