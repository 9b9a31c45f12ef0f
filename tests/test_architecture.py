"""The dependency rule of docs/architecture.md: an engine process imports nothing server-side."""

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
