"""The packed sentence-embedding model (all-MiniLM-L6-v2 by default: a 6-layer BERT, 384 dims) as
one hand-written forward: what memory rows and recall queries are embedded with.

The model is read from the runtime file's `emb/` components (pack.embedding_components): the
card, the tokenizer and the safetensors weights under their original names. The forward is the
BERT encoder (post-norm, exact erf GELU, absolute positions, token type 0) followed by the pooling
the card names (mean over the attention mask, CLS or max) and, when the card says so, L2
normalisation; it matches sentence-transformers' `encode` on the same model (tests/engine).

Per layer the query, key and value projections are one fused (3h, h) matmul, attention is
`scaled_dot_product_attention` with the batch's padding mask, and texts are batched by token
length (longest first, as sentence-transformers does) so a batch carries little padding. The
matmuls and attention run in bfloat16 where the hardware multiplies it natively (CUDA, or a CPU
with AVX-512 BF16 / AMX), with float32 accumulation, residual stream, layer norms and pooling:
the vectors stay within cosine 0.9999 of the float32 reference (tests/engine/test_embedding.py)
at about twice the speed; elsewhere everything is float32."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from ..storage.runtime_file import RuntimeFile

POOLINGS = ("mean", "cls", "max")


def matmul_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where the device multiplies it natively, else float32."""
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu" and torch.cpu._is_avx512_bf16_supported():
        return torch.bfloat16
    return torch.float32


@dataclass(frozen=True)
class EmbeddingCard:
    name: str
    hidden_size: int
    embedding_dim: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    max_seq_length: int
    pooling: str
    normalize: bool

    @classmethod
    def from_card(cls, card: dict) -> "EmbeddingCard":
        if card.get("architecture") != "bert":
            raise ValueError(f"embedding architecture {card.get('architecture')!r} is not bert")
        if card.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"embedding activation {card.get('hidden_act')!r} is not gelu")
        if card["pooling"] not in POOLINGS:
            raise ValueError(f"embedding pooling {card['pooling']!r} is not one of {', '.join(POOLINGS)}")
        return cls(name=card["name"], hidden_size=card["hidden_size"], embedding_dim=card["embedding_dim"],
                   num_layers=card["num_layers"], num_heads=card["num_heads"],
                   layer_norm_eps=float(card["layer_norm_eps"]),
                   max_seq_length=min(card["max_seq_length"], card["max_position_embeddings"]),
                   pooling=card["pooling"], normalize=bool(card["normalize"]))


@dataclass(frozen=True)
class _Layer:
    qkv_w: torch.Tensor      # (3h, h)
    qkv_b: torch.Tensor      # (3h,)
    out_w: torch.Tensor
    out_b: torch.Tensor
    norm1: tuple[torch.Tensor, torch.Tensor]
    up_w: torch.Tensor
    up_b: torch.Tensor
    down_w: torch.Tensor
    down_b: torch.Tensor
    norm2: tuple[torch.Tensor, torch.Tensor]


class EmbeddingModel:
    """Texts (or token IDs) to embedding vectors, float32, on one torch device."""

    def __init__(self, card: EmbeddingCard, tokenizer: Tokenizer, tensors: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype | None = None) -> None:
        self.card = card
        self.device = device
        self.dtype = dtype or matmul_dtype(device)  # of the matmuls and attention
        self.tokenizer = tokenizer
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(card.max_seq_length)

        def t(name: str) -> torch.Tensor:
            return tensors[name].to(device=device, dtype=torch.float32).contiguous()

        def w(name: str) -> torch.Tensor:  # a matmul operand
            return t(name).to(self.dtype)

        self.word = t("embeddings.word_embeddings.weight")
        self.position = t("embeddings.position_embeddings.weight")
        # Every text is one segment: token type 0 is folded into the position table once.
        self.position = (self.position + t("embeddings.token_type_embeddings.weight")[0]).contiguous()
        self.norm0 = (t("embeddings.LayerNorm.weight"), t("embeddings.LayerNorm.bias"))
        self.layers: list[_Layer] = []
        for n in range(card.num_layers):
            p = f"encoder.layer.{n}."
            self.layers.append(_Layer(
                qkv_w=torch.cat([w(p + f"attention.self.{x}.weight") for x in ("query", "key", "value")]),
                qkv_b=torch.cat([w(p + f"attention.self.{x}.bias") for x in ("query", "key", "value")]),
                out_w=w(p + "attention.output.dense.weight"), out_b=w(p + "attention.output.dense.bias"),
                norm1=(t(p + "attention.output.LayerNorm.weight"), t(p + "attention.output.LayerNorm.bias")),
                up_w=w(p + "intermediate.dense.weight"), up_b=w(p + "intermediate.dense.bias"),
                down_w=w(p + "output.dense.weight"), down_b=w(p + "output.dense.bias"),
                norm2=(t(p + "output.LayerNorm.weight"), t(p + "output.LayerNorm.bias"))))

    @classmethod
    def from_runtime(cls, runtime: RuntimeFile, device: str | torch.device = "cpu",
                     dtype: torch.dtype | None = None) -> "EmbeddingModel":
        card = EmbeddingCard.from_card(runtime.json("emb/card"))
        tokenizer = Tokenizer.from_str(runtime.bytes("emb/tokenizer").tobytes().decode("utf-8"))
        prefix = "emb/tensor/"
        tensors = {name[len(prefix):]: runtime.tensor(name) for name in runtime.names(prefix)}
        return cls(card, tokenizer, tensors, torch.device(device), dtype)

    @property
    def dim(self) -> int:
        return self.card.embedding_dim

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token IDs with [CLS] … [SEP], truncated at the card's max_seq_length."""
        return [e.ids for e in self.tokenizer.encode_batch(list(texts))]

    def encode(self, texts: Sequence[str], batch_size: int = 32) -> torch.Tensor:
        """(len(texts), dim) float32 embeddings, in the order given."""
        return self.encode_ids(self.tokenize(texts), batch_size)

    @torch.inference_mode()
    def encode_ids(self, ids: Sequence[Sequence[int]], batch_size: int = 32) -> torch.Tensor:
        out = torch.empty(len(ids), self.dim, dtype=torch.float32, device=self.device)
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            out[torch.tensor(chunk, device=self.device)] = self._batch([ids[i] for i in chunk])
        return out

    def _batch(self, ids: list[Sequence[int]]) -> torch.Tensor:
        card = self.card
        b, length = len(ids), max(len(x) for x in ids)
        tokens = torch.zeros(b, length, dtype=torch.long)
        mask = torch.zeros(b, length, dtype=torch.bool)
        for row, seq in enumerate(ids):
            tokens[row, :len(seq)] = torch.as_tensor(seq, dtype=torch.long)
            mask[row, :len(seq)] = True
        tokens, mask = tokens.to(self.device), mask.to(self.device)
        h, heads, eps, low = card.hidden_size, card.num_heads, card.layer_norm_eps, self.dtype
        x = self.word[tokens] + self.position[:length]  # float32: the residual stream
        x = F.layer_norm(x, (h,), *self.norm0, eps=eps)
        # (b, 1, 1, L): every query attends to the real keys of its own text.
        attend = mask[:, None, None, :] if not bool(mask.all()) else None
        for layer in self.layers:
            qkv = F.linear(x.to(low), layer.qkv_w, layer.qkv_b).view(b, length, 3, heads, h // heads)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=attend)
            attn = attn.transpose(1, 2).reshape(b, length, h)
            x = F.layer_norm(x + F.linear(attn, layer.out_w, layer.out_b).float(), (h,), *layer.norm1, eps=eps)
            up = F.gelu(F.linear(x.to(low), layer.up_w, layer.up_b))
            x = F.layer_norm(x + F.linear(up, layer.down_w, layer.down_b).float(), (h,), *layer.norm2, eps=eps)
        if card.pooling == "mean":
            weights = mask.unsqueeze(-1).to(x.dtype)
            pooled = (x * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        elif card.pooling == "cls":
            pooled = x[:, 0]
        else:
            pooled = x.masked_fill(~mask.unsqueeze(-1), float("-inf")).max(1).values
        return F.normalize(pooled, p=2, dim=-1) if card.normalize else pooled
