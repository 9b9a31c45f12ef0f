"""Walking a storage root: its namespace directories, their entry files, and what a start-up scan
finds there (`walk`), with the temporaries of dead writers removed on the way; `remove_entries`
for a clear.

The walk goes by directory descriptors (`tree`) from the root the tier holds open (`tree.Root`:
a root replaced meanwhile is not followed, not even halfway through a walk): each directory below
it is opened from its parent's without following a link, listed with `scandir(fd)`, and files are
looked at with `lstat` and removed with `unlink(name, dir_fd=)`. A link, or anything but a
directory where a directory belongs and a regular file where an entry file belongs, is skipped
and counted (`untrusted_files`), never indexed, and nothing outside the tree is removed.

A file found counts against the capacity for what it takes, not for the size it claims
(`counted_bytes`): a root other nodes can write may hold sparse files that declare gigabytes and
take nothing, and counting those evicted every real entry.

Primitives: `leaf_dirs`, `walk` -> `Found`, `remove_entries`, `counted_bytes`, `is_namespace`,
`remove_temp_if_dead`.
Must not know: the index (its lock, its order), the pool, engines.
"""

from __future__ import annotations

import functools
import logging
import os
import stat
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..errors import StorageError
from ..procs import pid_alive
from . import format as fmt
from .tree import DIR_FLAGS, FILE_FLAGS, Root, kind_of

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
    untrusted: str | None = None  # the first thing skipped as untrusted, in words (for the log)


Skipped = Callable[[str, str], None]  # (path, what it is): something untrusted was skipped


@dataclass(frozen=True)
class LeafDir:
    """One `<root>/<ns>/<ab>/<cd>` directory, open while the walk is at it."""

    ns: str
    path: str
    fd: int
    entries: list[os.DirEntry]


def leaf_dirs(tree: Root, ns: str | None = None, skipped: Skipped | None = None) -> Iterator[LeafDir]:
    """Every fan-out directory under the held root `tree` (of namespace `ns`, or of all), each
    with what it holds; its descriptor is valid until the next one is yielded. Unreadable
    directories are passed over; links and non-directories where directories belong are `skipped`."""
    root = tree.path
    try:
        root_fd = os.open(".", DIR_FLAGS, dir_fd=tree.fd())
    except OSError:
        return
    try:
        for ns_name, ns_fd in _subdirs(
            root_fd, root, lambda n: n == ns if ns is not None else is_namespace(n), skipped
        ):
            ns_path = f"{root}/{ns_name}"
            try:
                for d1, fd1 in _subdirs(ns_fd, ns_path, _is_fan, skipped):
                    try:
                        for d2, fd2 in _subdirs(fd1, f"{ns_path}/{d1}", _is_fan, skipped):
                            try:
                                entries = _list(fd2)
                                if entries is not None:
                                    yield LeafDir(ns_name, f"{ns_path}/{d1}/{d2}", fd2, entries)
                            finally:
                                os.close(fd2)
                    finally:
                        os.close(fd1)
            finally:
                os.close(ns_fd)
    finally:
        os.close(root_fd)


def walk(
    root: Root, node: str, index_key: Callable[[str, bytes], bytes], value_of: Callable[[int], int | None], counters
) -> Found:
    """Every entry file under the held root: its mtime, `index_key(ns, key)` and
    `value_of(counted_bytes)` (None: not a file to index). Temporaries of this node's dead writers, and any older than
    STALE_TEMP_S (a writer that died on whatever node), are removed. Unreadable entries are
    skipped, and so are (counted in `counters.untrusted_files`) links and whatever else is not a
    regular file: a walk never raises for a file. `counters.files_scanned` and `temps_removed`
    count as it goes (`hpkv status` shows how far a long scan got)."""
    last_report = time.monotonic()
    found = Found()

    def skipped(path: str, what: str) -> None:
        counters.untrusted_files += 1
        if found.untrusted is None:
            found.untrusted = f"{path} ({what})"

    for leaf in leaf_dirs(root, skipped=skipped):
        for entry in leaf.entries:
            name = entry.name
            if name.endswith(".tmp"):
                counters.temps_removed += remove_temp_if_dead(leaf.fd, entry, node)
                continue
            if not name.endswith(".kv"):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    skipped(f"{leaf.path}/{name}", kind_of(st.st_mode))
                    continue
                ik = index_key(leaf.ns, bytes.fromhex(name[:-3]))
            except (OSError, ValueError, StorageError):  # StorageError: too many namespaces
                continue
            size = counted_bytes(st, functools.partial(_declared, leaf.fd, name))
            value = None if size is None else value_of(size)
            if value is None:
                continue
            found.mtimes.append(st.st_mtime)
            found.keys.append(ik)
            found.values.append(value)
            counters.files_scanned += 1
            if time.monotonic() - last_report > REPORT_EVERY_S:
                last_report = time.monotonic()
                log.info("storage index: %d files scanned under %s", len(found.keys), root.path)
    return found


def counted_bytes(st: os.stat_result, declared: Callable[[], int | None]) -> int | None:
    """What a regular file found in the tree counts for against the capacity: its size, but no
    more than the blocks it takes (`st_blocks`: a sparse file takes less than it says); where the
    file system reports no block at all (some do not report them, or not yet for new data), no
    more than its header `declared` (read only then; None: no HPKV header, not indexed)."""
    taken = st.st_blocks * 512
    if taken >= st.st_size:
        return st.st_size
    if taken > 0:
        return taken
    size = declared()
    return None if size is None else min(size, st.st_size)


def _declared(dir_fd: int, name: str) -> int | None:
    """The size the header of `name` in `dir_fd` declares (`format.declared_bytes`), read
    without following a link or blocking; None where there is none to read."""
    try:
        fd = os.open(name, os.O_RDONLY | FILE_FLAGS | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        return fmt.declared_bytes(os.pread(fd, fmt.ALIGN, 0)) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except OSError:
        return None
    finally:
        os.close(fd)


def remove_entries(root: Root, ns: str | None = None) -> int:
    """Unlink every entry file (`*.kv`) under the held root (of namespace `ns`), each by name in its
    own directory: whatever stands there, a link included, goes, and nothing it points at. The
    number removed."""
    num = 0
    for leaf in leaf_dirs(root, ns):
        for entry in leaf.entries:
            if entry.name.endswith(".kv"):
                try:
                    os.unlink(entry.name, dir_fd=leaf.fd)
                    num += 1
                except OSError:
                    pass
    return num


def _subdirs(
    dir_fd: int, path: str, wanted: Callable[[str], bool], skipped: Skipped | None
) -> Iterator[tuple[str, int]]:
    """(name, descriptor) of the directories in `dir_fd` whose names are `wanted`, each opened
    without following a link; the caller closes each descriptor."""
    entries = _list(dir_fd)
    for entry in entries or ():
        if not wanted(entry.name):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False):
                if skipped is not None:
                    skipped(f"{path}/{entry.name}", kind_of(entry.stat(follow_symlinks=False).st_mode))
                continue
            fd = os.open(entry.name, DIR_FLAGS, dir_fd=dir_fd)
        except OSError:  # gone, or swapped for a link since it was listed (ENOTDIR, ELOOP)
            continue
        yield entry.name, fd


def _list(dir_fd: int) -> list[os.DirEntry] | None:
    """What a directory holds; None where it cannot be read (`scandir` lists a duplicate of the
    descriptor, which stays open)."""
    try:
        with os.scandir(dir_fd) as it:
            return list(it)
    except OSError:
        return None


def remove_temp_if_dead(dir_fd: int, entry: os.DirEntry, node: str) -> int:
    """1 if the temporary `entry` was removed. Its name says its writer (`.<key>.<node>.<pid>.<seq>.tmp`)."""
    parts = entry.name.split(".")
    try:
        writer_node, pid, mtime = parts[-4], int(parts[-3]), entry.stat(follow_symlinks=False).st_mtime
    except (IndexError, ValueError, OSError):
        return 0
    mine_and_dead = writer_node == node and not pid_alive(pid)
    if mine_and_dead or time.time() - mtime > STALE_TEMP_S:
        try:
            os.unlink(entry.name, dir_fd=dir_fd)
            return 1
        except OSError:
            pass
    return 0


def is_namespace(name: str) -> bool:
    return len(name) == 32 and all(c in "0123456789abcdef" for c in name)


def _is_fan(name: str) -> bool:
    return len(name) == 2
