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
