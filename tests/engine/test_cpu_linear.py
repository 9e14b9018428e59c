"""cpu_linear's bfloat16-weight product against the float32 product of the same (widened) weights."""
import pytest
import torch

from gpu_worker.engine import cpu_linear
from gpu_worker.engine.model import Linear

pytestmark = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                                reason="the kernel needs AVX2 and FMA")


@pytest.fixture(scope="module")
def kernel():
    k = cpu_linear.linear_bf16()
    assert k is not None, "the bfloat16 CPU kernel did not build (a C++ compiler and ninja are needed)"
    return k


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 9, 16, 17, 64])
@pytest.mark.parametrize("out_features,in_features", [(1, 8), (37, 576), (100, 1536), (33, 24)])
def test_matches_the_float32_product_of_the_same_weights(kernel, rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    expected = x.double() @ w.double().T
    got = kernel(x, w)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    # float32 sums of in_features products, in another order than float64's
    assert (got.double() - expected).abs().max().item() <= 1e-5 * in_features ** 0.5 * expected.abs().max().item()


@pytest.mark.parametrize("x,w,message", [
    (torch.zeros(2, 12), torch.zeros(3, 12, dtype=torch.bfloat16), "multiple of 8"),
    (torch.zeros(2, 8), torch.zeros(3, 8), "bfloat16 w"),
    (torch.zeros(2, 8, dtype=torch.float64), torch.zeros(3, 8, dtype=torch.bfloat16), "float32 x"),
    (torch.zeros(2, 8), torch.zeros(3, 16, dtype=torch.bfloat16), "x \\[M, K\\] and w \\[N, K\\]"),
    (torch.zeros(8, 2).T, torch.zeros(3, 8, dtype=torch.bfloat16), "contiguous"),
])
def test_refuses_what_it_cannot_multiply(kernel, x, w, message):
    with pytest.raises(RuntimeError, match=message):
        kernel(x, w)


def test_the_model_multiplies_bfloat16_weights_with_it_on_cpu(kernel):
    w = torch.randn(48, 64).bfloat16()
    linear = Linear(w, torch.float32)
    assert linear.kernel is kernel and linear.weight.dtype == torch.bfloat16 and linear.packed is None
    x = torch.randn(2, 3, 64)  # [batch, queries, features], as the forward passes it
    assert torch.allclose(linear(x), x @ w.float().T, rtol=1e-5, atol=1e-5)
    big = torch.randn(5, 20, 64)  # more rows than the kernel takes: widened weight, same result
    assert torch.allclose(linear(big), big @ w.float().T, rtol=1e-5, atol=1e-5)
