"""The benchmarks are one package, `bench`, run as `python -m bench.<name>`: every module imports
as part of it, none reaches another through sys.path, and the wheel's `hpkv.benchmark` holds
only what `hpkv bench` runs."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", MODULES)
def test_every_benchmark_imports_as_a_module_of_the_package(name):
    module = importlib.import_module(f"bench.{name}")

    assert "sys.path.insert" not in Path(module.__file__).read_text()


def test_the_shipped_benchmark_package_holds_only_what_hpkv_bench_runs():
    shipped = {p.stem for p in (ROOT / "src" / "hpkv" / "benchmark").glob("*.py")}

    assert shipped == {"__init__", "dataplane", "lookup", "machine", "report"}
