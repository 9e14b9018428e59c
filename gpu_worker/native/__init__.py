"""Builds and loads the device's native code, plain CPython extensions (one per module, from its
source files and the headers they share):

- `sockio` (sockio.cpp and tick_io.cpp): the native I/O threads, the socket loop and the tick I/O;
- `jcodec` (jcodec.cpp): journal records encoded from a transfer (header, checksum, data);
- `stacks` (stacks.cpp): every thread's native stack, for the stall watchdog (loop/watchdog.py);
- `fixedmap` (fixedmap.cpp, fixedmap.h): the host indexes' hash tables of fixed-width keys to rows.

`load(name)` returns a module, compiling it first when this virtualenv has no build of the
current source (a few seconds with g++; `make setup` does it). The device needs them: a machine
without a C++ compiler or the Python headers cannot run the device, and says so in one line.

    python -m gpu_worker.native     # build and check every module (make setup does)
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
import zlib
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).parent
FLAGS = ["-O2", "-std=c++17", "-shared", "-fPIC", "-pthread", "-Wall"]
# name -> (its source files, the libraries to link); zlib's headers come with the Python headers on
# Debian (libpython3.x-dev depends on zlib1g-dev), OpenSSL's (SHA-256) with libssl-dev
MODULES: dict[str, tuple[list[str], list[str]]] = {"sockio": (["sockio.cpp", "tick_io.cpp"], []),
                                                   "jcodec": (["jcodec.cpp"], ["-lz", "-lcrypto"]),
                                                   "stacks": (["stacks.cpp"], []),
                                                   "fixedmap": (["fixedmap.cpp"], [])}


class BuildError(RuntimeError):
    pass


def build_directory() -> Path:
    """Per virtualenv, else under the user's cache (as the engine's cpu_ops)."""
    for prefix in (Path(sys.prefix) / "aotx-build" / "native", Path(os.path.expanduser("~/.cache/aotx-build/native"))):
        try:
            prefix.mkdir(parents=True, exist_ok=True)
            return prefix
        except OSError:
            continue
    raise BuildError("no writable build directory for the device's native code")


def build(name: str) -> Path:
    """The built extension for the current source, flags and Python headers (named by their hash)."""
    files, libs = MODULES[name]
    sources = [HERE / file for file in files]
    include = sysconfig.get_paths()["include"]
    text = b"".join(path.read_bytes() for path in sources + sorted(HERE.glob("*.h")))
    digest = hashlib.sha256(text + " ".join(FLAGS + libs + [include]).encode()).hexdigest()[:16]
    what = ", ".join(f"gpu_worker/native/{file}" for file in files)
    target = build_directory() / f"aotx_{name}-{digest}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if target.exists():
        return target
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise BuildError(f"the device needs a C++ compiler (g++) to build {what}")
    if not os.path.exists(os.path.join(include, "Python.h")):
        raise BuildError(f"the device needs the Python headers to build {what} "
                         f"({include}/Python.h is missing)")
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")  # concurrent builds: each renames its own
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, f"-I{include}", *map(str, sources), "-o", tmp, *libs],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise BuildError(f"building {what} failed:\n{done.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def load(name: str) -> ModuleType:
    path = str(build(name))
    module_name = f"aotx_{name}"
    spec = importlib.util.spec_from_file_location(
        module_name, path, loader=importlib.machinery.ExtensionFileLoader(module_name, path))
    assert spec is not None and spec.loader is not None  # a file location with an explicit loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    try:
        modules = {name: load(name) for name in MODULES}
    except BuildError as exc:
        raise SystemExit(f"native: {exc}") from None
    payload = b"\x81\xa1v\x01"
    frames = modules["sockio"].split([b"\0\0", b"\0\4" + payload[:2], payload[2:]], 1 << 24)
    if frames != [payload]:
        raise SystemExit(f"native: the frame splitter returned {frames!r}")
    from ..storage.journal import CLASS_A, PART_HEADER, TYPE_SHARED  # the layout the codec must produce
    fields = (TYPE_SHARED, CLASS_A, 1, 0, 1, 4, 0, 4, 7)
    expected = PART_HEADER.pack(*fields, zlib.crc32(PART_HEADER.pack(*fields, 0, 0) + b"boot"), 0) + b"boot"
    if modules["jcodec"].records(1, 7, b"boot", 160) != [expected]:
        raise SystemExit("native: the journal codec does not give the documented record layout")
    for module in modules.values():
        print(f"native: built {module.__file__}")


if __name__ == "__main__":
    main()
