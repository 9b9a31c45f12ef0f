"""Story: `hpkv bench --json` runs the whole data-plane benchmark in a tiny configuration, as a real
process, and reports every row with positive figures and no temporaries left behind. Timing
targets are never asserted here: they depend on the machine and on what else runs on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HPKV_SCRIPT = Path(sys.executable).parent / "hpkv"
ROOT = Path(__file__).resolve().parents[1]


def bench_module(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m bench.<name> args` run in `cwd`, with the repository's `bench` package importable."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-m", f"bench.{name}", *args], capture_output=True, text=True, timeout=240, cwd=cwd, env=env
    )


SIZES = ("64k", "256k", "1m", "4m")
SIZE_BYTES = (64 << 10, 256 << 10, 1 << 20, 4 << 20)


@pytest.fixture
def report(shm_dir, tmp_path) -> dict:
    storage_parent = tmp_path / "disk"
    storage_parent.mkdir()
    result = subprocess.run(
        [
            str(HPKV_SCRIPT),
            "bench",
            "--sizes",
            ",".join(SIZES),
            "--total",
            "4m",
            "--lookup-keys",
            "20000",
            "--storage-dir",
            str(storage_parent),
            "--pool-dir",
            str(shm_dir),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert list(storage_parent.iterdir()) == [] and list(shm_dir.iterdir()) == []
    return json.loads(result.stdout)


def test_bench_reports_every_row_with_positive_figures(report):
    rows = {(row["measure"], row["entry_bytes"]): row for row in report["rows"]}
    for measure in ("DRAM write", "DRAM read", "storage write", "storage read"):
        for size in SIZE_BYTES:
            row = rows.pop((measure, size))
            assert row["unit"] == "GB/s"
            assert row["value"] > 0 and row["limit"] > 0 and row["ratio"] > 0
            assert (row["passed"] is None) == (size != 1 << 20)  # targets sit at 1 MiB
    assert rows.pop(("storage write, fsync=data", 1 << 20))["value"] > 0
    lookups = [rows.pop(key) for key in list(rows) if key[0].startswith("lookup")]
    assert rows == {}
    assert [row["measure"] for row in lookups] == ["lookup, all hit", "lookup, miss halfway"]
    for row in lookups:
        assert row["unit"] == "ms" and row["value"] > 0 and row["p99"] >= row["value"] > 0
        assert row["limit"] > 0
    assert isinstance(lookups[0]["passed"], bool)


def test_bench_records_the_machine_and_its_paths(report, shm_dir):
    machine = report["machine"]
    assert machine["cpus"] >= 1 and machine["memory_bytes"] > 0
    assert machine["pool_dir"]["fs_type"] == "tmpfs"
    assert Path(machine["pool_dir"]["path"]).parent == shm_dir
    assert report["config"]["total_bytes"] == 4 << 20
    assert report["config"]["num_lookup_keys"] == 20000


def test_bench_rejects_a_total_smaller_than_an_entry(tmp_path):
    result = subprocess.run(
        [str(HPKV_SCRIPT), "bench", "--sizes", "1m", "--total", "64k"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert "largest size" in result.stderr and "Traceback" not in result.stderr


def test_the_stalled_storage_benchmark_compares_the_backlog_limit_with_none(shm_dir, tmp_path):
    """bench.stalled_storage, small: with the writers stopped, the store without a limit skips
    saves once its pool is pinned, the store with one skips none, and both leave nothing behind."""
    result = bench_module(
        "stalled_storage",
        "--requests",
        "150",
        "--pool-bytes",
        str(4 << 20),
        "--doc-blocks",
        "64",
        "--storage-dir",
        str(tmp_path),
        "--pool-dir",
        str(shm_dir),
        "--json",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    limited, unlimited = out["stores"].values()
    assert limited["saves_skipped"] == 0 and unlimited["saves_skipped"] > 0
    assert limited["backlog_entries"] == out["pool_entries"] // 2 and limited["deferred"] > 0
    assert unlimited["backlog_entries"] == out["pool_entries"] and unlimited["deferred"] == 0
    assert unlimited["written_after"] == out["pool_entries"]
    assert list(shm_dir.iterdir()) == [] and list(tmp_path.iterdir()) == []


def test_the_storage_scan_benchmark_indexes_every_file_and_hits_during_the_walk(tmp_path):
    result = bench_module(
        "storage_scan", "--files", "300", "--storage-dir", str(tmp_path), "--no-cold", "--json", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["warm"]["files_indexed"] == 300 and out["warm"]["probe_hit"]
    assert out["cold"] is None
    assert list(tmp_path.iterdir()) == []
