"""SGLang calls its storage backend from three threads at once (prefetch, prefetch I/O, backup).
Here three threads drive one HpkvStorage with exists/get/set on overlapping pages while the HPKV
server is killed with -9 midway and a new one is auto-started: no exception ever reaches a
caller, and every page reported loaded holds exactly the bytes written under its key. The
threads' clients share one mapping of the pool, and a new server's pool gets a new one."""

from __future__ import annotations

import gc
import random
import signal
import threading
import time

import pytest

from helpers import sglang as su
from helpers.mappings import inode_mappings
from helpers.waiting import wait_for
from hpkv.keys import make_key

NUM_KEYS = 24
READ_PAGES = 8  # each thread reads into its own pages, as SGLang gives each prefetch its own slots


@pytest.fixture
def node(node, monkeypatch):
    su.use_node_env(monkeypatch, node)
    node.start_server()
    return node


def test_three_threads_with_the_server_killed_midway(node):
    pool = su.host_pool(device_tokens=128, seed=11)  # 65 pages: sources 0..23, read areas after
    keys = su.page_hashes("a prompt every request shares", NUM_KEYS)
    expected = [su.page_bytes(pool, i * pool.page_size) for i in range(NUM_KEYS)]
    storage = su.backend(pool)
    killed, stop = threading.Event(), threading.Event()
    errors: list[str] = []
    hits = {"before": 0, "after": 0}
    hits_lock = threading.Lock()

    def drive(thread_no: int) -> None:
        rng = random.Random(thread_no)
        area = [NUM_KEYS + thread_no * READ_PAGES + i for i in range(READ_PAGES)]
        while not stop.is_set():
            start = rng.randrange(NUM_KEYS - 1)
            end = min(NUM_KEYS, start + rng.randint(1, READ_PAGES))
            window, op = keys[start:end], rng.choice(("exists", "get", "set"))
            try:
                if op == "exists":
                    num = storage.batch_exists(window)
                    assert 0 <= num <= len(window), num
                elif op == "set":
                    done = storage.batch_set_v1(window, su.page_indices(pool, list(range(start, end))))
                    assert len(done) == len(window), done
                else:
                    loaded = storage.batch_get_v1(window, su.page_indices(pool, area[: len(window)]))
                    num = sum(loaded)
                    assert loaded == [True] * num + [False] * (len(window) - num), loaded
                    for i in range(num):
                        got = su.page_bytes(pool, area[i] * pool.page_size)
                        assert got == expected[start + i], f"wrong bytes for key {start + i}"
                    with hits_lock:
                        hits["after" if killed.is_set() else "before"] += num
            except Exception as exc:  # anything escaping the backend fails the test
                errors.append(f"thread {thread_no} {op}: {type(exc).__name__}: {exc}")
                return
            time.sleep(0.001)  # SGLang calls when work arrives; don't spin on fast misses while HPKV is down

    threads = [threading.Thread(target=drive, args=(n,), name=f"sglang-{n}") for n in range(3)]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: hits["before"] >= 20 or errors, 30, what="hits before the kill")
        node.servers[0].kill()
        killed.set()
        wait_for(lambda: hits["after"] >= 20 or errors, 60, what="hits from an auto-started server")
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
        storage.close()
    assert not errors, errors
    assert storage.stats.snapshot()["faults"] > 0  # the kill was seen, and turned into misses
    assert len(node.server_pids()) == 1  # the auto-started one, killed by node.close()


def test_the_threads_clients_share_one_mapping_of_the_pool(node):
    """Each storage thread has a client (a connection of its own), but the process maps the pool
    once: every mapping costs page tables for the whole pool. A lease taken before the server
    restarts still reads the old pool; the new server's pool gets a mapping of its own, and the
    old one goes with the last lease on it."""
    pool = su.host_pool(seed=3)
    storage = su.backend(pool)
    keys = su.page_hashes("prompt", 4)
    assert storage.batch_set_v1(keys, su.page_indices(pool, [0, 1, 2, 3])) == [True] * 4

    def storage_threads() -> list:
        """Three storage threads, alive together (a new client closes the clients of ended threads)."""
        clients, together = [], threading.Barrier(3)

        def call() -> None:
            storage.batch_exists(keys)
            clients.append(storage.io.client())  # this thread's own
            together.wait(timeout=30)

        threads = [threading.Thread(target=call, name=f"sglang-{n}") for n in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert len(clients) == 3
        return clients

    clients = storage_threads() + [storage.io.client()]  # and this thread's, which stored the pages
    old_inode = node.pool_path.stat().st_ino
    assert len({id(client.region) for client in clients}) == 1
    assert inode_mappings(old_inode) == 1

    lease = clients[-1].lease(storage.ns, [make_key(k) for k in keys])
    assert clients[-1].wait(lease) == 4
    before = bytes(lease.view(0))
    server = node.servers[0]
    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=30) == 0
    node.start_server()
    new_inode = node.pool_path.stat().st_ino
    assert new_inode != old_inode

    wait_for(lambda: storage.batch_exists(keys) == 4, 10, what="this thread's client back")  # on storage
    clients = storage_threads() + [storage.io.client()]  # new threads, new clients
    assert {client.region.inode for client in clients} == {new_inode}
    assert len({id(client.region) for client in clients}) == 1
    assert inode_mappings(new_inode) == 1
    assert bytes(lease.view(0)) == before  # the old pool file, unlinked, still mapped for the lease
    assert inode_mappings(old_inode) == 1
    del lease
    gc.collect()
    assert inode_mappings(old_inode) == 0
    storage.close()
