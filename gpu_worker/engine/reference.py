"""The `transformers` reference of a runtime file's generation model, for tests and benchmarks only.

It builds `LlamaForCausalLM` from `gen/card` and loads the very tensors the engine reads, so any
difference in logits is a difference in the forward, never in the weights. The device never imports
this module (transformers is a test and benchmark dependency).
"""

from __future__ import annotations

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
                       attn_implementation: str = "sdpa") -> LlamaForCausalLM:
    """`LlamaForCausalLM` in eval mode holding the runtime file's `gen/tensor/*` weights."""
    from transformers import LlamaForCausalLM
    from transformers.initialization import no_init_weights

    card = runtime.json("gen/card")
    config = llama_config(card)
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
    if card["tie_word_embeddings"]:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    if card["tie_word_embeddings"]:
        model.tie_weights()
    # PreTrainedModel.to is @functools.wraps(torch.nn.Module.to): mypy sees an unbound function
    return model.to(device=device, dtype=dtype).eval()  # type: ignore[call-arg]
