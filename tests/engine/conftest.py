"""Runtime files for the engine tests: the tiny random model (seconds) and the real default model,
each packed once per session, plus the transformers reference of each."""
import os

import pytest
import torch

from gpu_worker.storage.runtime_file import RuntimeFile

# Without a GPU, Triton's interpreter runs the engine's Triton kernels (triton_ops) on CPU tensors. It
# is chosen when a kernel is defined, so this must precede the first import of triton_ops.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A pool far smaller than the default 2048 pages: a float32 pool for SmolLM2 costs 0.75 MiB a page.
REAL_PROFILE = {"kv_pages": 256, "page_grant": 160}


@pytest.fixture(scope="session")
def tiny_gen(tmp_path_factory):
    from gpu_worker.pack import pack_tiny
    path = tmp_path_factory.mktemp("engine") / "tiny.aotxccir"
    pack_tiny(path, with_embedding=False)
    with RuntimeFile.open(path) as runtime:
        yield runtime


@pytest.fixture(scope="session")
def small_pool(tmp_path_factory):
    """The tiny model with a pool of 8 pages and a page grant of 4."""
    from gpu_worker.pack import pack_tiny
    path = tmp_path_factory.mktemp("engine") / "tiny-8-pages.aotxccir"
    pack_tiny(path, with_embedding=False, runtime_profile={"kv_pages": 8, "page_grant": 4})
    with RuntimeFile.open(path) as runtime:
        yield runtime


@pytest.fixture(scope="session")
def real_gen(tmp_path_factory):
    from gpu_worker.pack import pack_default
    path = tmp_path_factory.mktemp("engine") / "default.aotxccir"
    pack_default(path, progress=False, runtime_profile=REAL_PROFILE)
    with RuntimeFile.open(path) as runtime:
        yield runtime


def engine_values() -> str | None:
    """The weights the engine multiplies on CPU in float32 by default: its quantized blocks where
    cpu_ops builds (model.Linear), else the stored ones."""
    from gpu_worker.engine import cpu_ops
    from gpu_worker.engine.model import CPU_WEIGHTS
    return CPU_WEIGHTS[0] if cpu_ops.ops() is not None else None


@pytest.fixture(scope="session")
def tiny_reference(tiny_gen):
    """transformers holding the values the default CPU engine multiplies: logits equal up to summation order."""
    from gpu_worker.engine.reference import transformers_model
    return transformers_model(tiny_gen, cpu_weights=engine_values())


@pytest.fixture(scope="session")
def tiny_stored_reference(tiny_gen):
    """transformers holding the runtime file's stored weights (what CUDA and bfloat16 compute with)."""
    from gpu_worker.engine.reference import transformers_model
    return transformers_model(tiny_gen)


@pytest.fixture(scope="session")
def real_reference(real_gen):
    from gpu_worker.engine.reference import transformers_model
    return transformers_model(real_gen, cpu_weights=engine_values())


@pytest.fixture(scope="session")
def real_stored_reference(real_gen):
    from gpu_worker.engine.reference import transformers_model
    return transformers_model(real_gen)
