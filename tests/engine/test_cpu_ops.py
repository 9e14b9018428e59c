"""The CPU operators of cpu_ops.cpp against PyTorch's own computation of the same thing."""
import math

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.engine import cpu_ops
from gpu_worker.engine.model import Linear, cpu_weight_values, dequantize, quantize_q4, quantize_q8, rotate_half

pytestmark = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                                reason="the operators need AVX2 and FMA")


@pytest.fixture(scope="module")
def aotx():
    ops = cpu_ops.ops()
    assert ops is not None, "the CPU operators did not build (a C++ compiler and ninja are needed)"
    return ops


def close(got, expected, terms):
    """float32 sums of `terms` products, in another order than the float64 reference's."""
    return (got.double() - expected).abs().max().item() <= 1e-5 * math.sqrt(terms) * expected.abs().max().item()


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 9, 16, 17, 64])
@pytest.mark.parametrize("out_features,in_features", [(1, 8), (37, 576), (100, 1536), (33, 24)])
def test_linear_bf16_matches_the_product_of_the_same_weights(aotx, rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    got = aotx.linear_bf16(x, w)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    assert close(got, x.double() @ w.double().T, in_features)


@pytest.mark.parametrize("x,w,message", [
    (torch.zeros(2, 12), torch.zeros(3, 12, dtype=torch.bfloat16), "multiple of 8"),
    (torch.zeros(2, 8), torch.zeros(3, 8), "bfloat16 w"),
    (torch.zeros(2, 8, dtype=torch.float64), torch.zeros(3, 8, dtype=torch.bfloat16), "float32 x"),
    (torch.zeros(2, 8), torch.zeros(3, 16, dtype=torch.bfloat16), "x \\[M, K\\] and w \\[N, K\\]"),
    (torch.zeros(8, 2).T, torch.zeros(3, 8, dtype=torch.bfloat16), "contiguous"),
])
def test_linear_bf16_refuses_what_it_cannot_multiply(aotx, x, w, message):
    with pytest.raises(RuntimeError, match=message):
        aotx.linear_bf16(x, w)


def test_the_model_multiplies_bfloat16_weights_with_it_on_cpu(aotx):
    w = torch.randn(48, 64).bfloat16()
    linear = Linear(w, torch.float32)
    assert linear.kernel is aotx.linear_bf16 and linear.weight.dtype == torch.bfloat16 and linear.packed is None
    x = torch.randn(2, 3, 64)  # [batch, queries, features], as the forward passes it
    assert torch.allclose(linear(x), x @ w.float().T, rtol=1e-5, atol=1e-5)
    big = torch.randn(5, 20, 64)  # more rows than the kernel takes: widened weight, same result
    assert torch.allclose(linear(big), big @ w.float().T, rtol=1e-5, atol=1e-5)
    odd = torch.randn(4, 12).bfloat16()  # an input width the kernel does not take: PyTorch's path
    assert Linear(odd, torch.float32).kernel is None


@pytest.mark.parametrize("shape", [(1, 576), (8, 1, 576), (3, 5, 24)])
def test_rms_norm_matches_pytorch(aotx, shape):
    g = torch.Generator().manual_seed(len(shape))
    x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    assert torch.allclose(aotx.rms_norm(x, w, 1e-5), F.rms_norm(x, w.shape, w, 1e-5), rtol=1e-5, atol=1e-6)


def gathered_attention(q, k_pool, v_pool, block_tables, lengths, page_size):
    """The same attention the slow way: every row's keys gathered in order, masked past its length."""
    batch, heads, dim = q.shape
    kv_heads = k_pool.shape[1]
    out = torch.empty(batch, heads, dim, dtype=torch.float64)
    for b in range(batch):
        slots = [block_tables[b, j // page_size].item() * page_size + j % page_size for j in range(lengths[b])]
        keys, values = k_pool[slots].double(), v_pool[slots].double()  # [L, kv_heads, D]
        for i in range(heads):
            h = i // (heads // kv_heads)
            weights = torch.softmax(keys[:, h] @ q[b, i].double() / math.sqrt(dim), dim=0)
            out[b, i] = weights @ values[:, h]
    return out


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16])  # float16: the pool beside quantized weights
@pytest.mark.parametrize("dim", [64, 128, 24])  # the two head sizes held in registers, and the general path
@pytest.mark.parametrize("heads,kv_heads,lengths", [(9, 3, [1, 16, 17, 40]), (4, 4, [33]), (6, 1, [5, 64, 2])])
def test_paged_decode_attention_reads_each_rows_pages(aotx, heads, kv_heads, lengths, dim, pool_dtype):
    page_size, num_pages = 16, 24
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    k_pool = torch.randn(num_pages * page_size, kv_heads, dim, generator=g).to(pool_dtype)
    v_pool = torch.randn(num_pages * page_size, kv_heads, dim, generator=g).to(pool_dtype)
    q = torch.randn(len(lengths), heads, dim, generator=g)
    pages = max(-(-n // page_size) for n in lengths) + 1  # one spare entry: beyond every row's length
    block_tables = torch.randperm(num_pages, generator=g)[:len(lengths) * pages].view(len(lengths), pages)
    lengths = torch.tensor(lengths)
    got = aotx.paged_decode_attention(q, k_pool, v_pool, block_tables, lengths, page_size, dim ** -0.5)
    assert close(got, gathered_attention(q, k_pool, v_pool, block_tables, lengths, page_size), dim)


def test_paged_decode_attention_refuses_rows_outside_the_pool(aotx):
    pool = torch.zeros(32, 1, 8)
    q = torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="outside its block table"):
        aotx.paged_decode_attention(q, pool, pool, torch.tensor([[0]]), torch.tensor([17]), 16, 1.0)
    with pytest.raises(RuntimeError, match="page outside the pool"):
        aotx.paged_decode_attention(q, pool, pool, torch.tensor([[2]]), torch.tensor([3]), 16, 1.0)
    with pytest.raises(RuntimeError, match="page_size must be positive"):
        aotx.paged_decode_attention(q, pool, pool, torch.tensor([[0]]), torch.tensor([1]), 0, 1.0)
    with pytest.raises(RuntimeError, match="float32 or float16 pools"):
        aotx.paged_decode_attention(q, pool.half(), pool, torch.tensor([[0]]), torch.tensor([1]), 16, 1.0)
    with pytest.raises(RuntimeError, match="float32 or float16 pools"):
        aotx.paged_decode_attention(q, pool.bfloat16(), pool.bfloat16(), torch.tensor([[0]]), torch.tensor([1]), 16, 1.0)


# ---- quantized weights (GGUF's Q4_1 and Q8_0 blocks) ----------------------------------------------

def q4_1_weight(out_features, in_features, seed):
    """A weight as a dequantized GGUF Q4_1 tensor is stored in the runtime file: per block of 32,
    scale * code + min with codes 0..15 (both ends used, as GGML's quantizer does), in bfloat16."""
    g = torch.Generator().manual_seed(seed)
    blocks = in_features // 32
    codes = torch.randint(0, 16, (out_features, blocks, 32), generator=g)
    codes[..., 0], codes[..., 1] = 0, 15
    scale = torch.rand(out_features, blocks, 1, generator=g) * 0.01 + 1e-4
    low = -8 * scale + torch.randn(out_features, blocks, 1, generator=g) * 0.001
    return (codes * scale + low).view(out_features, in_features).bfloat16()


def test_quantize_q4_takes_back_the_blocks_of_a_q4_1_weight_and_nothing_else():
    w = q4_1_weight(40, 96, seed=1)
    packed = quantize_q4(w)
    assert packed is not None and packed[0].shape == (40, 48) and packed[1].shape == (40, 2, 3)
    values = dequantize(packed)
    # the stored bfloat16 values, up to their own rounding (half a unit in the last place: 2^-9 of each
    # value, which the recovered scale and min carry into every level)
    assert ((values - w.float()).abs() <= 2 ** -7 * w.float().abs().amax(dim=1, keepdim=True)).all()
    assert quantize_q4(torch.randn(40, 96).bfloat16()) is None  # more than 16 levels a block
    odd = w.clone()
    odd[3, 5] += 0.3 * (w[3].float().amax() - w[3].float().amin())  # one value off the 16 levels of its block
    assert quantize_q4(odd) is None


def test_quantize_q8_blocks_round_each_weight_to_1_254_of_its_block():
    w = torch.randn(17, 64).bfloat16()
    codes, scales = quantize_q8(w)
    assert codes.dtype == torch.int8 and scales.shape == (17, 2) and codes.abs().max() <= 127
    error = (dequantize((codes, scales)) - w.float()).view(17, 2, 32).abs()
    assert (error <= w.float().view(17, 2, 32).abs().amax(dim=-1, keepdim=True) / 254 + 1e-7).all()
    assert (dequantize(quantize_q8(torch.zeros(2, 32).bfloat16())) == 0).all()  # a block of zeros


def round_activations(x):
    """x as linear_q4 and linear_q8 round it: each row's blocks of 32 to int16 codes times the block's
    largest magnitude / 32767, in PyTorch's arithmetic (the same float32 operations as the kernel)."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    largest = blocks.abs().amax(dim=-1, keepdim=True)
    levels = torch.full_like(largest, 32767)  # tensor / tensor: IEEE division (a scalar divides by its reciprocal)
    inverse = torch.where(largest > 0, levels / largest, torch.zeros_like(largest))
    return ((blocks * inverse).round() * (largest / levels)).reshape(x.shape)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 9, 17, 64])
@pytest.mark.parametrize("out_features,in_features", [(1, 32), (37, 576), (100, 1536), (5, 288)])
def test_linear_q4_and_q8_are_integer_products_of_the_weights_they_hold(aotx, rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=g)
    x[torch.rand(rows, in_features, generator=g) < 0.02] *= 30  # outliers: the blocks that round coarsest
    x[0, :32] = 0  # a block of zeros
    four = quantize_q4(q4_1_weight(out_features, in_features, seed=rows))
    eight = quantize_q8(torch.randn(out_features, in_features, generator=g).bfloat16())
    for kernel, pack, widen, blocks in ((aotx.linear_q4, aotx.pack_q4, aotx.dequantize_q4, four),
                                        (aotx.linear_q8, aotx.pack_q8, aotx.dequantize_q8, eight)):
        values = dequantize(blocks)
        packed = pack(*blocks)  # eight weight rows a group: the rows past out_features are zero weights
        groups = (out_features + 7) // 8
        assert packed[0].shape[:2] == packed[1].shape[:2] == (groups, in_features // 32)
        widened = widen(*packed)
        # the kernels' dequantization is PyTorch's, to a rounding (the kernel fuses scale * code + min)
        assert ((widened[:out_features] - values).abs() <= 1e-6 * values.abs().max()).all()
        assert (widened[out_features:] == 0).all()
        whole = kernel(x, *packed)
        assert whole.shape == (rows, 8 * groups) and (whole[:, out_features:] == 0).all()
        got = whole[:, :out_features].double()
        rounded = aotx.round_activations(x)
        assert torch.equal(rounded, round_activations(x))
        # the product of the rounded activations and the dequantized weights, to float32 sums of
        # integer block products
        magnitude = rounded.double().abs() @ values.double().abs().T
        assert ((got - rounded.double() @ values.double().T).abs() <= 1e-6 * magnitude + 1e-30).all()
        # within the stated bound of the float product: each activation within half a step (1/65534)
        # of its block's largest magnitude
        largest = x.abs().view(rows, -1, 32).amax(dim=-1, keepdim=True).expand(-1, -1, 32).reshape(rows, -1)
        bound = largest.double() @ values.double().abs().T / 65534
        assert ((got - x.double() @ values.double().T).abs() <= bound + 1e-6 * magnitude).all()


def test_quantized_kernels_refuse_what_they_cannot_multiply(aotx):
    codes, scales = aotx.pack_q8(*quantize_q8(torch.randn(4, 64).bfloat16()))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        aotx.pack_q8(torch.zeros(4, 48, dtype=torch.int8), torch.zeros(4, 1))
    with pytest.raises(RuntimeError, match="scales \\[N, K / 32\\]"):
        aotx.pack_q8(torch.zeros(4, 64, dtype=torch.int8), torch.zeros(4, 1))
    with pytest.raises(RuntimeError, match="scales \\[N / 8, K / 32, 8\\]"):
        aotx.linear_q8(torch.zeros(2, 64), codes, scales[:, :1].contiguous())
    with pytest.raises(RuntimeError, match="uint8 w"):
        aotx.linear_q4(torch.zeros(2, 64), codes, scales)
    with pytest.raises(RuntimeError, match="int8 w \\[N / 8"):
        aotx.linear_q8(torch.zeros(2, 64), torch.zeros(4, 64, dtype=torch.int8), scales)
    with pytest.raises(RuntimeError, match="float32 x"):
        aotx.linear_q8(torch.zeros(2, 64, dtype=torch.float64), codes, scales)
    with pytest.raises(RuntimeError, match="a weight of K columns"):
        aotx.linear_q8(torch.zeros(2, 96), codes, scales)


def test_the_model_keeps_gguf_blocks_quantized_and_other_weights_as_int8_blocks(aotx):
    four_bit, random = q4_1_weight(48, 64, seed=3), torch.randn(48, 64).bfloat16()
    x = torch.randn(2, 3, 64)
    for w, kernel in ((four_bit, aotx.linear_q4), (random, aotx.linear_q8)):
        linear = Linear(w, torch.float32, "quantized")
        assert linear.kernel is kernel
        values = cpu_weight_values(w, "quantized")
        assert torch.allclose(linear(x), round_activations(x) @ values.T, rtol=1e-5, atol=1e-5)
        big = torch.randn(5, 20, 64)  # prefill: the widened weight through MKL, the same product
        assert torch.allclose(linear(big), round_activations(big) @ values.T, rtol=1e-5, atol=1e-5)
    assert Linear(four_bit, torch.float32, "bf16").kernel is aotx.linear_bf16
    padded = Linear(four_bit[:45], torch.float32, "quantized")  # 45 rows: a last group of five, padded
    assert padded.padded and padded(x).shape == (2, 3, 45)
    for rows in (x, big):
        assert torch.allclose(padded(rows), round_activations(rows) @ cpu_weight_values(four_bit[:45], "quantized").T,
                              rtol=1e-5, atol=1e-5)
    assert torch.equal(cpu_weight_values(four_bit, "bf16"), four_bit.float())


# ---- the fused element-wise steps -----------------------------------------------------------------

@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16])
def test_rope_write_kv_rotates_and_writes_like_the_pytorch_steps(aotx, pool_dtype):
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, tokens = 9, 3, 64, 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g)
    cos, sin = torch.randn(100, dim, generator=g), torch.randn(100, dim, generator=g)
    positions, slots = torch.tensor([0, 5, 7, 99, 3]), torch.tensor([1, 2, 3, 4, 0])
    k_pool, v_pool = torch.zeros(10, kv_heads, dim, dtype=pool_dtype), torch.zeros(10, kv_heads, dim, dtype=pool_dtype)
    q = aotx.rope_write_kv(qkv, cos, sin, positions, slots, k_pool, v_pool, heads, kv_heads)
    parts = qkv.view(tokens, heads + 2 * kv_heads, dim)
    c, s = cos[positions][:, None], sin[positions][:, None]
    rotated = parts[:, :heads + kv_heads] * c + rotate_half(parts[:, :heads + kv_heads]) * s
    assert torch.allclose(q, rotated[:, :heads], atol=1e-6)
    # keys rotated in float32, then rounded once to the pool's type (to nearest, as PyTorch converts)
    assert torch.allclose(k_pool[slots].float(), rotated[:, heads:].to(pool_dtype).float(), atol=1e-6 if pool_dtype == torch.float32 else 2e-3)
    assert torch.equal(v_pool[slots], parts[:, heads + kv_heads:].to(pool_dtype))
    untouched = [i for i in range(10) if i not in slots.tolist()]
    assert not k_pool[untouched].any() and not v_pool[untouched].any()
    with pytest.raises(RuntimeError, match="outside the pool"):
        aotx.rope_write_kv(qkv, cos, sin, positions, torch.tensor([1, 2, 3, 4, 10]), k_pool, v_pool, heads, kv_heads)
    with pytest.raises(RuntimeError, match="outside the tables"):
        aotx.rope_write_kv(qkv, cos, sin, torch.tensor([0, 5, 7, 100, 3]), slots, k_pool, v_pool, heads, kv_heads)


def test_add_rms_norm_and_silu_mul_match_pytorch(aotx):
    g = torch.Generator().manual_seed(6)
    x, delta, w = torch.randn(4, 576, generator=g), torch.randn(4, 576, generator=g), torch.randn(576, generator=g)
    total, normed = aotx.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(total, x + delta)
    assert torch.allclose(normed, F.rms_norm(x + delta, (576,), w, 1e-5), rtol=1e-5, atol=1e-6)
    # gates across the exponential's whole range, beyond its clamps included (width not a multiple of 8)
    gate_up = torch.cat((torch.linspace(-100, 100, 1501).view(1, -1), torch.randn(1, 1501, generator=g)), dim=1)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.allclose(aotx.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-6, atol=1e-6)
