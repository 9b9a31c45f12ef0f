"""The cluster tier inside the store (`store/cluster.py`), in process, on a real mooncake_master:
what one store commits, alone or in a hold spanning namespaces, or promotes from its storage, is
written through; another store's lookup fills it into its DRAM (a DRAM hit, the same bytes); a
clear of memory removes it."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from helpers.config import make_storage_config
from helpers.mooncake import mooncake_master  # noqa: F401  (a fixture)
from hpkv.cluster.client import ClusterClient
from hpkv.cluster.tier import ClusterTier
from hpkv.config import ClusterConfig
from hpkv.pool.region import PoolRegion
from hpkv.storage.storage_tier import StorageTier
from hpkv.store import TieredStore
from hpkv.tiers import Tier
from test_store import desc, keys, load, only_in_storage, payload


@pytest.fixture
def stores(mooncake_master):
    """Two stores, each over a pool of its own, joined by the cluster; each contributes 32 MiB."""
    config = ClusterConfig(enabled=True, master=mooncake_master.address, host="127.0.0.1", buffer_bytes=16 << 20)
    made, dirs = [], []

    def make(storage: Path | None = None) -> TieredStore:
        """A store joined to the cluster, with a storage tier in `storage` (None: none)."""
        dirs.append(Path(tempfile.mkdtemp(prefix="hpkv-cluster-store-", dir="/dev/shm")))
        region = PoolRegion.create(dirs[-1], 16 << 20)
        tier = ClusterTier(config, region.buf, ClusterClient(config, segment_bytes=32 << 20))
        assert tier.start()
        files = StorageTier(make_storage_config(storage)) if storage is not None else None
        if files is not None:
            files.start()
        made.append(TieredStore(region, files, cluster=tier))
        return made[-1]

    yield make
    for store in made:
        store.close()
    for d in dirs:
        import shutil

        shutil.rmtree(d, ignore_errors=True)


def fill_slots(store: TieredStore, ns: str, ks: list[bytes], offsets: list[int | None]) -> None:
    size = store.namespaces()[ns].entry_bytes
    for key, offset in zip(ks, offsets):
        assert offset is not None
        store.region.buf[offset : offset + size] = payload(key, size)


def test_a_hold_spanning_namespaces_is_written_through_and_read_by_another_store(stores):
    a, b = stores(), stores()
    ns0, ns1 = a.register(desc(rank=0)), a.register(desc(rank=1))
    k0, k1 = keys(4, "rank0"), keys(4, "rank1")
    fill_slots(a, ns0, k0, a.reserve(ns0, k0, hold="h"))
    fill_slots(a, ns1, k1, a.reserve(ns1, k1, hold="h"))
    assert a.settle("h", []) == (8, 0)
    assert a.flush(timeout=30)
    assert a.cluster is not None
    assert a.cluster.tier.contains(ns0, k0) == [True] * 4 and a.cluster.tier.contains(ns1, k1) == [True] * 4
    assert b.register(desc(rank=1)) == ns1
    assert b.lookup(ns1, k1 + keys(1, "none")).tiers == (Tier.DRAM,) * 4
    assert load(b, ns1, k1) == [payload(k) for k in k1]
    assert b.stats().cluster.hits == 4


def test_committed_entries_fill_another_store_and_a_clear_of_memory_removes_them(stores):
    a, b = stores(), stores()
    ns = a.register(desc())
    ks = keys(6, "plain")
    fill_slots(a, ns, ks, a.reserve(ns, ks))
    assert a.commit(ns, ks) == 6
    assert a.flush(timeout=30)
    b.register(desc())
    assert b.lookup(ns, ks[:3]).tiers == (Tier.DRAM,) * 3  # only what was asked for is read
    assert b.stats().cluster.hits == 3
    assert b.clear(dram=True, ns=ns) == {"dram": 3, "storage": 0, "cluster": 6}
    assert b.lookup(ns, ks).tiers == ()
    assert a.lookup(ns, ks).tiers == (Tier.DRAM,) * 6  # A's own DRAM is A's


def test_a_lease_with_no_lookup_before_it_is_filled_from_the_cluster(stores):
    """vLLM's scheduler half leases a full-attention prompt without a lookup first (protocol 5):
    the lease itself must find the cluster's objects."""
    a, b = stores(), stores()
    ns = a.register(desc())
    ks = keys(5, "leased")
    fill_slots(a, ns, ks, a.reserve(ns, ks))
    assert a.commit(ns, ks) == 5
    assert a.flush(timeout=30)
    b.register(desc())
    lease = b.lease(ns, ks + keys(1, "none"))
    assert len(lease.entries) == 5
    assert b.stats().cluster.hits == 5
    b.release(lease.id)
    assert load(b, ns, ks) == [payload(k) for k in ks]


def test_an_entry_promoted_from_storage_is_written_to_the_cluster_for_other_nodes(stores, tmp_path):
    """A prefix on one node's storage alone (computed before the cluster tier was there, or
    evicted from it): once that node reads it back, every other node hits it in memory."""
    a, b = stores(storage=tmp_path / "kv-a"), stores()
    ns = a.register(desc())
    ks = keys(4, "promoted")
    only_in_storage(a, ns, ks)  # on A's storage; the clear of memory took the cluster's objects too
    b.register(desc())
    assert b.lookup(ns, ks).tiers == ()
    assert load(a, ns, ks) == [payload(k) for k in ks]  # promoted from A's storage
    assert a.flush(timeout=30)
    assert b.lookup(ns, ks).tiers == (Tier.DRAM,) * 4
    assert load(b, ns, ks) == [payload(k) for k in ks]
    assert b.stats().cluster.hits == 4
