"""What HpkvStorage counts: running totals (pulled with `snapshot()`) and, when SGLang's
metrics are on (`--enable-metrics`), the per-operation samples SGLang's `get_stats()` drains
into its `sglang:prefetch_*`/`sglang:backup_*` histograms. Thread-safe."""

from __future__ import annotations

import threading

_COUNTERS = (
    "lookups",
    "lookup_pages",
    "hit_pages_dram",
    "hit_pages_storage",
    "loaded_pages",
    "load_missed_pages",
    "loaded_bytes",
    "saved_pages",
    "save_skipped_pages",
    "saved_bytes",
    "faults",
)


class BackendStats:
    def __init__(self, samples: bool) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._samples = samples  # only when SGLang drains them, else they would only grow
        self._prefetch_pgs: list[int] = []
        self._prefetch_gbps: list[float] = []
        self._backup_pgs: list[int] = []
        self._backup_gbps: list[float] = []

    def looked_up(self, num_pages: int, num_dram: int, num_storage: int) -> None:
        self._add(lookups=1, lookup_pages=num_pages, hit_pages_dram=num_dram, hit_pages_storage=num_storage)

    def loaded(self, num_pages: int, num_missed: int, num_bytes: int, seconds: float) -> None:
        self._add(loaded_pages=num_pages, load_missed_pages=num_missed, loaded_bytes=num_bytes)
        if self._samples and num_pages:
            with self._lock:
                self._prefetch_pgs.append(num_pages)
                self._prefetch_gbps.append(num_bytes / max(seconds, 1e-9) / 1e9)

    def saved(self, num_pages: int, num_skipped: int, num_bytes: int, seconds: float) -> None:
        self._add(saved_pages=num_pages, save_skipped_pages=num_skipped, saved_bytes=num_bytes)
        if self._samples and num_pages:
            with self._lock:
                self._backup_pgs.append(num_pages)
                self._backup_gbps.append(num_bytes / max(seconds, 1e-9) / 1e9)

    def fault(self) -> None:
        self._add(faults=1)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def take_storage_metrics(self):
        """SGLang's StorageMetrics for the samples since the last call; None when not sampling."""
        if not self._samples:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        with self._lock:
            metrics.prefetch_pgs, self._prefetch_pgs = self._prefetch_pgs, []
            metrics.prefetch_bandwidth, self._prefetch_gbps = self._prefetch_gbps, []
            metrics.backup_pgs, self._backup_pgs = self._backup_pgs, []
            metrics.backup_bandwidth, self._backup_gbps = self._backup_gbps, []
        return metrics

    def _add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta
