"""Reading entry files: finding one in place (a lookup's `stat`), reading and verifying one into
a caller's buffer, and what a read that fails makes of the file.

A reader knows what it expects (the entry's size) and tells the formats apart by the file's size
(`format.version_of_size`); with direct I/O an aligned buffer (a pool slot) is read with O_DIRECT
where the file's layout and the file system allow it, through the page cache otherwise (never a
reason for a miss). A file read whole that fails its checks is deleted (`bad_files`); a read that
fails or ends short is a miss that leaves the file. A file this tier is refused (a permission, a
name too long) leaves the index for good, one its device fails to read (EIO, which often passes:
a Lustre client evicted, an NFS soft timeout) for UNREADABLE_EIO_S; a file in a newer format stays
on disk for the nodes that read it.

Also how the tier says its I/O errors (`ErrorLog`): each kind at most every WARN_EVERY_S.

Primitives: `Reader.read_into`, `find_in_place`, `skip_untrusted`, `misses` (`MissCache`); `direct` (whether O_DIRECT is
used: off for good once the file system refuses it); `ErrorLog.warn` (reads' and writes').
Must not know: capacity, eviction, how files are written, the pool.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import time
from collections.abc import Callable

from ..stats import StorageCounters
from ..throttle import Throttle
from . import format as fmt
from . import scan, tree
from .fileio import O_DIRECT, aligned, aligned_buffer, close_quietly, open_in_tree, read_full
from .index import MAX_FILE_BYTES, FileIndex
from .marks import NEVER
from .paths import EntryPaths

log = logging.getLogger("hpkv.storage.tier")

TOUCH_EVERY_S = 60.0  # refresh a file's mtime (its LRU age across restarts) at most this often
UNREADABLE_EIO_S = 60.0  # a file its device failed to read is a miss this long, then found again
_REFUSED_ERRNOS = (errno.EACCES, errno.EPERM, errno.ENAMETOOLONG)
WARN_EVERY_S = 600.0  # an I/O error of one kind (what failed, errno) is said at most this often
MISS_S = 2.0  # in a cluster, a lookup that found no file is a miss this long without asking again
MAX_MISSES = 1 << 16


class MissCache:
    """Lookups that found no file, each a miss for MISS_S without a round trip (in a root shared
    by many nodes a `stat` is a round trip to a metadata server, and a prefix missed by many
    requests would cost one per request). Bounded: past MAX_MISSES the oldest go. A write of the
    key by this node indexes it, and the index is asked first; another node's write is seen
    MISS_S late at most."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._until: dict[bytes, float] = {}

    def missed(self, ik: bytes) -> bool:
        until = self._until.get(ik)
        if until is None:
            return False
        if until > self._clock():
            return True
        self._until.pop(ik, None)
        return False

    def add(self, ik: bytes) -> None:
        if len(self._until) >= MAX_MISSES:
            for old in list(self._until)[: MAX_MISSES // 4]:
                self._until.pop(old, None)
        self._until[ik] = self._clock() + MISS_S


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


class Reader:
    def __init__(
        self,
        paths: EntryPaths,
        index: FileIndex,
        counters: StorageCounters,
        errors: ErrorLog,
        direct: bool,
        on_gone: Callable[[], None] = lambda: None,
    ) -> None:
        self._paths = paths
        self._on_gone = on_gone  # an indexed file was found gone: the rest of the index may be stale
        self._index = index
        self._counters = counters
        self._errors = errors
        self.direct = direct
        self._warned_newer = False
        self.misses: MissCache | None = None  # a cluster's (`MissCache`); none on a root of one node

    def read_into(self, ns: str, key: bytes, dest: memoryview) -> bool:
        """Read and verify (ns, key) into `dest` (exactly the payload size). False is a miss; the
        content of `dest` is then undefined and must not be used. A stale handle (another node
        replaced the file while it was opened or read) is read again by name, once."""
        verdict = self._read_by_name(ns, key, dest)
        if verdict is None:
            verdict = self._read_by_name(ns, key, dest, last=True)
        if isinstance(verdict, str):
            self._discard(ns, key, verdict)
            return False
        if verdict:
            self._counters.reads += 1
            self._counters.read_bytes += len(dest)
            self._index.was_read(self._index.key(ns, key))
        return bool(verdict)

    def _read_by_name(self, ns: str, key: bytes, dest: memoryview, last: bool = False) -> bool | str | None:
        """One open and read of (ns, key): True, good; False, a miss already counted; a str, why
        the file is bad; None, a stale handle to try again (unless `last`)."""
        direct = self.direct and aligned(dest)
        try:
            fd, st = open_in_tree(
                self._paths.io,
                self._paths.tree,
                *self._paths.where(ns, key),
                os.O_RDONLY | (O_DIRECT if direct else 0),
            )
        except tree.Untrusted as exc:
            self.skip_untrusted(ns, key, exc)
            return False
        except OSError as exc:
            if direct and exc.errno == errno.EINVAL:
                if self.direct:  # the file system changed under us: no more O_DIRECT
                    self.direct = False
                    log.warning(
                        "the file system of %s refused O_DIRECT on a read (HPKV_KV_STORAGE_DIRECT_IO=on); "
                        "KV files go through the page cache from now on",
                        self._paths.root,
                    )
                return self._read_by_name(ns, key, dest, last)
            return self._failed_once(ns, key, exc, last)
        try:
            return self._read(ns, key, fd, st, dest, direct)
        except OSError as exc:
            return self._failed_once(ns, key, exc, last)
        finally:
            close_quietly(self._paths.io, fd)

    def _failed_once(self, ns: str, key: bytes, exc: OSError, last: bool) -> bool | None:
        if exc.errno == errno.ESTALE and not last:
            return None
        self._read_failed(ns, key, exc)
        return False

    def _read(self, ns: str, key: bytes, fd: int, st: os.stat_result, dest: memoryview, direct: bool) -> bool | str:
        """Read the open file into `dest` and check it: True, good; False, a miss already
        counted; else why the file is bad."""
        io = self._paths.io
        version = fmt.version_of_size(st.st_size, len(key), len(dest))
        if version is None:
            head = bytearray(16)
            newer = fmt.newer_version(head[: read_full(io, fd, [head], direct)])
            if newer is not None:
                return self._newer_format(ns, key, newer)
            return f"{st.st_size} bytes on disk, expected a header and {len(dest)} bytes"
        header_len = fmt.header_bytes(len(key), version)
        aligned_read = direct and version == fmt.VERSION_ALIGNED
        header: bytearray | mmap.mmap = aligned_buffer(header_len) if aligned_read else bytearray(header_len)
        try:
            if direct and not aligned_read:
                io.set_direct(fd, False)  # a version 1 file: its payload is not aligned
            got = read_full(io, fd, [header, dest], aligned_read)
            if got != st.st_size:  # it ended before its size said: changed under us, not known bad
                self._read_failed(ns, key, OSError(0, f"the file ended after {got} of {st.st_size} bytes"))
                return False
            reason = fmt.check(header, bytes.fromhex(ns), key, dest, version)
            if reason is not None and (newer := fmt.newer_version(header)) is not None:
                return self._newer_format(ns, key, newer)
        finally:
            if isinstance(header, mmap.mmap):
                header.close()
        if reason is not None:
            return reason
        if time.time() - st.st_mtime > TOUCH_EVERY_S:
            try:
                os.utime(fd)
            except OSError:  # a read-only mount, say: the bytes read are good all the same
                pass
        return True

    def find_in_place(self, ns: str, key: bytes) -> bool:
        """Index the file of (ns, key) as used now, if one is there, of a size an index value
        holds (no KV file of ours is larger), counted for what it takes (`scan.counted_bytes`).
        One `stat` (none for a miss remembered, `misses`): ask without holding a lock."""
        misses = self.misses
        if misses is not None and misses.missed(ik := self._index.key(ns, key)):
            return False
        try:
            st = self._paths.stat(ns, key)
        except OSError as exc:
            if misses is not None and exc.errno == errno.ENOENT:
                misses.add(ik)
            return False
        if not tree.is_regular(st):  # a link, a FIFO...: never a hit
            self.skip_untrusted(ns, key, tree.Untrusted(self._paths.path_of(ns, key), tree.kind_of(st.st_mode)))
            return False
        size = scan.counted_bytes(st, lambda: self._declared(ns, key)) if st.st_size <= MAX_FILE_BYTES else None
        if size is None:
            return False
        self._index.remember(self._index.key(ns, key), size)
        return True

    def _declared(self, ns: str, key: bytes) -> int | None:
        """The size (ns, key)'s header declares; None where it has none (or cannot be read)."""
        try:
            fd, _ = open_in_tree(self._paths.io, self._paths.tree, *self._paths.where(ns, key), os.O_RDONLY)
        except OSError:
            return None
        try:
            return fmt.declared_bytes(os.pread(fd, fmt.ALIGN, 0))
        except OSError:
            return None
        finally:
            close_quietly(self._paths.io, fd)

    def skip_untrusted(self, ns: str, key: bytes, exc: tree.Untrusted) -> None:
        """Something not an entry file stands at (ns, key)'s name, or on the way to it: a miss,
        out of the index and not adopted again (until written, or a restart), counted, said."""
        self._counters.untrusted_files += 1
        self._index.forget(self._index.key(ns, key), unreadable_s=NEVER)
        self._errors.warn(
            exc,
            f"skipped a name under {self._paths.root}",
            "it is never a hit; someone who can write the storage directory put it there (see hpkv doctor)",
        )

    def _read_failed(self, ns: str, key: bytes, exc: OSError) -> None:
        """A miss that leaves the file in place. A file gone (another node removed it) leaves the
        index; so does one this tier is refused, and one its device fails to read (EIO) for
        UNREADABLE_EIO_S. Anything else (out of file descriptors, a read cut short) may pass, and
        the file stays indexed."""
        self._counters.read_misses += 1
        ik = self._index.key(ns, key)
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            if self._index.has(ik):  # a hit with no file: another server or node removed it
                self._counters.stale_entries += 1
                self._on_gone()
            self._index.forget(ik)
            return
        if exc.errno in _REFUSED_ERRNOS:
            self._index.forget(ik, unreadable_s=NEVER)
            then = "the request recomputes, and such files are misses until written again or the server restarts"
        elif exc.errno == errno.EIO:
            self._index.forget(ik, unreadable_s=UNREADABLE_EIO_S)
            then = (
                f"the request recomputes, and such a file is a miss for {UNREADABLE_EIO_S:.0f} s, then found "
                "again by a lookup"
            )
        else:
            then = "the request recomputes"
        self._errors.warn(exc, f"cannot read KV files under {self._paths.root}", then)

    def _newer_format(self, ns: str, key: bytes, version: int) -> bool:
        """A file a newer HPKV wrote (a node sharing this directory, upgraded first): a miss here
        (False), left in place for the nodes that can read it, no longer a hit for this tier, nor
        its bytes counted against this tier's capacity (the newer nodes manage it)."""
        self._counters.read_misses += 1
        self._index.forget(self._index.key(ns, key), unreadable_s=NEVER)
        if not self._warned_newer:
            self._warned_newer = True
            log.warning(
                "KV file %s is in file format %d, newer than this HPKV reads (%s): treated as a miss and "
                "left in place for the nodes that wrote it; upgrade this node to use such files",
                self._paths.path_of(ns, key),
                version,
                ", ".join(map(str, fmt.VERSIONS)),
            )
        return False

    def _discard(self, ns: str, key: bytes, reason: str) -> None:
        log.warning("removing bad KV file %s: %s (the request recomputes)", self._paths.path_of(ns, key), reason)
        self._counters.bad_files += 1
        self._index.forget(self._index.key(ns, key))
        try:
            self._paths.unlink(ns, key)
        except OSError:
            pass
