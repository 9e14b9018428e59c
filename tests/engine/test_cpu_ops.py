"""The CPU operators of cpu_ops.cpp against PyTorch's own computation of the same thing."""
import math

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.engine import cpu_ops
from gpu_worker.engine.model import Linear

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


@pytest.mark.parametrize("heads,kv_heads,lengths", [(9, 3, [1, 16, 17, 40]), (4, 4, [33]), (6, 1, [5, 64, 2])])
def test_paged_decode_attention_reads_each_rows_pages(aotx, heads, kv_heads, lengths):
    page_size, dim, num_pages = 16, 64, 24
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    k_pool = torch.randn(num_pages * page_size, kv_heads, dim, generator=g)
    v_pool = torch.randn(num_pages * page_size, kv_heads, dim, generator=g)
    q = torch.randn(len(lengths), heads, dim, generator=g)
    pages = max(-(-n // page_size) for n in lengths) + 1  # one spare entry: beyond every row's length
    block_tables = torch.randperm(num_pages, generator=g)[:len(lengths) * pages].view(len(lengths), pages)
    lengths = torch.tensor(lengths)
    got = aotx.paged_decode_attention(q, k_pool, v_pool, block_tables, lengths, page_size, dim ** -0.5)
    assert close(got, gathered_attention(q, k_pool, v_pool, block_tables, lengths, page_size), 64)


def test_paged_decode_attention_refuses_rows_outside_the_pool(aotx):
    pool = torch.zeros(32, 1, 8)
    q = torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="outside its block table"):
        aotx.paged_decode_attention(q, pool, pool, torch.tensor([[0]]), torch.tensor([17]), 16, 1.0)
    with pytest.raises(RuntimeError, match="page outside the pool"):
        aotx.paged_decode_attention(q, pool, pool, torch.tensor([[2]]), torch.tensor([3]), 16, 1.0)
    with pytest.raises(RuntimeError, match="page_size must be positive"):
        aotx.paged_decode_attention(q, pool, pool, torch.tensor([[0]]), torch.tensor([1]), 0, 1.0)
