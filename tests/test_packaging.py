"""Packaging: `python -m build` makes an sdist and a wheel (built from the sdist, so the sdist is
complete); the wheel, installed into a clean virtual environment, gives the `hpkv` command,
`hpkv --version`, and the vLLM and SGLang entry points as importlib.metadata finds them.

Fast and offline: no build isolation (this environment's setuptools), the wheel installed with
--no-deps, and only what `hpkv --version` imports (click, rich) made visible to the venv."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import click
import pytest
import rich

import hpkv

REPO = Path(__file__).resolve().parents[1]
ENTRY_POINTS = {
    "vllm.general_plugins": ("hpkv", "hpkv.integrations.vllm.plugin:register"),
    "sglang.srt.plugins": ("ct_hpkv", "hpkv.integrations.sglang.plugin:register"),
    "sglang.serve_backends": ("ct_hpkv", "hpkv.integrations.sglang.plugin:serve_backend"),
}
# The venv sees nothing of this checkout: no PYTHONPATH (a src/*.egg-info there would make pip
# call the wheel installed already).
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
_NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv*", "__pycache__", "*.egg-info", "build", "dist", ".*_cache", ".hypothesis", "out"
)


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    pytest.importorskip("build", reason="needs `build` (pip install ct-hpkv[test])")
    tree = tmp_path_factory.mktemp("tree") / "ct-hpkv"
    shutil.copytree(REPO, tree, ignore=_NOT_SOURCES)
    out = tree.parent / "dist"
    result = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(tree)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("venv")
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True, timeout=120, env=CLEAN_ENV
    )
    python = root / "venv" / "bin" / "python"
    [wheel] = dist.glob("*.whl")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", "--no-index"]
    subprocess.run([*pip, str(wheel)], check=True, timeout=240, env=CLEAN_ENV)
    deps = root / "deps"  # what `hpkv --version` imports, and nothing of this environment's hpkv
    deps.mkdir()
    for package in (click, rich):
        (deps / package.__name__).symlink_to(Path(package.__file__).parent)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        env=CLEAN_ENV,
    ).stdout.strip()
    (Path(site) / "test-deps.pth").write_text(f"{deps}\n")
    return root / "venv"


def test_build_makes_an_sdist_and_a_wheel_of_this_version(dist):
    [sdist] = dist.glob("*.tar.gz")
    [wheel] = dist.glob("*.whl")
    assert sdist.name == f"ct_hpkv-{hpkv.__version__}.tar.gz"
    assert wheel.name == f"ct_hpkv-{hpkv.__version__}-py3-none-any.whl"
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert {"README.md", "pyproject.toml", "src/hpkv/cli.py", "src/hpkv/integrations/vllm/plugin.py"} <= names


def test_the_installed_wheel_gives_the_hpkv_command_and_its_version(venv):
    hpkv_command = venv / "bin" / "hpkv"
    assert hpkv_command.exists()
    result = subprocess.run([str(hpkv_command), "--version"], capture_output=True, text=True, env=CLEAN_ENV, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"hpkv, version {hpkv.__version__}"


def test_the_installed_wheel_has_the_vllm_and_sglang_entry_points(venv):
    probe = f"""
import importlib.metadata as md, importlib.util, json
out = {{}}
for group in {sorted(ENTRY_POINTS)!r}:
    out[group] = [(ep.name, ep.value, ep.dist.name, importlib.util.find_spec(ep.module).origin)
                  for ep in md.entry_points(group=group)]
print(json.dumps(out))
"""
    result = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, env=CLEAN_ENV, timeout=60
    )
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    for group, (name, value) in ENTRY_POINTS.items():
        [(got_name, got_value, dist_name, origin)] = found[group]
        assert (got_name, got_value, dist_name) == (name, value, "ct-hpkv")
        assert Path(origin).is_relative_to(venv), origin  # the wheel's module, not this checkout's
