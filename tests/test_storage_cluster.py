"""Stories of nodes sharing one storage root as a cluster (`storage/cluster.py`,
HPKV_KV_STORAGE_CLUSTER=on): each indexes and evicts only the parts it owns. Real tiers on a real
directory, in one process, each its own member; their monotonic clock is one the story moves by
hand, and their cluster threads never tick on their own (TICK_S an hour): each tick and pass is
the story's."""

from __future__ import annotations

import os
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bench import shared_root_sim as sim
from helpers.clock import FakeClock
from helpers.config import make_storage_config
from helpers.storage_stories import NS, file_bytes, key, payload, read, write
from hpkv import clearing
from hpkv.storage import cluster as cluster_mod
from hpkv.storage.fileio import FileIO
from hpkv.storage.members import Timing
from hpkv.storage.parts import PARTS, hrw_owners, member_hash, part_of
from hpkv.storage.storage_tier import StorageTier

LEASE_S = 30.0
TIMING = Timing(LEASE_S)


class CountedMetadata(FileIO):
    """Counts the directory listings and `stat`s by name a tier makes through the seam."""

    def __init__(self) -> None:
        self.listings = 0
        self.stats = 0

    def list_dir(self, dir_fd):
        self.listings += 1
        return super().list_dir(dir_fd)

    def stat_path(self, path, dir_fd=None):
        self.stats += 1
        return super().stat_path(path, dir_fd=dir_fd)


@pytest.fixture
def cluster(storage_dir, monkeypatch):
    """`make(capacity)`: a started tier in the cluster on `storage_dir`, ticked and passed by the
    story (`step`), its clock `clock`."""
    monkeypatch.setattr(cluster_mod, "TICK_S", 3600.0)
    clock = FakeClock()
    tiers: list[StorageTier] = []

    def make(capacity: int = 1 << 30, io: FileIO | None = None) -> StorageTier:
        config = replace(make_storage_config(storage_dir, capacity), cluster="on", lease_s=LEASE_S)
        tier = StorageTier(config, io=io, clock=clock)
        tier.start()
        assert tier.scan_done.wait(30)
        tiers.append(tier)
        return tier

    make.clock = clock  # type: ignore[attr-defined]
    make.tiers = tiers  # type: ignore[attr-defined]
    yield make
    for tier in tiers:
        tier.close()


def step(tiers: list[StorageTier], clock: FakeClock, seconds: float = TIMING.renew_s, passes: bool = False) -> None:
    """`seconds` pass; each tier renews and lists (and passes over its parts, with `passes`)."""
    clock.advance(seconds)
    for tier in tiers:
        assert tier.cluster is not None
        tier.cluster.tick()
    for tier in tiers if passes else ():
        assert tier.cluster is not None
        tier.cluster.pass_once()


def settle(tiers: list[StorageTier], clock: FakeClock) -> None:
    """Every tier sees every other, and holds its parts long enough to evict there."""
    for _ in range(int(TIMING.hold_s // TIMING.renew_s) + 2):
        step(tiers, clock)
    step(tiers, clock, passes=True)


def keys_owned_by(tier: StorageTier, n: int, seed: int = 0) -> list[bytes]:
    assert tier.cluster is not None
    owned, out, i = tier.cluster.ledger.owned, [], 0
    while len(out) < n:
        k = key(f"{seed}-{i}")
        i += 1
        if owned[part_of(k)]:
            out.append(k)
    return out


def covering(tier: StorageTier) -> list[bytes]:
    """Keys in `tier`'s parts, at least one under each first-level directory `<ab>`."""
    out, tops, i = [], set(), 0
    assert tier.cluster is not None
    while len(tops) < 256:
        k = key(f"cover-{i}")
        i += 1
        if tier.cluster.ledger.owned[part_of(k)] and k[0] not in tops:
            tops.add(k[0])
            out.append(k)
    return out


def fresh_keys(n: int) -> list[bytes]:
    return [key(f"{random.random()}") for _ in range(n)]


def files_under(root: Path) -> list[Path]:
    return [p for p in root.glob("*/*/*/*.kv")]


def test_the_parts_split_among_the_live_members_and_move_only_from_the_one_that_left():
    five = [f"node{i}-0000" for i in range(5)]
    owners5 = hrw_owners(sorted(five))
    four = sorted(five[:4])
    owners4 = hrw_owners(four)

    shares = np.bincount(owners5, minlength=5) / PARTS
    assert shares.min() > 0.19 and shares.max() < 0.21
    gone = sorted(five).index("node4-0000")
    moved = np.array(sorted(five))[owners5] != np.array(four)[owners4]
    assert set(np.flatnonzero(moved)) == set(np.flatnonzero(owners5 == gone))  # only node4's parts moved
    # the simulation's rule (bench.shared_root_sim.hrw_owner), on the same hashes
    ids = [member_hash(m) for m in sorted(five)]
    for part in (0, 1, 777, PARTS - 1):
        assert sim.hrw_owner(ids, part) == ids[owners5[part]]


def test_two_nodes_each_own_about_half_and_index_only_their_parts_and_what_they_wrote(cluster, storage_dir):
    clock = cluster.clock
    a, b = cluster(), cluster()
    settle([a, b], clock)
    assert a.cluster and b.cluster
    assert (a.cluster.ledger.owned ^ b.cluster.ledger.owned).all()  # every part has one owner
    assert 0.45 < a.cluster.ledger.share() < 0.55

    written = fresh_keys(200)
    for k in written:
        assert write(b, k)
    step([a, b], clock, passes=True)

    mine_in_a = sum(a.cluster.ledger.owned[part_of(k)] for k in written)
    assert len(a.index) == mine_in_a  # A learned B's files in A's parts, and only those
    assert len(b.index) == 200  # B knows what it wrote
    assert all(read(a, k) == payload(k) for k in written)  # every file readable from A by name


def test_steady_state_listings_and_stats_do_not_grow_with_the_files_other_nodes_own(cluster):
    clock = cluster.clock
    io = CountedMetadata()
    a, b = cluster(io=io), cluster()
    settle([a, b], clock)
    for k in keys_owned_by(a, 50):
        assert write(a, k)
    for k in covering(b):  # B's files in every first-level directory: the tree's shape is full
        assert write(b, k)
    step([a, b], clock, passes=True)
    step([a, b], clock, passes=True)  # each changed directory listed twice, then trusted

    def steady_state_ops() -> tuple[int, int, int]:
        io.listings = io.stats = 0
        for _ in range(3):
            step([a, b], clock, passes=True)
        return io.listings, io.stats, len(a.index)

    covered = len(covering(b))
    few = steady_state_ops()
    for k in keys_owned_by(b, 3000, seed=1):  # thirty times as many files, all in B's parts
        assert write(b, k)
    step([a, b], clock, passes=True)
    step([a, b], clock, passes=True)
    many = steady_state_ops()

    assert many == few, f"(listings, stats, indexed) with B's {covered} files {few}, with {covered + 3000} {many}"
    assert few[0] <= 3 * 3  # per period: the members, the root, and A's changed leaf directories (none)


def test_two_nodes_hold_the_capacity_together(cluster, storage_dir):
    clock = cluster.clock
    capacity = 40 * file_bytes()
    a, b = cluster(capacity), cluster(capacity)
    settle([a, b], clock)

    for i in range(6):
        for k in fresh_keys(20):
            assert write(a if i % 2 else b, k)
        step([a, b], clock, passes=True)

    on_disk = sum(p.stat().st_size for p in files_under(storage_dir))
    assert on_disk <= capacity, f"{on_disk} bytes on disk, {capacity} allowed"
    assert on_disk >= capacity * 0.6
    usage = a.cluster.files.total_usage() if a.cluster else {}
    assert usage["owners"] == 2 and usage["parts"] == PARTS and usage["bytes"] == on_disk


def test_a_silent_node_loses_its_parts_within_the_lease_and_fences_itself(cluster, storage_dir):
    clock = cluster.clock
    capacity = 30 * file_bytes()
    a, b = cluster(capacity), cluster(capacity)
    settle([a, b], clock)
    assert a.cluster and b.cluster
    for k in fresh_keys(60):
        assert write(b, k)  # B's own parts kept to its share; A's not yet passed over

    waited = 0.0
    while not a.cluster.ledger.evictable.all():  # B stops (a stall, or killed): A ticks on alone
        step([a], clock)
        waited += TIMING.renew_s
        assert waited <= TIMING.takeover_s, "B's parts not taken over within the bound"
    a.cluster.pass_once()

    on_disk = sum(p.stat().st_size for p in files_under(storage_dir))
    assert on_disk <= capacity
    assert b.cluster.members.fenced() and b.cluster.ledger.may_evict(b"\0" * 4 + b"x") is False
    b.evictor.evict_bytes(1 << 30)  # B, back from its stall, unlinks nothing before it renews
    assert sum(p.stat().st_size for p in files_under(storage_dir)) == on_disk


def test_a_node_that_leaves_removes_its_lease_and_usage_and_the_other_takes_its_parts(cluster, storage_dir):
    clock = cluster.clock
    a, b = cluster(), cluster()
    settle([a, b], clock)
    assert a.cluster and b.cluster
    member = b.cluster.members.member
    b.close()
    cluster.tiers.remove(b)

    names = os.listdir(storage_dir / "cluster" / "members")
    assert not [n for n in names if n.startswith(member)]
    assert member not in os.listdir(storage_dir / "cluster" / "usage")
    step([a], clock)
    assert a.cluster.ledger.owned.all() and not a.cluster.ledger.evictable.all()  # held off first
    settle([a], clock)
    assert a.cluster.ledger.evictable.all()


def test_a_miss_is_not_asked_again_for_two_seconds(cluster):
    clock = cluster.clock
    io = CountedMetadata()
    a, b = cluster(io=io), cluster()
    k = fresh_keys(1)[0]

    assert not a.contains(NS, k)
    io.stats = 0
    assert not a.contains(NS, k)
    assert io.stats == 0  # remembered: no round trip
    assert write(b, k)
    assert not a.contains(NS, k)
    clock.advance(2.5)
    assert a.contains(NS, k) and read(a, k) == payload(k)


def test_a_clear_on_one_node_makes_the_others_forget_and_list_again(cluster, storage_dir):
    clock = cluster.clock
    a, b = cluster(), cluster()
    settle([a, b], clock)
    for k in fresh_keys(50):
        assert write(b, k)
    step([a, b], clock, passes=True)
    assert len(a.index) > 0

    b.remove()
    step([a, b], clock, passes=True)

    assert len(a.index) == 0 and files_under(storage_dir) == []


def test_files_removed_by_others_in_a_nodes_parts_are_forgotten_at_its_next_pass(cluster):
    """Only the owner unlinks in its parts, but a reader elsewhere that found a file bad, the
    previous owner of a part gained, or a hand outside HPKV may remove one: the owner's next pass
    lists the directory (its mtime changed), finds it holds fewer files than the index, and forgets
    those gone, so they count against its share no longer and no lookup calls them hits."""
    clock = cluster.clock
    a, b = cluster(), cluster()
    settle([a, b], clock)
    assert a.cluster is not None and b.cluster is not None
    in_a = keys_owned_by(a, 30)
    for k in in_a:
        assert write(b, k)  # B writes in A's parts
    step([a, b], clock, passes=True)
    assert all(a.indexed(NS, k) for k in in_a)
    for k in in_a[:10]:
        os.unlink(a.paths.path_of(NS, k))  # removed by another hand
    stale = a.stats().stale_entries

    step([a, b], clock, passes=True)

    assert not any(a.indexed(NS, k) for k in in_a[:10]) and all(a.indexed(NS, k) for k in in_a[10:])
    assert a.cluster.last_pass is not None and a.cluster.last_pass[0].gone == 10
    assert a.stats().stale_entries == stale + 10
    assert a.stats().cluster.owned_files == 20  # type: ignore[union-attr]

    # A part gained: what A indexed there as another's files (read lately) and its owner evicted
    # since is forgotten at A's first pass over it.
    in_b = keys_owned_by(b, 10, seed=1)
    for k in in_b:
        assert write(b, k) and a.contains(NS, k)  # a lookup on A found it: A indexes it
    assert all(a.indexed(NS, k) for k in in_b)
    for k in in_b[:4]:
        os.unlink(a.paths.path_of(NS, k))  # B evicts them, then goes silent
    while not a.cluster.ledger.evictable.all():
        step([a], clock)
    a.cluster.pass_once()
    assert not any(a.indexed(NS, k) for k in in_b[:4]) and all(a.indexed(NS, k) for k in in_b[4:])
    assert a.stats().cluster.owned_files == 26  # type: ignore[union-attr]


def clear_settings(storage_dir: Path):
    """What `hpkv clear` reads of its settings: the storage's, the cluster on, another capacity."""
    return type("Settings", (), {"storage": replace(make_storage_config(storage_dir, 1 << 20), cluster="on")})()


def test_a_clear_without_a_server_joins_no_cluster_and_writes_no_capacity_for_the_servers_after_it(storage_dir):
    """`hpkv clear --storage` with no server, on a root no cluster has used yet: it removes the
    files and leaves no `cluster` directory (no lease, no usage, no epoch, and above all no
    `cluster/config`, whose capacity every server started after it would take as the root's)."""
    seed = StorageTier(make_storage_config(storage_dir, 1 << 30))
    seed.start()
    assert seed.scan_done.wait(30) and all(write(seed, k) for k in fresh_keys(3))
    seed.close()

    assert clearing.clear_storage_directly(clear_settings(storage_dir), None) == 3

    assert files_under(storage_dir) == [] and not (storage_dir / "cluster").exists()


def test_a_clear_without_a_server_makes_the_running_nodes_forget_and_list_again(cluster, storage_dir):
    clock = cluster.clock
    a = cluster(1 << 30)
    settle([a], clock)
    assert a.cluster is not None
    for k in fresh_keys(20):
        assert write(a, k)
    config_before = (storage_dir / "cluster" / "config").read_bytes()
    leases_before = sorted(p.name for p in (storage_dir / "cluster" / "members").iterdir())

    assert clearing.clear_storage_directly(clear_settings(storage_dir), None) == 20
    step([a], clock, passes=True)

    assert len(a.index) == 0 and files_under(storage_dir) == []  # the epoch replaced: A forgot
    assert (storage_dir / "cluster" / "config").read_bytes() == config_before
    assert sorted(p.name for p in (storage_dir / "cluster" / "members").iterdir()) != leases_before  # A renewed
    assert a.cluster.members.live() == (a.cluster.members.member,)  # and saw no other member come or go
    assert a.stats().cluster.members_expired == 0  # type: ignore[union-attr]


class SlowStats(FileIO):
    """Each `stat` by name takes `seconds` of the story's clock: a slow metadata server."""

    def __init__(self, clock: FakeClock, seconds: float) -> None:
        self.clock, self.seconds, self.slow = clock, seconds, False

    def stat_path(self, path, dir_fd=None):
        if self.slow:
            self.clock.advance(self.seconds)
        return super().stat_path(path, dir_fd=dir_fd)


def test_a_pass_longer_than_the_lease_renews_as_it_goes(cluster):
    clock = cluster.clock
    io = SlowStats(clock, 0.01)
    a, b = cluster(io=io), cluster()
    settle([a, b], clock)
    assert a.cluster and b.cluster
    for k in covering(a):  # every first-level directory there: a pass stats each of A's ~32,768 parts
        assert write(a, k)
    started = clock.now

    io.slow = True
    a.cluster.pass_once()
    io.slow = False

    assert clock.now - started > 2 * LEASE_S
    assert not a.cluster.members.fenced()
    b.cluster.tick()
    assert a.cluster.members.member in b.cluster.members.live()  # B never lost sight of A


def test_a_pass_skips_the_parts_it_gives_away_as_members_join_during_it(cluster):
    """A node started alone passes over every part; nodes that join meanwhile take theirs, and
    the pass looks at those no more (a start-up where the nodes come up a few seconds apart)."""
    clock = cluster.clock
    io = SlowStats(clock, 0.0004)  # a pass of 65,536 `stat`s: 26 s, within B's first lease in A's view
    a = cluster(io=io)
    settle([a], clock)
    assert a.cluster is not None and a.cluster.ledger.owned.all()
    for k in covering(a):  # a file under every first-level directory: a pass stats each of the 65,536 parts
        assert write(a, k)
    b = cluster()  # joins: A's heartbeats list the members again once a renewal is due, 10 s in
    assert b.cluster is not None

    io.slow = True
    result = a.cluster.pass_once()
    io.slow = False

    share = a.cluster.ledger.share()
    assert 0.4 < share < 0.6  # B's parts went to B during the pass
    seen_before = TIMING.renew_s / 0.0004  # parts statted before A's view gave B its parts
    assert result.dirs_statted < seen_before + 1.1 * share * (PARTS - seen_before)


def test_stats_say_the_member_the_live_members_its_parts_its_pass_and_the_expiries_it_saw(cluster):
    """What `hpkv status`, the metrics and `hpkv doctor` show of a node in the cluster."""
    clock = cluster.clock
    capacity = 1 << 30
    a, b = cluster(capacity), cluster(capacity)
    settle([a, b], clock)
    assert a.cluster and b.cluster
    written = fresh_keys(40)
    for k in written:
        assert write(b, k)
    clock.advance(5.0)
    a.cluster.pass_once()

    s = a.stats().cluster
    assert s is not None and b.stats().cluster is not None
    assert s.member == a.cluster.members.member and s.lease_s == LEASE_S
    assert s.live_members == sorted([a.cluster.members.member, b.cluster.members.member])
    assert s.parts == PARTS and s.parts_owned + b.stats().cluster.parts_owned == PARTS  # type: ignore[union-attr]
    assert s.parts_evictable == s.parts_owned and not s.fenced
    assert s.capacity_share_bytes == int(capacity * s.parts_owned / PARTS)
    mine = [k for k in written if a.cluster.ledger.owned[part_of(k)]]
    assert s.owned_files == len(mine) and s.owned_bytes == len(mine) * file_bytes() and s.foreign_files == 0
    assert s.renewals >= 3 and s.listings >= 3 and s.renew_failures == s.list_failures == 0
    assert s.passes == 3 and s.pass_failures == 0  # at its start, in settle, and this one
    assert s.last_pass_age_s == 0.0 and s.last_pass_s == 0.0  # the story's clock stood still during it
    assert s.last_pass_dirs_statted >= len({part_of(k) for k in mine})
    assert s.last_pass_dirs_listed >= 1 and s.last_pass_files_statted == s.last_pass_added == len(mine)
    assert s.members_expired == s.leases_reaped == 0

    waited = 0.0
    while not a.cluster.ledger.evictable.all():  # B goes silent: A sees it expire, takes its parts, reaps its lease
        step([a], clock)
        waited += TIMING.renew_s
        assert waited <= TIMING.takeover_s
    step([a], clock, TIMING.hold_s)
    s = a.stats().cluster
    assert s is not None and s.live_members == [a.cluster.members.member] and s.parts_owned == PARTS
    assert s.members_expired == 1 and s.leases_reaped == 1  # A owns part 0 now: it reaps
    assert s.last_pass_age_s == clock() - a.cluster.last_pass[2]  # type: ignore[index]
    assert b.stats().cluster.fenced  # type: ignore[union-attr]
