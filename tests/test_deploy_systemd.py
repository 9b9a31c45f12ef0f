"""deploy/systemd/hpkv-server.service: the node's server as a service. `systemd-analyze verify`
accepts the unit; the server started as the unit starts it (its ExecStart= and Environment=, the
example config file, the directories systemd makes for it) serves engines, which attach to it,
and while it is down (a crash, before systemd restarts it) never start a server of their own."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess

import pytest

from helpers.cli import DESC, HPKV_SCRIPT, hpkv
from helpers.deploy import UNIT, UnitServer, read_config, read_unit
from helpers.env import use_hpkv_env
from helpers.waiting import wait_for
from hpkv.config import load_settings
from hpkv.procs import pid_running
from hpkv.server.autostart import LOG_NAME, MANAGED_NAME, answers
from hpkv.server.client import Client, ServerUnavailable

SYSTEMD_ANALYZE = shutil.which("systemd-analyze") or "/usr/bin/systemd-analyze"


@pytest.fixture
def unit_server(tmp_path):
    server = UnitServer(tmp_path)
    yield server
    server.close()


def engine_client(kind: str = "vllm-worker-0") -> Client:
    """The client a vLLM worker makes (integrations/vllm/worker.py), from this process's settings."""
    settings = load_settings()
    return Client(
        settings.pool.dir, kind=kind, prefault=settings.pool.prefault, trusted_uids=settings.server_allow_uids
    )


@pytest.mark.skipif(
    not os.access(SYSTEMD_ANALYZE, os.X_OK), reason="needs systemd-analyze (Debian: apt install systemd)"
)
def test_systemd_analyze_verify_accepts_the_unit(tmp_path):
    # The one thing an operator must change: where hpkv is installed (verify checks that it runs).
    program = read_unit().exec_start()[0]
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace(f"ExecStart={program} ", f"ExecStart={HPKV_SCRIPT} "))
    result = subprocess.run([SYSTEMD_ANALYZE, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr  # a warning is a failure too


def test_the_unit_reads_the_config_file_restarts_and_stops_cleanly():
    unit = read_unit()
    assert unit.environment()["HPKV_CONFIG_FILE_PATH"] == "/etc/hpkv/config.ini"
    assert read_config()["HPKV_SHARE_MEM_FILE_PATH"] == f"/run/{unit.one('RuntimeDirectory')}"
    assert unit.one("RuntimeDirectoryMode") == "0700"  # what pool.directory accepts for one user
    assert unit.one("RuntimeDirectoryPreserve") == "restart"  # the marker outlives a restart
    assert unit.one("Restart") == "on-failure" and unit.one("LimitMEMLOCK") == "infinity"
    # SIGTERM to the server alone (its writers finish its writes), and time for its drain, which
    # gives up once storage has finished no write for 30 s.
    assert unit.one("KillMode") == "mixed" and int(unit.one("TimeoutStopSec")) > 30
    assert "PrivateDevices" not in unit.service  # its own /dev/shm would hide the pool from engines


def test_engines_attach_to_the_units_server_and_never_start_one_while_it_restarts(unit_server, monkeypatch):
    use_hpkv_env(monkeypatch, unit_server.engine_env())  # an auto-start would take this environment
    unit_server.start()
    pool_dir = unit_server.pool_dir
    assert stat.S_IMODE(pool_dir.stat().st_mode) == 0o700
    assert (pool_dir / MANAGED_NAME).is_file()
    worker = engine_client()
    ns = worker.register(DESC)
    keys = [bytes([i]) * 16 for i in range(4)]
    reservation = worker.reserve(ns, keys)
    for i in range(len(keys)):
        reservation.view(i)[:] = bytes([i + 1]) * DESC.entry_bytes
    assert worker.commit(reservation) == len(keys)
    stats = worker.stats()
    assert stats.server.pid == unit_server.proc.pid and not stats.server.auto
    assert stats.server.storage_path.startswith(str(unit_server.state_dir))  # the config file's settings
    assert "vllm-worker-0" in [c.kind for c in stats.clients]

    unit_server.stop(signal.SIGKILL)  # a crash: systemd restarts it RestartSec= later
    starting = engine_client("vllm-scheduler")  # an engine starting meanwhile
    with pytest.raises(ServerUnavailable, match="managed HPKV server"):
        starting.register(DESC)
    with pytest.raises(ServerUnavailable):
        worker.lookup(ns, keys)
    assert not answers(unit_server.socket) and not (pool_dir / LOG_NAME).exists()  # none auto-started
    status = hpkv(unit_server.engine_env(), "status")
    assert status.returncode == 1 and "systemctl start hpkv-server" in status.stderr

    unit_server.start()  # systemd's restart
    assert wait_for(lambda: _looks_up(worker, ns, keys), timeout_s=40, what="the worker back on the restarted server")
    assert worker.stats().server.pid == unit_server.proc.pid
    assert unit_server.stop() == 0  # systemctl stop: SIGTERM
    assert not unit_server.socket.exists() and (pool_dir / MANAGED_NAME).exists()
    assert "HPKV server stopped" in unit_server.log_path.read_text()


def test_a_server_run_by_hand_marks_nothing_and_once_it_is_killed_engines_auto_start(unit_server, monkeypatch):
    """`hpkv server` in a terminal (no service manager: no INVOCATION_ID) leaves no mark, so when
    it dies (nobody restarts it) the next engine auto-starts a server."""
    use_hpkv_env(monkeypatch, unit_server.engine_env())
    monkeypatch.setenv("HPKV_SERVER_IDLE_EXIT_S", "1")  # the auto-started one: gone soon after the test
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    server = subprocess.Popen(
        [str(HPKV_SCRIPT), "server"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_for(lambda: answers(unit_server.socket, timeout_s=0.2), timeout_s=30, what="the server to answer")
        assert not (unit_server.pool_dir / MANAGED_NAME).exists()
    finally:
        server.kill()
        server.wait()
    engine = engine_client()
    try:
        engine.register(DESC)  # auto-starts a server
        started = engine.stats().server
        assert started.auto
    finally:
        engine.close()
    # a poll of the socket would be a client, so the server's own pid tells when it has gone
    wait_for(lambda: not pid_running(started.pid), timeout_s=60, what="the auto-started server to exit")


def _looks_up(client: Client, ns: str, keys: list[bytes]) -> bool:
    try:
        client.lookup(ns, keys)
    except ServerUnavailable:
        return False
    return True
