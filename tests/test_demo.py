"""`hpkv demo`, the README's main job, runs to its table on a real vLLM (CPU build here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HPKV = Path(sys.executable).with_name("hpkv")

pytestmark = pytest.mark.engine  # `hpkv demo` starts vLLM twice


@pytest.mark.timeout(1200)
def test_hpkv_demo_shows_a_dram_hit_and_a_storage_hit_identical_to_vllms_own(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPKV_", "VLLM_"))}
    result = subprocess.run(
        [str(HPKV), "demo", "--workdir", str(tmp_path), "--prompt-words", "1500"],
        env={**env, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=1100,
    )
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    rows = {
        line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
        for line in out.splitlines()
        if line.startswith("│")
    }
    dram = rows["POST /reset_prefix_cache, same request"]
    disk = rows["engine restarted, same request"]
    assert dram[0] == "DRAM" and int(dram[1]) > 1000 and dram[3] == "yes"
    assert disk[0] == "storage" and int(disk[1]) > 1000 and disk[3] == "yes"
    [(files, cells)] = [(name, cells) for name, cells in rows.items() if " KV files written under " in name]
    assert int(files.split()[0]) > 0 and cells[1] == "-"  # a file count in its own words, no hit tokens
    assert "starting vLLM: done after" in out and "restarting vLLM: done after" in out
    assert list((tmp_path / "storage").rglob("*.kv"))
