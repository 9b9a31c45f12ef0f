"""Walking a storage root: its namespace directories, their entry files, and what a start-up scan
finds there (`walk`), with the temporaries of dead writers removed on the way.

Primitives: `namespace_dirs`, `entry_files`, `walk` -> `Found`.
Must not know: the index (its lock, its order), the pool, engines.
"""

from __future__ import annotations

import logging
import os
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import StorageError
from ..procs import pid_alive

log = logging.getLogger("hpkv.storage.tier")

STALE_TEMP_S = 3600.0  # a temporary this old is from a writer that died, on whatever node
REPORT_EVERY_S = 2.0  # a long walk says how far it got this often


@dataclass
class Found:
    """What the start-up walk found, in columns: a tuple per file cost 90 more bytes per file at
    the peak of the scan."""

    mtimes: array = field(default_factory=lambda: array("d"))
    keys: list[bytes] = field(default_factory=list)  # index keys
    values: list[int] = field(default_factory=list)  # index values


def walk(root: Path, node: str, index_key: Callable[[str, bytes], bytes], value_of: Callable[[int], int | None],
         counters) -> Found:
    """Every entry file under `root`: its mtime, `index_key(ns, key)` and `value_of(size)` (None:
    not a file to index). Temporaries of this node's dead writers, and any older than
    STALE_TEMP_S (a writer that died on whatever node), are removed. Unreadable entries are
    skipped: a walk never raises for a file. `counters.files_scanned` and `temps_removed` count
    as it goes (`hpkv status` shows how far a long scan got)."""
    last_report = time.monotonic()
    found = Found()
    for ns_dir in namespace_dirs(root):
        ns = os.path.basename(ns_dir)
        for path, entry in entry_files(ns_dir, temps=True):
            if path.endswith(".tmp"):
                counters.temps_removed += _remove_temp_if_dead(path, entry, node)
                continue
            try:
                st = entry.stat()
                ik = index_key(ns, bytes.fromhex(entry.name[:-3]))
            except (OSError, ValueError, StorageError):  # StorageError: too many namespaces
                continue
            value = value_of(st.st_size)
            if value is None:
                continue
            found.mtimes.append(st.st_mtime)
            found.keys.append(ik)
            found.values.append(value)
            counters.files_scanned += 1
            if time.monotonic() - last_report > REPORT_EVERY_S:
                last_report = time.monotonic()
                log.info("storage index: %d files scanned under %s", len(found.keys), root)
    return found


def namespace_dirs(root: Path, ns: str | None = None) -> list[str]:
    """The directory of namespace `ns`, or of every namespace under `root` (none if unreadable)."""
    if ns is not None:
        return [str(root / ns)]
    try:
        return [e.path for e in os.scandir(root) if e.is_dir() and _is_ns(e.name)]
    except OSError:
        return []


def entry_files(ns_dir: str, temps: bool = False):
    """(path, DirEntry) of every entry file (and temporary) under a namespace directory."""
    try:
        level1 = [e.path for e in os.scandir(ns_dir) if e.is_dir() and len(e.name) == 2]
    except OSError:
        return
    for d1 in level1:
        for d2 in _subdirs(d1):
            try:
                entries = list(os.scandir(d2))
            except OSError:
                continue
            for e in entries:
                if e.name.endswith(".kv") or (temps and e.name.endswith(".tmp")):
                    yield e.path, e


def _remove_temp_if_dead(path: str, entry: os.DirEntry, node: str) -> int:
    """1 if the temporary at `path` was removed. Its name says its writer (`.<key>.<node>.<pid>.<seq>.tmp`)."""
    parts = entry.name.split(".")
    try:
        writer_node, pid, mtime = parts[-4], int(parts[-3]), entry.stat().st_mtime
    except (IndexError, ValueError, OSError):
        return 0
    mine_and_dead = writer_node == node and not pid_alive(pid)
    if mine_and_dead or time.time() - mtime > STALE_TEMP_S:
        try:
            os.unlink(path)
            return 1
        except OSError:
            pass
    return 0


def _is_ns(name: str) -> bool:
    return len(name) == 32 and all(c in "0123456789abcdef" for c in name)


def _subdirs(path: str) -> list[str]:
    try:
        return [e.path for e in os.scandir(path) if e.is_dir() and len(e.name) == 2]
    except OSError:
        return []
