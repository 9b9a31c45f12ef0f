"""The dependency rules of docs/architecture.md: an engine process imports nothing server-side,
no import circle in src/hpkv, the store imports nothing of the server, one concept per module
of at most about 400 lines."""

import ast
import json
import subprocess
import sys
from pathlib import Path

ENGINE_MODULES = [
    "hpkv.integrations.vllm.plugin",
    "hpkv.integrations.vllm.connector",
    "hpkv.integrations.vllm.scheduler",
    "hpkv.integrations.vllm.worker",
    "hpkv.integrations.sglang.plugin",
    "hpkv.integrations.sglang.backend",
    "hpkv.costmodel",
]
SERVER_SIDE = (
    "hpkv.store",
    "hpkv.storage",
    "hpkv.server.daemon",
    "hpkv.server.handlers",
    "hpkv.server.connection",
    "hpkv.server.loop",
    "hpkv.server.access",
    "hpkv.pool.dram_tier",
    "hpkv.limits",
)


def test_an_engine_process_imports_nothing_from_the_store_or_the_storage_tier():
    code = (
        f"import importlib, json, sys\nfor m in {ENGINE_MODULES!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('hpkv'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(ENGINE_MODULES) <= set(loaded)
    leaked = [m for m in loaded if any(m == s or m.startswith(s + ".") for s in SERVER_SIDE)]
    assert leaked == []


# Classes whose methods an engine's interface dictates, each method a delegation.
ENGINE_INTERFACES = {"HpkvConnectorV1": "vLLM's KVConnectorBase_V1"}


def _methods(node) -> list[str]:
    def is_property(f) -> bool:
        return any(getattr(d, "id", getattr(d, "attr", None)) in ("property", "setter") for d in f.decorator_list)

    return [
        f.name
        for f in node.body
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        and not (f.name.startswith("__") and f.name.endswith("__"))
        and not is_property(f)
    ]


def test_every_module_holds_one_concept_of_at_most_about_400_lines_and_20_methods_a_class():
    src = Path(__file__).resolve().parents[1] / "src" / "hpkv"
    too_long, too_wide = [], []
    for path in sorted(src.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 400:
            too_long.append(f"{path.relative_to(src)} ({text.count(chr(10))} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.name not in ENGINE_INTERFACES and len(_methods(node)) > 20:
                too_wide.append(f"{path.relative_to(src)}: {node.name} ({len(_methods(node))} methods)")
    assert too_long == [] and too_wide == []


def _module_names(src: Path) -> dict[str, Path]:
    """Each module under `src` (the directory holding the top package) by its dotted name."""
    names = {}
    for path in sorted(src.rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def import_graph(src: Path, package: str = "hpkv") -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports, every import counted: module-level,
    inside functions and under TYPE_CHECKING alike (each is a dependency a reader must follow)."""
    modules = _module_names(src)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                up = base[: len(base) - node.level + 1] if node.level else []
                parent = ".".join(up + ([node.module] if node.module else []))
                # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod.
                targets = [
                    f"{parent}.{alias.name}" if f"{parent}.{alias.name}" in modules else parent for alias in node.names
                ]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and (target == package or target.startswith(package + ".")):
                    deps.add(target)
        graph[name] = deps
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(circles)


def _describe(circle: list[str], graph: dict[str, set[str]]) -> str:
    inside = set(circle)
    edges = ", ".join(f"{m} -> {d}" for m in circle for d in sorted(graph[m] & inside))
    return f"{' <-> '.join(circle)} ({edges})"


def test_no_import_circle_in_hpkv():
    src = Path(__file__).resolve().parents[1] / "src"
    graph = import_graph(src)
    circles = import_circles(graph)
    assert not circles, (
        "import circles in src/hpkv (dependencies must run one way; cut each where its state lives):\n  "
        + "\n  ".join(_describe(c, graph) for c in circles)
    )


def test_the_circle_check_finds_a_circle_through_function_level_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "a.py").write_text("import os\nfrom .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .c import g\n")
    (pkg / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import x\n")
    assert import_circles(import_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.sub.b", "pkg.sub.c"]]
    (pkg / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import os\n")
    assert import_circles(import_graph(tmp_path, "pkg")) == []


def test_the_store_and_its_tiers_import_nothing_of_the_server():
    graph = import_graph(Path(__file__).resolve().parents[1] / "src")
    below = ("hpkv.store", "hpkv.pool", "hpkv.storage", "hpkv.limits")
    reaching_up = sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        if any(m == b or m.startswith(b + ".") for b in below)
        for d in deps
        if d.startswith("hpkv.server")
    )
    assert reaching_up == [], "the store, pool and storage tier import the server (docs/architecture.md)"
