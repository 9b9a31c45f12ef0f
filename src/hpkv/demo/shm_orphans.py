"""Shared-memory segments an engine's processes left behind in /dev/shm.

vLLM's message queues are Python `multiprocessing.shared_memory` segments (`/dev/shm/psm_*`, up
to hundreds of MiB each): their creator unlinks one on a clean exit, Python's resource tracker
once every process using it has gone; a process group killed hard, the tracker with it, leaves
them in RAM for good. Other engines (other test runs) may be using segments at the same time.

Primitives: `snapshot()` (the segment names there now), `in_use()` (the names some live process
has open or mapped, from /proc/*/fd and /proc/*/maps), `remove_orphans(before, since)` (those not
in `before`, created at or after `since`, owned by this user and held by no live process:
removed, their paths returned).
Must not know: the engines; it reads /proc and /dev/shm only.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "psm_"  # multiprocessing.shared_memory's names on POSIX


def snapshot(shm_dir: Path = SHM_DIR) -> frozenset[str]:
    """The names of the segments in `shm_dir` now."""
    try:
        return frozenset(entry.name for entry in os.scandir(shm_dir) if entry.name.startswith(PREFIX))
    except OSError:
        return frozenset()


def _names_in(paths: Iterable[str], prefix: str) -> set[str]:
    return {p[len(prefix) :].removesuffix(" (deleted)") for p in paths if p.startswith(prefix)}


def _open_paths(proc: str) -> list[str]:
    try:
        fds = os.listdir(f"/proc/{proc}/fd")
    except OSError:
        return []  # gone, or not ours to read
    out = []
    for fd in fds:
        try:
            out.append(os.readlink(f"/proc/{proc}/fd/{fd}"))
        except OSError:
            continue  # closed meanwhile
    return out


def _mapped_paths(proc: str) -> list[str]:
    try:
        with open(f"/proc/{proc}/maps", encoding="utf-8", errors="replace") as f:
            return [line[line.index("/") :].rstrip("\n") for line in f if "/" in line]
    except OSError:
        return []


def in_use(shm_dir: Path = SHM_DIR) -> set[str]:
    """Names of files in `shm_dir` that some live process has open or mapped."""
    prefix = f"{shm_dir}/"
    names: set[str] = set()
    for proc in os.listdir("/proc"):
        if proc.isdigit():
            names |= _names_in(_open_paths(proc), prefix)
            names |= _names_in(_mapped_paths(proc), prefix)
    return names


def remove_orphans(before: frozenset[str], since: float, shm_dir: Path = SHM_DIR) -> list[Path]:
    """Remove the segments that appeared after `before` was taken, are no older than `since`
    (time.time()), belong to this user and no live process holds; the paths removed."""
    candidates = snapshot(shm_dir) - before
    if not candidates:
        return []
    held = in_use(shm_dir)
    removed = []
    for name in sorted(candidates - held):
        path = shm_dir / name
        try:
            st = path.stat()
            if st.st_ctime < since or st.st_uid != os.getuid():
                continue
            path.unlink()
        except OSError:
            continue  # unlinked meanwhile (by its tracker, say)
        removed.append(path)
    return removed
