"""Stories of a storage root others change under a running server: the root moved away and a link
put in its place, sparse files another node plants that declare gigabytes, and a second server on
the same directory clearing it. Real files, links, tiers and (for the write-throughs) writer
processes."""

from __future__ import annotations

import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import xxhash

from helpers import storage_stories as stories
from helpers.config import make_storage_config
from helpers.keys import desc as desc_of
from helpers.keys import entry_key
from helpers.server import Node
from helpers.storage_stories import NS, OTHER_NS, eventually, file_bytes, key, payload, read, write
from helpers.waiting import wait_for
from hpkv import clearing
from hpkv.doctor import Verdict, run_checks
from hpkv.storage import format as fmt
from hpkv.storage import storage_tier as storage_tier_mod
from hpkv.storage.storage_tier import StorageTier
from test_store import desc, keys, only_in_storage, open_store  # noqa: F401 (a fixture)
from test_store import payload as store_payload

open_tier, tier = stories.open_tier, stories.tier
THEIRS = b"another user's file"
PLANTER_NS = "5a" * 16  # another node's namespace
HPKV_SCRIPT = Path(sys.executable).parent / "hpkv"


def entry_path(root: Path, ns: str, k: bytes) -> Path:
    h = k.hex()
    return root / ns / h[:2] / h[2:4] / f"{h}.kv"


def replace_root(storage_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """Move the root away and put a link to another user's directory at its name: (where the
    root is now, the link's target)."""
    moved, elsewhere = tmp_path / "moved-away", tmp_path / "elsewhere"
    storage_dir.rename(moved)
    elsewhere.mkdir()
    storage_dir.symlink_to(elsewhere, target_is_directory=True)
    return moved, elsewhere


def plant(root: Path, ks: list[bytes], ns: str = NS) -> list[Path]:
    """Files named as the entries of `ks` under `root`: another user's."""
    paths = [entry_path(root, ns, k) for k in ks]
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(THEIRS)
    return paths


# -- row 11: the root moved away and a link put in its place --------------------------------------


def test_a_root_replaced_by_a_link_is_not_followed_by_reads_writes_evictions_or_a_clear(
    open_tier, storage_dir, tmp_path, caplog
):
    tier = open_tier(capacity=64 * file_bytes())
    assert tier.scan_done.wait(10)
    indexed = [key(f"indexed-{i}") for i in range(6)]  # in the index, their files nowhere in the tree held
    for k in indexed:
        tier.index.remember(tier.index.key(NS, k), file_bytes())
    mine = key("mine")
    assert write(tier, mine)
    moved, elsewhere = replace_root(storage_dir, tmp_path)
    victims = plant(elsewhere, [mine, *indexed, key("new")])

    with caplog.at_level(logging.WARNING, logger="hpkv.storage.tier"):
        assert read(tier, indexed[0]) is None  # not read (nor removed as bad) through the link
        assert write(tier, key("new"))
        tier.evictor.evict_bytes(3 * file_bytes())
        assert tier.remove() == 2  # the entries of the tree held: `mine` and the new one

    assert [p.read_bytes() for p in victims] == [THEIRS] * len(victims)
    assert not list(moved.rglob("*.kv"))
    assert storage_dir.is_symlink() and not list(elsewhere.rglob("*.tmp"))
    said = tier.stats().root_replaced
    assert said is not None and str(storage_dir) in said and "moved away" in said and "restart the server" in said
    assert sum(said in r.getMessage() for r in caplog.records) == 1  # said once


def test_clear_without_a_server_does_not_follow_a_root_replaced_after_it_opened_it(storage_dir, tmp_path, monkeypatch):
    """`hpkv clear --storage` with no server: the root it opened is the one it clears, whatever
    its name comes to point at meanwhile."""
    seed = StorageTier(make_storage_config(storage_dir, None))
    seed.start()
    ks = [key(i) for i in range(3)]
    assert all(write(seed, k) for k in ks)
    seed.close()
    victims: list[Path] = []
    remove_entries = storage_tier_mod.scan.remove_entries

    def replaced_then_removed(root, ns=None):  # the clear opened the root; then it is replaced
        moved, elsewhere = replace_root(storage_dir, tmp_path)
        victims.extend(plant(elsewhere, ks))
        return remove_entries(root, ns)

    monkeypatch.setattr(storage_tier_mod.scan, "remove_entries", replaced_then_removed)
    settings = type("Settings", (), {"storage": make_storage_config(storage_dir, None)})()

    assert clearing.clear_storage_directly(settings, None) == 3  # type: ignore[arg-type]

    assert victims and [p.read_bytes() for p in victims] == [THEIRS] * 3
    assert not list((tmp_path / "moved-away").rglob("*.kv"))


def test_write_through_processes_write_into_no_replaced_root(open_store, storage_dir, tmp_path):  # noqa: F811
    store = open_store()
    ns = store.register(desc())
    first = keys(4, "first")
    only_in_storage(store, ns, first)  # the writer processes have opened the root
    assert store.stats().writers.processes >= 1
    moved, elsewhere = replace_root(storage_dir, tmp_path)

    later = keys(16, "later")
    only_in_storage(store, ns, later)

    assert not list(elsewhere.rglob("*"))
    assert all(entry_path(moved, ns, k).exists() for k in later)
    assert store.stats().storage.write_failures == 0


# -- row 12: sparse files another node plants ----------------------------------------------------


def sparse_entry(root: Path, k: bytes, declared: int, ns: str = PLANTER_NS) -> Path:
    """An entry file with a valid header declaring a payload of `declared` bytes, and nothing
    else written: a sparse file of that size."""
    fixed = struct.pack("<8sHHI16sQQ", fmt.MAGIC, fmt.VERSION, len(k), 0, bytes.fromhex(ns), declared, 0)
    head = fixed + struct.pack("<I", xxhash.xxh32_intdigest(fixed + k)) + k
    path = entry_path(root, ns, k)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(head)
    os.truncate(path, fmt.header_bytes(len(k)) + declared)
    return path


def test_sparse_files_that_declare_a_gibibyte_each_evict_nothing(open_tier, storage_dir):
    tier = open_tier(capacity=32 * file_bytes())
    assert tier.scan_done.wait(10)
    mine = [key(i) for i in range(20)]
    assert all(write(tier, k) for k in mine)
    planted = [sparse_entry(storage_dir, key(f"sparse-{i}"), 1 << 30) for i in range(8)]
    empty = entry_path(storage_dir, PLANTER_NS, key("empty"))
    empty.parent.mkdir(parents=True, exist_ok=True)
    empty.touch()
    os.truncate(empty, 1 << 30)  # no block, no header
    assert planted[0].stat().st_size > 1 << 30 and planted[0].stat().st_blocks * 512 <= 64 << 10

    found = tier.rescan.once()

    assert tier.stats().evictions == 0
    assert all(tier.indexed(NS, k) and read(tier, k) == payload(k) for k in mine)
    assert found == (8, 0)  # the empty one is no KV file: not indexed
    assert tier.contains(PLANTER_NS, key("sparse-0")) and not tier.contains(PLANTER_NS, key("empty"))
    assert tier.index.used_bytes <= 20 * file_bytes() + 8 * (64 << 10)


def test_entries_being_promoted_are_not_evicted_by_another_nodes_files(open_store, storage_dir):  # noqa: F811
    """A lease's storage hits are in use until read: another node filling the directory past
    the capacity evicts other files at this node's next walk, never those."""
    k0 = keys(1)[0]
    entry = fmt.header_bytes(len(k0)) + len(store_payload(k0))
    store = open_store(capacity=24 * entry)
    ns = store.register(desc())
    old, leased = keys(8, "old"), keys(8, "leased")
    only_in_storage(store, ns, old + leased)
    other = StorageTier(make_storage_config(storage_dir, 1 << 30))
    other.start()
    try:
        lease = store.lease(ns, leased, start_reads=False)
        assert len(lease.entries) == 8
        for k in keys(8, "other-node"):  # real files of another node, 16 entries' worth each
            assert other.write_from(OTHER_NS, k, memoryview(store_payload(k, 16 * len(store_payload(k)))))
        store.storage.rescan.once()

        assert store.stats().storage.evictions >= 8
        assert all(entry_path(storage_dir, ns, k).exists() for k in leased)
        store.leases.start_reads(lease)
        assert lease.wait(timeout=10) == 8
        size = store.namespaces()[ns].entry_bytes
        assert [bytes(store.region.buf[o : o + size]) for o in lease.offsets] == [store_payload(k) for k in leased]
        store.release(lease.id)
        assert store.storage is not None
        store.storage.evictor.evict_bytes(1 << 30)  # read now: no longer in use, evicted as any other
        assert not any(entry_path(storage_dir, ns, k).exists() for k in leased)
    finally:
        other.close()


# -- row 13: another server on the same directory clears it ---------------------------------------


def test_an_index_another_server_emptied_heals_from_one_failed_read(open_tier):
    a = open_tier(capacity=None)
    assert a.scan_done.wait(10)
    ks = [key(i) for i in range(40)]
    assert all(write(a, k) for k in ks)
    b = open_tier(capacity=None)
    assert b.scan_done.wait(10) and b.stats().num_entries == 40

    assert b.remove() == 40
    assert write(b, ks[7])  # and writes one of them again

    assert read(a, ks[0]) is None  # a hit with no file: forgotten
    assert not a.indexed(NS, ks[0])
    assert eventually(lambda: a.stats().num_entries <= 1, timeout_s=10)  # the rest, by a walk it asked for
    assert a.stats().stale_entries == 40 - 1  # all counted but the one written again
    assert not a.contains(NS, ks[1]) and not a.indexed(NS, ks[0])
    assert a.contains(NS, ks[7]) and read(a, ks[7]) == payload(ks[7])


def test_a_server_whose_root_was_replaced_clears_nothing_through_the_link_and_says_so(shm_dir, tmp_path):
    """With a real server: `hpkv clear --storage` clears the tree it holds, nothing where the link
    points; `hpkv status` and `hpkv doctor` say what happened and the fix."""
    node = Node(shm_dir, tmp_path, HPKV_IO_THREADS="2")
    try:
        node.start_server()
        agent = node.agent()
        agent.call("register")
        assert agent.call("save", prefix="r", n=4)["committed"] == 4
        wait_for(lambda: agent.call("stats")["stats"]["storage"]["writes"] == 4 or None, what="the write-throughs")
        moved, elsewhere = replace_root(node.storage_dir, tmp_path)
        victims = plant(elsewhere, [entry_key("r", i) for i in range(4)], desc_of().ns)

        cleared = subprocess.run(
            [str(HPKV_SCRIPT), "clear", "--storage"], env=node.env, capture_output=True, text=True, timeout=60
        )
        status = subprocess.run([str(HPKV_SCRIPT), "status"], env=node.env, capture_output=True, text=True, timeout=60)
        checks = {c.name: c for c in run_checks(node.env)}
        agent.exit()
    finally:
        node.close()

    assert cleared.returncode == 0, cleared.stderr
    assert [p.read_bytes() for p in victims] == [THEIRS] * 4 and not list(moved.rglob("*.kv"))
    said = " ".join(status.stdout.split())
    assert "REPLACED" in said and "moved away" in said, status.stdout
    running = checks["storage: running server"]
    assert running.verdict is Verdict.WARN and "moved away" in running.detail and "restart the server" in running.fix
