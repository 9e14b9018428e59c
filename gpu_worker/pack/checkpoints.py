"""Models from safetensors checkpoint directories: the sentence-transformers BERT embedding model
(emb/, tensors keep their names and dtypes) and the Idefics3 (SmolVLM) vision-language model (gen/
and vision/: the decoder as the engine's LLaMA, the vision encoder and connector, their cards with
the image rules and the per-image token budget).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from .gguf import NO_CAPABILITIES, _expected_shapes
from .writer import _progress, _source

# sentence-transformers' 1_Pooling/config.json keys for the pooling modes the engine implements.
POOLING_MODES = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens"}


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
