"""`hpkv doctor`'s checks of a storage root shared as a cluster (HPKV_KV_STORAGE_CLUSTER,
`storage/cluster.py`): this node in it, as its running server sees it (its lease, the members it
sees, its parts, its pass, its usage against its share of the capacity), and the whole root as
the owners' usage files under `<path>/cluster/` add up, read without a server too.

Primitives: `check_storage_cluster(storage, server)` -> a list of checks (none where the root has
no `cluster` directory and the server shares none).
Must not know: how checks are shown; how the cluster judges members or owners (it reads what
the server and the files say).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from ..config import StorageConfig
from ..stats import ServerStats, StorageClusterStats
from ..status import human_bytes, human_duration
from ..storage import tree
from ..storage.cluster import RESCAN_COST_FACTOR, RESCAN_S
from ..storage.fileio import FileIO
from ..storage.parts import PARTS
from ..storage.usage import ClusterFiles
from .check import Check, ServerProbe, Verdict

OVER_SHARE = 1.1  # a node's parts holding more than this times its share: its eviction is behind
LATE_PASSES = 3  # a pass this many periods late (RESCAN_S, or ten times the last pass) is stuck


def check_storage_cluster(storage: StorageConfig, server: ServerProbe) -> list[Check]:
    stats = server.stats
    running = stats.storage.cluster if stats is not None and stats.storage is not None else None
    checks = [] if stats is None or running is None else [_node(stats, running)]
    root = _root(Path(storage.path), running)
    return checks + ([root] if root is not None else [])


def _node(stats: ServerStats, c: StorageClusterStats) -> Check:
    name = "storage cluster: this node"
    share = c.parts_owned / c.parts if c.parts else 0.0
    detail = (
        f"the running server (pid {stats.server.pid}) is member {c.member} of {len(c.live_members)} live; it owns "
        f"{c.parts_owned} of {c.parts} parts ({share:.1%}), whose files take {human_bytes(c.owned_bytes)} of its "
        f"share {human_bytes(c.capacity_share_bytes)} of the capacity; {_pass(c)}"
    )
    if c.fenced:
        return Check(
            name,
            Verdict.WARN,
            f"{detail}; it is FENCED: its last renewal of its lease, or listing of the members, is too old "
            f"(lease {c.lease_s:g} s), so it evicts nothing and the others may take its parts",
            "see the server's log for why renewals fail (the shared file system slow or unreachable from "
            "this node); it comes back by itself once they succeed",
        )
    if c.last_renew_age_s is not None and c.last_renew_age_s > c.lease_s / 2:
        return Check(
            name,
            Verdict.WARN,
            f"{detail}; its lease was last renewed {human_duration(c.last_renew_age_s)} ago (every "
            f"{c.lease_s / 3:g} s is due): at {c.lease_s:g} s the others count it dead",
            "see the server's log; check that the shared file system answers from this node",
        )
    late_s = LATE_PASSES * max(RESCAN_S, RESCAN_COST_FACTOR * (c.last_pass_s or 0.0)) + c.lease_s
    if c.last_pass_age_s is not None and c.last_pass_age_s > late_s:
        return Check(
            name,
            Verdict.WARN,
            f"{detail}; no pass has ended for {human_duration(c.last_pass_age_s)}: files other nodes write in its "
            "parts are not counted, nor evicted, meanwhile",
            "see the server's log for the pass that failed or hangs (the shared file system)",
        )
    if c.capacity_share_bytes and c.owned_bytes > OVER_SHARE * c.capacity_share_bytes:
        return Check(
            name,
            Verdict.WARN,
            f"{detail}: more than its share, so its eviction is behind (parts it gained are evicted in only "
            "after the hold, about 20 s)",
            "run hpkv doctor again in a minute; if it stays over, see the server's log",
        )
    return Check(name, Verdict.OK, detail)


def _pass(c: StorageClusterStats) -> str:
    if c.last_pass_age_s is None or c.last_pass_s is None:
        return f"no pass over its parts has ended yet ({c.pass_failures} failed)"
    return (
        f"its last pass over them ended {human_duration(c.last_pass_age_s)} ago and took {c.last_pass_s:.1f} s "
        f"({c.last_pass_dirs_statted} leaf directories looked at, {c.last_pass_dirs_listed} listed; "
        f"{c.pass_failures} of {c.passes + c.pass_failures} passes failed)"
    )


def _root(path: Path, running: StorageClusterStats | None) -> Check | None:
    """The owners' usage files summed against the capacity in `cluster/config`; None where the
    root has no `cluster` directory (never shared as a cluster) and the server shares none."""
    name = "storage cluster: the whole root"
    root = tree.Root(str(path))
    files = ClusterFiles(root, FileIO(), None, create=False)
    try:
        capacity = files.agreed_capacity()
        total = files.total_usage()
        leases = files.members()
    except FileNotFoundError:
        if running is None:
            return None
        return Check(name, Verdict.INFO, f"no owner has written its usage under {path}/cluster yet")
    except OSError as exc:
        return Check(name, Verdict.WARN, f"cannot read {path}/cluster: {exc.strerror}", "see its permissions")
    finally:
        with contextlib.suppress(OSError):
            root.close()
    detail = (
        f"{leases} leases in {path}/cluster/members; the usage files of {total['owners']} owners cover "
        f"{total['parts']} of {PARTS} parts and add up to {human_bytes(total['bytes'])} in {total['files']} files"
    )
    if capacity:
        detail += f", {total['bytes'] / capacity:.1%} of the capacity the nodes share ({human_bytes(capacity)})"
    if total["parts"] != PARTS:
        detail += (
            " (owners write theirs after each pass, and a dead member's stays until its lease is reaped: "
            "right after a join or a death they do not add up to every part once)"
        )
    if capacity and total["bytes"] > OVER_SHARE * capacity:
        return Check(
            name,
            Verdict.WARN,
            f"{detail}: over the capacity",
            "run hpkv doctor again in a minute (owners evict at their next pass); if it stays over, see the "
            "servers' logs",
        )
    return Check(name, Verdict.OK if running is not None else Verdict.INFO, detail)
