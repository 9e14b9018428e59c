"""Builds and loads the device's native I/O threads (sockio.cpp: the socket loop and the tick I/O),
a plain CPython extension.

`load()` returns the module, compiling it first when this virtualenv has no build of the current
source (about 3 s with g++; `make setup` does it). The device needs it: a machine without a C++
compiler or the Python headers cannot serve the device socket, and says so in one line.

    python -m gpu_worker.sockio     # build and check (make setup does)
"""
from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("sockio.cpp")
NAME = "aotx_sockio"
FLAGS = ["-O2", "-std=c++17", "-shared", "-fPIC", "-pthread", "-Wall"]


class BuildError(RuntimeError):
    pass


def build_directory() -> Path:
    """Per virtualenv, else under the user's cache (as the engine's cpu_ops)."""
    for prefix in (Path(sys.prefix) / "aotx-build" / "sockio", Path(os.path.expanduser("~/.cache/aotx-build/sockio"))):
        try:
            prefix.mkdir(parents=True, exist_ok=True)
            return prefix
        except OSError:
            continue
    raise BuildError("no writable build directory for the socket loop")


def build() -> Path:
    """The built extension for the current source, flags and Python headers (named by their hash)."""
    include = sysconfig.get_paths()["include"]
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS + [include]).encode()).hexdigest()[:16]
    target = build_directory() / f"{NAME}-{digest}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if target.exists():
        return target
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise BuildError("the device's socket loop needs a C++ compiler (g++) to build gpu_worker/sockio.cpp")
    if not os.path.exists(os.path.join(include, "Python.h")):
        raise BuildError(f"the device's socket loop needs the Python headers ({include}/Python.h is missing)")
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")  # concurrent builds: each renames its own
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, f"-I{include}", str(SOURCE), "-o", tmp],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise BuildError(f"building gpu_worker/sockio.cpp failed:\n{done.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def load():
    path = str(build())
    spec = importlib.util.spec_from_file_location(NAME, path, loader=importlib.machinery.ExtensionFileLoader(NAME, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    try:
        module = load()
    except BuildError as exc:
        raise SystemExit(f"sockio: {exc}") from None
    payload = b"\x81\xa1v\x01"
    frames = module.split([b"\0\0", b"\0\4" + payload[:2], payload[2:]], 1 << 24)
    if frames != [payload]:
        raise SystemExit(f"sockio: the frame splitter returned {frames!r}")
    print(f"sockio: built {module.__file__}")


if __name__ == "__main__":
    main()
