"""Packing runtime files: the default models, any local GGUF LLaMA-family model with a BERT
sentence-embedding model, a tiny random-weight runtime for tests, and turning shared operation on
for an existing file (`python -m gpu_worker pack`).

Weights are converted once here so boot only maps them: GGUF tensors are dequantized to bfloat16
in (out, in) order with Q and K un-permuted to the `rotate_half` layout; embedding weights keep
their safetensors dtype and names.

One module per concept, each importing only those listed after it: `cli` (the command line),
`tiny` (the random-weight runtime for tests), `defaults` (the runtimes of real models,
`pack_default` and `pack_vlm`), `checkpoints` (the embedding and vision-language models from
safetensors directories), `gguf` (the generation model from a GGUF) and `writer` (profiles and
writing the file). The names below are what the rest of the project
imports from `gpu_worker.pack`; they stay importable from here.
"""

from .checkpoints import (IDEFICS3_LAYER_TENSORS, IDEFICS3_TEXT_TENSORS, PIL_LANCZOS, POOLING_MODES,
                          embedding_components, vlm_components)
from .cli import main
from .defaults import (DEFAULT_EMBEDDING, DEFAULT_EMBEDDING_NAME, DEFAULT_GGUF, _package_dir, default_embedding_dir,
                       pack_default, pack_vlm)
from .gguf import (BYTE_LEVEL_PRE, GGUF_GLOBAL_TENSORS, GGUF_LAYER_TENSORS, LLAMA3_SPLIT, NO_CAPABILITIES,
                   TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, byte_level_tokenizer, gguf_components,
                   sentencepiece_tokenizer, unpermute_qk)
from .tiny import (CHATML_TEMPLATE, TINY_CONFIG, TINY_CORPUS, TINY_SPECIAL_TOKENS, TINY_VOCAB_SIZE,
                   TINY_WORDPIECE_WORDS, _bytes_to_unicode, _tiny_embedding, _tiny_generation, pack_tiny,
                   pack_tiny_vlm, tiny_tokenizer)
from .writer import JOURNAL_LIMITS, _chain, _write, enable_shared, parse_capacity, shared_profile
