"""`hpkv demo --engine sglang` runs to its table on a real serving SGLang (`make demo-sglang`:
`.venv-sglang`, with the test-only CPU layer on the engine's PYTHONPATH)."""

from __future__ import annotations

import os
import subprocess

import pytest

from helpers import sglang_serving as ss
from helpers.cli import assert_demo_walk

# `hpkv demo --engine sglang` starts SGLang twice
pytestmark = [pytest.mark.engine, pytest.mark.sglang, pytest.mark.demo]


@pytest.mark.timeout(1200)
def test_hpkv_demo_on_sglang_shows_a_dram_hit_and_a_storage_hit_identical_to_sglangs_own(tmp_path):
    ss.require_sglang_venv()
    env = ss.engine_environ({})
    result = subprocess.run(
        [str(ss.SGLANG_PYTHON.with_name("hpkv")), "demo", "--engine", "sglang", "--workdir", str(tmp_path)],
        env={**env, "COLUMNS": "200", "PATH": f"{ss.SGLANG_PYTHON.parent}{os.pathsep}{env.get('PATH', '')}"},
        capture_output=True,
        text=True,
        timeout=1100,
    )
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert_demo_walk(out, "SGLang", "POST /flush_cache, same request", tmp_path / "storage")
