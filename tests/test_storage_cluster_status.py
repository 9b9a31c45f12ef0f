"""What an operator sees of a storage root shared as a cluster (HPKV_KV_STORAGE_CLUSTER=on): a real
`hpkv server` alone in its cluster, and `hpkv status` (table and JSON), the metrics and `hpkv doctor`
against it (`helpers.cli`; the fixture `pool_dir` is conftest's)."""

from __future__ import annotations

import json
import time

from helpers.cli import ServerProcess, free_port, hpkv, hpkv_env, wait_for_storage, write_entries
from test_metrics import scrape


def test_status_json_metrics_and_doctor_show_this_nodes_member_parts_pass_and_usage(pool_dir, tmp_path):
    port = free_port()
    storage = tmp_path / "storage"
    env = hpkv_env(
        pool_dir,
        storage,
        tmp_path,
        HPKV_KV_STORAGE_CLUSTER="on",
        HPKV_KV_STORAGE_SIZE="64m",
        HPKV_METRICS_PORT=str(port),
    )
    server = ServerProcess(env, tmp_path / "server.log")
    try:
        with server.client() as client:
            write_entries(client, 4)
            wait_for_storage(client, 4)
            deadline = time.monotonic() + 30
            while (c := client.stats().storage.cluster) is None or c.passes < 1:  # type: ignore[union-attr]
                assert time.monotonic() < deadline, "no pass over its parts"
                time.sleep(0.1)
        status = hpkv({**env, "COLUMNS": "400"}, "status")
        raw = hpkv(env, "status", "--json")
        samples = scrape(port)
        checks = {ch["name"]: ch for ch in json.loads(hpkv(env, "doctor", "--json").stdout)["checks"]}
    finally:
        server.stop()

    assert status.returncode == 0, status.stderr
    words = " ".join(status.stdout.split())
    assert "storage cluster (this node's view)" in words, words
    assert f"{c.member}, lease 30 s" in words and f"1: {c.member};" in words
    assert "65536 of 65536 (100.0%)" in words and "4 files in its parts" in words
    assert "of its share 64.0 MiB of the root's 64.0 MiB" in words
    assert "leaf directories looked at" in words and "passes, 0 failed" in words

    mine = json.loads(raw.stdout)["storage"]["cluster"]
    assert mine["member"] == c.member and mine["live_members"] == [c.member] and mine["parts_owned"] == 65536
    assert mine["owned_files"] == 4 and mine["renewals"] >= 1 and mine["passes"] >= 1

    assert samples[("hpkv_storage_cluster_enabled", ())] == 1
    assert samples[("hpkv_storage_cluster_live_members", ())] == 1
    assert samples[("hpkv_storage_cluster_parts_owned", ())] == 65536
    assert samples[("hpkv_storage_cluster_owned_files", ())] == 4
    assert samples[("hpkv_storage_cluster_capacity_share_bytes", ())] == 64 << 20
    assert samples[("hpkv_storage_cluster_passes_total", ())] >= 1
    assert samples[("hpkv_storage_cluster_renewals_total", ())] >= 1
    assert samples[("hpkv_storage_cluster_fenced", ())] == 0
    assert samples[("hpkv_storage_cluster_last_pass_seconds", ())] >= 0

    node = checks["storage cluster: this node"]
    assert node["verdict"] == "ok" and c.member in node["detail"] and "65536 of 65536 parts" in node["detail"]
    root = checks["storage cluster: the whole root"]
    assert root["verdict"] == "ok" and "1 leases" in root["detail"]
    assert "1 owners cover 65536 of 65536" in root["detail"]

    # No server: the root as its files say (the server removed its lease and usage as it left).
    after = {ch["name"]: ch for ch in json.loads(hpkv(env, "doctor", "--json").stdout)["checks"]}
    assert "storage cluster: this node" not in after
    assert after["storage cluster: the whole root"]["verdict"] == "info"
    assert "0 leases" in after["storage cluster: the whole root"]["detail"]


def test_metrics_export_the_storage_cluster_as_zeros_where_it_is_off(server, env):
    samples = scrape(int(env["HPKV_METRICS_PORT"]))
    assert samples[("hpkv_storage_cluster_enabled", ())] == 0
    assert samples[("hpkv_storage_cluster_parts_owned", ())] == 0
