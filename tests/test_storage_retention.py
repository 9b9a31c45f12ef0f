"""Stories about retention (`storage/retention.py`, HPKV_KV_STORAGE_RETENTION): files unused for
longer than it are removed, oldest first, newer ones stay, a file read on another node since
stays; and on a real `hpkv server`, files past it when the server starts are gone soon after.
Time moves by a fake wall clock and by file mtimes, never by sleeping."""

from __future__ import annotations

import dataclasses
import os
import time

from helpers import storage_stories as stories
from helpers.cli import DESC, hpkv, wait_for_storage, write_entries
from helpers.clock import FakeClock
from helpers.config import make_storage_config
from helpers.storage_stories import NS, CountedStats, key, read, write
from helpers.waiting import wait_for
from hpkv.storage.retention import Retention
from hpkv.storage.storage_tier import StorageTier
from hpkv.tiers import Tier

HOUR = 3600.0
open_tier = stories.open_tier


def _tier(storage_dir, clock: FakeClock) -> tuple[StorageTier, Retention]:
    """A real tier on a fake wall clock, and its retention, whose passes the story runs itself
    (the tier's own thread is off: it would run them whenever it is scheduled)."""
    tier = StorageTier(make_storage_config(storage_dir), wall_clock=clock)
    tier.start()
    tier.add_namespace(NS, '{"test": true}')
    assert tier.scan_done.wait(10)
    return tier, Retention(HOUR, tier.index, tier.paths, tier.evictor, clock)


def test_a_file_unused_past_the_retention_is_gone_and_a_newer_one_stays(storage_dir):
    clock = FakeClock(time.time())
    tier, retention = _tier(storage_dir, clock)
    try:
        assert write(tier, key("old"))
        clock.advance(50 * 60)
        assert write(tier, key("new"))
        clock.advance(20 * 60)  # old: 70 minutes unused; new: 20
        assert retention.expire_once() == 1
        assert not os.path.exists(tier.paths.path_of(NS, key("old"))) and not tier.contains(NS, key("old"))
        assert read(tier, key("new")) is not None
        assert retention.num_expired == 1
        assert retention.expire_once() == 0  # the oldest left is in use: nothing more looked at
    finally:
        tier.close()


def test_a_read_keeps_a_file_and_a_read_on_another_node_does_too(storage_dir):
    clock = FakeClock(time.time())
    tier, retention = _tier(storage_dir, clock)
    try:
        for name in ("read-here", "read-elsewhere", "unused"):
            assert write(tier, key(name))
        clock.advance(40 * 60)
        assert read(tier, key("read-here")) is not None
        elsewhere = clock.now
        os.utime(tier.paths.path_of(NS, key("read-elsewhere")), (elsewhere, elsewhere))  # what a read there does
        clock.advance(40 * 60)
        assert retention.expire_once() == 1
        assert not os.path.exists(tier.paths.path_of(NS, key("unused")))
        assert tier.contains(NS, key("read-here")) and tier.contains(NS, key("read-elsewhere"))
    finally:
        tier.close()


def test_a_pass_looks_at_the_old_end_only(storage_dir):
    """Nothing past the retention: one file looked at, however many there are."""
    clock = FakeClock(time.time())
    tier, retention = _tier(storage_dir, clock)
    try:
        for i in range(50):
            assert write(tier, key(i))
        tier.paths.io = counted = CountedStats()
        assert retention.expire_once() == 0
        assert counted.stats == 1
    finally:
        tier.close()


def test_a_server_started_with_old_files_removes_them_and_keeps_the_rest(pool_dir, tmp_path):
    from helpers.cli import ServerProcess, hpkv_env

    env = hpkv_env(pool_dir, tmp_path / "storage", tmp_path)
    server = ServerProcess(env, tmp_path / "server.log")
    try:
        with server.client() as client:
            old_ns, _ = write_entries(client, 3, dataclasses.replace(DESC, model="old"))
            new_ns, new_keys = write_entries(client, 2)
            wait_for_storage(client, 5)
    finally:
        assert server.stop() == 0
    two_hours_ago = time.time() - 2 * HOUR
    old_files = sorted((tmp_path / "storage" / old_ns).rglob("*.kv"))
    for path in old_files:
        os.utime(path, (two_hours_ago, two_hours_ago))

    env["HPKV_KV_STORAGE_RETENTION"] = "1h"
    server = ServerProcess(env, tmp_path / "server2.log")
    try:
        with server.client() as client:
            assert wait_for(lambda: client.stats().storage.expired == 3, timeout_s=20)
            assert not any(p.exists() for p in old_files)
            assert client.register(DESC) == new_ns
            assert client.lookup(new_ns, new_keys).tiers == (Tier.STORAGE,) * 2
            status = hpkv(env, "status")
            assert "retention 1h (3 files expired)" in status.stdout, status.stdout
        shown = hpkv(env, "config")
        assert "HPKV_KV_STORAGE_RETENTION" in shown.stdout and "1h (3600 s)" in shown.stdout
    finally:
        server.stop()
