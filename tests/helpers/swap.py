"""A command run where /proc/swaps lists a swap file: the machine's memory and kernel as they are,
seen by HPKV as a node with swap configured (a private mount namespace; root and unshare, else the
test is skipped). For the paths that lock the pool in memory only where something could swap."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

FAKE_SWAPS = "Filename\tType\tSize\tUsed\tPriority\n/swapfile file\t1048572\t0\t-2\n"


def with_swap_configured(tmp_path: Path, *command: str) -> subprocess.CompletedProcess:
    """`command` run where /proc/swaps lists a swap file (a private mount namespace, as root)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to show a swap in /proc/swaps")
    swaps = tmp_path / "swaps"
    swaps.write_text(FAKE_SWAPS)
    script = 'mount --bind "$0" /proc/swaps && exec "$@"'
    result = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, str(swaps), *command], capture_output=True, text=True, timeout=120
    )
    if "mount" in result.stderr and result.returncode != 0:
        pytest.skip(f"cannot bind-mount over /proc/swaps here: {result.stderr.strip()}")
    return result
