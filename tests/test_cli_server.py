"""Stories about `hpkv server`, `hpkv status` and `hpkv clear`, against real server processes
(`helpers.cli`; the fixtures `pool_dir`, `env` and `server` are conftest's)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import time
from pathlib import Path

import psutil
from click.testing import CliRunner

from helpers.cli import DESC, ENTRY_BYTES, ServerProcess, free_port, hpkv, hpkv_env, wait_for_storage, write_entries
from helpers.processes import stop
from hpkv.cli import main
from hpkv.keys import NamespaceDesc
from hpkv.pool.backing import swap_needs_lock
from hpkv.status import human_bytes
from hpkv.tiers import Tier


def kv_files(storage_dir: Path) -> list[Path]:
    return sorted(storage_dir.rglob("*.kv"))


# -- hpkv server -----------------------------------------------------------------------------------


def test_sigterm_stops_the_server_with_status_0_and_removes_socket_and_pool(server):
    assert server.socket.exists()
    assert server.stop() == 0
    assert not server.socket.exists()
    assert not (server.pool_dir / "hpkv.pool").exists()
    assert "HPKV server stopped" in server.log()


def test_server_with_a_bad_setting_says_so_and_exits_2(pool_dir, tmp_path):
    result = hpkv(hpkv_env(pool_dir, tmp_path / "storage", tmp_path, HPKV_KV_MEM_POOL_SIZE="lots"), "server")
    assert result.returncode == 2
    assert "HPKV_KV_MEM_POOL_SIZE" in result.stderr and "Traceback" not in result.stderr


def test_server_with_unusable_directories_names_them_and_exits_2(pool_dir, tmp_path):
    (tmp_path / "a-file").write_text("")
    for env, expected in (
        (
            hpkv_env(tmp_path / "a-file", tmp_path / "storage", tmp_path),
            f"{tmp_path / 'a-file'} is a file, not a directory; point HPKV_SHARE_MEM_FILE_PATH",
        ),
        (
            hpkv_env(Path("/proc/hpkv-pool"), tmp_path / "storage", tmp_path),
            "/proc/hpkv-pool (HPKV_SHARE_MEM_FILE_PATH) is on proc, a kernel pseudo file system",
        ),
        (
            hpkv_env(pool_dir, Path("/sys/kernel/mm"), tmp_path),
            "the storage directory /sys/kernel/mm (HPKV_KV_STORAGE_PATH) is on sysfs",
        ),
    ):
        result = hpkv(env, "server")
        assert result.returncode == 2, result.stderr
        assert expected in result.stderr and "Traceback" not in result.stderr
    assert list(pool_dir.iterdir()) == []  # the pool of the last one is gone again


def test_server_in_a_directory_too_deep_for_a_socket_says_so_and_leaves_nothing(pool_dir, tmp_path):
    deep = pool_dir / ("d" * 100)
    result = hpkv(hpkv_env(deep, tmp_path / "storage", tmp_path), "server")
    assert result.returncode == 2
    assert "cannot listen on" in result.stderr and "107 bytes" in result.stderr
    assert "Traceback" not in result.stderr
    assert list(deep.iterdir()) == []  # the pool file it had made is gone


# -- hpkv status -----------------------------------------------------------------------------------


def test_status_shows_tiers_namespace_hit_rates_and_clients(server, env):
    with server.client() as client:
        ns, keys = write_entries(client, 4)
        client.lookup(ns, keys + [b"missing" * 2])  # 4 of 5 keys hit DRAM
        wait_for_storage(client, 4)
        result = hpkv(env, "status")
        engine_pid = os.getpid()
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for words in (
        "DRAM",
        "64.0 MiB",
        "locked in memory" if swap_needs_lock("tmpfs") is None else "never swapped (no swap is configured)",
        "storage",
        env["HPKV_KV_STORAGE_PATH"],
        "index ready",
        "0 bad files",
        ns[:12],
        "vllm",
        "Qwen/Qwen2.5-1.5B-Instruct",
        "bfloat16",
        "80.0%",
        "test-engine",
        str(engine_pid),
        "cli",
        "managed",
        str(server.proc.pid),
        "write-through processes (nice 10)",
    ):
        assert words in out, f"{words!r} missing from:\n{out}"


def test_status_shows_holds_waiting_for_a_scheduler(server, env):
    with server.client() as client:
        ns, _ = write_entries(client, 1)
        client.reserve(ns, [b"held-key"], hold="vllm.1.step-3")
        result = hpkv(env, "status")
        assert "1 holds waiting for an engine's scheduler" in result.stdout, result.stdout
        client.settle("vllm.1.step-3", [b"held-key"])
        assert "holds waiting" not in hpkv(env, "status").stdout


def test_status_shows_entries_waiting_for_a_storage_device_that_stopped(server, env):
    with server.client() as client:
        ns, keys = write_entries(client, 4)  # starts the server's write-through processes
        wait_for_storage(client, 4)
        writers = [
            child.pid
            for child in psutil.Process(server.proc.pid).children()
            if "hpkv.storage.writer" in " ".join(child.cmdline())
        ]
        assert len(writers) == 2  # HPKV_IO_THREADS=2: every place has its process, none can start
        for pid in writers:
            stop(pid)
        try:
            write_entries(client, 3, dataclasses.replace(DESC, model="another/model"))
            stopped = hpkv(env, "status")
        finally:
            for pid in writers:
                os.kill(pid, signal.SIGCONT)
        wait_for_storage(client, 7)
        deadline = time.monotonic() + 10  # the last write's bookkeeping ends just after its file lands
        while client.stats().write_backlog.entries and time.monotonic() < deadline:
            time.sleep(0.02)
        backlog = client.stats().write_backlog
        assert (backlog.entries, backlog.bytes, backlog.deferred) == (0, 0, 0)
    assert stopped.returncode == 0, stopped.stderr
    waiting = f"3 entries ({human_bytes(3 * DESC.entry_bytes)}) waiting to be written"
    assert waiting in " ".join(stopped.stdout.split()), stopped.stdout
    assert "waiting to be written" not in hpkv(env, "status").stdout


def test_status_shows_entries_deferred_past_the_backlog_limit(server, env):
    """A stalled device pins at most half the pool (32 MiB here); the entries past that wait
    unpinned, and status says how many."""
    big = dataclasses.replace(DESC, model="big/model", entry_bytes=1 << 20)
    with server.client() as client:
        write_entries(client, 4)
        wait_for_storage(client, 4)
        writers = [
            child.pid
            for child in psutil.Process(server.proc.pid).children()
            if "hpkv.storage.writer" in " ".join(child.cmdline())
        ]
        for pid in writers:
            stop(pid)
        try:
            write_entries(client, 40, big)
            stopped = hpkv(env, "status")
            # 32 MiB more: the pool's unpinned half goes to them, evicting the 8 deferred entries.
            write_entries(client, 32, dataclasses.replace(big, model="bigger/model"))
        finally:
            for pid in writers:
                os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            backlog = client.stats().write_backlog
            if backlog.entries == backlog.deferred == 0:
                break
            time.sleep(0.05)
        lost = client.stats().store.write_through_lost
        after = hpkv(env, "status")
    assert stopped.returncode == 0, stopped.stderr
    waiting = "32 entries (32.0 MiB) waiting to be written and 8 more deferred"
    assert waiting in " ".join(stopped.stdout.split()), stopped.stdout
    assert lost >= 8
    assert f"{lost} entries never written" in " ".join(after.stdout.split()), after.stdout


def test_a_write_budget_shows_in_status_and_metrics(pool_dir, tmp_path):
    """HPKV_KV_STORAGE_WRITE_BUDGET=1m: an hour's worth is about 43 KB, so of 20 entries of 4 KiB
    some are written and the rest refused; status and the metrics say so."""
    port = free_port()
    env = hpkv_env(
        pool_dir, tmp_path / "storage", tmp_path, HPKV_KV_STORAGE_WRITE_BUDGET="1m", HPKV_METRICS_PORT=str(port)
    )
    server = ServerProcess(env, tmp_path / "server.log")
    try:
        with server.client() as client:
            write_entries(client, 20)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                storage = client.stats().storage
                if storage.writes + storage.over_budget == 20:
                    break
                time.sleep(0.05)
            assert 5 <= storage.writes <= 12 and storage.over_budget == 20 - storage.writes
            status = hpkv(env, "status")
            import urllib.request

            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                metrics = response.read().decode()
    finally:
        server.stop()
    assert status.returncode == 0, status.stderr
    words = " ".join(status.stdout.split())
    assert "write budget 1.0 MiB a day" in words and f"{storage.over_budget} writes over it" in words, words
    assert "hpkv_storage_write_budget_bytes 1.048576e+06" in metrics
    assert f"hpkv_storage_writes_over_budget_total {float(storage.over_budget)}" in metrics
    assert "the storage write budget (HPKV_KV_STORAGE_WRITE_BUDGET=1048576 bytes a day) is spent" in server.log()


def test_status_json_is_the_raw_stats(server, env):
    with server.client() as client:
        ns, keys = write_entries(client, 3)
        client.lookup(ns, keys)
        result = hpkv(env, "status", "--json")
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert stats["store"]["lookup_keys"] == 3 and stats["store"]["hit_keys_dram"] == 3
    assert stats["namespaces"][ns]["hit_keys_dram"] == 3
    assert stats["writers"]["nice"] == 10 and stats["writers"]["died"] == 0
    assert stats["storage"]["direct_io"] is False  # HPKV_KV_STORAGE_DIRECT_IO's default
    assert stats["dram"]["num_entries"] == 3
    assert stats["server"]["pid"] == server.proc.pid and stats["server"]["auto"] is False
    assert {c["kind"] for c in stats["clients"]} == {"test-engine", "cli"}


def test_status_without_a_server_says_how_one_starts_and_exits_1(env, pool_dir):
    result = hpkv(env, "status")
    assert result.returncode == 1
    assert f"no HPKV server is running on {pool_dir / 'hpkv.sock'}" in result.stderr
    assert "hpkv server" in result.stderr and "Traceback" not in result.stderr
    assert not (pool_dir / "hpkv.sock").exists()  # status never starts a server


def test_status_over_a_socket_left_by_a_killed_server_exits_1(env, pool_dir):
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(pool_dir / "hpkv.sock"))
    stale.close()  # the file stays, nobody listens: what SIGKILL leaves behind
    result = hpkv(env, "status")
    assert result.returncode == 1
    assert "no HPKV server is running" in result.stderr


# -- hpkv clear ------------------------------------------------------------------------------------


def test_clear_help_says_memory_is_the_default():
    result = CliRunner().invoke(main, ["clear", "--help"])
    assert result.exit_code == 0
    assert "With neither --memory nor --storage, clears memory" in " ".join(result.output.split())


def test_clear_memory_empties_dram_and_keeps_storage(server, env, tmp_path):
    with server.client() as client:
        ns, keys = write_entries(client, 4)
        wait_for_storage(client, 4)
        result = hpkv(env, "clear", "--memory")
        assert result.returncode == 0, result.stderr
        assert "memory: dropped 4 entries" in result.stdout
        assert "storage" not in result.stdout
        assert client.lookup(ns, keys).tiers == (Tier.STORAGE,) * 4  # the next request can only hit storage
        stats = client.stats()
    assert stats.dram.num_entries == 0
    assert stats.storage.num_entries == 4
    assert len(kv_files(tmp_path / "storage")) == 4


def test_clear_without_flags_clears_memory_only(server, env, tmp_path):
    with server.client() as client:
        ns, keys = write_entries(client, 2)
        wait_for_storage(client, 2)
        result = hpkv(env, "clear")
        assert result.returncode == 0, result.stderr
        assert client.lookup(ns, keys).tiers == (Tier.STORAGE,) * 2
    assert len(kv_files(tmp_path / "storage")) == 2


def test_clear_storage_of_one_namespace_by_prefix_through_the_server(server, env, tmp_path):
    other = NamespaceDesc(
        engine="sglang",
        model="other",
        dtype="float16",
        layout="nhd",
        block_size=64,
        num_layers=2,
        entry_bytes=ENTRY_BYTES,
    )
    with server.client() as client:
        ns, keys = write_entries(client, 3)
        other_ns, other_keys = write_entries(client, 2, other)
        wait_for_storage(client, 5)
        result = hpkv(env, "clear", "--memory", "--storage", "--namespace", ns[:8])
        assert result.returncode == 0, result.stderr
        assert f"memory: dropped 3 entries of namespace {ns}" in result.stdout
        assert f"storage: removed 3 entry files of namespace {ns}" in result.stdout
        assert client.lookup(ns, keys).num_hit == 0
        assert client.lookup(other_ns, other_keys).tiers == (Tier.DRAM,) * 2
    assert len(kv_files(tmp_path / "storage" / other_ns)) == 2


def test_clear_storage_without_a_server_deletes_the_files(server, env, tmp_path):
    with server.client() as client:
        write_entries(client, 4)
        wait_for_storage(client, 4)
    assert server.stop() == 0
    assert len(kv_files(tmp_path / "storage")) == 4
    result = hpkv(env, "clear", "--storage")
    assert result.returncode == 0, result.stderr
    assert f"storage: removed 4 entry files from {tmp_path / 'storage'}" in result.stdout
    assert kv_files(tmp_path / "storage") == []
    assert not server.socket.exists()  # clearing never starts a server


def test_clear_memory_without_a_server_says_the_pool_is_empty(env):
    result = hpkv(env, "clear")
    assert result.returncode == 0, result.stderr
    assert "DRAM pool is already empty" in result.stdout


def test_clear_rejects_a_namespace_that_is_not_an_id(env):
    result = hpkv(env, "clear", "--storage", "--namespace", "../etc")
    assert result.returncode == 2
    assert "not a namespace id" in result.stderr
