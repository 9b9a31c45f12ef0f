"""The index rebuilt at start: the walk of the root (`scan.walk`), merged into the index while
lookups and writes go on, then the automatic capacity completed and the excess evicted.

What the walk found goes in oldest at the old end (by mtime), behind what lookups and writes
indexed meanwhile, without what left the index or was removed meanwhile (`FileIndex.add_scanned`),
in slices so that lookups and writes are not held up for the merge of a large directory. A file
scanned is known as used SLACK_MINUTES before the scan, so that a read elsewhere any time after
it spares it from an eviction.

Primitives: `rebuild`, `merge`.
Must not know: how files are read or written, the pool.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from ..stats import StorageCounters
from . import scan
from .capacity import CapacityPolicy
from .eviction import SLACK_MINUTES, Evictor
from .index import MAX_FILE_BYTES, FileIndex
from .tree import Root

log = logging.getLogger("hpkv.storage.tier")

_MERGE_SLICE = 1 << 16  # files merged into the index per hold of its lock


def rebuild(
    root: Root, node: str, index: FileIndex, capacity: CapacityPolicy, evictor: Evictor, counters: StorageCounters
) -> None:
    """Index every entry file under the held root and remove leftover temporaries (`scan.walk`)."""
    started = time.monotonic()
    known_s = time.time() - SLACK_MINUTES * 60
    index.scan_known_s = known_s  # retention tells the scan's minute from a use by it
    with index.busy():  # what the walk found holds namespace numbers until it is merged
        found = scan.walk(root, node, index.key, lambda size: _value(index, size, known_s), counters)
        merge(index, found)
    if found.untrusted is not None:
        log.warning(
            "the storage scan skipped %d names under %s that are not what HPKV puts there, e.g. %s: "
            "HPKV follows no link and reads only regular files in the storage tree, so none is a hit; "
            "someone who can write the storage directory put them there (see hpkv doctor)",
            counters.untrusted_files,
            root.path,
            found.untrusted,
        )
    capacity.size_with_own(index.used_bytes)  # none learned yet: not while the scan runs
    if len(found.keys) > 10_000 or time.monotonic() - started > 2.0:
        log.info("storage index ready: %d files in %.1f s", len(found.keys), time.monotonic() - started)
    if index.used_bytes > capacity.capacity_bytes:
        evictor.evict_bytes(index.used_bytes - capacity.capacity_bytes)


def _value(index: FileIndex, size: int, known_s: float) -> int | None:
    return index.value_of(size, known_s) if size <= MAX_FILE_BYTES else None


def merge(index: FileIndex, found: scan.Found) -> None:
    """Add what the walk found, newest first, each to the old end (ties: in walk order)."""
    newest_first = np.argsort(-np.frombuffer(found.mtimes, dtype=np.float64), kind="stable")
    for start in range(0, len(newest_first), _MERGE_SLICE):
        chunk = newest_first[start : start + _MERGE_SLICE].tolist()
        if not index.add_scanned((found.keys[i], found.values[i]) for i in chunk):
            break
    index.scan_merged()
