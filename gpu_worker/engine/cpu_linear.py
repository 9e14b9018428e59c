"""The CPU product of float32 activations with the runtime file's bfloat16 weights (cpu_linear.cpp).

`linear_bf16()` returns `torch.ops.aotx_cpu.linear_bf16`, building the extension first when this
virtualenv has no build of the current source (about 15 s, once; `make setup` does it). It is None
where the CPU lacks AVX2 and FMA, or the build fails (no C++ compiler): the model then widens its
weights to float32 once and uses oneDNN (model.Linear), which is correct but streams twice the bytes.

    python -c "from gpu_worker.engine.cpu_linear import main; main()"   # build, check (make setup does)
"""
from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_linear.cpp")
log = logging.getLogger("gpu_worker.engine")


def build_directory() -> Path:
    """Per virtualenv (the build is tied to its torch), else torch's own cache."""
    prefix = Path(sys.prefix) / "aotx-build" / "cpu_linear"
    try:
        prefix.mkdir(parents=True, exist_ok=True)
    except OSError:
        prefix = Path(os.path.expanduser("~/.cache/aotx-build/cpu_linear"))
        prefix.mkdir(parents=True, exist_ok=True)
    return prefix


@functools.cache
def linear_bf16():
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    from torch.utils.cpp_extension import load
    try:
        import ninja  # the build tool torch's loader runs: the pip package's, PATH or not
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        load("aotx_cpu_linear", [str(SOURCE)], extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"],
             build_directory=str(build_directory()), is_python_module=False)
    except Exception as exc:  # no compiler, no ninja: the float32 path still serves
        log.warning("bfloat16 CPU kernel unavailable (%s); using float32 weights", exc)
        return None
    return torch.ops.aotx_cpu.linear_bf16


def main():
    kernel = linear_bf16()
    if kernel is None:
        raise SystemExit("cpu_linear: not available on this machine (see the warning above)")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 576, generator=g), torch.randn(100, 576, generator=g).bfloat16()
    diff = (kernel(x, w) - x @ w.float().T).abs().max().item()
    if diff > 1e-4:
        raise SystemExit(f"cpu_linear: differs from the float32 product by {diff}")
    print(f"cpu_linear: built in {build_directory()}; max difference from the float32 product {diff:.2g}")


if __name__ == "__main__":
    main()
