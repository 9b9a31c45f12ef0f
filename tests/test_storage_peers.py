"""Stories about the storage-tier comparison with LMCache's fs adapter (`bench.storage_peers`):
both sides get the same shape of work, and a row passes only when HPKV is at least as fast."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import bench.storage_peers as cli
from bench.storage_peers import PeerConfig, PeerReport, PeerRow, file_costs, lmcache_command, measure_hpkv, run


def test_a_round_must_split_into_equal_submits():
    with pytest.raises(ValueError):
        PeerConfig(entry_sizes=(3 << 20,), round_bytes=256 << 20)
    assert PeerConfig(entry_sizes=(64 << 10,)).keys_per_submit(64 << 10) == 512


def test_lmcache_gets_the_same_shape_as_hpkv(tmp_path):
    config = PeerConfig(entry_sizes=(1 << 20,), round_bytes=16 << 20, rounds=3, in_flight=4)

    command = lmcache_command(tmp_path / "lm", 1 << 20, config, "load", tmp_path / "out.json")

    args = dict(zip(command[3::], command[4::]))
    assert json.loads(args["--l2-adapter"]) == {"type": "fs", "base_path": str(tmp_path / "lm")}
    assert (args["--data-size-kb"], args["--num-keys"], args["--in-flight"]) == ("1024", "4", "4")
    assert (args["--rounds"], args["--warmup-rounds"], args["--only"]) == ("3", "1", "load")


def test_a_row_passes_only_at_or_above_the_peer_and_near_the_limit_at_one_mib():
    assert PeerRow(64 << 10, "write", hpkv=1.0, lmcache=0.5, limit=4.0).passed  # no limit target here
    assert not PeerRow(64 << 10, "write", hpkv=0.4, lmcache=0.5, limit=4.0).passed
    assert not PeerRow(1 << 20, "read", hpkv=2.0, lmcache=1.0, limit=4.0).passed  # 0.5x the limit
    assert PeerRow(1 << 20, "read", hpkv=3.0, lmcache=1.0, limit=4.0).passed


def test_hpkv_writes_new_keys_every_round_and_reads_back_the_same_bytes(tmp_path):
    config = PeerConfig(entry_sizes=(64 << 10,), round_bytes=1 << 20, rounds=2, in_flight=2)
    src = np.frombuffer(np.random.default_rng(1).bytes(config.round_bytes), dtype=np.uint8)
    dst = np.zeros(config.round_bytes, dtype=np.uint8)

    write_s, read_s = measure_hpkv(tmp_path / "hpkv", src, dst, 64 << 10, config)

    assert write_s > 0 and read_s > 0
    assert np.array_equal(src, dst)
    assert len(list((tmp_path / "hpkv").rglob("*.kv"))) == 3 * 16  # warm-up + 2 rounds, all kept


@pytest.mark.skipif(not Path(PeerConfig().lmcache).exists(), reason="lmcache is not installed beside this python")
def test_a_small_run_against_lmcache_gives_one_write_and_one_read_row_per_size(tmp_path):
    pytest.importorskip("aiofiles")
    config = PeerConfig(entry_sizes=(64 << 10,), round_bytes=1 << 20, rounds=1, in_flight=2, storage_parent=tmp_path)

    report = run(config)

    assert [(row.entry_bytes, row.direction) for row in report.rows] == [(64 << 10, "write"), (64 << 10, "read")]
    assert all(row.hpkv > 0 and row.lmcache > 0 and row.limit > 0 for row in report.rows)
    assert list(tmp_path.iterdir()) == []  # the temporaries are gone


def test_file_costs_time_creates_and_removals_and_leave_nothing_behind(tmp_path):
    costs = file_costs(tmp_path, num_files=50)

    assert costs["files"] == 50
    assert costs["create_us"] > 0 and costs["unlink_us"] > 0
    assert 0 <= costs["create_system_us"] and 0 <= costs["unlink_system_us"]
    assert list(tmp_path.iterdir()) == []


def test_a_report_saved_as_json_prints_the_same_file_costs(tmp_path, capsys):
    report = PeerReport(
        PeerConfig(),
        {"cpus": 2, "load_avg_1m": 0.5, "storage_dir": {"fs_type": "ext4", "path": "/x"}},
        (PeerRow(1 << 20, "write", 2.0, 1.0, 3.0),),
        10.0,
        {"create_us": 210.0, "create_system_us": 200.0, "unlink_us": 80.0, "unlink_system_us": 75.0, "files": 500},
    )
    saved = tmp_path / "run.json"
    saved.write_text(cli.to_json(report))

    assert cli.main(["--table-from", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "create 210 us (200 us of system CPU), unlink 80 us (75 us)" in out
