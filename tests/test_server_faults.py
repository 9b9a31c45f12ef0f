"""Stories of things dying: the server killed with -9 in the middle of writes, a client killed
while it holds reservations and leases, files left behind by the dead, a client that finds a new
server by itself, and a server stopped with SIGTERM while storage writes are in flight."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers.keys import desc, entry_key, payload
from helpers.processes import kill, stop, wait_gone
from helpers.waiting import wait_for
from hpkv.config import load_settings
from hpkv.errors import PoolError
from hpkv.server import daemon
from hpkv.server import protocol as p
from hpkv.tiers import Tier

DRAM, STORAGE = int(Tier.DRAM), int(Tier.STORAGE)
SMALL = 64 << 10
BIG = 1 << 20  # 64 slots in the 64m pool


def storage_entries(stats: dict) -> int:
    return stats["storage"]["num_entries"]


def read_back(client, ns: str, index: int, prefix: str, rank: int = 0, entry_bytes: int = SMALL) -> bytes | None:
    """The bytes the server serves for one key (None on a miss)."""
    key = entry_key(prefix, index)
    if not client.lookup(ns, [key]).num_hit:
        return None
    lease = client.lease(ns, [key])
    try:
        if client.wait(lease, timeout_s=10) != 1:
            return None
        return bytes(lease.view(0))
    finally:
        client.release(lease)


def test_server_killed_in_the_middle_of_writes(node):
    """Calls fail fast, a new server starts cleanly, and no partial entry is ever visible."""
    writer = node.agent("worker", timeout_s=2.0, retry_interval_s=0.3)
    writer.call("register", rank=0, entry_bytes=SMALL)
    old_pid = writer.call("stats")["server_pid"]
    old_pool_inode = node.pool_path.stat().st_ino
    writer.send(
        "write_loop", prefix="loop", seconds=30, entry_bytes=SMALL, copy_pause_s=0.005, until_commits_on_next_server=20
    )

    watcher = node.client("watcher")
    wait_for(lambda: watcher.stats().store.commits >= 20, what="20 commits")
    watcher.close()
    kill(old_pid)
    wait_gone(old_pid)
    assert node.socket_path.exists() and node.pool_path.exists()  # what a -9 leaves behind

    summary = writer.recv(timeout_s=30)
    assert summary["max_call_s"] <= 2.0 + 5.0  # the timeout plus scheduling slack on a busy machine: no hang
    assert summary["unavailable"] >= 1 and summary["other_errors"] == []
    new_pid = writer.call("stats")["server_pid"]
    assert new_pid != old_pid and node.server_pids() == [new_pid]
    assert summary["server_pids"] == [old_pid, new_pid]  # it kept committing on the new server
    assert "removing stale socket" in node.server_log()
    assert "removing stale pool file" in node.server_log()
    assert node.pool_path.stat().st_ino != old_pool_inode

    checker = node.client("checker")
    ns = checker.register(desc(0, SMALL))
    commit_sent = set(summary["commit_sent"])
    for i in range(summary["num_keys"]):
        got = read_back(checker, ns, i, "loop")
        if got is not None:
            assert i in commit_sent, f"entry {i} was never committed, yet it is visible"
            assert got == payload(entry_key("loop", i), 0, SMALL), f"entry {i} reads back other bytes"
    committed_on_new = [i for i, pid in summary["committed"] if pid == new_pid]
    assert committed_on_new
    for i in committed_on_new:
        assert read_back(checker, ns, i, "loop") == payload(entry_key("loop", i), 0, SMALL)


def test_a_client_killed_with_reservations_and_leases_gives_them_back(node):
    node.env["HPKV_SERVER_MAX_SLOT_SHARE"] = "1"  # the victim holds every slot
    node.env["HPKV_SERVER_MAX_USER_SLOT_SHARE"] = "1"
    victim = node.agent("worker")
    victim.call("register", rank=0, entry_bytes=BIG)
    assert victim.call("save", prefix="leased", n=56, entry_bytes=BIG)["committed"] == 56
    wait_for(lambda: storage_entries(victim.call("stats")["stats"]) == 56, what="write-through")
    assert victim.call("load", prefix="leased", n=56, entry_bytes=BIG, release=False)["num_ready"] == 56
    assert victim.call("reserve", prefix="pending", n=8, entry_bytes=BIG)["reserved"] == 8

    other = node.client("other")
    ns = other.register(desc(0, BIG))
    stats = other.stats()
    assert stats.reservations == 8 and stats.leases == 1
    pending = [entry_key("pending", i) for i in range(8)]
    fresh = [entry_key("fresh", i) for i in range(8)]
    assert other.reserve(ns, pending).offsets == [None] * 8  # held by the victim
    assert other.reserve(ns, fresh).offsets == [None] * 8  # every slot is leased or reserved

    victim.kill()
    wait_for(lambda: (lambda s: s.reservations == 0 and s.leases == 0)(other.stats()), what="reclaim")
    again = other.reserve(ns, pending)
    assert None not in again.offsets  # the victim's keys are free again
    evicting = other.reserve(ns, fresh)
    assert None not in evicting.offsets  # leased entries were evictable
    other.abort(again)
    other.abort(evicting)
    assert other.stats().dram.evictions >= 8


def test_a_live_client_that_loses_its_connection_keeps_its_reserved_slots_out_of_reach(node):
    """A call that timed out drops the connection while the process may still be copying into
    its reserved slots: the server must not hand them to anyone else meanwhile."""
    node.start_server()
    writer, other = node.client("writer"), node.client("other")
    ns = writer.register(desc(0, BIG))
    other.register(desc(0, BIG))
    pending = [entry_key("pending", i) for i in range(4)]
    assert None not in writer.reserve(ns, pending).offsets
    writer._drop("a call timed out")  # what the client does after a timeout
    wait_for(lambda: other.stats().quarantined == 4, what="quarantine")
    assert other.reserve(ns, pending).offsets == [None] * 4
    assert other.stats().reservations == 0


def test_stale_socket_pool_and_lock_are_recovered_by_the_next_auto_start(node):
    first = node.agent("worker")
    old_pid = first.call("stats")["server_pid"]
    first.kill()
    kill(old_pid)
    wait_gone(old_pid)
    # a starter killed while it held the start lock
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import fcntl, os, sys, time\n"
                "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
                "fcntl.flock(fd, fcntl.LOCK_EX)\n"
                "print('locked', flush=True)\n"
                "time.sleep(60)\n"
            ),
            str(node.shm_dir / p.LOCK_NAME),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline() == "locked\n"
    holder.kill()
    holder.wait()
    for name in (p.SOCKET_NAME, p.LOCK_NAME, "hpkv.pool"):
        assert (node.shm_dir / name).exists()

    second = node.agent("worker")
    answer = second.call("stats")
    assert answer["elapsed_s"] < 10
    assert answer["server_pid"] != old_pid and node.server_pids() == [answer["server_pid"]]
    assert answer["stats"]["server"]["pool_path"] == str(node.pool_path)


def test_an_auto_started_server_resolves_relative_paths_where_its_starter_runs(node):
    """The server runs in /, but the engine that starts it may name the pool directory, the
    config file and (in that file) the storage directory relative to its own directory."""
    here = node.shm_dir / "engine-cwd"
    here.mkdir()
    (here / "relative.ini").write_text("HPKV_KV_STORAGE_PATH=stored-kv\n")
    node.env.update(HPKV_SHARE_MEM_FILE_PATH="pool", HPKV_CONFIG_FILE_PATH="relative.ini")
    engine = node.agent("worker", cwd=here)
    assert engine.call("register")
    assert engine.call("save", prefix="rel", n=2)["committed"] == 2
    server = engine.call("stats")
    assert server["stats"]["server"]["pool_path"] == str(here / "pool" / "hpkv.pool")
    wait_for(
        lambda: len([f for f in (here / "stored-kv").rglob("*") if f.is_file() and f.suffix != ".json"]) == 2,
        what="the two entries written under the starter's stored-kv",
    )
    assert not Path("/pool").exists() and not Path("/stored-kv").exists()
    kill(server["server_pid"])
    wait_gone(server["server_pid"])


@contextlib.contextmanager
def busy_server(socket_path: Path):
    """A live listener on `socket_path` whose queue of connections to accept is full: a connect
    to it fails at once with EAGAIN, as one to a server too busy to accept does."""
    busy = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    busy.bind(str(socket_path))
    busy.listen(0)
    queued = []
    try:
        while len(queued) < 64:
            waiting = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            waiting.setblocking(False)
            queued.append(waiting)
            try:
                waiting.connect(str(socket_path))
            except BlockingIOError:
                break
        else:
            pytest.fail("the queue of connections to accept never filled")
        yield
    finally:
        for sock in queued:
            sock.close()
        busy.close()


def test_a_server_too_busy_to_accept_counts_as_running_and_keeps_its_socket(node):
    """A live server whose queue of connections to accept is full refuses a probe at once
    (EAGAIN): a second server must take it for running, not crash or remove its socket."""
    with busy_server(node.socket_path):
        with pytest.raises(PoolError, match="already running.*queue of connections to accept is full"):
            daemon.Server(load_settings(node.env)).run()
        assert node.socket_path.exists()


def test_a_server_too_busy_to_accept_still_answers_for_the_autostart(node):
    """The engines' probe sees the same EAGAIN: a busy server, so no second one is started."""
    from hpkv.server.autostart import answers

    with busy_server(node.socket_path):
        assert answers(node.socket_path)
    assert not answers(node.socket_path)  # closed: nobody answers


def test_a_lock_file_planted_as_a_symbolic_link_is_not_followed(node, tmp_path):
    from hpkv.server.autostart import ServerUnavailable, ensure_server

    target = tmp_path / "not-a-lock"
    (node.shm_dir / p.LOCK_NAME).symlink_to(target)

    with pytest.raises(ServerUnavailable, match="is a symbolic link; remove it"):
        ensure_server(node.shm_dir, timeout_s=5)
    assert not target.exists()


def test_lock_held_by_a_live_starter_is_waited_for_not_broken(node):
    lock_fd = os.open(node.shm_dir / p.LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    starter = node.agent("worker")
    starter.send("stats")
    time.sleep(0.5)
    assert node.server_pids() == []  # nobody starts a server while another starter holds the lock
    os.close(lock_fd)
    assert "error" not in starter.recv()
    assert len(node.server_pids()) == 1


def test_a_client_finds_a_new_server_by_itself_and_registers_again(node):
    engine = node.agent("scheduler", retry_interval_s=1.0)
    engine.call("register", rank=0)
    assert engine.call("save", prefix="prompt", n=4)["committed"] == 4
    wait_for(lambda: storage_entries(engine.call("stats")["stats"]) == 4, what="write-through")
    old_pid = engine.call("stats")["server_pid"]
    kill(old_pid)
    wait_gone(old_pid)

    first = engine.try_call("lookup", prefix="prompt", n=4)
    assert first["error"] == "ServerUnavailable" and first["elapsed_s"] < 3
    soon = engine.try_call("lookup", prefix="prompt", n=4)  # within the retry interval: no attempt
    assert soon["error"] == "ServerUnavailable" and "retrying in" in soon["message"]
    assert node.server_pids() == []
    time.sleep(1.0)
    later = engine.call("lookup", prefix="prompt", n=4)  # unregistered namespaces would be an error
    assert later["tiers"] == [STORAGE] * 4
    assert later["server_pid"] != old_pid
    assert engine.call("load", prefix="prompt", n=4)["same"] == [True] * 4


def test_a_client_without_autostart_picks_up_a_server_an_operator_restarted(node):
    server = node.start_server()
    engine = node.agent("scheduler", autostart=False, retry_interval_s=0.2)
    engine.call("register", rank=0)
    engine.call("save", prefix="prompt", n=2)
    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=10) == 0
    assert engine.try_call("lookup", prefix="prompt", n=2)["error"] == "ServerUnavailable"
    time.sleep(0.3)
    assert engine.try_call("lookup", prefix="prompt", n=2)["error"] == "ServerUnavailable"  # none there
    node.start_server()
    time.sleep(0.3)
    assert engine.call("lookup", prefix="prompt", n=2)["tiers"] == [STORAGE] * 2


def test_a_server_restarted_after_a_crash_is_used_within_a_second_whatever_the_backoff(node):
    """The wait before the next attempt (30 s here) is cut short once a new server binds the
    socket: the engine pays a stat of it at most every PROBE_S, never a connect per request."""
    server = node.start_server()
    engine = node.agent("scheduler", autostart=False, retry_interval_s=30.0)
    engine.call("register", rank=0)
    engine.call("save", prefix="prompt", n=2)
    kill(server.pid)
    wait_gone(server.pid)
    assert engine.try_call("lookup", prefix="prompt", n=2)["error"] == "ServerUnavailable"
    time.sleep(0.6)
    waiting = engine.try_call("lookup", prefix="prompt", n=2)  # the dead server's socket: no attempt
    assert waiting["error"] == "ServerUnavailable" and "retrying in 2" in waiting["message"]

    new = node.start_server()  # returns once the new server answers
    ready = time.monotonic()
    wait_for(lambda: "error" not in engine.try_call("lookup", prefix="prompt", n=2), timeout_s=5.0, what="reconnect")
    assert time.monotonic() - ready < 1.0
    assert engine.call("lookup", prefix="prompt", n=2)["server_pid"] == new.pid


def test_a_client_that_finds_its_server_replaced_under_it_sends_its_next_call_to_the_new_one(node):
    """The server dies and another is up before the client calls again (an operator's restart
    while the engine was idle): the next call is the new server's, not a miss on the dead
    server's connection, whatever the backoff (30 s here)."""
    server = node.start_server()
    engine = node.agent("scheduler", autostart=False, retry_interval_s=30.0)
    engine.call("register", rank=0)
    engine.call("save", prefix="prompt", n=2)
    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=10) == 0
    new = node.start_server()

    answer = engine.try_call("lookup", prefix="prompt", n=2)

    assert answer.get("server_pid") == new.pid, answer
    assert answer["tiers"] == [STORAGE] * 2  # registered again on the new connection


def test_a_server_that_stops_answering_costs_a_call_its_timeout_not_a_hang(node):
    server = node.start_server()
    engine = node.agent("scheduler", autostart=False, timeout_s=1.0, retry_interval_s=0.5)
    engine.call("register", rank=0)
    engine.call("save", prefix="prompt", n=2)
    stop(server.pid)
    try:
        stuck = engine.try_call("lookup", prefix="prompt", n=2)
        assert stuck["error"] == "ServerUnavailable" and 1.0 <= stuck["elapsed_s"] <= 1.0 + 5.0
    finally:
        server.send_signal(signal.SIGCONT)
    time.sleep(0.5)
    assert engine.call("lookup", prefix="prompt", n=2)["tiers"] == [DRAM] * 2  # same server, new connection


def save_big(client, ns: str, keys: list[bytes]) -> int:
    """Reserve, fill and commit entries of BIG bytes, as an engine's worker saves them."""
    res = client.reserve(ns, keys)
    for i, key in enumerate(keys):
        res.view(i)[:] = payload(key, 0, BIG)
    return client.commit(res)


def test_sigterm_finishes_storage_writes_in_flight_and_exits_cleanly(node):
    server = node.start_server()
    client = node.client("engine")
    ns = client.register(desc(0, BIG))
    keys = [entry_key("late", i) for i in range(48)]
    assert save_big(client, ns, keys) == 48
    server.send_signal(signal.SIGTERM)  # at once: the write-throughs are queued, not done
    assert server.wait(timeout=30) == 0
    assert not node.socket_path.exists() and not node.pool_path.exists()
    assert "HPKV server stopping" in node.foreground_log(server)

    node.start_server()
    reader = node.client("reader")
    ns = reader.register(desc(0, BIG))
    assert reader.lookup(ns, keys).tiers == (Tier.STORAGE,) * 48
    lease = reader.lease(ns, keys)
    assert reader.wait(lease, timeout_s=10) == 48
    assert all(bytes(lease.view(i)) == payload(key, 0, BIG) for i, key in enumerate(keys))
    reader.release(lease)


def test_a_second_sigterm_stops_a_server_whose_storage_does_not_answer(node):
    """The first SIGTERM waits for the storage writes; with a device that stopped answering, it
    would wait for ever. The second gives them up: the server exits at once and cleanly."""
    server = node.start_server()
    client = node.client("engine")
    ns = client.register(desc(0, BIG))
    assert save_big(client, ns, [entry_key("warm", i) for i in range(4)]) == 4
    wait_for(lambda: client.stats().storage.num_entries == 4, what="the warm entries on storage")
    writers = [
        child.pid
        for child in psutil.Process(server.pid).children()
        if "hpkv.storage.writer" in " ".join(child.cmdline())
    ]
    assert writers
    for pid in writers:
        stop(pid)  # a storage device that stopped answering
    assert save_big(client, ns, [entry_key("stuck", i) for i in range(40)]) == 40
    client.close()
    server.send_signal(signal.SIGTERM)
    with pytest.raises(subprocess.TimeoutExpired):
        server.wait(timeout=2)  # writing what waits, which it cannot
    assert "writing 40 entries still waiting for storage" in node.foreground_log(server)
    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=15) == 0
    assert not node.socket_path.exists() and not node.pool_path.exists()
    log = node.foreground_log(server)
    assert "stopping without writing" in log and "HPKV server stopped" in log
    assert "died" not in log  # the killed writers are not mistaken for deaths
    for pid in writers:
        wait_gone(pid)


def test_each_failure_in_a_row_doubles_the_wait_before_the_next_attempt(node):
    """A server that cannot start (a bad setting) must not cost the engine a start-up attempt every
    second for ever: the wait doubles with each failure in a row, and a success resets it."""
    import re

    from hpkv.server.autostart import ServerUnavailable

    client = node.client("engine", retry_interval_s=0.2)

    def next_wait() -> float:
        with pytest.raises(ServerUnavailable):
            client.stats()  # an attempt, which fails
        with pytest.raises(ServerUnavailable) as waiting:
            client.stats()  # within the wait: no attempt, and it says how long is left
        return float(re.search(r"retrying in ([0-9.]+) s", str(waiting.value)).group(1))

    waits = []
    for _ in range(4):
        waits.append(next_wait())
        time.sleep(waits[-1] + 0.05)
    for wait, expected in zip(waits, (0.2, 0.4, 0.8, 1.6)):
        assert expected - 0.15 <= wait <= expected, waits
    server = node.start_server()  # the last wait is over: the next call connects
    assert client.stats().server.pid == server.pid
    kill(server.pid)
    server.wait()
    assert 0.05 <= next_wait() <= 0.2  # the success reset the count


def test_a_server_out_of_file_descriptors_keeps_serving_its_clients_and_accepts_again_later(node):
    """accept() failing with EMFILE (a burst of connections past `ulimit -n`) used to stop the
    server, and every engine lost its cache. Now it waits and accepts again."""
    import resource
    import socket

    proc = node.start_server()
    client = node.client("engine")
    ns = client.register(desc())
    soft, hard = resource.prlimit(proc.pid, resource.RLIMIT_NOFILE)
    resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (len(os.listdir(f"/proc/{proc.pid}/fd")) + 3, hard))
    burst = []
    try:
        for _ in range(12):  # past the limit: the ones the server cannot accept wait in its backlog
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(node.socket_path))
            burst.append(sock)
        time.sleep(1.0)  # the server meets EMFILE on accept, several times
        assert proc.poll() is None
        assert client.lookup(ns, [entry_key("k", 0)]).num_hit == 0  # the connected client is served
    finally:
        for sock in burst:
            sock.close()
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (soft, hard))
    late = node.client("late")
    assert late.register(desc()) == ns
    assert proc.poll() is None
    assert "cannot accept a connection" in node.foreground_log(proc)


def test_a_key_error_inside_the_store_is_an_internal_error_not_an_unknown_namespace(node):
    """Only a namespace nobody registered is `unknown_namespace`; a KeyError raised by a bug in
    the store, for a namespace that is registered, is reported (and logged) as the bug it is."""
    import threading

    from hpkv.server.autostart import answers
    from hpkv.server.client import ServerError

    server = daemon.Server(load_settings(node.env))
    thread = threading.Thread(target=server.run, name="hpkv-server", daemon=True)
    thread.start()
    try:
        wait_for(lambda: answers(node.socket_path), what="the server answers")
        client = node.client("keyerror", retry_interval_s=0.0)
        with pytest.raises(ServerError) as unknown:
            client.lookup("0" * 32, [entry_key("k", 0)])
        assert unknown.value.code == "unknown_namespace"
        ns = client.register(desc(0, SMALL))

        def broken_lookup(ns: str, keys: list[bytes]):
            raise KeyError("slot 7")

        server.store.lookup = broken_lookup
        with pytest.raises(ServerError) as bug:
            client.lookup(ns, [entry_key("k", 0)])
        assert bug.value.code == "internal" and "slot 7" in str(bug.value)
        client.close()
    finally:
        server.stop()
        thread.join(timeout=30)
