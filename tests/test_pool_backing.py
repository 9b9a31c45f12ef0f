"""Stories about the pages behind the pool: a pool of any size is created at once, its pages are
reserved (and locked where something could swap them) in the background, in address order, and
no slot is handed out before the pages behind it are there."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers.swap import with_swap_configured
from hpkv.pool.backing import CHUNK_BYTES, FIRST_BYTES, swap_needs_lock
from hpkv.pool.region import PoolRegion
from hpkv.pool.slots import SlotAllocator
from hpkv.pool.tier import DramTier

MiB = 1 << 20
GiB = 1 << 30


def _reserved_bytes(region: PoolRegion) -> int:
    return os.fstat(region.share_fd()).st_blocks * 512


def _vm_locked_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmLck:"):
            return int(line.split()[1]) << 10
    return 0


def test_a_large_pool_is_created_at_once_and_its_pages_reserved_behind_in_order(shm_dir, caplog):
    with caplog.at_level(logging.INFO, logger="hpkv.pool.region"):
        region = PoolRegion.create(shm_dir, GiB)
        try:
            ready_at_start = region.ready_bytes
            assert FIRST_BYTES <= ready_at_start <= GiB  # the first slabs are ready for the first writes
            assert _reserved_bytes(region) >= ready_at_start  # never ready before reserved
            assert region.wait_ready(60)
            assert region.ready_bytes == GiB
            assert _reserved_bytes(region) >= GiB
        finally:
            region.close()

    assert any("pool of 1.0 GiB ready in" in r.getMessage() for r in caplog.records)


def test_no_slot_is_handed_out_beyond_the_pages_reserved(shm_dir):
    region = PoolRegion.create(shm_dir, GiB)
    try:
        tier = DramTier(GiB, 32 * MiB, ready=lambda: region.ready_bytes)
        tier.add_namespace("ns", 8 * MiB)
        handed, offsets, deadline = 0, set(), time.monotonic() + 60
        while len(offsets) < GiB // (8 * MiB) and time.monotonic() < deadline:
            reserved_before = _reserved_bytes(region)
            entry = tier.reserve("ns", handed.to_bytes(8, "little"))
            assert entry is not None  # the oldest entry makes room while the pool is filling
            # Reservation is in address order: the pages of this slot are behind the prefix
            # reserved when it was handed out (or since).
            assert entry.offset + entry.slot_bytes <= region.ready_bytes
            assert entry.offset + entry.slot_bytes <= max(reserved_before, _reserved_bytes(region))
            tier.commit(entry)
            offsets.add(entry.offset)
            handed += 1
        assert len(offsets) == GiB // (8 * MiB)  # once ready, the whole pool serves
    finally:
        region.close()


def test_the_allocator_hands_out_backed_slabs_only_and_the_lowest_first():
    ready = [2 * MiB]
    alloc = SlotAllocator(8 * MiB, MiB, ready=lambda: ready[0])

    first = [alloc.alloc(MiB), alloc.alloc(MiB)]
    assert first == [0, MiB]
    assert alloc.alloc(MiB) is None  # the third slab has no pages yet
    alloc.free(0)
    assert alloc.alloc(MiB) == 0  # a freed slab is backed
    ready[0] = 8 * MiB
    assert [alloc.alloc(MiB) for _ in range(6)] == [i * MiB for i in range(2, 8)]


def test_closing_a_pool_while_its_pages_are_reserved_stops_the_reservation(shm_dir):
    region = PoolRegion.create(shm_dir, 2 * GiB)
    region.close()

    assert not any(t.name == "hpkv-pool-backing" and t.is_alive() for t in threading.enumerate())
    assert list(shm_dir.iterdir()) == []


@pytest.mark.skipif(swap_needs_lock("tmpfs") is None, reason="this machine has swap configured")
def test_with_no_swap_configured_nothing_is_locked_and_the_pool_says_why(shm_dir):
    before = _vm_locked_bytes()
    region = PoolRegion.create(shm_dir, FIRST_BYTES + 4 * CHUNK_BYTES)
    try:
        assert region.wait_ready(60)
        stats = region.backing_stats()
        assert stats["no_lock_why"] == "no swap is configured"
        assert stats["locked_in_memory"] and stats["locked_bytes"] == region.size_bytes
        assert _vm_locked_bytes() == before  # no mlock: nothing to fault in page by page
    finally:
        region.close()


WITH_SWAP = """
import sys
from pathlib import Path
from hpkv.pool.region import PoolRegion
region = PoolRegion.create(Path(sys.argv[1]), int(sys.argv[2]))
assert region.wait_ready(60)
locked = [l for l in open("/proc/self/status") if l.startswith("VmLck:")][0].split()[1]
print("stats", region.backing_stats(), "vmlck_kib", locked)
region.close()
"""


def test_where_swap_is_configured_the_pages_are_locked_in_the_background(shm_dir, tmp_path):
    size = FIRST_BYTES + 4 * CHUNK_BYTES
    result = with_swap_configured(tmp_path, sys.executable, "-c", WITH_SWAP, str(shm_dir), str(size))

    assert result.returncode == 0, result.stderr
    assert f"'locked_bytes': {size}" in result.stdout and "'no_lock_why': None" in result.stdout
    assert int(result.stdout.split("vmlck_kib")[1]) << 10 >= size
