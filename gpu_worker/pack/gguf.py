"""The generation model from a LLaMA-family GGUF: its card from the GGUF metadata, its tensors
dequantized once to bfloat16 in (out, in) order with Q and K un-permuted to the `rotate_half`
layout (`unpermute_qk`), and its tokenizer rebuilt from the GGUF vocabulary (byte-level BPE or
SentencePiece). Also the LLaMA shapes and byte-level pre-tokenizers the checkpoint and tiny models
reuse.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from .writer import _progress, _source

NO_CAPABILITIES = {"media_types": [], "automatic_memory": False}

# GGUF tensor names -> ours. Per-layer names are "blk.{i}.{key}.weight" -> "layers.{i}.{value}".
GGUF_GLOBAL_TENSORS = {"token_embd.weight": "embed_tokens", "output_norm.weight": "norm", "output.weight": "lm_head"}
GGUF_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
    "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj",
}

# llama.cpp's `tokenizer.ggml.pre` names the split that runs before byte-level BPE.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
BYTE_LEVEL_PRE = {
    # smollm: every digit alone, then the GPT-2 regex (transformers' GGUF converter misses the digits).
    "smollm": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
    "default": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "llama-bpe": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
}
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4


def unpermute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp stores Q and K rows interleaved for pair-wise RoPE; restore HF's rotate_half order."""
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, -1).swapaxes(1, 2).reshape(rows, -1)


def _field(reader, key: str, default=KeyError):
    field = reader.fields.get(key)
    if field is None:
        if default is KeyError:
            raise ValueError(f"GGUF metadata has no {key}")
        return default
    return field.contents()


def _float32(value: float) -> float:
    """GGUF stores these as float32; keep the value a person wrote (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _gguf_card(reader, name: str, source: dict) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not LLaMA-family")
    hidden = _field(reader, "llama.embedding_length")
    n_head = _field(reader, "llama.attention.head_count")
    head_dim = _field(reader, "llama.attention.key_length", hidden // n_head)
    if _field(reader, "llama.rope.dimension_count", head_dim) != head_dim:
        raise ValueError("GGUF uses partial rotary embeddings, which the engine does not implement")
    tensor_names = {t.name for t in reader.tensors}
    if _field(reader, "llama.rope.scaling.type", "none") != "none" or "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF uses RoPE scaling, which the engine does not implement")
    return {
        "name": name,
        "architecture": "llama",
        "vocab_size": len(_field(reader, "tokenizer.ggml.tokens")),
        "hidden_size": hidden,
        "intermediate_size": _field(reader, "llama.feed_forward_length"),
        "num_layers": _field(reader, "llama.block_count"),
        "num_heads": n_head,
        "num_kv_heads": _field(reader, "llama.attention.head_count_kv", n_head),
        "head_dim": head_dim,
        "rope_theta": _float32(_field(reader, "llama.rope.freq_base", 10000.0)),
        "rms_norm_eps": _float32(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": _field(reader, "llama.context_length"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "capabilities": copy.deepcopy(NO_CAPABILITIES),
        "source": source,
    }


def _expected_shapes(card: dict) -> dict[str, tuple]:
    h, i, d = card["hidden_size"], card["intermediate_size"], card["head_dim"]
    q, kv = card["num_heads"] * d, card["num_kv_heads"] * d
    shapes = {"embed_tokens": (card["vocab_size"], h), "norm": (h,)}
    if not card["tie_word_embeddings"]:
        shapes["lm_head"] = (card["vocab_size"], h)
    layer = {"input_layernorm": (h,), "post_attention_layernorm": (h,), "q_proj": (q, h), "k_proj": (kv, h),
             "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    for n in range(card["num_layers"]):
        shapes.update({f"layers.{n}.{key}": shape for key, shape in layer.items()})
    return shapes


def _our_tensor_name(gguf_name: str) -> str:
    if gguf_name in GGUF_GLOBAL_TENSORS:
        return GGUF_GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight" \
            and parts[2] in GGUF_LAYER_TENSORS:
        return f"layers.{parts[1]}.{GGUF_LAYER_TENSORS[parts[2]]}"
    raise ValueError(f"GGUF tensor {gguf_name} has no place in a LLaMA model")


def _gguf_tensors(reader, card: dict, progress: bool) -> Iterator:
    expected = _expected_shapes(card)
    names = {t.name: _our_tensor_name(t.name) for t in reader.tensors}
    missing = set(expected) - set(names.values())
    if missing:
        raise ValueError(f"GGUF lacks tensors for {sorted(missing)[0]} (and {len(missing) - 1} more)")
    heads = {"q_proj": card["num_heads"], "k_proj": card["num_kv_heads"]}
    for t in _progress(reader.tensors, desc="packing", unit="tensor", enabled=progress):
        name = names[t.name]
        # F32 tensors come back as read-only views of the GGUF mapping; only those get copied.
        weight = torch.from_numpy(np.require(dequantize(t.data, t.tensor_type), np.float32, ["C", "W"]))
        if tuple(weight.shape) != expected[name]:
            raise ValueError(f"GGUF tensor {t.name} has shape {tuple(weight.shape)}, expected {expected[name]}")
        kind = name.rsplit(".", 1)[-1]
        if kind in heads:
            weight = unpermute_qk(weight, heads[kind])
        yield f"gen/tensor/{name}", "tensor", weight.to(torch.bfloat16)


def _added_tokens(tokens: list[str], types: list[int]) -> tuple[list, list]:
    special = [AddedToken(tok, special=True, normalized=False)
               for tok, kind in zip(tokens, types) if kind == TOKEN_TYPE_CONTROL]
    plain = [AddedToken(tok, special=False, normalized=False)
             for tok, kind in zip(tokens, types) if kind == TOKEN_TYPE_USER_DEFINED]
    return special, plain


def byte_level_tokenizer(tokens: list[str], merges: list[tuple[str, str]], types: list[int],
                         pre: str = "smollm", bos: str | None = None) -> Tokenizer:
    """A GPT-2 style byte-level BPE; tokens of type control become special added tokens."""
    if pre not in BYTE_LEVEL_PRE:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (known: {', '.join(BYTE_LEVEL_PRE)})")
    tokenizer = Tokenizer(models.BPE({tok: i for i, tok in enumerate(tokens)}, merges))
    tokenizer.pre_tokenizer = BYTE_LEVEL_PRE[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    post: list[processors.PostProcessor] = [processors.ByteLevel(trim_offsets=False)]
    if bos is not None:
        post.append(processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tokens.index(bos))]))
    tokenizer.post_processor = processors.Sequence(post)
    special, plain = _added_tokens(tokens, types)
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)
    return tokenizer


def sentencepiece_tokenizer(tokens: list[str], scores: list[float], types: list[int], unk: str,
                            add_space_prefix: bool = True, bos: str | None = None) -> Tokenizer:
    """LLaMA-1/2 style SentencePiece BPE with byte fallback; merges are rebuilt from the piece scores
    the way transformers' GGUF converter does (every split of a piece into two vocab pieces, best score first)."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges: list[tuple[str, str, float]] = []
    for piece, score in zip(tokens, scores):
        pairs = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((left, right, score) for left, right in pairs)
    merges.sort(key=lambda merge: merge[2], reverse=True)
    tokenizer = Tokenizer(models.BPE(vocab, [(left, right) for left, right, _ in merges],
                                     unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Prepend("▁")] if add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                          + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    if bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, vocab[bos])])
    special, plain = _added_tokens(tokens, types)
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)
    return tokenizer


def _gguf_tokenizer(reader) -> Tokenizer:
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    model = _field(reader, "tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (gpt2 or llama)")
    # llama.cpp's defaults: SentencePiece vocabularies add BOS, byte-level ones do not.
    add_bos = _field(reader, "tokenizer.ggml.add_bos_token", model == "llama")
    bos = tokens[_field(reader, "tokenizer.ggml.bos_token_id")] if add_bos else None
    if model == "gpt2":
        merges = [tuple(merge.split(" ", 1)) for merge in _field(reader, "tokenizer.ggml.merges")]
        return byte_level_tokenizer(tokens, merges, types, _field(reader, "tokenizer.ggml.pre", "default"), bos)
    return sentencepiece_tokenizer(tokens, list(_field(reader, "tokenizer.ggml.scores")), types,
                                   tokens[_field(reader, "tokenizer.ggml.unknown_token_id", 0)],
                                   bool(_field(reader, "tokenizer.ggml.add_space_prefix", True)), bos)


def gguf_components(gguf_path, *, name: str | None = None, source: dict | None = None,
                    progress: bool = True) -> Iterator:
    """The gen/ components of a LLaMA-family GGUF, each tensor dequantized once."""
    gguf_path = Path(gguf_path)
    reader = GGUFReader(gguf_path)
    card = _gguf_card(reader, name or gguf_path.name.split(".")[0], source or _source(gguf_path))
    tokenizer = _gguf_tokenizer(reader)
    template = _field(reader, "tokenizer.chat_template", None)
    if template is None:
        raise ValueError(f"{gguf_path} has no tokenizer.chat_template")
    yield "gen/card", "json", card
    yield "gen/tokenizer", "json", tokenizer.to_str()
    yield "gen/chat_template", "text", template
    yield from _gguf_tensors(reader, card, progress)
