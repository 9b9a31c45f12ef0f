"""Stories about the pages behind the pool: a pool of any size is created at once, its pages are
reserved (and locked where something could swap them) in the background, in address order, and
no slot is handed out before the pages behind it are there."""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers.server import Node
from helpers.stats import stats_from
from helpers.swap import with_swap_configured
from helpers.waiting import wait_for
from hpkv.config import load_settings
from hpkv.pool.backing import CHUNK_BYTES, FIRST_BYTES, swap_needs_lock
from hpkv.pool.dram_tier import DramTier
from hpkv.pool.region import PoolRegion
from hpkv.pool.slots import SlotAllocator
from hpkv.server import daemon
from hpkv.server.autostart import answers

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


def _status_text(stats) -> str:
    import io

    from rich.console import Console

    from hpkv.status import print_status

    console = Console(file=io.StringIO(), width=250)
    print_status(stats, console)
    return console.file.getvalue()


def test_status_says_how_much_of_the_pool_is_ready_and_why_it_is_not_locked():
    filling = {"capacity_bytes": 4 * GiB, "ready_bytes": GiB, "locked_bytes": GiB, "locked_in_memory": False}
    unswappable = {"capacity_bytes": 4 * GiB, "ready_bytes": 4 * GiB, "locked_bytes": 4 * GiB}
    unswappable["no_lock_why"] = "no swap is configured"

    assert "reserving pages: 1.0 GiB ready" in _status_text(stats_from({"dram": filling}))
    assert "never swapped (no swap is configured)" in _status_text(stats_from({"dram": unswappable}))


def test_a_server_answers_before_its_pool_is_reserved_and_logs_when_it_is(shm_dir, tmp_path, caplog):
    node = Node(shm_dir, tmp_path, HPKV_KV_MEM_POOL_SIZE="1g", HPKV_KV_STORAGE_ENABLE="0")
    server = daemon.Server(load_settings(node.env))
    thread = threading.Thread(target=server.run, name="hpkv-server", daemon=True)
    with caplog.at_level(logging.INFO):
        thread.start()
        try:
            wait_for(lambda: answers(node.socket_path), what="the server answers")
            with node.client("status") as client:
                wait_for(lambda: client.stats().dram.ready_bytes == GiB, timeout_s=60, what="the whole pool")
                assert client.stats().dram.locked_bytes == GiB or swap_needs_lock("tmpfs") is None
        finally:
            server.stop()
            thread.join(60)
    messages = [r.getMessage() for r in caplog.records]
    ready = next(m for m in messages if m.startswith("HPKV server ready"))
    now = re.search(rf"\({GiB} bytes, (\d+) with pages now, the rest reserved in the background", ready)
    assert now is not None and FIRST_BYTES <= int(now.group(1)) <= GiB, ready
    assert any(m.startswith("pool of 1.0 GiB ready in") for m in messages)


def test_a_prefault_stops_once_its_mapping_is_closed_or_let_go(shm_dir):
    """A client's background prefault holds its mapping weakly: the pool of a server that is gone,
    which its clients let go of, is unmapped rather than populated on to its end."""
    owner = PoolRegion.create(shm_dir, GiB)
    try:
        for close in (True, False):
            fd = os.open(owner.path, os.O_RDWR | os.O_CLOEXEC)
            attached = PoolRegion.attach(fd, GiB, owner.path)
            attached.prefault()
            if close:
                attached.close()
            del attached
            wait_for(
                lambda: not any(t.name == "hpkv-prefault" and t.is_alive() for t in threading.enumerate()),
                timeout_s=10,
                what="the prefault thread to stop",
            )
    finally:
        owner.close()
