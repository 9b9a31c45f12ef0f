"""bench.device_check runs on a GPU; its CPU mode runs the same logic, so the script itself is
tested here: the server restart under a running worker (issue 18, row 13) must leave one pool
registered and mapped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_restart_check_passes_on_the_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.device_check",
            "--device",
            "cpu",
            "--restart-only",
            "--restarts",
            "2",
            "--layers",
            "2",
            "--page-bytes",
            "8192",
            "--kv-blocks",
            "32",
            "--blocks",
            "8",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )

    assert result.returncode == 0, result.stdout + result.stderr
    out = json.loads(result.stdout)
    assert (out["registered"], out["unregistered"]) == (3, 2) and len(out["restart_s"]) == 2
    assert len(out["checks"]) == 3 and all(out["checks"].values()), out["checks"]
