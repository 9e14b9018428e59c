"""The tiny runtime for fast tests: random-weight LLaMA and BERT models of a few thousand
parameters with real tokenizers (a byte-level BPE learned on a fixed corpus, a WordPiece), and the
tiny SmolVLM runtime over a random scaled-down checkpoint (`pack_tiny_vlm`).
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from typing import Iterator

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from .checkpoints import vlm_components
from .gguf import BYTE_LEVEL_PRE, NO_CAPABILITIES, TOKEN_TYPE_CONTROL, byte_level_tokenizer
from .writer import _chain, _qualified, _write

# SmolLM2-135M-Instruct's `tokenizer.chat_template`, so the tiny runtime renders prompts the same way.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


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
    from ..engine.reference import write_random_idefics3
    started = time.monotonic()
    write_random_idefics3(checkpoint_dir, seed=seed)
    return _write(runtime_path, _chain(vlm_components(checkpoint_dir, name=name, progress=False), _tiny_embedding(seed)),
                  shared=shared, capacity=None, runtime_profile=runtime_profile, started=started)
