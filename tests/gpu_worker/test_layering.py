"""The device's layers (docs/architecture.md, "Device"): operations see the device only through
the context kinds/kind.py declares, so nothing below the device's hub imports it, and the device,
its parts (pipeline/, recovery/) and the operations form no import circle. Every import
counts, those under TYPE_CHECKING and inside functions included: each is an edge a reader
follows."""
from __future__ import annotations

import ast
from pathlib import Path

import gpu_worker

ROOT = Path(gpu_worker.__file__).parent
HUB = {"gpu_worker.device", "gpu_worker.pipeline.admission", "gpu_worker.pipeline.execution",
       "gpu_worker.pipeline.retention", "gpu_worker.pipeline.transfers", "gpu_worker.pipeline.tick",
       "gpu_worker.recovery.replay", "gpu_worker.recovery.checkpoints", "gpu_worker.recovery.succession"}
BELOW_THE_HUB = ("gpu_worker.kinds", "gpu_worker.memory", "gpu_worker.state", "gpu_worker.storage",
                 "gpu_worker.pipeline.images", "gpu_worker.pipeline.prompt", "gpu_worker.contract",
                 "gpu_worker.engine")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """{module: the gpu_worker modules it imports}, resolving `from . import x` to the submodule."""
    files = {module_name(path): path for path in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + [node.module] if node.module else
                                package[:len(package) - node.level + 1]) if node.level else node.module or ""
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return seen


def test_nothing_below_the_hub_imports_it() -> None:
    graph = import_graph()
    offenders = {name: sorted(graph[name] & HUB) for name in graph
                 if name.startswith(BELOW_THE_HUB) and graph[name] & HUB}
    assert offenders == {}


def test_no_import_circle_through_the_device_its_parts_or_the_kinds() -> None:
    graph = import_graph()
    watched = sorted(name for name in graph if name in HUB or name.startswith("gpu_worker.kinds"))
    circles = {name: sorted(module for module in reachable(graph, name) if name in reachable(graph, module))
               for name in watched if name in reachable(graph, name)}
    assert circles == {}


def test_the_graph_sees_a_circle_when_there_is_one() -> None:
    """The check above would fail: an import from an operation back to the device closes one."""
    graph = import_graph()
    graph["gpu_worker.kinds.spaces"].add("gpu_worker.device")
    assert "gpu_worker.kinds.spaces" in reachable(graph, "gpu_worker.kinds.spaces")
    assert "gpu_worker.device" in reachable(graph, "gpu_worker.device")
