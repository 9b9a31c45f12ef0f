"""The Prometheus families of HPKV's two kinds of cluster, from a stats snapshot: the cluster tier
(Mooncake Store, `hpkv_cluster_*`) and the storage root shared by a cluster of nodes
(HPKV_KV_STORAGE_CLUSTER, `hpkv_storage_cluster_*`). Each is exported whether it is on or not
(zeros), so one dashboard fits every server.

Primitives: `cluster_families(stats)`, `storage_cluster_families(stats)`.
Must not know: the store's internals beyond the fields of `hpkv.stats.ServerStats`.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..stats import ClusterStats, ServerStats, StorageClusterStats


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily("hpkv_" + name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily("hpkv_" + name, doc, value=value)


_CLUSTER_COUNTERS = (
    ("cluster_lookup_keys", "lookup_keys", "Keys the cluster tier was asked for (after DRAM misses)."),
    ("cluster_found_keys", "found_keys", "Keys the cluster tier held when asked."),
    ("cluster_hits", "hits", "Objects read from the cluster tier into the DRAM pool, verified (served as DRAM hits)."),
    ("cluster_misses", "misses", "Objects asked of the cluster tier and not read (gone, or the read failed)."),
    (
        "cluster_bad_objects",
        "bad_objects",
        "Objects read from the cluster tier that were not what they claimed (namespace, key, length, checksum): "
        "misses, removed.",
    ),
    ("cluster_objects_written", "objects_written", "Entries written through to the cluster tier."),
    ("cluster_written_bytes", "bytes_written", "Payload bytes written to the cluster tier."),
    ("cluster_read_bytes", "bytes_read", "Payload bytes read from the cluster tier."),
    (
        "cluster_write_dropped",
        "write_dropped",
        "Committed entries not written to the cluster tier: its queue was full.",
    ),
    ("cluster_errors", "errors", "Cluster tier calls or objects that failed for the cluster's sake."),
    ("cluster_timeouts", "timeouts", "Cluster tier lookups that waited all of HPKV_CLUSTER_TIMEOUT_S (misses)."),
    ("cluster_breaker_trips", "breaker_trips", "Times the cluster tier was skipped after failures in a row."),
)


def cluster_families(stats: ServerStats) -> Iterator[Metric]:
    """Exported whether the tier is on or not (zeros), so one dashboard fits every server."""
    cluster = stats.cluster if stats.cluster is not None else ClusterStats()
    yield _gauge(
        "cluster_enabled",
        "1 when the cluster tier is on (HPKV_CLUSTER_ENABLE) and usable.",
        int(stats.cluster is not None),
    )
    yield _gauge("cluster_reachable", "1 while the cluster tier's master answers.", int(cluster.reachable))
    yield _gauge(
        "cluster_breaker_open", "1 while the cluster tier is skipped after failures.", int(cluster.breaker_open)
    )
    yield _gauge("cluster_segment_bytes", "Memory this node contributes to the cluster tier.", cluster.segment_bytes)
    for name, field, doc in _CLUSTER_COUNTERS:
        yield _counter(name, doc, getattr(cluster, field))


# (metric name without hpkv_ and _total, StorageClusterStats field, help) of the storage cluster's counters.
_STORAGE_CLUSTER_COUNTERS = (
    ("storage_cluster_renewals", "renewals", "Renewals of this node's membership lease in the shared storage root."),
    (
        "storage_cluster_renew_failures",
        "renew_failures",
        "Renewals of this node's lease that failed (a lease's worth of them in a row fences the node).",
    ),
    (
        "storage_cluster_lease_remade",
        "lease_remade",
        "Times this node found its lease gone (reaped as dead while it stalled) and made it again.",
    ),
    ("storage_cluster_listings", "listings", "Listings of the members' leases."),
    ("storage_cluster_list_failures", "list_failures", "Listings of the members' leases that failed."),
    (
        "storage_cluster_members_expired",
        "members_expired",
        "Members this node saw go silent past the lease (their parts taken over).",
    ),
    ("storage_cluster_members_back", "members_back", "Expired members this node saw renewing again."),
    ("storage_cluster_leases_reaped", "leases_reaped", "Expired members' leases this node removed."),
    ("storage_cluster_passes", "passes", "Passes over this node's parts of the shared storage root."),
    ("storage_cluster_pass_failures", "pass_failures", "Passes over this node's parts that failed."),
)
# (metric name without hpkv_, field, help) of its gauges; no field: the live members counted.
_STORAGE_CLUSTER_GAUGES: tuple[tuple[str, str | None, str], ...] = (
    ("storage_cluster_live_members", None, "Members of the shared storage root live in this node's view."),
    ("storage_cluster_parts", "parts", "Parts of the key space in all."),
    ("storage_cluster_parts_owned", "parts_owned", "Parts this node owns (indexes and evicts in)."),
    (
        "storage_cluster_parts_evictable",
        "parts_evictable",
        "Parts this node may evict in now (owned for the hold, and not fenced).",
    ),
    ("storage_cluster_fenced", "fenced", "1 while this node evicts nothing: its lease or listing is too old."),
    (
        "storage_cluster_capacity_share_bytes",
        "capacity_share_bytes",
        "The root's capacity times this node's share of the parts: what it holds its parts to.",
    ),
    ("storage_cluster_owned_bytes", "owned_bytes", "Bytes of the files indexed in this node's parts."),
    ("storage_cluster_owned_files", "owned_files", "Files indexed in this node's parts."),
    ("storage_cluster_foreign_files", "foreign_files", "Files of other nodes' parts this node indexes."),
    (
        "storage_cluster_last_renew_age_seconds",
        "last_renew_age_s",
        "Seconds since this node last renewed its lease (-1: never).",
    ),
    (
        "storage_cluster_last_pass_age_seconds",
        "last_pass_age_s",
        "Seconds since this node's last pass over its parts ended (-1: none yet).",
    ),
    ("storage_cluster_last_pass_seconds", "last_pass_s", "How long this node's last pass took (-1: none yet)."),
    (
        "storage_cluster_last_pass_dirs_statted",
        "last_pass_dirs_statted",
        "Leaf directories of its parts the last pass looked at (one stat each).",
    ),
    (
        "storage_cluster_last_pass_dirs_listed",
        "last_pass_dirs_listed",
        "Leaf directories the last pass listed (changed since their last listing).",
    ),
    (
        "storage_cluster_last_pass_files_statted",
        "last_pass_files_statted",
        "Names the last pass looked up (found listed and not indexed).",
    ),
    (
        "storage_cluster_last_pass_gone",
        "last_pass_gone",
        "Indexed files the last pass found removed by others in this node's parts (forgotten).",
    ),
)


def storage_cluster_families(stats: ServerStats) -> Iterator[Metric]:
    """The shared storage root's cluster as this node sees it; zeros where it is off."""
    c = stats.storage.cluster if stats.storage is not None else None
    yield _gauge(
        "storage_cluster_enabled",
        "1 when this node's storage root is shared as a cluster (HPKV_KV_STORAGE_CLUSTER).",
        int(c is not None),
    )
    for name, field, doc in _STORAGE_CLUSTER_COUNTERS:
        yield _counter(name, doc, getattr(c, field) if c is not None else 0)
    for name, gauge_field, doc in _STORAGE_CLUSTER_GAUGES:
        yield _gauge(name, doc, _gauge_value(c, gauge_field))


def _gauge_value(c: StorageClusterStats | None, field: str | None) -> float:
    if c is None:
        return 0
    if field is None:
        return len(c.live_members)
    value = getattr(c, field)
    return -1 if value is None else float(value)
