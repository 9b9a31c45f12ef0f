"""The cluster tier's keys: off by default, file > env > default like every key, each value checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpkv.config import ClusterConfig, load_settings
from hpkv.errors import ConfigError


def test_the_cluster_tier_is_off_by_default_with_mooncakes_usual_settings(tmp_path):
    cluster = load_settings({"HOME": str(tmp_path)}).cluster
    assert cluster == ClusterConfig()
    assert not cluster.enabled and cluster.protocol == "tcp" and cluster.metadata == "P2PHANDSHAKE"
    assert cluster.replicas == 1 and cluster.segment_bytes == 4 << 30


def test_the_file_wins_over_the_environment(tmp_path):
    config = tmp_path / "config.ini"
    config.write_text("HPKV_CLUSTER_MASTER = master.example:6000\nHPKV_CLUSTER_PROTOCOL = rdma\n")
    env = {
        "HOME": str(tmp_path),
        "HPKV_CONFIG_FILE_PATH": str(config),
        "HPKV_CLUSTER_ENABLE": "on",
        "HPKV_CLUSTER_MASTER": "other:1",
        "HPKV_CLUSTER_SEGMENT_SIZE": "512m",
        "HPKV_CLUSTER_METADATA": "http://meta:8080/metadata",
    }
    settings = load_settings(env)
    assert settings.cluster.enabled and settings.cluster.master == "master.example:6000"
    assert settings.cluster.protocol == "rdma" and settings.cluster.segment_bytes == 512 << 20
    assert settings.cluster.metadata == "http://meta:8080/metadata"
    assert "config.ini:1" in settings.source_of("HPKV_CLUSTER_MASTER").where


@pytest.mark.parametrize(
    "key, text",
    [
        ("HPKV_CLUSTER_MASTER", "no-port"),
        ("HPKV_CLUSTER_MASTER", "host:70000"),
        ("HPKV_CLUSTER_PROTOCOL", "udp"),
        ("HPKV_CLUSTER_METADATA", "etcd://x"),
        ("HPKV_CLUSTER_REPLICAS", "0"),
        ("HPKV_CLUSTER_TIMEOUT_S", "0"),
    ],
)
def test_a_bad_value_is_an_error_naming_the_key(tmp_path: Path, key, text):
    with pytest.raises(ConfigError, match=key):
        load_settings({"HOME": str(tmp_path), key: text})


def test_without_mooncake_the_segment_process_says_so_and_doctor_names_the_fix(tmp_path, monkeypatch):
    import dataclasses
    import json
    import subprocess
    import sys

    from hpkv.config import load_settings
    from hpkv.doctor import ServerProbe, Verdict, check_cluster

    code = (
        "import sys; sys.modules['mooncake'] = None; "
        "from hpkv.cluster.segment import main; sys.exit(main(sys.argv[1:]))"
    )
    config = json.dumps(dataclasses.asdict(ClusterConfig(enabled=True)))
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), config], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and "ct-hpkv[cluster]" in done.stderr
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    settings = load_settings({"HOME": str(tmp_path), "HPKV_CLUSTER_ENABLE": "1", "HPKV_CLUSTER_MASTER": "127.0.0.1:1"})
    checks = {c.name: c for c in check_cluster(settings, ServerProbe(tmp_path / "hpkv.sock"))}
    assert checks["cluster libraries"].verdict is Verdict.FAIL and "ct-hpkv[cluster]" in checks["cluster libraries"].fix
    assert checks["cluster master"].verdict is Verdict.FAIL
    assert check_cluster(load_settings({"HOME": str(tmp_path)}), ServerProbe(tmp_path / "hpkv.sock")) == []
