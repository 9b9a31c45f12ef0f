"""Prometheus metrics of the HPKV Server, served over HTTP (loopback by default).

Pulled, not pushed: a custom collector reads `Server.stats()` on each scrape and turns the
snapshot into metric families, so no counter is kept twice. The one thing stats cannot give,
request latency, is a histogram fed by `observe(op, seconds)` from the request loop.

The HTTP server is `scrape.ScrapeServer`: bounded, so idle connections cost it no thread.
Primitives: `Metrics(server)`, `start(host, port)`, `observe(op, seconds)`, `stop()`.
Must not know: the store's internals beyond the fields of `hpkv.stats.ServerStats`.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, MetricsHandler, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..stats import DramStats, ServerStats, StorageStats
from .cluster_metrics import cluster_families, storage_cluster_families
from .scrape import POLL_S, ScrapeServer

log = logging.getLogger(__name__)

# Socket round trips take tens of microseconds; a lease wait or a storage clear may take seconds.
_LATENCY_BUCKETS_S = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
    60.0,
)
_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")

# (metric name without hpkv_ and _total, stats field, help) of the store's own counters.
_STORE_COUNTERS = (
    ("lookups", "lookups", "Lookup requests."),
    ("lookup_keys", "lookup_keys", "Keys asked for in lookup requests."),
    ("commits", "commits", "Entries published into the DRAM pool."),
    ("aborts", "aborts", "Reserved entries given back without being published."),
    ("reserve_skipped", "skipped_present", "Keys not reserved because they were held already or no slot was free."),
    ("leases", "leases", "Lease requests (readers pinning entries)."),
    ("promotions", "promotions", "Entries read from storage into the DRAM pool for a lease."),
    (
        "promotion_failures",
        "promotion_failures",
        "Promotions that failed (missing or bad file); the engine recomputes.",
    ),
    (
        "write_through_skipped",
        "write_through_skipped",
        "Write-throughs skipped because storage already held the entry.",
    ),
    (
        "write_through_deferred",
        "write_through_deferred",
        "Committed entries whose write-through waited unpinned: the backlog held half the pool.",
    ),
    (
        "write_through_lost",
        "write_through_lost",
        "Committed entries never written to storage: deferred ones that left DRAM before their turn, and "
        "those a stopping server gave up.",
    ),
)
_STORAGE_COUNTERS = (
    ("storage_reads", "reads", "Entry files read from storage."),
    ("storage_read_misses", "read_misses", "Storage reads that found no usable file."),
    ("storage_writes", "writes", "Entry files written to storage."),
    ("write_failures", "write_failures", "Storage writes dropped (I/O error or no space)."),
    ("checksum_failures", "bad_files", "Storage files that failed the length/header/checksum check and were deleted."),
    ("storage_space_errors", "space_errors", "ENOSPC/EDQUOT met while writing to storage."),
    (
        "storage_writes_over_budget",
        "over_budget",
        "Storage writes not made because HPKV_KV_STORAGE_WRITE_BUDGET was spent (the entry stayed in DRAM only).",
    ),
    ("storage_expired", "expired", "Storage files removed for being unused longer than HPKV_KV_STORAGE_RETENTION."),
    (
        "storage_stale_entries",
        "stale_entries",
        "Indexed storage files found gone (another server or node removed them): forgotten, misses from then on.",
    ),
)


def op_label(request_type: str) -> str:
    """`LeaseWait` -> `lease_wait`."""
    return _CAMEL.sub("_", request_type).lower()


class _StatsCollector:
    """Reads one stats snapshot per scrape."""

    def __init__(self, server) -> None:
        self._server = server

    def collect(self) -> Iterator[Metric]:
        stats = self._server.stats()
        yield from _store_families(stats)
        yield from _tier_families(stats)
        yield from _namespace_families(stats)
        yield from cluster_families(stats)
        yield from storage_cluster_families(stats)
        yield from _server_families(stats)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily("hpkv_" + name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily("hpkv_" + name, doc, value=value)


def _store_families(stats: ServerStats) -> Iterator[Metric]:
    store = stats.store
    for name, field, doc in _STORE_COUNTERS:
        yield _counter(name, doc, getattr(store, field))
    hits = CounterMetricFamily("hpkv_hit_keys", "Keys found by lookups, by the tier that held them.", labels=["tier"])
    hits.add_metric(["dram"], store.hit_keys_dram)
    hits.add_metric(["storage"], store.hit_keys_storage)
    yield hits
    if stats.storage is not None:
        yield from _storage_counters(stats.storage)
    writers = stats.writers
    if writers is not None:
        yield _gauge("write_processes", "Write-through processes running now.", writers.processes)
        yield _counter("write_process_deaths", "Write-through processes that died (each fails its job).", writers.died)
        yield _counter(
            "write_process_start_failures",
            "Write-through processes that could not start (their "
            "writes ran in the server process; another start is tried a minute later).",
            writers.start_failures,
        )
    yield _gauge("active_leases", "Leases held by readers now.", stats.leases)
    yield _gauge("active_reservations", "Entries reserved by writers and not yet committed.", stats.reservations)
    yield _gauge(
        "active_holds",
        "Holds of reservations waiting for an engine's scheduler to settle them "
        "(saves computed next to a load not yet known good).",
        stats.holds,
    )
    backlog = stats.write_backlog
    if backlog is not None:
        yield _gauge(
            "write_backlog_entries",
            "Committed entries waiting for their write-through to storage (each pins its DRAM slot until written).",
            backlog.entries,
        )
        yield _gauge(
            "write_backlog_bytes", "Payload bytes of the entries waiting for their write-through.", backlog.bytes
        )
        yield _gauge(
            "write_backlog_deferred",
            "Committed entries past the backlog's limit (half the pool), waiting unpinned for their write-through.",
            backlog.deferred,
        )


def _storage_counters(storage: StorageStats) -> Iterator[Metric]:
    for name, field, doc in _STORAGE_COUNTERS:
        yield _counter(name, doc, getattr(storage, field))
    if storage.write_budget_bytes is not None:
        yield _gauge(
            "storage_write_budget_bytes", "HPKV_KV_STORAGE_WRITE_BUDGET: bytes a day.", storage.write_budget_bytes
        )
        yield _gauge(
            "storage_write_budget_available_bytes",
            "Bytes the write budget allows now (it refills at the budget's rate, up to an hour's worth).",
            storage.write_budget_available_bytes or 0,
        )


def _tier_families(stats: ServerStats) -> Iterator[Metric]:
    tiers: dict[str, DramStats | StorageStats] = {"dram": stats.dram}
    if stats.storage is not None:
        tiers["storage"] = stats.storage
    families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
        "capacity_bytes": GaugeMetricFamily("hpkv_capacity_bytes", "Capacity of the tier.", labels=["tier"]),
        "used_bytes": GaugeMetricFamily("hpkv_used_bytes", "Bytes the tier's entries take.", labels=["tier"]),
        "num_entries": GaugeMetricFamily("hpkv_entries", "Entries held by the tier.", labels=["tier"]),
        "evictions": CounterMetricFamily("hpkv_evictions", "Entries evicted to make room.", labels=["tier"]),
    }
    for tier, values in tiers.items():
        for field, family in families.items():
            family.add_metric([tier], getattr(values, field))
    yield from families.values()
    # Only storage counts the bytes it moves; the DRAM tier keeps no byte counters (copies happen
    # in the clients, straight into the mapped pool).
    if stats.storage is not None:
        read = CounterMetricFamily("hpkv_read_bytes", "Bytes read from the tier.", labels=["tier"])
        read.add_metric(["storage"], stats.storage.read_bytes)
        written = CounterMetricFamily("hpkv_written_bytes", "Bytes written to the tier.", labels=["tier"])
        written.add_metric(["storage"], stats.storage.write_bytes)
        yield read
        yield written
        yield _gauge(
            "storage_index_ready",
            "1 once the start-up scan of the storage directory is done.",
            int(stats.storage.index_ready),
        )
    dram = stats.dram
    yield _gauge(
        "dram_locked_in_memory",
        "1 when the pool is locked in memory (mlock); a ramfs pool is never swapped and shows 0.",
        int(dram.locked_in_memory),
    )
    yield _gauge(
        "dram_ready_bytes",
        "Pool bytes with pages reserved (slots are handed out from these); the rest is reserved in the background.",
        dram.ready_bytes,
    )
    yield _gauge("dram_locked_bytes", "Pool bytes that cannot be swapped out (locked, or no swap).", dram.locked_bytes)
    yield _gauge("dram_free_slabs", "Pool slabs not yet given to any entry size.", dram.free_slabs)
    yield _counter("dram_slab_moves", "Slabs moved from one entry size to another.", dram.slab_moves)
    yield _counter("dram_reserve_failures", "Reservations that found no free or evictable slot.", dram.reserve_failures)


def _namespace_families(stats: ServerStats) -> Iterator[Metric]:
    info = GaugeMetricFamily(
        "hpkv_namespace_info",
        "One per registered namespace, with its description.",
        labels=["ns", "engine", "model", "dtype", "tp_size", "rank"],
    )
    lookups = CounterMetricFamily("hpkv_namespace_lookups", "Lookup requests per namespace.", labels=["ns"])
    keys = CounterMetricFamily("hpkv_namespace_lookup_keys", "Keys asked for per namespace.", labels=["ns"])
    hits = CounterMetricFamily("hpkv_namespace_hit_keys", "Keys found per namespace and tier.", labels=["ns", "tier"])
    for ns, entry in stats.namespaces.items():
        desc = _desc(entry.desc)
        info.add_metric([ns] + [str(desc.get(k, "")) for k in ("engine", "model", "dtype", "tp_size", "rank")], 1)
        lookups.add_metric([ns], entry.lookups)
        keys.add_metric([ns], entry.lookup_keys)
        hits.add_metric([ns, "dram"], entry.hit_keys_dram)
        hits.add_metric([ns, "storage"], entry.hit_keys_storage)
    yield from (info, lookups, keys, hits)


def _desc(text: str) -> dict:
    try:
        desc = json.loads(text)
    except ValueError:
        return {}
    return desc if isinstance(desc, dict) else {}


def _server_families(stats: ServerStats) -> Iterator[Metric]:
    server = stats.server
    info = GaugeMetricFamily(
        "hpkv_server_info", "The server's version, protocol and mode.", labels=["version", "protocol", "mode"]
    )
    info.add_metric([server.version, str(server.protocol), "auto" if server.auto else "managed"], 1)
    yield info
    yield _gauge("uptime_seconds", "Seconds since the server started.", server.uptime_s)
    clients = GaugeMetricFamily("hpkv_clients", "Connected clients, by the kind they said they are.", labels=["kind"])
    by_kind: dict[str, int] = {}
    for client in stats.clients:
        by_kind[client.kind] = by_kind.get(client.kind, 0) + 1
    for kind, num in sorted(by_kind.items()):
        clients.add_metric([kind], num)
    yield clients
    yield _gauge("connected_clients", "Connected clients.", len(stats.clients))


class Metrics:
    """The server's metrics endpoint. Owns its registry, its HTTP server and that server's thread."""

    def __init__(self, server) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(server))
        ProcessCollector(namespace="hpkv", registry=self.registry)
        self._latency = Histogram(
            "hpkv_request_seconds",
            "Time the server took to handle a request, by type.",
            ["op"],
            registry=self.registry,
            buckets=_LATENCY_BUCKETS_S,
        )
        self._http: Any = None  # the ScrapeServer, once started
        self._thread: threading.Thread | None = None
        self.address: tuple[str, int] | None = None

    def start(self, host: str, port: int) -> None:
        """Listen on host:port. A port that cannot be had is logged, and the server goes on
        without metrics: the cache matters more than its dashboard."""
        try:
            self._http = ScrapeServer(host, port, MetricsHandler.factory(self.registry))
        except OSError as exc:
            log.error(
                "cannot serve metrics on %s:%d: %s; the server runs without metrics. Fix: choose a free "
                "HPKV_METRICS_PORT (or 0 for none), or another HPKV_METRICS_HOST",
                host,
                port,
                exc.strerror or exc,
            )
            return
        self._thread = threading.Thread(
            target=self._http.serve_forever, args=(POLL_S,), name="hpkv-metrics", daemon=True
        )
        self._thread.start()
        self.address = (host, self._http.server_port)
        log.info("metrics on http://%s:%d/metrics", host, self._http.server_port)

    def observe(self, op: str, seconds: float) -> None:
        self._latency.labels(op_label(op)).observe(seconds)

    def stop(self) -> None:
        if self._http is None:
            return
        self._http.shutdown()
        self._http.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._http = None
