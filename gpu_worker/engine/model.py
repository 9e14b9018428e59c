"""The generation model: a LLaMA forward over the runtime file's tensors, attending through a paged KV pool.

One function serves prefill and decode. Inputs are a padded batch `[B, Q]` of tokens with their
positions; each token's key and value are written into the pool at its slot
(`page * page_size + offset`), then every row gathers its keys and values through its block table
and attends with a causal mask built from positions. Prefill is `Q` = longest prompt, decode is
`Q = 1`; rows may be at any length. Padding tokens write to a scratch page no sequence owns and
read at most position 0, so they never disturb a real row and never produce NaN. A decode step
reads each row's keys and values in place instead (paged_decode_attention), and the rotation is
fused with the pool writes, the residual sums with the norms and SiLU with its product: triton_ops'
kernels on CUDA (nine kernels a layer instead of some twenty-three), cpu_ops' operators of the same
names on CPU in float32, where the products also run on cpu_ops, over the GGUF's own quantized
blocks by default (Linear, docs/engine.md), and a decode step's whole layer loop is one call
(cpu_ops' decode_layers).

Weights follow docs/runtime-file.md: `(out, in)` matrices, Q/K rows in the `rotate_half` RoPE
layout. Q, K and V are concatenated into one matrix, as are gate and up, so each layer runs four
matrix products instead of seven; that matters most for small batches, where launch and
dispatch overhead rivals the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F

from gpu_worker.engine import cpu_ops

if TYPE_CHECKING:
    from gpu_worker.storage.runtime_file import RuntimeFile


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_card(cls, card: dict[str, Any]) -> "ModelConfig":
        if card.get("architecture") != "llama":
            raise ValueError(f"model architecture {card.get('architecture')!r} is not llama")
        return cls(**{name: card[name] for name in cls.__dataclass_fields__})


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Computed in float32 whatever the compute dtype, as the reference does. The reference rounds to the
    # compute dtype before applying the weight, the fused op after: identical in float32, within one
    # rounding in bfloat16.
    return F.rms_norm(x, weight.shape, weight, eps)


def rope_tables(config: ModelConfig, length: int, device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[length, head_dim]` in float32 for the `rotate_half` layout (frequencies repeated twice)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


# oneDNN lays a packed weight out for this many rows; of 1, 8 and 64, 8 measured best for decode
# steps of 1 to 8 requests, and larger products (prefill) still run at full speed.
PACKED_BATCH_HINT = 8
# Above this many rows a product is bound by arithmetic, not by reading the weights: the bfloat16
# kernel (no cache blocking) gives way to widening the weight and MKL's sgemm.
KERNEL_MAX_ROWS = 64


Q8_BLOCK = 32
CPU_WEIGHTS = ("quantized", "bf16")  # how Linear keeps a weight on CPU in float32 (the first is the default)
# A weight is taken for 4-bit blocks when every value is within this fraction of its block's largest
# magnitude of the 16 levels recovered: the bfloat16 rounding of a dequantized GGUF Q4_1 block is at
# most 2^-9 of it, while a weight with more levels misses by about 1/30 (half a level).
Q4_TOLERANCE = 2.0 ** -7


def quantize_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An `(out, in)` weight as int8 blocks of 32 along `in` and one float32 scale per block (its
    largest magnitude / 127, as GGML's Q8_0): `(int8 [out, in], float32 [out, in / 32])`."""
    out, width = weight.shape
    blocks = weight.float().view(out, width // Q8_BLOCK, Q8_BLOCK)
    scales = blocks.abs().amax(dim=-1) / 127
    quantized = (blocks / scales.clamp_min(torch.finfo(torch.float32).tiny)[..., None]).round().clamp(-127, 127)
    return quantized.to(torch.int8).view(out, width).contiguous(), scales.contiguous()


def quantize_q4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The 4-bit blocks an `(out, in)` weight holds, or None when it holds more than 16 levels in some
    block of 32: `(uint8 [out, in / 2], float16 [out, 2, in / 32])`, codes two to a byte (code j of a
    block in the low half of byte j, code j + 16 in the high half) and each row's block scales, then
    its block mins, so that value = scale * code + min (GGUF's Q4_1; the runtime file stores such a
    weight dequantized).
    """
    out, width = weight.shape
    blocks = weight.float().view(out, width // Q8_BLOCK, Q8_BLOCK)
    low, high = blocks.amin(dim=-1), blocks.amax(dim=-1)
    # float16, as GGUF keeps them: a true Q4_1 block's scale and min come back to their own values
    scale, low = ((high - low) / 15).half(), low.half()
    wide_scale, wide_low = scale.float(), low.float()
    codes = ((blocks - wide_low[..., None]) / wide_scale.clamp_min(torch.finfo(torch.float32).tiny)[..., None]).round()
    codes = codes.clamp(0, 15)
    error = (codes * wide_scale[..., None] + wide_low[..., None] - blocks).abs()
    if not bool(torch.isfinite(wide_scale).all()) or bool(
            (error > Q4_TOLERANCE * blocks.abs().amax(dim=-1, keepdim=True)).any()):
        return None
    codes = codes.to(torch.uint8)
    packed = codes[..., :Q8_BLOCK // 2] | (codes[..., Q8_BLOCK // 2:] << 4)
    return packed.reshape(out, width // 2).contiguous(), torch.stack((scale, low), dim=1).contiguous()


def dequantize(packed: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The float32 weight that quantize_q4's or quantize_q8's blocks hold (PyTorch's arithmetic; the
    engine's kernels compute the same values in registers)."""
    codes, scales = packed
    if codes.dtype == torch.uint8:  # 4-bit: scale * code + min
        halves = codes.view(codes.shape[0], -1, Q8_BLOCK // 2)  # byte j: code j, code j + 16
        blocks = torch.cat((halves & 0x0F, halves >> 4), dim=-1).float()
        wide = scales.float()
        return (blocks * wide[:, 0, :, None] + wide[:, 1, :, None]).view(codes.shape[0], -1)
    blocks = codes.view(codes.shape[0], -1, Q8_BLOCK).float()
    return (blocks * scales[..., None]).view(codes.shape[0], -1)


def cpu_weight_values(weight: torch.Tensor, cpu_weights: str) -> torch.Tensor:
    """The float32 values Linear multiplies for this stored weight on CPU in float32 with cpu_ops:
    for a reference that holds exactly the engine's weights (engine/reference.py)."""
    if cpu_weights == "quantized" and weight.shape[1] % Q8_BLOCK == 0:
        return dequantize(quantize_q4(weight) or quantize_q8(weight))
    return weight.float()


class Linear:
    """`x @ weight.T` for an `(out, in)` weight, given as stored in the runtime file (bfloat16).

    On CPU in float32, with cpu_ops built, `cpu_weights` says how the weight is kept:
    - "quantized": as the 4-bit blocks it holds when it was a GGUF Q4_1 weight (quantize_q4, 0.625
      bytes a weight, multiplied by cpu_ops' linear_q4), else quantized to int8 blocks once at load
      (quantize_q8, 1.125 bytes, linear_q8; a GGUF Q8_0 weight gets its own blocks back), in either
      case packed eight weight rows at a time for the kernels (cpu_ops' pack_q4, pack_q8). Both
      kernels round each row of activations to int16 per block of 32 (within 1/65534 of the block's
      largest magnitude; cpu_ops' round_activations) and multiply in integers, 16 products an
      instruction: a decode step streams every weight once, so fewer bytes a weight (bfloat16: 2)
      and fewer instructions a weight are less time. Products of more than KERNEL_MAX_ROWS rows
      (prefill) multiply the same rounded activations with the weight widened to float32, by MKL's
      sgemm, so every product is that of the rounded activations and the dequantized weights,
      whatever its row count. The dequantized weights differ from the stored bfloat16 values by
      their rounding (docs/engine.md states the bound on the logits).
    - "bf16": the bfloat16 weight as it is, multiplied by linear_bf16, which widens it in
      registers: exactly the float32 product of the stored weights, up to summation order.
    Where that kernel is not available, the weight is widened to float32 once and packed for oneDNN's
    inner product, which reads it about twice as fast as the MKL path `torch.matmul` takes for a few
    rows. On CUDA the weight is cast to the compute dtype. Every path sums in float32 on CPU."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, cpu_weights: str = "bf16"):
        self.weight: torch.Tensor | None  # None only where packed is set
        self.packed: torch.Tensor | None
        self.scales: torch.Tensor | None  # quantized weights: each block's scale (and min, 4-bit)
        self.kernel: torch._ops.OpOverloadPacket | None
        self.widen: Callable[[], torch.Tensor]  # the float32 weight, for products of many rows (with kernel)
        # what those products multiply instead of the activations (quantized: their int16 rounding)
        self.round: Callable[[torch.Tensor], torch.Tensor] = lambda rows: rows
        self.weight, self.packed, self.scales, self.kernel = None, None, None, None
        on_cpu_float32 = weight.device.type == "cpu" and dtype == torch.float32
        usable = on_cpu_float32 and weight.dtype == torch.bfloat16 and weight.shape[1] % 8 == 0  # 8 per step
        aotx = cpu_ops.ops() if usable else None
        quantize = aotx is not None and cpu_weights == "quantized" and weight.shape[1] % Q8_BLOCK == 0
        self.out_features = weight.shape[0]
        # quantized: packed eight weight rows at a time, the last group padded with zero rows, whose
        # outputs the products drop (`padded`); decode_layers takes only unpadded weights
        self.padded = quantize and self.out_features % 8 != 0
        four_bit = quantize_q4(weight) if quantize else None
        if four_bit is not None:
            (self.weight, self.scales), self.kernel = aotx.pack_q4(*four_bit), aotx.linear_q4  # type: ignore[union-attr]
            self.widen = lambda: aotx.dequantize_q4(self.weight, self.scales)[:self.out_features]  # type: ignore[union-attr]
        elif quantize:
            (self.weight, self.scales), self.kernel = aotx.pack_q8(*quantize_q8(weight)), aotx.linear_q8  # type: ignore[union-attr]
            self.widen = lambda: aotx.dequantize_q8(self.weight, self.scales)[:self.out_features]  # type: ignore[union-attr]
        elif aotx is not None:
            self.weight, self.kernel = weight.contiguous(), aotx.linear_bf16
            self.widen = lambda: self.weight.float()  # type: ignore[union-attr]
        elif on_cpu_float32 and torch.backends.mkldnn.is_available():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.float(), PACKED_BATCH_HINT)
        else:
            self.weight = weight.to(dtype)
        if quantize:
            self.round = aotx.round_activations  # type: ignore[union-attr]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            if rows.shape[0] > KERNEL_MAX_ROWS:  # prefill: compute-bound, where MKL's blocking wins
                return (self.round(rows) @ self.widen().T).view(*x.shape[:-1], -1)
            y = self.kernel(rows, self.weight, self.scales) if self.scales is not None else self.kernel(rows, self.weight)
            if self.padded:
                y = y[:, :self.out_features].contiguous()
            return y.view(*x.shape[:-1], y.shape[-1])
        if self.packed is None:
            return x @ self.weight.T  # type: ignore[union-attr]  # set unless packed is
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q `[B, Q, heads, D]`, keys and values `[B, L, kv_heads, D]` -> `[B, Q, heads * D]`.

    The query heads that share a KV head are folded into the query dimension, so grouped-query
    attention becomes plain attention over the KV heads: no copies of keys and values, and every
    scaled_dot_product_attention backend (masks included) applies. `mask` is `[B, 1, group * Q, L]`:
    the `[B, 1, Q, L]` mask repeated once per query head of a group."""
    batch, queries, heads, dim = q.shape
    kv_heads = keys.shape[2]
    group = heads // kv_heads
    q = q.view(batch, queries, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(batch, kv_heads, group * queries, dim)
    out = F.scaled_dot_product_attention(q, keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=mask)
    out = out.view(batch, kv_heads, group, queries, dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, queries, heads * dim)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Layer:
    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype, cpu_weights: str):
        """tensors: as stored in the runtime file, on the model's device."""
        self.input_norm = tensors["input_layernorm"].to(dtype)
        self.qkv = Linear(torch.cat([tensors["q_proj"], tensors["k_proj"], tensors["v_proj"]]), dtype, cpu_weights)
        self.o = Linear(tensors["o_proj"], dtype, cpu_weights)
        self.post_norm = tensors["post_attention_layernorm"].to(dtype)
        self.gate_up = Linear(torch.cat([tensors["gate_proj"], tensors["up_proj"]]), dtype, cpu_weights)
        self.down = Linear(tensors["down_proj"], dtype, cpu_weights)


class Llama:
    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], device: str | torch.device,
                 dtype: torch.dtype,
                 fused_kernels: bool | None = None, cpu_weights: str = CPU_WEIGHTS[0]):
        """fused_kernels: the fused element-wise steps (rotation with the pool writes, residual sum with the
        norm, SiLU with its product). None = triton_ops' on CUDA where they pass their self-check and
        cpu_ops' on CPU in float32; True = triton_ops' required (raises where unavailable; on CPU only
        under TRITON_INTERPRET=1, for tests); False = neither (PyTorch's operators). cpu_weights: see
        Linear ("int8" or "bf16"; only CPU float32 with cpu_ops built reads it)."""
        if cpu_weights not in CPU_WEIGHTS:
            raise ValueError(f"cpu_weights must be one of {CPU_WEIGHTS}, not {cpu_weights!r}")
        self.config, self.device, self.dtype = config, torch.device(device), dtype
        # CPU float32: the norms and decode attention of cpu_ops (None elsewhere, or where it cannot build)
        self.cpu_ops = cpu_ops.ops() if self.device.type == "cpu" and dtype == torch.float32 else None
        self.fused = None
        if fused_kernels or (fused_kernels is None and self.device.type == "cuda"):
            from gpu_worker.engine import triton_ops  # imports Triton: only where it may be used
            self.fused = triton_ops.ops(self.device)
            if fused_kernels and self.fused is None:
                raise RuntimeError(f"the Triton kernels are unavailable on {self.device} (the log says why)")
        if self.fused is not None:
            self.cpu_ops = None
        elif fused_kernels is None and self.cpu_ops is not None:
            self.fused = self.cpu_ops  # the same four operators, by the same names and arguments
        self.cpu_weights = cpu_weights
        # The KV pool's type: float16 on CPU where cpu_ops runs every step over quantized weights (as
        # llama.cpp keeps its cache): a decode step reads every row's keys and values from memory, and
        # half the bytes is about half the time of attention; the compute type elsewhere ("bf16" stays
        # the exact float32 product of the stored weights). Keys and values are rounded once, when
        # written; everything else stays float32 (reference.transformers_model rounds them the same way).
        self.kv_dtype = torch.float16 if (self.fused is not None and self.fused is self.cpu_ops
                                          and cpu_weights == "quantized") else dtype

        # in the runtime file's dtype (Linear and the embedding lookup convert), copied off the file's mapping
        def stored(name: str) -> torch.Tensor:
            return tensors[name].to(device=self.device, copy=True)

        self.embed = stored("embed_tokens")
        self.norm = stored("norm").to(dtype)
        self.lm_head = Linear(self.embed if config.tie_word_embeddings else stored("lm_head"), dtype, cpu_weights)
        layer_keys = ("input_layernorm", "post_attention_layernorm", "q_proj", "k_proj", "v_proj", "o_proj",
                      "gate_proj", "up_proj", "down_proj")
        self.layers = [Layer({key: stored(f"layers.{i}.{key}") for key in layer_keys}, dtype, cpu_weights)
                       for i in range(config.num_layers)]
        # A decode step's layers in one call (cpu_ops' decode_layers, the loop below to the bit) where
        # every product and fused step runs on cpu_ops: weights, scales (empty for bfloat16), norms.
        self._decode_args: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None = None
        linears = [linear for layer in self.layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if self.cpu_ops is not None and self.fused is self.cpu_ops and all(
                linear.kernel is not None and not linear.padded for linear in linears):
            no_scales = torch.empty(0)
            self._decode_args = ([linear.weight for linear in linears],  # type: ignore[misc]  # set with kernel
                                 [no_scales if linear.scales is None else linear.scales for linear in linears],
                                 [norm for layer in self.layers for norm in (layer.input_norm, layer.post_norm)])
        cos, sin = rope_tables(config, config.max_position_embeddings, self.device)
        # Cast like the reference does (float32 tables, rounded to the compute dtype at use).
        self.cos, self.sin = cos.to(dtype), sin.to(dtype)
        self._pool_views: tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                                tuple[list[torch.Tensor], list[torch.Tensor]]] | None = None

    @classmethod
    def from_runtime(cls, runtime: RuntimeFile, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                     fused_kernels: bool | None = None, cpu_weights: str = CPU_WEIGHTS[0]) -> "Llama":
        config = ModelConfig.from_card(runtime.json("gen/card"))
        prefix = "gen/tensor/"
        tensors = {name[len(prefix):]: runtime.tensor(name) for name in runtime.names(prefix)}
        return cls(config, tensors, device, dtype, fused_kernels, cpu_weights)

    def new_kv_cache(self, num_pages: int, page_size: int) -> torch.Tensor:
        """The paged KV pool: `[layers, 2 (k, v), num_pages, page_size, kv_heads, head_dim]`.

        Zeroed, not empty: masked-out slots still enter the attention product with weight 0, and 0 * NaN
        from uninitialised memory would be NaN."""
        c = self.config
        return torch.zeros(c.num_layers, 2, num_pages, page_size, c.num_kv_heads, c.head_dim,
                           device=self.device, dtype=self.kv_dtype)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 block_tables: torch.Tensor, kv_cache: torch.Tensor, last: torch.Tensor | None = None,
                 embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits `[B, V]` at index `last[b]` of each row, or `[B, Q, V]` at every position when `last` is None.

        embeds: `(flat indices into [B * Q], rows [n, hidden])`: those tokens' inputs are the rows
        instead of their embeddings (an image's features at its image tokens: vision.py).

        tokens, positions, slots: `[B, Q]` int64; block_tables: `[B, pages]` int64 page ids, enough pages
        for the longest row (extra entries may name any page: the causal mask hides them)."""
        c = self.config
        batch, queries = tokens.shape
        page_size = kv_cache.shape[3]
        context = block_tables.shape[1] * page_size
        aotx, fused = self.cpu_ops, self.fused
        paged_decode = queries == 1 and (aotx is not None or fused is not None)
        if paged_decode:  # each row sees its keys 0..position where they lie in the pool
            lengths = positions[:, 0] + 1
            block_tables = block_tables.contiguous()
            scale = c.head_dim ** -0.5  # scaled_dot_product_attention's default, as the reference uses
        else:
            # Key j is visible to a query at position p when j <= p: causal within the row and it hides the
            # block-table padding beyond the row's length. Shared by every layer.
            mask = (torch.arange(context, device=tokens.device) <= positions[..., None]).unsqueeze(1)
            mask = mask.repeat(1, 1, c.num_heads // c.num_kv_heads, 1)  # the layout attention() folds queries into
        if fused is None:
            cos, sin = self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)
        else:
            flat_positions = positions.reshape(-1).contiguous()  # (decode inputs are columns of one tensor)
        slots = slots.reshape(-1).contiguous()

        pools = self._pools(kv_cache)
        x = F.embedding(tokens, self.embed).to(self.dtype)
        if embeds is not None:
            x = x.view(batch * queries, -1).index_copy(0, embeds[0], embeds[1].to(self.dtype)).view(batch, queries, -1)
        h = self._norm(x, self.layers[0].input_norm)
        if paged_decode and self._decode_args is not None and batch <= KERNEL_MAX_ROWS:
            weights, scales, norms = self._decode_args
            k_pools, v_pools = self._pool_views[2]  # type: ignore[index]  # set by _pools
            x = self.cpu_ops.decode_layers(  # type: ignore[union-attr]  # set with _decode_args
                x.view(batch, -1), h.view(batch, -1), weights, scales, norms, k_pools, v_pools, self.cos, self.sin,
                flat_positions, slots, block_tables, lengths, page_size, scale, c.num_heads, c.num_kv_heads,
                c.rms_norm_eps).view(batch, 1, -1)
        else:
            for i, layer in enumerate(self.layers):
                qkv = layer.qkv(h)
                pool, k_pool, v_pool = pools[i]  # [k/v, slot, kv_head, head_dim], and its two halves
                if fused is not None:  # rotation and the pool writes in one kernel
                    q = fused.rope_write_kv(qkv.view(batch * queries, -1), self.cos, self.sin, flat_positions, slots,
                                            k_pool, v_pool, c.num_heads, c.num_kv_heads)
                    q = q.view(batch, queries, c.num_heads, c.head_dim)
                else:
                    qkv = qkv.view(batch, queries, c.num_heads + 2 * c.num_kv_heads, c.head_dim)
                    qk, v = qkv.split([c.num_heads + c.num_kv_heads, c.num_kv_heads], dim=2)
                    qk = qk * cos + rotate_half(qk) * sin  # queries and keys rotated together
                    q, k = qk.split([c.num_heads, c.num_kv_heads], dim=2)
                    pool.index_copy_(1, slots, torch.stack((k, v)).view(2, -1, c.num_kv_heads, c.head_dim))
                if paged_decode:
                    # one of them is set: paged_decode
                    decode = (fused or aotx).paged_decode_attention  # type: ignore[union-attr]
                    out = decode(q.reshape(batch, c.num_heads, c.head_dim).contiguous(), k_pool, v_pool, block_tables,
                                 lengths, page_size, scale)
                    delta = layer.o(out.view(batch, 1, c.num_heads * c.head_dim))
                else:
                    # index_select over whole pages: a plain copy per page, several times faster than advanced indexing
                    pages = kv_cache[i].view(2, kv_cache.shape[2], -1).index_select(1, block_tables.reshape(-1))
                    keys, values = pages.view(2, batch, context, c.num_kv_heads, c.head_dim).to(self.dtype)
                    delta = layer.o(attention(q, keys, values, mask))
                x, h = self._add_norm(x, delta, layer.post_norm)

                gate_up = layer.gate_up(h)
                if fused is not None:
                    delta = layer.down(fused.silu_mul(gate_up))
                else:
                    gate, up = gate_up.chunk(2, dim=-1)
                    delta = layer.down(F.silu(gate) * up)
                if i + 1 < len(self.layers):
                    x, h = self._add_norm(x, delta, self.layers[i + 1].input_norm)
            x = x + delta

        if last is not None:
            x = x[torch.arange(batch, device=x.device), last]
        return self.lm_head(self._norm(x, self.norm))

    def _pools(self, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Each layer's pool as `[k/v, slot, kv_head, head_dim]` and its key and value halves: views made
        once per pool (a runner keeps one), not twice a layer every step (decode_layers takes the halves
        as two lists, kept beside them)."""
        if self._pool_views is None or self._pool_views[0] is not kv_cache:
            c = self.config
            views = [kv_cache[i].view(2, -1, c.num_kv_heads, c.head_dim) for i in range(c.num_layers)]
            self._pool_views = (kv_cache, [(view, view[0], view[1]) for view in views],
                                ([view[0] for view in views], [view[1] for view in views]))
        return self._pool_views[1]

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual sum and its norm (the next block's input): one kernel with triton_ops."""
        if self.fused is not None:
            return self.fused.add_rms_norm(x, delta, weight, self.config.rms_norm_eps)
        x = x + delta
        return x, self._norm(x, weight)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.cpu_ops is not None:
            return self.cpu_ops.rms_norm(x.contiguous(), weight, self.config.rms_norm_eps)
        return rms_norm(x, weight, self.config.rms_norm_eps)
