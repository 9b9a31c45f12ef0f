"""What the storage tier counts and says: its counters (the `stats` snapshot) and its warnings
of I/O errors, each kind said at most every WARN_EVERY_S.

Primitives: `StorageCounters`, `ErrorLog.warn`.
Must not know: files, the index, capacity.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..throttle import Throttle

log = logging.getLogger("hpkv.storage.tier")

WARN_EVERY_S = 600.0  # an I/O error of one kind (what failed, errno) is said at most this often


@dataclass
class StorageCounters:
    reads: int = 0
    read_bytes: int = 0
    read_misses: int = 0
    writes: int = 0
    write_bytes: int = 0
    write_failures: int = 0
    bad_files: int = 0
    evictions: int = 0
    space_errors: int = 0
    files_scanned: int = 0
    temps_removed: int = 0
    over_budget: int = 0
    untrusted_files: int = 0  # links, FIFOs... in the tree: skipped, never hits (`tree`)
    stale_entries: int = 0  # indexed files found gone (another server or node removed them): forgotten


class ErrorLog:
    """Say an I/O error at most every WARN_EVERY_S per kind: once for the life of the process
    hid a device that failed again hours later; every time flooded the log."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._said = Throttle()  # by (what failed, errno)

    def warn(self, exc: OSError | None, what: str, then: str = "the entry stays in DRAM only") -> None:
        code = exc.errno if exc else 0
        if not self._said.allows(self._clock(), WARN_EVERY_S, (what, code)):
            return
        log.warning(
            "%s: %s; %s (errors of this kind are counted, and said at most every %.0f minutes)",
            what,
            exc.strerror if exc else "no room within HPKV_KV_STORAGE_SIZE",
            then,
            WARN_EVERY_S / 60,
        )
