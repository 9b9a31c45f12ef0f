"""`hpkv demo`, the README's main job, runs to its table on a real vLLM (CPU build here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.cli import assert_demo_walk

HPKV = Path(sys.executable).with_name("hpkv")

pytestmark = [pytest.mark.engine, pytest.mark.vllm, pytest.mark.demo]  # `hpkv demo` starts vLLM twice


# What a user who followed the quick start and tuned it may have exported: the demo walks the
# documented set-up all the same (with these, vLLM would load no hit and save nothing).
USER_EXPORTS = {"VLLM_HPKV_TOKEN_THRESHOLD": "100000", "HPKV_KV_STORAGE_ENABLE": "false"}


@pytest.mark.timeout(1200)
def test_hpkv_demo_shows_a_dram_hit_and_a_storage_hit_identical_to_vllms_own(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPKV_", "VLLM_"))}
    result = subprocess.run(
        [str(HPKV), "demo", "--workdir", str(tmp_path), "--prompt-words", "1500"],
        env={**env, **USER_EXPORTS, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=1100,
    )
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert_demo_walk(out, "vLLM", "POST /reset_prefix_cache, same request", tmp_path / "storage")
    # Each start's own first-request cost is measured apart, before the rows it would distort.
    rows = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]
    assert rows[0] == "warm-up: another prompt, the engine's first request"
    assert rows.index("engine restarted, warm-up: another prompt") == rows.index("engine restarted, same request") - 1
    for key, value in USER_EXPORTS.items():
        assert f"ignoring {key}={value} from the environment" in out
