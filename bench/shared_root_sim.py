"""A cost model of one storage root shared by many nodes: today's design beside the proposed one
(issue 36), at 4 / 64 / 256 nodes and 1 / 10 / 100 million files, calibrated with per-operation
costs measured on GlusterFS and MooseFS (`bench.netfs_ops`), plus a seeded simulation of the
proposed membership and lease protocol under joins, leaves, kills, stalls, clock skew and
listing lag.

    python -m bench.shared_root_sim [--costs costs.json] [--fs glusterfs|moosefs|all] [--seed 0] [--json]

Pure Python, no file system touched, a second or two.

Today (src/hpkv/storage/rescan.py, index.py): every node indexes every file of the root
(155 MiB of server memory per million files, `bench.index_costs`) and walks the whole root every
max(30 s, 10x the last walk): it lists each `<ns>/<ab>/<cd>` leaf directory and `lstat`s each
file. A lookup that misses its index stats the file by name (one round trip; no negative
cache). Each node learns the others' writes for the capacity at its next walk.

The proposed design
===================
Parts. The key space is split into PARTS = 65,536 parts, one per leaf directory name
`<ab>/<cd>` (the first two bytes of the key, across all namespaces): the layout already files
keys so, and a part's files are found by listing its leaf directory in each namespace, nothing
else. Keys are hashes, so parts hold equal shares of the files and of the writes.

Membership. `<root>/cluster/members/` holds one lease file per running server, named
`<member>.<seq>`: `<member>` is the host name and a random incarnation drawn at start (a restarted
server is a new member; two nodes with one host name stay apart). The server renews it every
RENEW_S by renaming it to `<member>.<seq+1>` (one metadata operation), and lists the directory
every RENEW_S (one listing of N names; a member's highest seq counts, as a listing may show a
renamed lease under both names for a moment). A member is live, in an observer's view, while the
observer has seen its name change within EXPIRE_S of its own monotonic clock, or first saw it
less than EXPIRE_S ago. Nothing compares clocks across nodes: skewed or stepped wall clocks do not
matter, only each node's monotonic rate (drift of 1e-4 is 3 ms in 30 s). A server that stops
removes its lease (a graceful leave); the lease of a member expired for EXPIRE_S + HOLD_S is
removed by the live member that owns part 0.

Ownership. A part belongs to the live member of highest rendezvous weight hash(member, part)
(HRW: a join or a death moves only the parts that member gains or had, 1/N of them, spread over
all the others; computed for 65,536 parts at each change of a node's view, vectorized: numpy
is a dependency already). Each node computes owners from its own view; views differ for at most
RENEW_S + MAX_LAG_S after a change. Rules that keep two nodes from evicting one part at once:
- a node evicts in a part only once the part has been its own, in its view, for HOLD_S
  (FRESH_S + MAX_LAG_S + BATCH_S + margin): by then the previous owner has seen the change
  (it lists at least every FRESH_S, and a listing lags by at most MAX_LAG_S) and stopped;
- a node stops evicting a part as soon as its view gives it to another;
- a node evicts nothing while its last successful renewal started more than EXPIRE_S ago, or
  its last successful listing more than FRESH_S ago (by its monotonic clock; a stalled or
  partitioned node fences itself before the others can declare it dead); after such a gap it
  counts HOLD_S again;
- each eviction batch checks ownership first and unlinks for at most BATCH_S.
A node killed -9: its parts have a new evicting owner within TAKEOVER_BOUND_S = MAX_LAG_S +
2 x RENEW_S + EXPIRE_S + HOLD_S (72 s), plus the walk of that part (1/(N-1) of the dead node's share
per node).

Capacity and usage. `HPKV_KV_STORAGE_SIZE` C is for the root (as today); the first server
writes it with PARTS to `<root>/cluster/config` (O_EXCL), and a server started with another
setting says so and uses the file's. A node's quota is C x (parts it owns) / PARTS, and it runs
one LRU over the files of its parts (a share of M/N files: the same order as a global LRU to
within 1/sqrt(M/N)). Only the owner unlinks in its parts (`hpkv clear` aside), so its index goes
stale only by the others' new files, which it learns by a pass over its parts every max(30 s,
10x the pass): a `stat` of each leaf directory, a listing of those whose mtime changed since it
listed them (and of every one at least every RELIST_S: a change within the mtime's granularity,
a clear), an `lstat` of each name it does not index (`owner_pass`); it counts its own writes at
once. A file's mtime, which readers on every node refresh at most once a minute, is looked at
before it is evicted, as today. Usage is kept per part: after each pass or eviction the owner
writes `<root>/cluster/usage/<member>` (bytes, files and LRU
horizon of each part it owns; one file per owner rather than 65,536), which a new owner reads at
takeover (it can evict files older than the horizon while its first pass runs) and `hpkv status`
sums. `hpkv clear --storage` on any node bumps `<root>/cluster/epoch`, which each owner stats
once a pass: a new epoch drops its index and lists its parts again.

Lookups. A lookup of a key outside the node's index stats the file by name, as today; a miss is
remembered for NEG_S in a bounded negative cache (NEG_ENTRIES), so a prefix missed by many
requests costs one round trip per NEG_S, not one per request (GlusterFS's client caches no
negative entry: each repeat is a ~0.1-0.5 ms round trip). A file another node wrote is read where
it stands, never indexed by a non-owner: index memory is the node's share.

Built (src/hpkv/storage/: members.py, parts.py, owner_pass.py, usage.py, cluster.py, and the miss
cache in reading.py) as described here, with these details the model counts: a pass lists each
namespace's first level (`<ab>`, 256 names) and `stat`s only the leaf directories of its parts
under those there are; it `stat`s the epoch file and writes its usage file once a pass; and a
node's index keeps, besides its parts' files, at most MAX_FOREIGN_FILES files of others' parts
that it wrote or read (forgotten, never unlinked, past that: a lookup finds them by name); a
leaf directory whose mtime changed is listed again at the next pass (at least MAX_LAG_S later)
before that mtime is trusted, so a listing that lagged, or a change within the mtime's
granularity, is not missed until RELIST_S.
`tests/test_shared_root_sim.py` checks that the constants here are the implementation's.

What it tolerates: joins and graceful leaves (parts move after HOLD_S; no eviction meanwhile),
kills and stalls (takeover within TAKEOVER_BOUND_S; the stalled node fences itself), wall clocks
that disagree by any amount, listings and attributes that lag by up to MAX_LAG_S (the tested
file systems: ~1 s), a metadata server slow enough that renewals fail (the node fences itself).
What it guarantees: at most one node evicts a part at a time, provided no node's process stalls
longer than HOLD_S - FRESH_S - MAX_LAG_S between an ownership check and its unlinks, and no
listing lags more than MAX_LAG_S; no file evicted twice regardless (an unlink succeeds once; only
a successful unlink counts as freed); no file leaked (every part has an evicting owner within
TAKEOVER_BOUND_S of any change while one node lives; temporaries older than an hour are removed
by the part's owner); the root holds at most C plus the writes no owner has passed over yet
(the other nodes' write rate x the owner's pass period) plus a dead node's share of the writes
during its takeover.
What it costs per node: memory and pass operations in proportion to its share (M/N, times
HRW's imbalance: 1.01 at 4 nodes, ~1.2 at 256 with 65,536 parts); per RENEW_S one rename and one
listing of N names (the one term that grows with the nodes: 256 names every 10 s); and its own
traffic.

The model's traffic per node (`Traffic`, documented defaults): writes of new files, lookups that
find another node's file, lookups of keys no node has (a share of them repeating a key missed
within NEG_S). Eviction costs one `stat` and one `unlink` per victim in both designs (the
cluster's write rate in all), so it is left out of the background figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
from dataclasses import asdict, dataclass, fields
from pathlib import Path

# Today's design: src/hpkv/storage/rescan.py (RESCAN_S, RESCAN_COST_FACTOR), layout.py (two fan-out
# levels of 256), and the storage index's resident memory (docs/benchmarks.md, bench.index_costs).
INDEX_MIB_PER_MILLION = 155.0
RESCAN_S = 30.0
RESCAN_COST_FACTOR = 10.0
LEAF_DIRS = 1 << 16  # `<ab>/<cd>` directories per namespace
READDIR_BATCH = 64  # names one `getdents` returns through FUSE (4 KiB of ~64-byte records)

# The proposed design (see above).
PARTS = LEAF_DIRS
RENEW_S = 10.0
EXPIRE_S = 30.0
FRESH_S = 15.0
MAX_LAG_S = 2.0
BATCH_S = 1.0
HOLD_S = FRESH_S + MAX_LAG_S + BATCH_S + 2.0
TAKEOVER_BOUND_S = MAX_LAG_S + 2 * RENEW_S + EXPIRE_S + HOLD_S
NEG_S = 2.0
RELIST_S = 600.0  # an owner lists each leaf directory of its parts at least this often, changed or not
NEG_ENTRIES = 1 << 16
NEG_ENTRY_BYTES = 150  # a key of 36 bytes and its expiry in a dict
MAX_FOREIGN_FILES = 1 << 16  # files of others' parts a node keeps indexed (it wrote or read them lately)
FOREIGN_ENTRY_BYTES = INDEX_MIB_PER_MILLION * (1 << 20) / 1e6

NODES = (4, 64, 256)
FILES = (1_000_000, 10_000_000, 100_000_000)


@dataclass(frozen=True)
class Costs:
    """Seconds per operation through one client (`bench.netfs_ops` medians)."""

    create: float  # create, write 4 KiB, fsync, rename
    rename: float
    stat_hit: float
    stat_miss: float
    readdir_entry: float  # per file: its share of a listing (names only)
    walk_entry: float  # per file: its share of the listing and its `lstat`
    dir_list: float  # per leaf directory: open and list
    unlink: float
    lag_new: float  # a new name renamed into place on one client until another's `stat` finds it
    lag_attr: float  # a replacement, an unlink or an mtime until another client sees it


# `flock /tmp/hpkv-engine.lock python -m bench.netfs_ops` on this machine (2 cores, shared by other
# helpers; 500 files, 5 trials; commit 00983b3): medians, in seconds. Other runs that day moved
# GlusterFS's round trips by up to 2-3x (stat 130-600 us). `--costs` takes a fresh run's JSON.
# That run's walk check (2,000 files, spread over ~1,970 leaf directories / packed into 16): the
# tier's walk took 2.26 / 0.11 s on GlusterFS, 0.52 / 0.04 s on MooseFS; the model says 0.61x /
# 0.65x and 0.90x / 0.72x of that (it leaves out the `<ab>` level's 256 directories and the
# tier's own work per file): today's figures on GlusterFS are, if anything, optimistic.
DEFAULT_COSTS = {
    "local": Costs(198e-6, 17e-6, 6.3e-6, 10.3e-6, 0.8e-6, 3.9e-6, 15.2e-6, 92e-6, 14e-6, 26e-6),
    "glusterfs": Costs(3.46e-3, 843e-6, 215e-6, 90e-6, 26.6e-6, 28.5e-6, 672e-6, 985e-6, 376e-6, 1.003),
    "moosefs": Costs(878e-6, 237e-6, 129e-6, 115e-6, 1.0e-6, 14.1e-6, 221e-6, 135e-6, 84e-6, 533e-6),
}


def walk_checks(path: Path) -> list[str]:
    """The model's walk time against the tier's walk `bench.netfs_ops --walk-files` measured, one
    line per file system and layout: files x walk_entry + leaf directories x dir_list."""
    doc = json.loads(path.read_text())
    costs = load_costs(path)
    lines = []
    for fs, checks in doc.get("walks", {}).items():
        for c in checks:
            model, _ = walk(c["files"], c["dirs"], costs[fs])
            lines.append(
                f"{fs}, {c['layout']}: {c['files']:.0f} files in {c['dirs']:.0f} leaf directories walked in "
                f"{c['seconds']:.2f} s, the model says {model:.2f} s ({model / c['seconds']:.2f}x)"
            )
    return lines


def load_costs(path: Path) -> dict[str, Costs]:
    """The file systems of a `bench.netfs_ops --out` JSON, as Costs."""
    doc = json.loads(path.read_text())
    out = {}
    for name, ops in doc["fs"].items():
        med = {op: v["median"] * 1e-6 for op, v in ops.items()}
        out[name] = Costs(
            create=med["create_fsync_rename"],
            rename=med["rename"],
            stat_hit=med["stat_hit"],
            stat_miss=med["stat_miss"],
            readdir_entry=med["readdir_entry"],
            walk_entry=med["walk_entry"],
            dir_list=med.get("dir_list", DEFAULT_COSTS.get(name, DEFAULT_COSTS["glusterfs"]).dir_list),
            unlink=med["unlink"],
            lag_new=med["lag_new"],
            lag_attr=max(med["lag_replace"], med["lag_unlink"], med["lag_mtime"]),
        )
    return out


@dataclass(frozen=True)
class Traffic:
    """One node's own traffic (assumed, the same in both designs)."""

    writes_per_s: float = 20.0  # new KV files
    finds_per_s: float = 20.0  # lookups that find another node's file by name
    misses_per_s: float = 50.0  # lookups of keys no node has
    repeat_miss_fraction: float = 0.5  # of those, keys missed within NEG_S before
    namespaces: int = 1


@dataclass
class Row:
    design: str
    fs: str
    nodes: int
    files: int
    index_mib: float  # per node (the most loaded one)
    walk_s: float  # one walk of the root (today), one pass over its parts (proposed)
    walk_every_s: float
    bg_ops_per_node: float  # background metadata operations per second (most loaded node)
    member_ops_per_node: float  # of which membership (leases)
    bg_ops_total: float
    traffic_ops_per_node: float  # its own traffic's metadata operations per second
    lookup_learns_s: float  # until a lookup on another node finds a new file (worst)
    capacity_learns_s: float  # until the capacity counts another node's write (worst)
    overshoot: float  # bytes over the capacity, as a fraction of it (worst)


def occupied(files: float, dirs: int) -> float:
    """Leaf directories holding at least one of `files` spread at random over `dirs`."""
    return dirs * -math.expm1(-files / dirs)


def walk(files: float, dirs: float, costs: Costs) -> tuple[float, float]:
    """(seconds, metadata operations) of one walk: open and list each leaf directory (open,
    readdir calls, release), `lstat` each file."""
    seconds = files * costs.walk_entry + dirs * costs.dir_list
    ops = files + dirs * 3 + files / READDIR_BATCH
    return seconds, ops


def traffic_ops(traffic: Traffic, negative_cache: bool) -> float:
    """Metadata operations per second of a node's own traffic: a write's create and rename, a
    find's `stat`, a miss's `stat` (not a repeat, with the negative cache)."""
    misses = traffic.misses_per_s * ((1 - traffic.repeat_miss_fraction) if negative_cache else 1)
    return traffic.writes_per_s * 2 + traffic.finds_per_s + misses


def today(fs: str, nodes: int, files: int, costs: Costs, traffic: Traffic) -> Row:
    dirs = occupied(files, LEAF_DIRS * traffic.namespaces)
    walk_s, walk_ops = walk(files, dirs, costs)
    every = max(RESCAN_S, RESCAN_COST_FACTOR * walk_s)
    learns = every + walk_s  # written just behind the walk's pass: counted at the end of the next
    others_per_s = traffic.writes_per_s * (nodes - 1)
    return Row(
        "today",
        fs,
        nodes,
        files,
        index_mib=files / 1e6 * INDEX_MIB_PER_MILLION,
        walk_s=walk_s,
        walk_every_s=every,
        bg_ops_per_node=walk_ops / every,
        member_ops_per_node=0.0,
        bg_ops_total=nodes * walk_ops / every,
        traffic_ops_per_node=traffic_ops(traffic, negative_cache=False),
        lookup_learns_s=costs.lag_new,
        capacity_learns_s=learns,
        overshoot=others_per_s * learns / files,
    )


def part_loads(nodes: int, seed: int, parts: int = PARTS) -> list[int]:
    """Parts per node under rendezvous hashing: each part's owner is, for a good hash, a uniform
    and independent choice among the nodes (the multinomial HRW gives; `hrw_owner` is the rule)."""
    rng = random.Random(seed * 1_000_003 + nodes)
    loads = [0] * nodes
    for _ in range(parts):
        loads[rng.randrange(nodes)] += 1
    return loads


def member_ops(nodes: int) -> float:
    """Membership operations per second per node: a renewal (one rename) and a listing of the
    members' directory (open, readdir calls, release) every RENEW_S."""
    return (1 + 2 + math.ceil(nodes / READDIR_BATCH)) / RENEW_S


def owner_pass(files: float, dirs: float, new_per_s: float, costs: Costs) -> tuple[float, float, float]:
    """(seconds, metadata operations, period) of an owner's pass over its parts, repeated every
    max(RESCAN_S, RESCAN_COST_FACTOR x its duration): a `stat` of each leaf directory; a listing
    (open, readdir calls, release) of those whose mtime changed since it last listed them (each
    such directory listed again at the next pass before its mtime is trusted), and of every one
    at least every RELIST_S; an `lstat` of each name it does not index (the others' new
    files, `new_per_s` of them)."""
    period = RESCAN_S
    for _ in range(50):  # the period and what changes in it depend on each other: to their fixed point
        per_dir = new_per_s * period / max(dirs, 1.0)
        listed = dirs * min(1.0, 2 * -math.expm1(-per_dir) + period / RELIST_S)  # a change: listed twice
        entries = files * listed / max(dirs, 1.0)
        new = new_per_s * period
        seconds = dirs * costs.stat_hit + listed * costs.dir_list + entries * costs.readdir_entry + new * costs.stat_hit
        ops = dirs + listed * 2 + entries / READDIR_BATCH + new
        period = max(RESCAN_S, RESCAN_COST_FACTOR * seconds)
    return seconds, ops, period


def traffic_index_mib(traffic: Traffic) -> float:
    """A node's index memory besides its share: the miss cache, and at most MAX_FOREIGN_FILES
    files of others' parts it wrote or read (its own traffic fills it)."""
    neg = min(NEG_ENTRIES, traffic.misses_per_s * NEG_S) * NEG_ENTRY_BYTES / (1 << 20)
    return neg + MAX_FOREIGN_FILES * FOREIGN_ENTRY_BYTES / (1 << 20)


def proposed(fs: str, nodes: int, files: int, costs: Costs, traffic: Traffic, loads: list[int]) -> Row:
    dirs_all = occupied(files, LEAF_DIRS * traffic.namespaces)
    writes_per_s = traffic.writes_per_s * nodes

    def node(load: int) -> tuple[float, float, float]:
        """(pass seconds, pass period, background ops/s) of a node owning `load` parts."""
        share = load / PARTS
        pass_s, pass_ops, every = owner_pass(files * share, dirs_all * share, writes_per_s * share, costs)
        usage_ops = 5 / every  # its usage file (the directory made if missing, opened; create, rename), once a pass
        root_ops = 2 / every  # the root listed for its namespaces, once a pass
        epoch_ops = 3 / every  # the clear epoch's `stat` (and its directory's open), once a pass
        tops_ops = traffic.namespaces * (2 + math.ceil(256 / READDIR_BATCH)) / every  # each `<ns>` listed
        return pass_s, every, pass_ops / every + root_ops + usage_ops + epoch_ops + tops_ops + member_ops(nodes)

    pass_s, every, bg = node(max(loads))
    most = max(loads) / PARTS
    learns = every + pass_s + costs.lag_attr  # a directory's new mtime shows after the attribute lag
    takeover_s = TAKEOVER_BOUND_S + pass_s / max(1, nodes - 1)
    over = writes_per_s * (nodes - 1) / nodes * learns + writes_per_s * most * takeover_s
    return Row(
        "proposed",
        fs,
        nodes,
        files,
        index_mib=files * most / 1e6 * INDEX_MIB_PER_MILLION + traffic_index_mib(traffic),
        walk_s=pass_s,
        walk_every_s=every,
        bg_ops_per_node=bg,
        member_ops_per_node=member_ops(nodes),
        bg_ops_total=sum(node(load)[2] for load in loads),
        traffic_ops_per_node=traffic_ops(traffic, negative_cache=True),
        lookup_learns_s=costs.lag_new + NEG_S,
        capacity_learns_s=learns,
        overshoot=over / files,
    )


def table_rows(costs: dict[str, Costs], traffic: Traffic, seed: int) -> list[Row]:
    rows = []
    for fs, c in costs.items():
        for nodes in NODES:
            loads = part_loads(nodes, seed)
            for files in FILES:
                rows.append(today(fs, nodes, files, c, traffic))
                rows.append(proposed(fs, nodes, files, c, traffic, loads))
    return rows


def _duration(s: float) -> str:
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def markdown(rows: list[Row]) -> str:
    head = (
        "| fs | design | nodes | files | index MiB/node | walk or pass (every) | background ops/s per node (leases) "
        "| ops/s total | lookup sees a write | capacity counts it | overshoot |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r.fs} | {r.design} | {r.nodes} | {r.files / 1e6:g} M | {r.index_mib:,.0f} | "
            f"{_duration(r.walk_s)} ({_duration(r.walk_every_s)}) | {r.bg_ops_per_node:,.0f} "
            f"({r.member_ops_per_node:.1f}) | {r.bg_ops_total:,.0f} | {_duration(r.lookup_learns_s)} | "
            f"{_duration(r.capacity_learns_s)} | {r.overshoot:.1%} |"
        )
    return "\n".join(lines)


# -- the membership and lease protocol, simulated -------------------------------------------------

MASK = (1 << 64) - 1


def mix(x: int) -> int:
    """splitmix64's finalizer: the rendezvous weight's hash."""
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def hrw_owner(members: list[int], part: int) -> int:
    """The member of highest weight for `part` (rendezvous hashing)."""
    return max(members, key=lambda m: mix(mix(m) ^ part))


@functools.lru_cache(maxsize=256)
def _owners(live: tuple[int, ...], parts: int) -> tuple[int, ...]:
    """Each part's owner among `live` (views repeat: computed once per view)."""
    return tuple(hrw_owner(list(live), p) for p in range(parts))


@dataclass
class _Node:
    id: int
    offset: float  # its wall clock's error: never used by the protocol, kept to show it
    rate: float  # its monotonic clock's rate
    seq: int = 0
    last_renew: float = -math.inf  # local times
    last_list: float = -math.inf
    stalled_until: float = 0.0
    alive: bool = True
    seen: dict[int, tuple[int, float]] | None = None  # member -> (seq seen, local time it changed)
    dropped: dict[int, tuple[int, float]] | None = None  # members expired in its view -> (seq, local time)
    own_since: dict[int, float] | None = None  # part -> local time it became its own
    evicting: frozenset[int] = frozenset()

    def local(self, t: float) -> float:
        return t * self.rate


@dataclass
class ProtocolResult:
    max_evictors: int  # most nodes evicting one part at once (the design: 1)
    longest_unowned_s: float  # longest a part had no evicting node while one lived, after start-up
    bound_s: float  # TAKEOVER_BOUND_S, as simulated
    steps: int


def simulate_protocol(
    seed: int = 0,
    nodes: int = 12,
    parts: int = 256,
    duration_s: float = 600.0,
    dt: float = 0.1,
    hold_s: float = HOLD_S,
    max_lag_s: float = MAX_LAG_S,
    fence: bool = True,
) -> ProtocolResult:
    """Run the membership rules (module docstring) on `nodes` servers and `parts` parts through a
    join, a graceful leave, a kill, a stall past EXPIRE_S, a stall under FRESH_S, two kills at
    once and two joins, with wall clocks up to an hour apart, monotonic rates 1 +- 1e-4 and every
    listing lagging uniformly up to `max_lag_s`. Counts, every `dt`, the nodes evicting each part.
    `hold_s` and `fence` (False: a node goes on evicting after a stall) are there to show that the
    rules are what keeps a part to one node."""
    rng = random.Random(seed)
    history: dict[int, list[tuple[float, int | None]]] = {}  # member -> (true time, seq or None: removed)
    members: dict[int, _Node] = {}
    events: list[tuple[float, str, int, float]] = [(rng.uniform(0, 5), "join", i, 0.0) for i in range(nodes)]
    events += [
        (100.0, "join", nodes, 0.0),
        (160.0, "leave", 3, 0.0),
        (220.0, "kill", 5, 0.0),
        (300.0, "stall", 7, EXPIRE_S * 1.5),
        (330.0, "stall", 8, FRESH_S * 0.8),
        (400.0, "kill", 1, 0.0),
        (400.0, "kill", 2, 0.0),
        (460.0, "join", nodes + 1, 0.0),
        (462.0, "join", nodes + 2, 0.0),
    ]
    events.sort()
    ids = {i: rng.getrandbits(63) for i in range(nodes + 3)}
    last_evicted = [0.0] * parts
    longest, most, steps, t = 0.0, 0, 0, 0.0
    settled_s = 5 + hold_s + 2 * RENEW_S
    while t < duration_s:
        while events and events[0][0] <= t:
            _, kind, i, arg = events.pop(0)
            if kind == "join":
                members[i] = _Node(ids[i], rng.uniform(-3600, 3600), 1 + rng.uniform(-1e-4, 1e-4), seen={}, dropped={})
                members[i].own_since = {}
            elif kind == "leave":
                members[i].alive = False
                history[ids[i]].append((t, None))  # it removes its lease, having stopped evicting
            elif kind == "kill":
                members[i].alive = False
            else:
                members[i].stalled_until = t + arg
        acting = [n for n in members.values() if n.alive and n.stalled_until <= t]
        for node in acting:
            _act(node, t, rng, history, parts, hold_s, max_lag_s, fence)
        count = [0] * parts
        for node in acting:
            for p in node.evicting:
                count[p] += 1
        most = max(most, max(count))
        for p in range(parts):
            if count[p] or not acting:
                last_evicted[p] = t
            elif t > settled_s:
                longest = max(longest, t - last_evicted[p])
        t += dt
        steps += 1
    return ProtocolResult(most, longest, TAKEOVER_BOUND_S - HOLD_S + hold_s, steps)


def _listing(history: dict[int, list[tuple[float, int | None]]], at: float) -> dict[int, int]:
    """The lease names a listing shows as of true time `at`: member -> seq."""
    out = {}
    for member, changes in history.items():
        seq = None
        for when, s in changes:
            if when > at:
                break
            seq = s
        if seq is not None:
            out[member] = seq
    return out


def _act(
    node: _Node, t: float, rng: random.Random, history, parts: int, hold_s: float, max_lag_s: float, fence: bool
) -> None:
    """One step of a running node: fence, renew, list, own, evict (the module docstring's rules)."""
    assert node.seen is not None and node.own_since is not None and node.dropped is not None
    now = node.local(t)
    if fence and (now - node.last_renew >= EXPIRE_S or now - node.last_list >= FRESH_S):
        node.own_since.clear()  # fenced: a stall, or a first step; HOLD_S counts again
    if now - node.last_renew >= RENEW_S:
        node.seq += 1
        history.setdefault(node.id, []).append((t, node.seq))
        node.last_renew = now
    if now - node.last_list >= RENEW_S:
        listed = _listing(history, t - rng.uniform(0, max_lag_s))
        for member, seq in listed.items():
            if member in node.dropped:
                if node.dropped[member][0] == seq:
                    continue  # the lease it expired, unchanged: still dead
                del node.dropped[member]  # renewed since: back (a stall ended; it fenced itself)
            if node.seen.get(member, (None,))[0] != seq:
                node.seen[member] = (seq, now)
        for member in [m for m in node.seen if m not in listed and m != node.id]:
            del node.seen[member]  # a lease removed: the member left
        for member in [m for m in node.dropped if m not in listed]:
            del node.dropped[member]
        for member in [m for m, (_, since) in node.seen.items() if now - since > EXPIRE_S and m != node.id]:
            node.dropped[member] = (node.seen.pop(member)[0], now)  # expired: dead, or stalled and fenced
        node.seen[node.id] = (node.seq, now)
        node.last_list = now
        mine = {p for p, owner in enumerate(_owners(tuple(sorted(node.seen)), parts)) if owner == node.id}
        for p in [p for p in node.own_since if p not in mine]:
            del node.own_since[p]
        for p in mine:
            node.own_since.setdefault(p, now)
        if 0 in mine:  # the owner of part 0 removes leases expired for EXPIRE_S + HOLD_S
            for member, (seq, when) in node.dropped.items():
                if now - when >= hold_s and listed.get(member) == seq:
                    history[member].append((t, None))
    fenced = fence and (now - node.last_renew >= EXPIRE_S or now - node.last_list >= FRESH_S)
    node.evicting = frozenset() if fenced else frozenset(p for p, s in node.own_since.items() if now - s >= hold_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--costs", type=Path, help="a `bench.netfs_ops --out` JSON (default: the figures above)")
    parser.add_argument("--fs", default="glusterfs,moosefs", help="file systems of the costs, comma-separated, or all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    for f in fields(Traffic):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = parser.parse_args()
    costs = load_costs(args.costs) if args.costs else dict(DEFAULT_COSTS)
    if args.fs != "all":
        costs = {fs: costs[fs] for fs in args.fs.split(",")}
    traffic = Traffic(**{f.name: getattr(args, f.name) for f in fields(Traffic)})
    rows = table_rows(costs, traffic, args.seed)
    protocol = simulate_protocol(args.seed)
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "protocol": asdict(protocol)}, indent=1))
        return
    print(markdown(rows))
    for line in walk_checks(args.costs) if args.costs else []:
        print(f"\ncheck: {line}")
    print(
        f"\nprotocol (seed {args.seed}): at most {protocol.max_evictors} node(s) evicting a part at once; "
        f"longest a part went without an evicting node {protocol.longest_unowned_s:.1f} s "
        f"(bound {protocol.bound_s:.0f} s)"
    )


if __name__ == "__main__":
    main()
