"""Stories about the server's Prometheus endpoint: what a scrape says after a client's work."""

from __future__ import annotations

import socket
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from helpers.cli import ENTRY_BYTES, ServerProcess, hpkv_env, wait_for_storage, write_entries
from hpkv.server.metrics import op_label
from hpkv.tiers import Tier


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics as {(name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_count_what_the_client_did(server, env):
    port = int(env["HPKV_METRICS_PORT"])
    with server.client() as client:
        ns, keys = write_entries(client, 4)
        assert client.lookup(ns, keys + [b"x" * 16]).num_dram == 4  # 5 keys, 4 DRAM hits
        wait_for_storage(client, 4)
        client.clear(dram=True)
        assert client.lookup(ns, keys).tiers == (Tier.STORAGE,) * 4  # 4 keys, 4 storage hits
        lease = client.lease(ns, keys)  # promotes the four back into DRAM
        assert client.wait(lease) == 4
        client.release(lease)
        m = scrape(port)

    assert m[("hpkv_lookups_total", ())] == 2
    assert m[("hpkv_lookup_keys_total", ())] == 9
    assert m[("hpkv_hit_keys_total", (("tier", "dram"),))] == 4
    assert m[("hpkv_hit_keys_total", (("tier", "storage"),))] == 4
    assert m[("hpkv_namespace_lookup_keys_total", (("ns", ns),))] == 9
    assert m[("hpkv_namespace_hit_keys_total", (("ns", ns), ("tier", "storage")))] == 4
    assert m[("hpkv_commits_total", ())] == 4
    assert m[("hpkv_promotions_total", ())] == 4
    assert m[("hpkv_written_bytes_total", (("tier", "storage"),))] == 4 * ENTRY_BYTES
    assert m[("hpkv_read_bytes_total", (("tier", "storage"),))] == 4 * ENTRY_BYTES
    assert m[("hpkv_entries", (("tier", "dram"),))] == 4
    assert m[("hpkv_entries", (("tier", "storage"),))] == 4
    assert m[("hpkv_capacity_bytes", (("tier", "dram"),))] == 64 << 20
    assert m[("hpkv_checksum_failures_total", ())] == 0
    assert m[("hpkv_active_leases", ())] == 0
    assert m[("hpkv_write_processes", ())] >= 1  # the four files were written by one
    assert m[("hpkv_write_process_deaths_total", ())] == 0
    assert m[("hpkv_write_process_start_failures_total", ())] == 0
    assert ("hpkv_write_backlog_entries", ()) in m and ("hpkv_write_backlog_bytes", ()) in m
    assert m[("hpkv_write_backlog_deferred", ())] == 0
    assert m[("hpkv_write_through_deferred_total", ())] == m[("hpkv_write_through_lost_total", ())] == 0
    assert m[("hpkv_connected_clients", ())] == 1
    assert m[("hpkv_clients", (("kind", "test-engine"),))] == 1
    assert m[("hpkv_request_seconds_count", (("op", "lookup"),))] == 2
    assert m[("hpkv_request_seconds_count", (("op", "commit"),))] == 1
    info = [labels for (name, labels) in m if name == "hpkv_namespace_info"]
    assert dict(info[0])["model"] == "Qwen/Qwen2.5-1.5B-Instruct"
    assert dict(next(labels for (name, labels) in m if name == "hpkv_server_info"))["mode"] == "managed"


def test_metrics_listen_on_loopback_only_by_default(server, env):
    port = int(env["HPKV_METRICS_PORT"])
    with open("/proc/net/tcp", encoding="ascii") as f:
        listeners = [line.split()[1] for line in f.readlines()[1:] if line.split()[3] == "0A"]  # 0A: LISTEN
    assert f"0100007F:{port:04X}" in listeners  # 127.0.0.1, little-endian hex


def test_a_taken_metrics_port_leaves_the_server_running_without_metrics(pool_dir, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = ServerProcess(
            hpkv_env(pool_dir, tmp_path / "storage", tmp_path, HPKV_METRICS_PORT=str(port)), tmp_path / "server.log"
        )
        try:
            with process.client() as client:
                assert client.stats().server.pid == process.proc.pid
        finally:
            assert process.stop() == 0
    assert f"cannot serve metrics on 127.0.0.1:{port}" in process.log()


def test_metrics_are_off_when_the_port_is_0(pool_dir, tmp_path):
    process = ServerProcess(hpkv_env(pool_dir, tmp_path / "storage", tmp_path), tmp_path / "server.log")
    try:
        assert "metrics on" not in process.log()
    finally:
        assert process.stop() == 0


def test_request_types_become_snake_case_op_labels():
    assert op_label("Lookup") == "lookup"
    assert op_label("LeaseWait") == "lease_wait"


def test_every_metric_the_alerting_rules_name_is_exported(server, env):
    """docs/operations.md's alerting rules must name metrics a real server exports, or they would
    never fire."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    rules = doc.split("### What to alert on", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    named = set(re.findall(r"\bhpkv_[a-z_]+", rules))
    assert len(named) >= 8
    with server.client() as client:
        write_entries(client, 2)  # starts the write-through processes, whose metrics then appear
        wait_for_storage(client, 2)
        exported = {name for name, _ in scrape(int(env["HPKV_METRICS_PORT"]))}
    assert named <= exported, named - exported
