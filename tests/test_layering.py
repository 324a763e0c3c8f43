"""The packages depend one way: kernels / cpp_dag -> service.model -> service.artifact ->
service.runtime -> service.observe -> service.sched -> service.serving -> service.loadgen / service.evaluate ->
service.cli, and no module imports itself back through others.

Read from the source with `ast`: every import counts, at module level, inside a function, or under
`if TYPE_CHECKING:` alike (an import moved into a function to dodge a cycle is still an edge).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "cpp_dag", "service")
# a module's layer is that of its longest matching prefix
LAYERS = {
    "service": 0,  # the namespace package itself: imports nothing
    "kernels": 0,
    "cpp_dag": 0,
    "service.model": 1,
    "service.artifact": 2,
    "service.runtime": 3,
    "service.observe": 4,
    "service.sched": 5,
    "service.serving": 6,
    "service.loadgen": 7,  # the load generator (`slmrank bench`): the serving layer's stubs and client
    "service.evaluate": 7,  # `slmrank evaluate`: a tool over the artifact and the runtimes, beside the load generator
    "service.cli": 8,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
            if "_gen" not in p.parts}


def layer_of(module: str) -> int:
    best = max((prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".")), key=len,
               default=None)
    if best is None:
        raise AssertionError(f"{module}: in no layer; add its package to LAYERS in {Path(__file__).name}")
    return LAYERS[best]


def imports_of(module: str, path: Path, known: set[str]) -> set[tuple[str, int]]:
    """(imported project module, line) for every import statement in the file."""
    is_package = path.name == "__init__.py"
    found: set[tuple[str, int]] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            targets = [stem] + [f"{stem}.{a.name}" for a in node.names]
        for target in targets:
            # the longest prefix that is a project module: `from .x import f` names module x
            parts = target.split(".")
            for n in range(len(parts), 0, -1):
                candidate = ".".join(parts[:n])
                if candidate in known:
                    if candidate != module:
                        found.add((candidate, node.lineno))
                    break
    return found


def import_graph() -> dict[str, set[tuple[str, int]]]:
    modules = project_modules()
    known = set(modules)
    return {m: imports_of(m, p, known) for m, p in modules.items()}


def test_the_layer_table_covers_every_module():
    for module in project_modules():
        layer_of(module)


def test_no_import_goes_up_a_layer():
    upward = [f"{m} (layer {layer_of(m)}) imports {dep} (layer {layer_of(dep)}) at line {line}"
              for m, deps in import_graph().items() for dep, line in sorted(deps) if layer_of(dep) > layer_of(m)]
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_no_import_cycles():
    graph = {m: {d for d, _ in deps} for m, deps in import_graph().items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    cycles: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def external_imports(path: Path) -> set[tuple[str, int]]:
    """(top-level name, line) of every absolute import in the file."""
    found: set[tuple[str, int]] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {(a.name.split(".")[0], node.lineno) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add((node.module.split(".")[0], node.lineno))
    return found


# scheduling and everything below it knows nothing of the transport
NO_GRPC = ("service.sched", "service.runtime", "service.artifact", "service.model")


def test_no_grpc_below_serving():
    offending = [f"{m} imports {name} at line {line}" for m, p in project_modules().items()
                 if any(m == pkg or m.startswith(pkg + ".") for pkg in NO_GRPC)
                 for name, line in sorted(external_imports(p)) if name == "grpc" or name.startswith("grpc_")]
    assert not offending, "gRPC below service.serving:\n" + "\n".join(offending)


def test_the_front_process_loads_no_torch():
    """A front starts in well under a second: it and what it imports (the verdict, the shapes, the
    status mapping) load no torch, checked in a fresh interpreter."""
    code = ("import sys, service.serving.fronts.front\n"
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "assert 'service.sched.verdict' in sys.modules and 'service.serving.status' in sys.modules\n"
            "print(len(loaded))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0", "the front process loads torch"


@pytest.mark.parametrize("source, expected", [
    ("from .b import f\n", {"service.runtime.b"}),
    ("from ..model import config\n", {"service.model", "service.model.config"}),
    ("def f():\n    from service.serving.server import x\n", {"service.serving.server"}),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..observe.records import R\n",
     {"service.observe.records"}),
])
def test_the_parser_sees_every_kind_of_import(tmp_path, source, expected):
    path = tmp_path / "a.py"
    path.write_text(source)
    known = {"service.runtime.a", "service.runtime.b", "service.model", "service.model.config",
             "service.serving.server", "service.observe.records"}
    assert {m for m, _ in imports_of("service.runtime.a", path, known)} == expected
