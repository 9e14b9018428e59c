"""The engine's CPU operators (cpu_ops.cpp): `torch.ops.aotx_cpu.linear_bf16`, `linear_q4`,
`linear_q8` (and their `dequantize_*`), `rms_norm`, `add_rms_norm`, `rope_write_kv`, `silu_mul`,
`paged_decode_attention`, and memory recall's `masked_top_k` (recall_scan.cpp), one library.

`ops()` returns `torch.ops.aotx_cpu`, building the extension first when this virtualenv has no
build of the current source (about 30 s, once; `make setup` does it). It is None where the CPU
lacks AVX2 and FMA (F16C, which every AVX2 CPU has, is assumed), or the build fails (no C++
compiler): the model then uses PyTorch's own operators with weights widened to float32 once
(model.py), which is correct but slower.

    python -c "from gpu_worker.engine.cpu_ops import main; main()"   # build and check (make setup does)

The check fails (exit 1) only when a built operator computes a wrong product.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent
# the library's sources (the operators, memory recall's scan) and the header they share
SOURCES = [HERE / "cpu_ops.cpp", HERE / "recall_scan.cpp"]
HEADERS = [HERE / "simd.h"]
log = logging.getLogger("gpu_worker.engine")


def build_directory() -> Path:
    """Per virtualenv, else under the user's cache; one directory per version of the source, of
    torch and per checkout, so checkouts sharing a virtualenv never rebuild over each other's
    extension (`ops` loads a library found there as it is; torch's loader, which builds one, runs
    ninja, and the build commands name the sources by their paths, so two checkouts of one version
    in one directory rebuilt it (20 s) at each load that followed the other's: bench/recovery.py
    --versus, a second checkout's boots beside this one's)."""
    digest = hashlib.sha256(str(HERE.resolve()).encode() + b"\0" + torch.__version__.encode() + b"\0"
                            + b"".join(path.read_bytes() for path in SOURCES + HEADERS)).hexdigest()[:16]
    prefix = Path(sys.prefix) / "aotx-build" / "cpu_ops" / digest
    try:
        prefix.mkdir(parents=True, exist_ok=True)
    except OSError:
        prefix = Path(os.path.expanduser("~/.cache/aotx-build/cpu_ops")) / digest
        prefix.mkdir(parents=True, exist_ok=True)
    return prefix


@functools.cache
def ops() -> torch._ops._OpNamespace | None:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    built = build_directory() / "aotx_cpu_ops.so"
    if built.exists():  # built from these sources for this torch (the directory says so): load it
        # as it is, without torch's loader (setuptools imported and ninja run: a tenth of a boot)
        torch.ops.load_library(str(built))
        return torch.ops.aotx_cpu
    from torch.utils.cpp_extension import load
    try:
        import ninja  # the build tool torch's loader runs: the pip package's, PATH or not
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        # -fopenmp: at::parallel_for is OpenMP code in the headers; the library then binds to the
        # libgomp.so.1 torch has already loaded, so both share one thread pool
        load("aotx_cpu_ops", [str(path) for path in SOURCES],
             extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"], extra_ldflags=["-fopenmp"],
             build_directory=str(build_directory()), is_python_module=False)
    except Exception as exc:  # no compiler, no ninja: PyTorch's operators still serve
        log.warning("CPU operators unavailable (%s); using PyTorch's with float32 weights", exc)
        return None
    return torch.ops.aotx_cpu


def main() -> None:
    aotx = ops()
    if aotx is None:  # setup goes on: the engine runs on PyTorch's operators (tests/engine says so)
        print("cpu_ops: not built on this machine (see the warning above); the engine will use PyTorch's operators")
        return
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 576, generator=g), torch.randn(100, 576, generator=g).bfloat16()
    diff = (aotx.linear_bf16(x, w) - x @ w.float().T).abs().max().item()
    if diff > 1e-4:
        raise SystemExit(f"cpu_ops: linear_bf16 differs from the float32 product by {diff}")
    print(f"cpu_ops: built in {build_directory()}; linear_bf16 within {diff:.2g} of the float32 product")


if __name__ == "__main__":
    main()
