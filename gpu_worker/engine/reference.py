"""The `transformers` reference of a runtime file's generation model, for tests and benchmarks only.

It builds `LlamaForCausalLM` from `gen/card` and loads the very tensors the engine reads, so any
difference in logits is a difference in the forward, never in the weights. The device never imports
this module (transformers is a test and benchmark dependency).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpu_worker.storage.runtime_file import RuntimeFile


def llama_config(card: dict[str, Any]) -> LlamaConfig:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=card["vocab_size"], hidden_size=card["hidden_size"], intermediate_size=card["intermediate_size"],
        num_hidden_layers=card["num_layers"], num_attention_heads=card["num_heads"],
        num_key_value_heads=card["num_kv_heads"], head_dim=card["head_dim"], hidden_act="silu",
        max_position_embeddings=card["max_position_embeddings"], rms_norm_eps=card["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": card["rope_theta"]},
        tie_word_embeddings=card["tie_word_embeddings"], bos_token_id=card.get("bos_token_id"),
        eos_token_id=card.get("eos_token_id"), pad_token_id=card.get("eos_token_id"),
        attention_bias=False, mlp_bias=False,
    )


def transformers_model(runtime: RuntimeFile, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                       attn_implementation: str = "sdpa", cpu_weights: str | None = None) -> LlamaForCausalLM:
    """`LlamaForCausalLM` in eval mode holding the runtime file's `gen/tensor/*` weights, or, with
    `cpu_weights`, the values the engine's matrix products use on CPU in float32 with that setting
    (model.Linear: "quantized" holds the GGUF blocks it recovers, dequantized, rounds each
    product's activations as the engine's do and attends over keys and values rounded to float16,
    the engine's KV pool there), so that its logits are the engine's up to summation order."""
    from transformers import LlamaForCausalLM
    from transformers.initialization import no_init_weights

    card = dict(runtime.json("gen/card"))
    if cpu_weights is not None:  # the embedding lookup reads the stored table, the output product its blocks
        card["tie_word_embeddings"] = False
    config = llama_config(card)
    if cpu_weights == "quantized" and attn_implementation == "sdpa":
        attn_implementation = _float16_kv_attention()
    config._attn_implementation = attn_implementation
    with no_init_weights():  # every weight is replaced below; random init of 135M parameters takes seconds
        model = LlamaForCausalLM(config)
    names = {"embed_tokens": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}
    layer_names = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm",
                   "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
                   "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
                   "down_proj": "mlp.down_proj"}
    state = {}
    for name in runtime.names("gen/tensor/"):
        ours = name[len("gen/tensor/"):]
        if ours.startswith("layers."):
            _, index, key = ours.split(".")
            theirs = f"model.layers.{index}.{layer_names[key]}.weight"
        else:
            theirs = names[ours]
        state[theirs] = runtime.tensor(name).to(dtype)
    if cpu_weights is not None:
        _engine_values(runtime, state, cpu_weights, dtype)
    elif card["tie_word_embeddings"]:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    if card["tie_word_embeddings"]:
        model.tie_weights()
    if cpu_weights == "quantized":  # the engine's quantized products multiply rounded activations
        from gpu_worker.engine import cpu_ops
        from gpu_worker.engine.model import Q8_BLOCK

        aotx = cpu_ops.ops()
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.in_features % Q8_BLOCK == 0:
                module.register_forward_pre_hook(lambda _, args, aotx=aotx: (_rounded(aotx, args[0]),))
    # PreTrainedModel.to is @functools.wraps(torch.nn.Module.to): mypy sees an unbound function
    return model.to(device=device, dtype=dtype).eval()  # type: ignore[call-arg]


def _float16_kv_attention() -> str:
    """The name of an attention function for transformers: its SDPA over keys and values rounded to
    float16 (after the rotation), as the engine's CPU pool holds them for quantized weights (model.py)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                  **kwargs: Any) -> Any:
        return sdpa_attention_forward(module, query, key.half().to(key.dtype), value.half().to(value.dtype),
                                      *args, **kwargs)

    AttentionInterface.register("aotx_float16_kv", attention)
    return "aotx_float16_kv"


def _rounded(aotx: Any, x: torch.Tensor) -> torch.Tensor:
    """x as the engine's quantized products round it (cpu_ops' round_activations, over its last dimension)."""
    return aotx.round_activations(x.reshape(-1, x.shape[-1]).float().contiguous()).view(x.shape).to(x.dtype)


def _engine_values(runtime: RuntimeFile, state: dict[str, torch.Tensor], cpu_weights: str, dtype: torch.dtype) -> None:
    """Replace the matrices of `state` by the values the engine multiplies: quantized as the engine
    concatenates them (q, k, v; gate, up), then split back."""
    from gpu_worker.engine.model import cpu_weight_values

    head = "gen/tensor/lm_head" if "gen/tensor/lm_head" in runtime.names("gen/tensor/") else "gen/tensor/embed_tokens"
    state["lm_head.weight"] = cpu_weight_values(runtime.tensor(head), cpu_weights).to(dtype)
    layers = runtime.json("gen/card")["num_layers"]
    for i in range(layers):
        for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"),
                      ("self_attn.o_proj",), ("mlp.down_proj",)):
            keys = [f"model.layers.{i}.{name}.weight" for name in group]
            ours = ["gen/tensor/layers.{}.{}".format(i, name.split(".")[1]) for name in group]
            stored = torch.cat([runtime.tensor(name) for name in ours])
            values = cpu_weight_values(stored, cpu_weights).to(dtype)
            for key, part in zip(keys, values.split([state[key].shape[0] for key in keys])):
                state[key] = part.contiguous()


# ---- Idefics3 (SmolVLM): a random checkpoint directory and the transformers model of a packed one ----

# SmolVLM's chat template (content parts: text and image)
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'][0]['type'] "
    "== 'image' %}{{':'}}{% else %}{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == "
    "'text' %}{{line['text']}}{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# SmolVLM-256M-Instruct's shapes (its config.json, preprocessor_config.json and processor_config.json)
SMOLVLM_256M = {
    "text": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
             "num_key_value_heads": 3, "vocab_size": 49280, "rope_theta": 100000.0, "max_position_embeddings": 8192},
    "vision": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
               "image_size": 512, "patch_size": 16},
    "scale_factor": 4, "longest_edge": 2048,
}
# The same architecture scaled down for tests: tiles of 64 pixels, 8x8 patches, 4 image tokens a tile.
TINY_VLM = {
    "text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 448, "rope_theta": 100000.0, "max_position_embeddings": 4096},
    "vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
               "image_size": 64, "patch_size": 8},
    "scale_factor": 4, "longest_edge": 192,
}


def write_random_idefics3(model_dir: str | os.PathLike[str], shapes: dict[str, Any] = TINY_VLM, seed: int = 0) -> None:
    """A SmolVLM-style checkpoint directory with random weights (as `save_pretrained` writes one):
    config, processor (image processor, tokenizer with SmolVLM's image tokens, chat template) and
    safetensors. Weights: unit-variance token embeddings and 1/sqrt(fan in) matrices, so logits are
    spread out and greedy choices are not decided by rounding."""
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil,
                              Idefics3Processor, PreTrainedTokenizerFast)
    from tokenizers import AddedToken

    from gpu_worker.pack.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    specials = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
    specials += [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<end_of_utterance>",
                                        unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    text, vision = dict(shapes["text"]), dict(shapes["vision"])
    text["vocab_size"] = max(text["vocab_size"], tok.get_vocab_size())
    eos, image_token_id = tok.token_to_id("<end_of_utterance>"), tok.token_to_id("<image>")
    assert image_token_id is not None  # added above
    config = Idefics3Config(
        text_config={"model_type": "llama", **{k: v for k, v in text.items() if k != "rope_theta"},
                     "rope_parameters": {"rope_type": "default", "rope_theta": text["rope_theta"]},
                     "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": eos, "pad_token_id": 0,
                     "tie_word_embeddings": False},
        vision_config=vision, scale_factor=shapes["scale_factor"], image_token_id=image_token_id,
        tie_word_embeddings=False)
    g = torch.Generator().manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                param.copy_(torch.randn(param.shape, generator=g))
            elif "norm" in name and name.endswith("weight"):
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=g))
            elif name.endswith("bias"):
                param.copy_(0.02 * torch.randn(param.shape, generator=g))
            else:
                fan_in = param[0].numel() if param.dim() > 1 else param.shape[0]
                param.copy_(torch.randn(param.shape, generator=g) * fan_in ** -0.5)
    model.to(torch.bfloat16).save_pretrained(model_dir)  # type: ignore[arg-type]  # PreTrainedModel.to wraps Module.to
    tile = vision["image_size"]
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": shapes["longest_edge"]}, max_image_size={"longest_edge": tile},
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    seq_len = (tile // vision["patch_size"]) ** 2 // shapes["scale_factor"] ** 2
    Idefics3Processor(image_processor, tokenizer, image_seq_len=seq_len,
                      chat_template=SMOLVLM_TEMPLATE).save_pretrained(model_dir)


def transformers_vlm(runtime: RuntimeFile, *, dtype: torch.dtype = torch.float32,
                     attn_implementation: str = "sdpa") -> Any:
    """`Idefics3ForConditionalGeneration` in eval mode holding the runtime file's gen/ and vision/
    tensors (the very values the engine reads, widened to `dtype`)."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration
    from transformers.initialization import no_init_weights

    card, vcard = runtime.json("gen/card"), runtime.json("vision/card")
    text = llama_config(card).to_dict()
    config = Idefics3Config(
        text_config=text,
        vision_config={"hidden_size": vcard["hidden_size"], "intermediate_size": vcard["intermediate_size"],
                       "num_hidden_layers": vcard["num_layers"], "num_attention_heads": vcard["num_heads"],
                       "image_size": vcard["image_size"], "patch_size": vcard["patch_size"],
                       "layer_norm_eps": vcard["layer_norm_eps"]},
        scale_factor=vcard["scale_factor"], image_token_id=vcard["image_token_id"],
        tie_word_embeddings=card["tie_word_embeddings"])
    config._attn_implementation = attn_implementation
    with no_init_weights():
        model = Idefics3ForConditionalGeneration(config)
    layer_names = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm",
                   "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
                   "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
                   "down_proj": "mlp.down_proj"}
    names = {"embed_tokens": "model.text_model.embed_tokens.weight", "norm": "model.text_model.norm.weight",
             "lm_head": "lm_head.weight"}
    state = {}
    for name in runtime.names("gen/tensor/"):
        ours = name[len("gen/tensor/"):]
        if ours.startswith("layers."):
            _, index, key = ours.split(".")
            state[f"model.text_model.layers.{index}.{layer_names[key]}.weight"] = runtime.tensor(name).to(dtype)
        else:
            state[names[ours]] = runtime.tensor(name).to(dtype)
    for name in runtime.names("vision/tensor/"):
        ours = name[len("vision/tensor/"):]
        theirs = "model.connector.modality_projection.proj.weight" if ours == "connector.proj" else \
            f"model.vision_model.{ours}"
        state[theirs] = runtime.tensor(name).to(dtype)
    if card["tie_word_embeddings"]:
        state["lm_head.weight"] = state["model.text_model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model.to(dtype=dtype).eval()  # type: ignore[call-arg]  # as transformers_model
