"""The engine's fused GPU operators, written in Triton: four kernels that do, per layer, what PyTorch's
operators do in some twenty launches.

A decode step of a small model is bound by kernel launches, not arithmetic: SmolLM2-135M's 30 layers
took ~23 kernels each through PyTorch's operators (RoPE alone is five: two products, a negation, a
concatenation and a sum; the KV write two more; the attention over gathered pages five). Inside a
CUDA graph each kernel still costs a few microseconds however little it computes, so the step's
time is roughly its kernel count. With these four a layer is nine kernels: the input norm, the
QKV product, `rope_write_kv`, `paged_decode_attention`, the output product, `add_rms_norm`, the
gate/up product, `silu_mul`, the down product (whose residual sum is the next layer's
`add_rms_norm`).

- `rope_write_kv(qkv, cos, sin, positions, slots, k_pool, v_pool, heads, kv_heads)`: rotates every
  token's query and key heads (the `rotate_half` layout), writes keys and values at the tokens' pool
  slots, returns the rotated queries `[tokens, heads, head_dim]`.
- `paged_decode_attention(q, k_pool, v_pool, block_tables, lengths, page_size, scale)`: one query
  per row over its keys where they lie in the pool, through its block table (the same contract as
  cpu_ops' operator); a program serves a KV head's whole query group with an online softmax, 32 keys
  at a time. With few rows several programs share each row's keys (`attention_splits`) and
  `_merge_splits` combines their shares (flash-decoding).
- `add_rms_norm(x, delta, weight, eps)`: the residual sum `x + delta` (rounded to the compute dtype,
  as PyTorch's sum is) and its RMS norm, in one pass: returns both.
- `silu_mul(gate_up)`: `silu(gate) * up` for the concatenated gate/up product.

Every kernel computes in float32 and rounds once when it stores. `ops(device)` returns this module's
operators after a self-check on `device` against PyTorch's formulas (small inputs, float32 and
bfloat16), or None with one logged reason: no Triton, no CUDA (unless `TRITON_INTERPRET=1`, Triton's
interpreter, which runs the same kernels on CPU tensors: that is how tests/engine/test_triton_ops.py
checks them on machines without a GPU), or a kernel that fails to compile or to agree. The model
then keeps PyTorch's operators.
"""
from __future__ import annotations

import functools
import logging
import os
import sys
from types import ModuleType

import torch

log = logging.getLogger("gpu_worker.engine")

try:
    import triton
    import triton.language as tl
except ImportError:  # the model keeps PyTorch's operators (ops() says why)
    triton = None

ATTENTION_BLOCK = 32  # keys per step of the online softmax (several pages, gathered slot by slot)
SPLIT_KEYS = 64  # the fewest keys a split of one row's attention takes (two steps)
SPLIT_PROGRAMS = 264  # attention programs worth having per layer: two per SM of an H100 or H200 (132)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    # Triton reads a kernel's parameter annotations (tl.constexpr, pointer and scalar types): the
    # kernels keep only the ones Triton wants, hence the `type: ignore[no-untyped-def]` on each.
    @triton.jit
    def _rope_write_kv(qkv, cos, sin, positions, slots, q_out, k_pool, v_pool,  # type: ignore[no-untyped-def]
                       HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr, HALF_BLOCK: tl.constexpr):
        token, head = tl.program_id(0), tl.program_id(1)
        half = DIM // 2
        i = tl.arange(0, HALF_BLOCK)
        inside = i < half
        source = qkv + (token * (HEADS + 2 * KV_HEADS) + head) * DIM
        slot = tl.load(slots + token)
        first = tl.load(source + i, mask=inside, other=0.0).to(tl.float32)
        second = tl.load(source + half + i, mask=inside, other=0.0).to(tl.float32)
        if head < HEADS + KV_HEADS:  # a query or key head: rotated
            table = tl.load(positions + token) * DIM
            cos_1 = tl.load(cos + table + i, mask=inside, other=0.0).to(tl.float32)
            cos_2 = tl.load(cos + table + half + i, mask=inside, other=0.0).to(tl.float32)
            sin_1 = tl.load(sin + table + i, mask=inside, other=0.0).to(tl.float32)
            sin_2 = tl.load(sin + table + half + i, mask=inside, other=0.0).to(tl.float32)
            # x * cos + rotate_half(x) * sin, rotate_half(x) = (-second, first)
            first, second = first * cos_1 - second * sin_1, second * cos_2 + first * sin_2
            if head < HEADS:
                target = q_out + (token * HEADS + head) * DIM
            else:
                target = k_pool + (slot * KV_HEADS + head - HEADS) * DIM
        else:  # a value head: written as it is
            target = v_pool + (slot * KV_HEADS + head - HEADS - KV_HEADS) * DIM
        tl.store(target + i, first.to(target.dtype.element_ty), mask=inside)
        tl.store(target + half + i, second.to(target.dtype.element_ty), mask=inside)

    @triton.jit
    def _paged_decode_attention(q, k_pool, v_pool, block_tables, lengths, out,  # type: ignore[no-untyped-def]
                                part_acc, part_best, part_total, scale, table_stride, split_keys, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                                DIM: tl.constexpr, DIM_BLOCK: tl.constexpr, GROUP_BLOCK: tl.constexpr,
                                PAGE: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr):
        row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        group = HEADS // KV_HEADS
        g = tl.arange(0, GROUP_BLOCK)
        d = tl.arange(0, DIM_BLOCK)
        n = tl.arange(0, BLOCK)
        head_mask = (g < group)[:, None] & (d < DIM)[None, :]
        heads = row * HEADS + kv_head * group + g
        queries = tl.load(q + heads[:, None] * DIM + d[None, :], mask=head_mask, other=0.0).to(tl.float32) * scale
        start = split * split_keys  # this program's keys: [start, end)
        end = tl.minimum(tl.load(lengths + row), start + split_keys)
        best = tl.full([GROUP_BLOCK], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_BLOCK], tl.float32)
        acc = tl.zeros([GROUP_BLOCK, DIM_BLOCK], tl.float32)
        while start < end:  # (a `for` over range(start, end) is the same loop, but Triton's interpreter
            key = start + n  # cannot take a loaded bound there)
            valid = key < end
            page = tl.load(block_tables + row * table_stride + key // PAGE, mask=valid, other=0)
            where = ((page * PAGE + key % PAGE) * KV_HEADS + kv_head)[:, None] * DIM + d[None, :]
            kv_mask = valid[:, None] & (d < DIM)[None, :]
            keys = tl.load(k_pool + where, mask=kv_mask, other=0.0).to(tl.float32)
            scores = tl.sum(queries[:, None, :] * keys[None, :, :], axis=2)  # [group, BLOCK]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            keep = tl.exp(best - new_best)
            weights = tl.exp(scores - new_best[:, None])
            values = tl.load(v_pool + where, mask=kv_mask, other=0.0).to(tl.float32)
            acc = acc * keep[:, None] + tl.sum(weights[:, :, None] * values[None, :, :], axis=1)
            total = total * keep + tl.sum(weights, axis=1)
            best = new_best
            start += BLOCK
        if SPLITS == 1:
            result = acc / total[:, None]
            tl.store(out + heads[:, None] * DIM + d[None, :], result.to(out.dtype.element_ty), mask=head_mask)
        else:  # this split's share, merged by _merge_splits (an empty split leaves best -inf and total 0)
            parts = heads * SPLITS + split
            tl.store(part_acc + parts[:, None] * DIM + d[None, :], acc, mask=head_mask)
            tl.store(part_best + parts, best, mask=g < group)
            tl.store(part_total + parts, total, mask=g < group)

    @triton.jit
    def _merge_splits(part_acc, part_best, part_total, out,  # type: ignore[no-untyped-def]
                      DIM: tl.constexpr, DIM_BLOCK: tl.constexpr, SPLITS: tl.constexpr, SPLIT_BLOCK: tl.constexpr):
        head = tl.program_id(0)  # of all rows' heads
        s = tl.arange(0, SPLIT_BLOCK)
        d = tl.arange(0, DIM_BLOCK)
        inside = s < SPLITS
        best = tl.load(part_best + head * SPLITS + s, mask=inside, other=float("-inf"))
        weight = tl.exp(best - tl.max(best, axis=0))  # split 0 always holds key 0, so the max is finite
        total = tl.sum(tl.load(part_total + head * SPLITS + s, mask=inside, other=0.0) * weight, axis=0)
        acc = tl.load(part_acc + (head * SPLITS + s)[:, None] * DIM + d[None, :],
                      mask=inside[:, None] & (d < DIM)[None, :], other=0.0)
        result = tl.sum(acc * weight[:, None], axis=0) / total
        tl.store(out + head * DIM + d, result.to(out.dtype.element_ty), mask=d < DIM)

    @triton.jit
    def _add_rms_norm(x, delta, weight, x_out, h_out, eps,  # type: ignore[no-untyped-def]
                      WIDTH: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        inside = i < WIDTH
        total = tl.load(x + row * WIDTH + i, mask=inside, other=0.0).to(tl.float32) \
            + tl.load(delta + row * WIDTH + i, mask=inside, other=0.0).to(tl.float32)
        total = total.to(x_out.dtype.element_ty)  # the residual stream as PyTorch's sum rounds it
        tl.store(x_out + row * WIDTH + i, total, mask=inside)
        total = total.to(tl.float32)
        inverse = 1.0 / tl.sqrt(tl.sum(total * total, axis=0) / WIDTH + eps)
        scale = tl.load(weight + i, mask=inside, other=0.0).to(tl.float32)
        tl.store(h_out + row * WIDTH + i, (total * inverse * scale).to(h_out.dtype.element_ty), mask=inside)

    @triton.jit
    def _silu_mul(gate_up, out, WIDTH: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        row, part = tl.program_id(0), tl.program_id(1)
        i = part * BLOCK + tl.arange(0, BLOCK)
        inside = i < WIDTH
        gate = tl.load(gate_up + row * 2 * WIDTH + i, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(gate_up + row * 2 * WIDTH + WIDTH + i, mask=inside, other=0.0).to(tl.float32)
        tl.store(out + row * WIDTH + i, (gate / (1.0 + tl.exp(-gate)) * up).to(out.dtype.element_ty), mask=inside)


def _contiguous(*tensors: torch.Tensor) -> None:
    """The kernels index with row-major offsets: a strided view would be read wrong, silently."""
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("triton_ops: contiguous tensors expected")


def _power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  slots: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, heads: int,
                  kv_heads: int) -> torch.Tensor:
    """qkv `[tokens, (heads + 2 kv_heads) * head_dim]` contiguous; cos, sin `[positions, head_dim]`;
    positions, slots `[tokens]` int64; k_pool, v_pool `[slots, kv_heads, head_dim]` contiguous.
    Returns the rotated queries `[tokens, heads, head_dim]`."""
    _contiguous(qkv, cos, sin, positions, slots, k_pool, v_pool)
    tokens, dim = qkv.shape[0], k_pool.shape[-1]
    q = torch.empty(tokens, heads, dim, dtype=qkv.dtype, device=qkv.device)
    _rope_write_kv[(tokens, heads + 2 * kv_heads)](qkv, cos, sin, positions, slots, q, k_pool, v_pool, heads,
                                                   kv_heads, dim, _power_of_two(dim // 2))
    return q


def attention_splits(batch: int, kv_heads: int, keys: int) -> int:
    """How many programs share each (row, KV head)'s keys: enough programs to fill the GPU when there are
    few rows (one request: 3 programs would leave it idle while each walks its whole context), never a
    split of fewer than SPLIT_KEYS keys. Fixed by the batch and page bucket, as a CUDA graph needs."""
    return max(1, min(-(-keys // SPLIT_KEYS), SPLIT_PROGRAMS // (batch * kv_heads)))


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           lengths: torch.Tensor, page_size: int, scale: float,
                           splits: int | None = None) -> torch.Tensor:
    """q `[B, heads, D]`, k_pool and v_pool `[slots, kv_heads, D]`, block_tables `[B, pages]`, lengths `[B]`
    (row b sees keys 0..lengths[b]-1): `[B, heads, D]`. All contiguous. `splits` (default
    attention_splits) programs share each row's keys; more than one adds the merging kernel."""
    _contiguous(q, k_pool, v_pool, block_tables, lengths)
    batch, heads, dim = q.shape
    kv_heads = k_pool.shape[1]
    keys = block_tables.shape[1] * page_size  # the most any row may have
    splits = splits or attention_splits(batch, kv_heads, keys)
    split_keys = -(-keys // (splits * ATTENTION_BLOCK)) * ATTENTION_BLOCK
    out = torch.empty_like(q)
    parts = [out] * 3  # one split writes `out` itself: the kernel never touches these then
    if splits > 1:
        parts = [torch.empty(batch, heads, splits, *shape, dtype=torch.float32, device=q.device)
                 for shape in ((dim,), (), ())]
    _paged_decode_attention[(batch, kv_heads, splits)](
        q, k_pool, v_pool, block_tables, lengths, out, *parts, scale, block_tables.shape[1], split_keys, heads,
        kv_heads, dim, _power_of_two(dim), _power_of_two(heads // kv_heads), page_size, ATTENTION_BLOCK, splits)
    if splits > 1:
        _merge_splits[(batch * heads,)](*parts, out, dim, _power_of_two(dim), splits, _power_of_two(splits))
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta) * weight) for contiguous x and delta of the same shape."""
    _contiguous(x, delta, weight)
    width = x.shape[-1]
    x_out, h_out = torch.empty_like(x), torch.empty_like(x)
    _add_rms_norm[(x.numel() // width,)](x, delta, weight, x_out, h_out, eps, width, _power_of_two(width))
    return x_out, h_out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a contiguous `[..., 2 * width]` holding gate then up."""
    _contiguous(gate_up)
    width = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], width, dtype=gate_up.dtype, device=gate_up.device)
    block = min(_power_of_two(width), 1024)
    _silu_mul[(out.numel() // width, triton.cdiv(width, block))](gate_up, out, width, block)
    return out


# ---- availability --------------------------------------------------------------------------------

def _self_check(device: torch.device) -> str | None:
    """None when every kernel agrees with PyTorch's formula on `device`, else what went wrong."""
    from gpu_worker.engine.model import attention, rotate_half

    g = torch.Generator().manual_seed(0)
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        def tensor(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

        def differs(got: torch.Tensor, expected: torch.Tensor) -> bool:
            expected = expected.float()
            return (got.float() - expected).abs().max().item() > tolerance * (1 + expected.abs().max().item())

        name = str(dtype).removeprefix("torch.")
        heads, kv_heads, dim, tokens = 4, 2, 16, 6
        qkv, cos, sin = tensor(tokens, (heads + 2 * kv_heads) * dim), tensor(10, dim), tensor(10, dim)
        positions = torch.tensor([0, 3, 9, 1, 2, 5], device=device)
        slots = torch.tensor([5, 2, 11, 0, 7, 3], device=device)
        k_pool, v_pool = torch.zeros(12, kv_heads, dim, device=device, dtype=dtype), \
            torch.zeros(12, kv_heads, dim, device=device, dtype=dtype)
        q = rope_write_kv(qkv, cos, sin, positions, slots, k_pool, v_pool, heads, kv_heads)
        parts = qkv.view(tokens, heads + 2 * kv_heads, dim).float()
        c, s = cos.float()[positions, None], sin.float()[positions, None]
        rotated = parts[:, :heads + kv_heads] * c + rotate_half(parts[:, :heads + kv_heads]) * s
        if differs(q, rotated[:, :heads]) or differs(k_pool[slots], rotated[:, heads:]) \
                or differs(v_pool[slots], parts[:, heads + kv_heads:]):
            return f"rope_write_kv disagrees with PyTorch in {name}"

        page, k_pool, v_pool = 16, tensor(4 * 16, kv_heads, dim), tensor(4 * 16, kv_heads, dim)
        tables, lengths = torch.tensor([[2, 0, 1], [1, 3, 0]], device=device), torch.tensor([40, 3], device=device)
        queries = tensor(2, heads, dim)
        # the model's own PyTorch path: pages gathered through the block tables, keys past each length masked
        gathered = [pool.view(-1, page, kv_heads, dim)[tables].flatten(1, 2).float() for pool in (k_pool, v_pool)]
        mask = (torch.arange(tables.shape[1] * page, device=device) < lengths[:, None])[:, None, None, :]
        expected = attention(queries[:, None].float(), *gathered,  # type: ignore[call-arg]  # keys, values
                             mask.repeat(1, 1, heads // kv_heads, 1))
        for splits in (1, 2):  # one program per row and KV head, then two sharing each row's keys
            got = paged_decode_attention(queries, k_pool, v_pool, tables, lengths, page, dim ** -0.5, splits)
            if differs(got, expected.view(2, heads, dim)):
                return f"paged_decode_attention ({splits} split) disagrees with PyTorch in {name}"

        x, delta, weight = tensor(3, 40), tensor(3, 40), tensor(40)
        x_out, h_out = add_rms_norm(x, delta, weight, 1e-5)
        total = (x + delta).float()
        if differs(x_out, total) or differs(h_out, torch.nn.functional.rms_norm(total, (40,), weight.float(), 1e-5)):
            return f"add_rms_norm disagrees with PyTorch in {name}"
        gate_up = tensor(3, 2 * 40)
        if differs(silu_mul(gate_up), torch.nn.functional.silu(gate_up[:, :40].float()) * gate_up[:, 40:].float()):
            return f"silu_mul disagrees with PyTorch in {name}"
    return None


@functools.cache
def _ops(device_type: str) -> ModuleType | None:
    if triton is None:
        log.info("Triton is not installed; the model uses PyTorch's operators")
        return None
    if device_type != "cuda" and not interpreted():
        return None  # compiled Triton needs a GPU; TRITON_INTERPRET=1 runs the kernels on CPU (tests)
    try:
        problem = _self_check(torch.device(device_type))
    except Exception as exc:  # a kernel that does not compile or launch here
        problem = f"{type(exc).__name__}: {exc}"
    if problem is not None:
        log.warning("Triton operators unavailable (%s); the model uses PyTorch's operators", problem)
        return None
    return sys.modules[__name__]


def ops(device: str | torch.device) -> ModuleType | None:
    """This module (its four operators) where they run and agree with PyTorch on `device`, else None."""
    return _ops(torch.device(device).type)


# ---- compiling without a GPU ---------------------------------------------------------------------

# Each kernel's arguments that are not pointers to the compute dtype, then its constexprs at SmolLM2-135M's
# shapes (as the wrappers above choose them), one set per variant to build.
SIGNATURES: dict[str, tuple[dict[str, str], *tuple[dict[str, int], ...]]] = {
    "_rope_write_kv": ({"positions": "*i64", "slots": "*i64"}, {"HEADS": 9, "KV_HEADS": 3, "DIM": 64, "HALF_BLOCK": 32}),
    "_paged_decode_attention": ({"block_tables": "*i64", "lengths": "*i64", "part_acc": "*fp32", "part_best": "*fp32",
                                 "part_total": "*fp32", "scale": "fp32", "table_stride": "i32", "split_keys": "i32"},
                                *({"HEADS": 9, "KV_HEADS": 3, "DIM": 64, "DIM_BLOCK": 64, "GROUP_BLOCK": 4, "PAGE": 16,
                                   "BLOCK": ATTENTION_BLOCK, "SPLITS": splits} for splits in (1, 4))),
    "_merge_splits": ({"part_acc": "*fp32", "part_best": "*fp32", "part_total": "*fp32"},
                      {"DIM": 64, "DIM_BLOCK": 64, "SPLITS": 4, "SPLIT_BLOCK": 4}),
    "_add_rms_norm": ({"eps": "fp32"}, {"WIDTH": 576, "BLOCK": 1024}),
    "_silu_mul": ({}, {"WIDTH": 1536, "BLOCK": 1024}),
}


def main(argv: list[str] | None = None) -> None:
    """`python -m gpu_worker.engine.triton_ops [ARCH]`: compiles every kernel for CUDA compute capability
    ARCH (default 90, the H100 and H200) in bfloat16 and float32 with Triton's compiler and its bundled
    ptxas; no GPU needed. Prints one line per kernel; exits 1 on the first that does not build."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    arch = int((argv if argv is not None else sys.argv[1:] or ["90"])[0])
    if triton is None or interpreted():
        raise SystemExit("triton_ops: needs Triton, and TRITON_INTERPRET unset")
    builds = [(name, kinds, constants) for name, (kinds, *variants) in SIGNATURES.items() for constants in variants]
    for dtype in ("bf16", "fp32"):
        for name, kinds, constants in builds:
            kernel = globals()[name]
            signature = {arg: "constexpr" if arg in constants else kinds.get(arg, f"*{dtype}")
                         for arg in kernel.arg_names}
            try:
                compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", arch, 32))
            except Exception as exc:
                print(f"sm_{arch} {name} {dtype}: {type(exc).__name__}: {exc}", file=sys.stderr)
                raise SystemExit(1)
            variant = f" SPLITS={constants['SPLITS']}" if "SPLITS" in constants else ""
            print(f"sm_{arch} {name}{variant} {dtype}: {len(compiled.asm['cubin'])} bytes of cubin")

if __name__ == "__main__":
    main()
