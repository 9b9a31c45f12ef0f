"""The storage tier: one checksummed file per entry, bounded, evicted LRU, shareable by nodes.

Layout: `<root>/<ns>/<hex[0:2]>/<hex[2:4]>/<hex>.kv`, with `<root>/<ns>/namespace.json` holding
the readable namespace description. Files are immutable once published: they are written to a
temporary name in the same directory and renamed into place, so a reader sees a whole file or
none. Every read checks length, header and payload checksum; a bad file is deleted and the read is
a miss (a file in a format newer than this HPKV reads is a miss too, but stays for the nodes that
wrote it); a read that fails or stops short is a miss that leaves the file. Several tiers (nodes)
may share one root: the index learns files it did not write when a lookup finds them, and a
reader that loses a race with an evictor just misses. With direct I/O (HPKV_KV_STORAGE_DIRECT_IO),
files in the aligned format go between the device and pool slots with O_DIRECT where the file
system takes it (see `fileio`). Below the root no link is followed, only regular files are read,
and nothing else in the tree is ever a hit (`tree`: skipped, counted in `untrusted_files`).

Primitives: `start`, `add_namespace`, `indexed` (`index_probe`), `contains`, `touch`, `read_into`,
`write_from` (or `publish`, where another process writes the file), `submit`, `remove`, `stats`,
`close`. Capacity is enforced on this tier's view; `ENOSPC`/`EDQUOT` evict a little and retry
once; a write that still cannot happen is dropped (counted), never raised, and lowers the
capacity to what fitted (for CAPACITY_RECOVERY_S after the last such error). Where another node writes to the
directory too, eviction spares a file another node read since this tier last used it (its
mtime). A write the budget (HPKV_KV_STORAGE_WRITE_BUDGET, `budget`) cannot pay for is not made
(counted).
Must not know: the pool, engines, devices.
"""

from __future__ import annotations

import errno
import itertools
import logging
import math
import mmap
import os
import socket
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..config import StorageConfig
from ..errors import StorageError
from ..fsinfo import MEMORY_FS, room_bytes
from . import format as fmt
from . import root as storage_root
from . import scan, tree
from .budget import WriteBudget
from .fileio import (ALIGN, O_DIRECT, FileIO, FileTarget, aligned, aligned_buffer, direct_supported, open_in_tree,
                     read_full, write_entry_file)

log = logging.getLogger(__name__)

AUTO_CAPACITY_FRACTION = 0.8
SMALL_AUTO_CAPACITY = 1 << 30  # below this an automatic capacity is worth a warning
TOUCH_EVERY_S = 60.0  # refresh a file's mtime (its LRU age across restarts) at most this often
MAX_UNREADABLE = 1 << 20  # files this tier cannot read, remembered so that no lookup counts them as hits
UNREADABLE_EIO_S = 60.0  # a file its device failed to read is a miss this long, then found again
SPARE_CHECKS_PER_PASS = 16  # eviction victims whose mtime one eviction looks at (`_evict`)
MAX_VALUES = 1 << 16  # distinct index values kept for sharing (`_value`)
CAPACITY_RECOVERY_S = 600.0  # a capacity learned from "no room" holds this long after the last such error
WARN_EVERY_S = 600.0  # an I/O error of one kind (what failed, errno) is said at most this often
_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# A file this tier is refused (a permission, a name too long): out of the index until written
# again, or every lookup is a hit that every promotion misses. One its device fails to read (EIO)
# only for UNREADABLE_EIO_S: that often passes (a Lustre client evicted, an NFS soft timeout), and
# the files read most would otherwise stay out for good.
_REFUSED_ERRNOS = (errno.EACCES, errno.EPERM, errno.ENAMETOOLONG)
_SIZE_BITS = 40  # an index value: the file's size in its low bits, a minute above them (`_value`)
_SIZE_MASK = (1 << _SIZE_BITS) - 1  # a file larger than this (1 TiB) is no KV file of ours: never indexed
_SLACK_MINUTES = 2  # a file read elsewhere since: its mtime this many minutes past the minute known (`_used_since`)
# One sequence for every tier in the process: two tiers on one root (same node, same pid) must
# never pick the same temporary name, or one's O_EXCL fails and its clean-up deletes the other's.
_TEMP_SEQ = itertools.count(1)


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


class StorageTier:
    def __init__(self, config: StorageConfig, io: FileIO | None = None) -> None:
        self.root = Path(config.path)
        self._root = tree.Root(str(self.root))  # held open for reads and removals
        self.config = config
        self.io = io or FileIO()
        self.counters = StorageCounters()
        self.capacity_bytes = config.capacity_bytes or 0
        self._sized_bytes = self.capacity_bytes  # what the settings (or auto) gave: see `_learn_capacity`
        self.used_bytes = 0
        self.scan_done = threading.Event()
        # Whether another tier writes here too (this one adopted a file it did not write): only
        # then are eviction victims looked at first (`_evict`), a `stat` each (costly on Lustre).
        self.shared = False
        self._node = socket.gethostname().replace(".", "_")
        self._lock = threading.Lock()
        # Index: by index key, least recently used first, the file's size and the minute this
        # index last knew it used, packed in one int (`_value`). An index key is the namespace's
        # 2-byte number and the engine key in one bytes object (`_ik`): a tuple of the two cost 64
        # more bytes per file, and a large directory holds millions of files.
        self._lru: OrderedDict[bytes, int] = OrderedDict()
        self._ns_ids: dict[str, bytes] = {}
        self._ns_names: list[str] = []
        self._values: dict[int, int] = {}  # one int object per (size, minute), not one per file
        self._inflight_bytes = 0
        # Victims popped by an eviction and not yet unlinked: a lookup's `stat` still finds their
        # files, and adopting one would index a key whose file is about to go (and take this
        # tier's own file for another node's: `shared`). A miss instead.
        self._evicting: set[bytes] = set()
        # `remove`s so far, and the index key prefixes of the last ones (None: all): a victim an
        # eviction spared must not come back into the index past a remove of its namespace.
        self._removals = 0
        self._removed: deque[bytes | None] = deque(maxlen=_REMOVALS_KEPT)
        # Keys removed while the start-up scan runs, so the scan does not bring them back.
        self._gone: set[bytes] | None = set()
        self._cleared: set[str | None] = set()  # namespaces cleared meanwhile (None: all)
        self._dirs: set[str] = set()
        self._executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix="hpkv-io")
        self._warned_at: dict[tuple[str, int], float] = {}  # (what failed, errno) -> when last said
        self.direct = config.direct_io  # cleared by `start` where the file system refuses O_DIRECT
        self._warned_newer = False
        # Files a newer HPKV wrote (`_newer_format`) or that cannot be read (`_read_failed`): out
        # of the index, and not adopted again by a `stat`, or every lookup would count them as
        # hits that every read then misses. Until this tier writes or reads the key, or the
        # monotonic time given (inf: for good).
        self._unreadable: dict[bytes, float] = {}
        # The file system said "no room" (or a quota did): capacity_bytes is what fitted then,
        # until CAPACITY_RECOVERY_S pass without another such error (`_recover_capacity`).
        self._capacity_learned = False
        self._space_error_at = -math.inf
        self.budget = WriteBudget(config.write_budget_bytes)

    # -- life ---------------------------------------------------------------------------------

    def start(self, promised_ram_bytes: int = 0) -> None:
        """Make the root usable (`root.prepare`: StorageError, StorageUnusable where it is not),
        size the tier, and rebuild the index in the background.
        `promised_ram_bytes`: memory promised elsewhere and not taken yet (a DRAM pool on ramfs,
        whose pages arrive on first touch), which an automatic capacity on ramfs leaves out."""
        fs_type = storage_root.prepare(self.root)  # StorageUnusable: the server goes on with DRAM alone
        if self.config.capacity_bytes is None:
            self.capacity_bytes = int(room_bytes(self.root, promised_ram_bytes) * AUTO_CAPACITY_FRACTION)
            self._sized_bytes = self.capacity_bytes
        if fs_type in MEMORY_FS:
            storage_root.say_memory_fs(self.root, fs_type, self.config.capacity_bytes is None, self.capacity_bytes,
                                       promised_ram_bytes, AUTO_CAPACITY_FRACTION)
        if self.direct and not direct_supported(str(self.root)):
            self.direct = False
            log.warning("the file system of %s does not take O_DIRECT (HPKV_KV_STORAGE_DIRECT_IO=on); KV files "
                        "go through the page cache instead", self.root)
        threading.Thread(target=self._scan, name="hpkv-storage-scan", daemon=True).start()

    def close(self, wait: bool = True) -> None:
        """Finish queued writes, then stop the I/O threads; without `wait`, drop what is queued
        and do not wait for what runs (a device that does not answer)."""
        self._executor.shutdown(wait=wait, cancel_futures=not wait)
        if wait:  # else a thread may still be in a system call on it: the process is about to exit
            self._root.close()

    def submit(self, fn, *args) -> Future:
        return self._executor.submit(fn, *args)

    def add_namespace(self, ns: str, description_json: str) -> None:
        """Keep the readable description beside the data. Best effort: a full disk must not stop
        the store from starting (the entries themselves do not need the description)."""
        tmp = f".namespace.{self._node}.{os.getpid()}.{next(_TEMP_SEQ)}.tmp"
        try:
            tree.write_description(str(self.root), ns, "namespace.json", tmp, description_json + "\n")
        except OSError as exc:
            log.warning("cannot write %s: %s; going on without it", self.root / ns / "namespace.json",
                        exc.strerror)

    # -- lookups and I/O ----------------------------------------------------------------------

    def path_of(self, ns: str, key: bytes) -> str:
        parts, name = self._where(ns, key)
        return f"{self.root}/{'/'.join(parts)}/{name}"

    @staticmethod
    def _where(ns: str, key: bytes) -> tuple[tuple[str, str, str], str]:
        """The directories below the root holding (ns, key)'s file, and its name."""
        name = key.hex()
        fan = name.ljust(4, "0")  # keys under 2 bytes still get both levels, where the scan looks
        return (ns, fan[0:2], fan[2:4]), f"{name}.kv"

    def _unlink(self, ns: str, key: bytes) -> None:
        """Remove (ns, key)'s file by name in its directory, reached without following a link."""
        parts, name = self._where(ns, key)
        dir_fd = self._root.open("/".join(parts), tree.DIR_FLAGS)
        try:
            self.io.unlink(name, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)

    def _ik(self, ns: str, key: bytes) -> bytes:
        """The index key of (ns, key)."""
        ns_id = self._ns_ids.get(ns)
        if ns_id is None:
            with self._lock:
                ns_id = self._ns_ids.get(ns)
                if ns_id is None:
                    if len(self._ns_names) >= 1 << 16:
                        raise StorageError(f"more than {1 << 16} namespaces under {self.root}")
                    ns_id = self._ns_ids[ns] = len(self._ns_names).to_bytes(2, "big")
                    self._ns_names.append(ns)
        return ns_id + key

    def _split(self, ik: bytes) -> tuple[str, bytes]:
        return self._ns_names[int.from_bytes(ik[:2], "big")], ik[2:]

    def indexed(self, ns: str, key: bytes) -> bool:
        """Whether the index holds (ns, key): no I/O, so callers may ask while holding a lock."""
        return self._ik(ns, key) in self._lru

    def index_probe(self, ns: str) -> tuple[bytes, Callable[[bytes], bool]]:
        """(prefix, holds): `holds(prefix + key)` is `indexed(ns, key)` without a Python call per
        key, for walks over long prefixes (a method call per key made a lookup of 4,096 keys a
        third slower)."""
        return self._ik(ns, b""), self._lru.__contains__

    def contains(self, ns: str, key: bytes) -> bool:
        """Whether a file for (ns, key) exists, adopting files other tiers wrote (one `lstat` of
        the file when the index does not hold it: ask without holding a lock); what stands
        there and is not a regular file is skipped and counted."""
        ik = self._ik(ns, key)
        if ik in self._lru:
            return True
        if ik in self._evicting:
            return False
        marked = ik in self._unreadable
        if marked and self._is_unreadable(ik):
            return False
        if not self._index_in_place(ns, key):  # used now: a lookup found it
            return False
        if not marked and self.scan_done.is_set():
            self.shared = True  # a file this tier did not write (not one of its own the scan has yet to find)
        return True

    def touch(self, ns: str, keys: list[bytes]) -> None:
        """Make the keys indexed the most recently used, in the order given (the last most
        recent): promotions are about to read them. Without it, writes queued before those reads
        could evict the files a lookup just reported as hits. No I/O, but it waits for this
        tier's lock, which an eviction or a `remove` holds for long: callers must hold no lock."""
        prefix = self._ik(ns, b"")
        with self._lock:
            for key in keys:
                if prefix + key in self._lru:
                    self._lru.move_to_end(prefix + key)

    def read_into(self, ns: str, key: bytes, dest: memoryview) -> bool:
        """Read and verify (ns, key) into `dest` (exactly the payload size). False is a miss; the
        content of `dest` is then undefined and must not be used. With direct I/O, an aligned
        `dest` (a pool slot) is read into with O_DIRECT where the file's layout allows it. Only a
        file read whole that fails its checks is deleted; a read that fails or stops short is a
        miss that leaves the file where it is."""
        path = self.path_of(ns, key)
        direct = self.direct and aligned(dest)
        try:
            fd, st = open_in_tree(self.io, self._root, *self._where(ns, key),
                                  os.O_RDONLY | (O_DIRECT if direct else 0))
        except tree.Untrusted as exc:
            self._skip_untrusted(ns, key, exc)
            return False
        except OSError as exc:
            if direct and exc.errno == errno.EINVAL:
                if self.direct:  # the file system changed under us: no more O_DIRECT
                    self.direct = False
                    log.warning("the file system of %s refused O_DIRECT on a read (HPKV_KV_STORAGE_DIRECT_IO=on); "
                                "KV files go through the page cache from now on", self.root)
                return self.read_into(ns, key, dest)
            self._read_failed(ns, key, exc)
            return False
        header = None
        try:
            version = fmt.version_of_size(st.st_size, len(key), len(dest))
            if version is None:
                head = bytearray(16)
                got = read_full(self.io, fd, [head], direct)
                newer = fmt.newer_version(head[:got])
                if newer is not None:
                    self._newer_format(ns, key, path, newer)
                    return False
                reason = f"{st.st_size} bytes on disk, expected a header and {len(dest)} bytes"
            else:
                header_len = fmt.header_bytes(len(key), version)
                if direct and version == fmt.VERSION_ALIGNED:
                    header = aligned_buffer(header_len)
                else:
                    header = bytearray(header_len)
                    if direct:
                        self.io.set_direct(fd, False)  # a version 1 file: its payload is not aligned
                        direct = False
                got = read_full(self.io, fd, [header, dest], direct)
                if got != st.st_size:  # it ended before its size said: changed under us, not known bad
                    self._read_failed(ns, key, OSError(0, f"the file ended after {got} of {st.st_size} bytes"))
                    return False
                reason = fmt.check(header, bytes.fromhex(ns), key, dest, version)
                if reason is not None and (newer := fmt.newer_version(header)) is not None:
                    self._newer_format(ns, key, path, newer)
                    return False
            if reason is None and time.time() - st.st_mtime > TOUCH_EVERY_S:
                try:
                    os.utime(fd)
                except OSError:  # a read-only mount, say: the bytes read are good all the same
                    pass
        except OSError as exc:
            self._read_failed(ns, key, exc)
            return False
        finally:
            self.io.close(fd)
            if isinstance(header, mmap.mmap):
                header.close()
        if reason is not None:
            self._discard(ns, key, path, reason)
            return False
        self.counters.reads += 1
        self.counters.read_bytes += len(dest)
        ik = self._ik(ns, key)
        with self._lock:
            self._unreadable.pop(ik, None)  # it can be read after all (a device error that passed)
            value = self._lru.get(ik)
            if value is not None:
                self._lru[ik] = self._value(value & _SIZE_MASK, time.time())
                self._lru.move_to_end(ik)
        return True

    def _read_failed(self, ns: str, key: bytes, exc: OSError) -> None:
        """A miss that leaves the file in place. A file gone (another node removed it) leaves the
        index; so does one this tier is refused, and a `stat` does not bring it back (a later
        start-up scan, or a write of the key, does); one its device fails to read (EIO) leaves it
        for UNREADABLE_EIO_S, then a lookup's `stat` adopts it again, and its bytes, out of
        `used_bytes` meanwhile, count again. Anything else (out of file descriptors, a read cut short) may pass,
        and the file stays indexed."""
        self.counters.read_misses += 1
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            self._forget(ns, key)
            return
        if exc.errno in _REFUSED_ERRNOS:
            self._forget(ns, key, unreadable_s=math.inf)
            then = "the request recomputes, and such files are misses until written again or the server restarts"
        elif exc.errno == errno.EIO:
            self._forget(ns, key, unreadable_s=UNREADABLE_EIO_S)
            then = (f"the request recomputes, and such a file is a miss for {UNREADABLE_EIO_S:.0f} s, then found "
                    "again by a lookup")
        else:
            then = "the request recomputes"
        self._warn(exc, f"cannot read KV files under {self.root}", then)

    def _mark_unreadable(self, ik: bytes, for_s: float) -> None:
        """Caller holds the lock. Bounded: marks past their time go first, and only if that is
        not enough all of them (those files are found again, one read each)."""
        now = time.monotonic()
        if len(self._unreadable) >= MAX_UNREADABLE:
            for k in [k for k, until in self._unreadable.items() if until <= now]:
                del self._unreadable[k]
            if len(self._unreadable) >= MAX_UNREADABLE:
                self._unreadable.clear()
        self._unreadable[ik] = now + for_s

    def _is_unreadable(self, ik: bytes, locked: bool = False) -> bool:
        """Whether `ik` is marked unreadable; a mark past its time is dropped, unless marked again
        meanwhile. `locked`: the caller holds the lock (else it is taken only to drop a mark)."""
        until = self._unreadable.get(ik)
        if until is None:
            return False
        if until > time.monotonic():
            return True
        if locked:
            self._drop_mark(ik, until)
        else:
            with self._lock:
                self._drop_mark(ik, until)
        return False

    def _drop_mark(self, ik: bytes, until: float) -> None:
        """Caller holds the lock."""
        if self._unreadable.get(ik) == until:
            del self._unreadable[ik]

    def _newer_format(self, ns: str, key: bytes, path: str, version: int) -> None:
        """A file a newer HPKV wrote (a node sharing this directory, upgraded first): a miss here,
        left in place for the nodes that can read it, and no longer a hit for this tier's lookups
        (nor its bytes counted against this tier's capacity: the newer nodes manage it)."""
        self.counters.read_misses += 1
        self._forget(ns, key, unreadable_s=math.inf)
        if not self._warned_newer:
            self._warned_newer = True
            log.warning("KV file %s is in file format %d, newer than this HPKV reads (%s): treated as a miss and "
                        "left in place for the nodes that wrote it; upgrade this node to use such files", path,
                        version, ", ".join(map(str, fmt.VERSIONS)))

    def write_version(self, payload_bytes: int) -> int:
        """The format version of this tier's new files: aligned for direct I/O when it can be."""
        return fmt.VERSION_ALIGNED if self.direct and payload_bytes % ALIGN == 0 else fmt.VERSION

    def write_from(self, ns: str, key: bytes, payload: memoryview) -> bool:
        """Publish `payload` as (ns, key) from this process. False when it could not be written
        (counted, logged)."""
        version = self.write_version(len(payload))
        header = fmt.encode_header(bytes.fromhex(ns), key, payload, version)
        direct = version == fmt.VERSION_ALIGNED and aligned(payload)
        return self.publish(ns, key, len(payload), version, lambda target: write_entry_file(
            self.io, target, [header, payload], self.config.fsync, direct))

    def publish(self, ns: str, key: bytes, payload_bytes: int, version: int,
                write: Callable[[FileTarget], OSError | None]) -> bool:
        """Make room for (ns, key) and have `write` put its file, in format `version`, at a target
        this tier names (`write_entry_file`'s contract: the whole file or nothing, the error
        returned, not raised). A full disk evicts and retries once (`_put`). False when it could
        not be written (counted, logged); a failed write whose file is in place all the same (a
        writer process killed after its rename) is indexed, and True."""
        size = fmt.header_bytes(len(key), version) + payload_bytes
        if not self.budget.spend(size):
            self.counters.over_budget += 1
            return False
        if not self._make_room(size):
            self.budget.refund(size)
            self.counters.write_failures += 1
            return False
        try:
            error = self._put(ns, key, size, write)
            published = error is None or self._adopt(ns, key)
        except BaseException:  # e.g. no writer process: the caller may write it another way
            self.budget.refund(size)
            raise
        finally:
            with self._lock:
                self._inflight_bytes -= size
        if error is None:
            self.counters.writes += 1
            self.counters.write_bytes += payload_bytes
        if published:
            return True
        if isinstance(error, tree.Untrusted):  # a link planted on the way: not followed
            self.counters.untrusted_files += 1
        self._warn(error, f"cannot write KV files under {self.root}")
        self.counters.write_failures += 1
        self.budget.refund(size)  # nothing was written
        return False

    def _put(self, ns: str, key: bytes, size: int, write: Callable[[FileTarget], OSError | None]) -> OSError | None:
        """`write` the file and index it; the error where it could not. A directory removed under
        this tier (ENOENT where it was known to exist) is made again, once. A full disk or quota
        evicts a little and retries once: evicting again and again emptied whole shared
        directories on one quota error. Only a retry that finds no room either teaches the tier
        what fits (`_learn_capacity`): one "no room" alone is often a moment's (a Lustre OST full
        for a while), and learning from each shrank the tier to one file under intermittent
        ones. While the start-up scan runs nothing is learned: `used_bytes` holds only part of
        this tier's files then, and what fits would be learned as one file."""
        target = self._target(ns, key)
        error = write(target)
        if error is not None and error.errno == errno.ENOENT and not target.mkdir:
            self._dirs.discard(target.directory)
            target = self._target(ns, key)
            error = write(target)
        if error is not None and error.errno in _SPACE_ERRNOS:
            self.counters.space_errors += 1  # one an eviction cures does not hold off the recovery
            self._evict_bytes(max(4 * size, self.used_bytes // 100))
            target = self._target(ns, key)
            error = write(target)
            if error is not None and error.errno in _SPACE_ERRNOS:  # given up: a miss later, never a lost entry
                self._note_space_error()
                if self.scan_done.is_set():
                    self._learn_capacity(size)
        if error is not None:
            self._dirs.discard(target.directory)
            return error
        self._dirs.add(target.directory)
        self._remember(ns, key, size)
        with self._lock:
            self._unreadable.pop(self._ik(ns, key), None)
        return None

    def _adopt(self, ns: str, key: bytes) -> bool:
        """Index the file of (ns, key) if one is in place after a failed write (its writer
        process was killed after its rename, or another node wrote it), unless that file is
        one this tier cannot read (the one in place before, still)."""
        ik = self._ik(ns, key)
        if ik in self._evicting or self._is_unreadable(ik):
            return False
        return self._index_in_place(ns, key)  # used now: just written

    def _index_in_place(self, ns: str, key: bytes) -> bool:
        """Index the file of (ns, key) as used now, if one is there, of a size an index value
        holds (`_SIZE_MASK`: no KV file of ours is larger)."""
        try:
            st = self.io.stat_path(self.path_of(ns, key))
        except OSError:
            return False
        if not tree.is_regular(st):  # a link, a FIFO...: never a hit
            self._skip_untrusted(ns, key, tree.Untrusted(self.path_of(ns, key), tree.kind_of(st.st_mode)))
            return False
        if st.st_size > _SIZE_MASK:
            return False
        self._remember(ns, key, st.st_size)
        return True

    def _skip_untrusted(self, ns: str, key: bytes, exc: tree.Untrusted) -> None:
        """Something not an entry file stands at (ns, key)'s name, or on the way to it: a miss,
        out of the index and not adopted again (until written, or a restart), counted, said."""
        self.counters.untrusted_files += 1
        self._forget(ns, key, unreadable_s=math.inf)
        self._warn(exc, f"skipped a name under {self.root}",
                   "it is never a hit; someone who can write the storage directory put it there (see hpkv doctor)")

    def _note_space_error(self) -> None:
        with self._lock:  # `_recover_capacity` reads it under the lock: it cannot undo what is learned now
            self.counters.space_errors += 1
            self._space_error_at = time.monotonic()

    def _learn_capacity(self, size: int) -> None:
        """The file system had no room (or the quota was spent) with `used_bytes` of this tier's
        files on it, even after an eviction: that is what fits, whatever HPKV_KV_STORAGE_SIZE said
        (auto on a shared file system of petabytes, say, under a user quota). Only lowered, and
        to at least one file, so the tier goes on writing what fits; back to what it was sized to once
        CAPACITY_RECOVERY_S pass without another such error (others' files, which took the room,
        may be gone by then)."""
        with self._lock:
            learned = max(self.used_bytes, size)
            if learned >= self.capacity_bytes:
                return
            self.capacity_bytes = learned
            first, self._capacity_learned = not self._capacity_learned, True
        if first:
            log.warning("the file system under %s has no room for more KV files (full, or a quota) with %d bytes of "
                        "them there: the storage tier now holds at most that, not the %d bytes it was sized to "
                        "(HPKV_KV_STORAGE_SIZE=%s), until %.0f minutes pass without such an error, when it tries "
                        "that size again. Set HPKV_KV_STORAGE_SIZE below the space (or quota) HPKV may use there",
                        self.root, learned, self._sized_bytes,
                        "auto" if self.config.capacity_bytes is None else self.config.capacity_bytes,
                        CAPACITY_RECOVERY_S / 60)

    def _recover_capacity(self) -> None:
        with self._lock:  # checked again here: a space error just before must keep what it learned
            if not self._capacity_learned or time.monotonic() - self._space_error_at < CAPACITY_RECOVERY_S:
                return
            learned, self.capacity_bytes, self._capacity_learned = self.capacity_bytes, self._sized_bytes, False
        log.info("no room errors under %s for %.0f minutes: the storage tier holds up to %d bytes again (it held "
                 "at most %d since the last one)", self.root, CAPACITY_RECOVERY_S / 60, self._sized_bytes, learned)

    def _target(self, ns: str, key: bytes) -> FileTarget:
        final = self.path_of(ns, key)
        directory = final[: final.rfind("/")]
        tmp = f"{directory}/.{key.hex()}.{self._node}.{os.getpid()}.{next(_TEMP_SEQ)}.tmp"
        return FileTarget(final, tmp, directory, mkdir=directory not in self._dirs, root=str(self.root))

    # -- index, capacity, eviction ------------------------------------------------------------

    def _value(self, size: int, used_s: float) -> int:
        """An index value: `size` and the minute of `used_s` (the wall clock, as file mtimes are)
        in one int, shared by every file of that size and minute. So files are given the minute
        they are used, found or scanned in, never their own mtimes: millions of distinct ints."""
        value = (int(used_s // 60) << _SIZE_BITS) | size
        if len(self._values) >= MAX_VALUES:  # bounded: values already indexed stay, only less shared
            self._values.clear()
        return self._values.setdefault(value, value)

    def _remember(self, ns: str, key: bytes, size: int) -> None:
        """Index (ns, key) as the most recently used, now."""
        ik = self._ik(ns, key)
        value = self._value(size, time.time())
        with self._lock:
            old = self._lru.get(ik)
            self._lru[ik] = value
            self.used_bytes += size - (old & _SIZE_MASK if old is not None else 0)
            self._lru.move_to_end(ik)

    def _forget(self, ns: str, key: bytes, unreadable_s: float | None = None) -> None:
        """Out of the index; and marked unreadable for `unreadable_s` if given, in the same hold
        of the lock, so that no lookup adopts the file in between."""
        ik = self._ik(ns, key)
        with self._lock:
            value = self._lru.pop(ik, None)
            if value is not None:
                self.used_bytes -= value & _SIZE_MASK
            self._note_gone([ik])
            if unreadable_s is not None:
                self._mark_unreadable(ik, unreadable_s)

    def _note_gone(self, keys) -> None:
        """Caller holds the lock."""
        if self._gone is not None:
            self._gone.update(keys)

    def _discard(self, ns: str, key: bytes, path: str, reason: str) -> None:
        log.warning("removing bad KV file %s: %s (the request recomputes)", path, reason)
        self.counters.bad_files += 1
        self._forget(ns, key)
        try:
            self._unlink(ns, key)
        except OSError:
            pass

    def _make_room(self, size: int) -> bool:
        """Count `size` bytes in flight and evict until they fit; False if they never can."""
        if self._capacity_learned and time.monotonic() - self._space_error_at >= CAPACITY_RECOVERY_S:
            self._recover_capacity()
        if size > self.capacity_bytes:
            return False
        with self._lock:
            self._inflight_bytes += size
        self._evict(lambda freed: self.used_bytes + self._inflight_bytes - self.capacity_bytes)
        return True

    def _evict_bytes(self, num_bytes: int) -> None:
        self._evict(lambda freed: num_bytes - freed)

    def _unpop(self, victims: list[tuple[bytes, int]]) -> None:
        """Victims an eviction popped and did not get to (something raised): back at the old
        end of the index, counted again, no longer misses to lookups."""
        if not victims:
            return
        with self._lock:
            for ik, value in reversed(victims):
                self._evicting.discard(ik)
                if ik not in self._lru:
                    self._lru[ik] = value
                    self._lru.move_to_end(ik, last=False)
                    self.used_bytes += value & _SIZE_MASK

    def _evict(self, excess: Callable[[int], int]) -> None:
        """Evict the least recently used files while `excess(bytes freed so far)`, called with the
        lock held, is positive. Where the directory is `shared`, a victim's file is looked at
        first: one another node read since this index last knew it used (reads refresh the
        mtime) goes to the recent end instead. At most SPARE_CHECKS_PER_PASS victims are looked
        at, each once, so a pass ends. Until its unlink a victim is a miss to lookups
        (`_evicting`); one written again meanwhile is left in place."""
        freed = 0
        checked: set[bytes] = set()
        while True:
            victims = []
            with self._lock:
                removals = self._removals
                over = excess(freed)
                while self._lru and over > 0:
                    ik, value = self._lru.popitem(last=False)
                    self.used_bytes -= value & _SIZE_MASK
                    over -= value & _SIZE_MASK
                    victims.append((ik, value))
                    self._evicting.add(ik)
                self._note_gone([ik for ik, _ in victims])
            spared, kept = [], False
            handled: set[bytes] = set()
            try:
                for ik, value in victims:
                    path = self.path_of(*self._split(ik))
                    if self.shared and ik not in checked and len(checked) < SPARE_CHECKS_PER_PASS:
                        checked.add(ik)
                        used_s = self._used_since(path, value)
                        if used_s is not None:  # known used now (later, where a clock is ahead: spared once)
                            spared.append((ik, self._value(value & _SIZE_MASK, max(used_s, time.time()))))
                            with self._lock:
                                self._evicting.discard(ik)
                            handled.add(ik)
                            continue
                    if ik in self._lru:  # written again since it was popped: unlinked, it would be a hit with no file
                        kept = True
                        with self._lock:
                            self._evicting.discard(ik)
                        handled.add(ik)
                        continue
                    try:
                        self._unlink(*self._split(ik))
                    except OSError:
                        pass  # another node evicted it first (or a link stands there: not followed)
                    with self._lock:
                        self._evicting.discard(ik)
                    handled.add(ik)
                    freed += value & _SIZE_MASK
                    self.counters.evictions += 1
            finally:
                self._unpop([(ik, value) for ik, value in victims if ik not in handled])
            if not spared:
                if kept:  # what it holds counts again: evict on
                    continue
                return
            with self._lock:
                removed = self._removed_since(removals)
                for ik, value in spared:
                    if removed is None or ik[:2] in removed:  # removed while it was looked at: its file is going
                        freed += value & _SIZE_MASK
                    # Not written again, nor found unreadable, while it was looked at.
                    elif ik not in self._lru and not self._is_unreadable(ik, locked=True):
                        self._lru[ik] = value
                        self.used_bytes += value & _SIZE_MASK

    def _removed_since(self, removals: int) -> set[bytes] | None:
        """The index key prefixes removed since `removals` (None: all namespaces). Caller holds
        the lock."""
        num = self._removals - removals
        if num > len(self._removed):
            return None
        recent = list(self._removed)[len(self._removed) - num :] if num else []
        return None if None in recent else set(recent)

    def _used_since(self, path: str, value: int) -> float | None:
        """The mtime of `path` where it is later than the minute `value` knows, with a minute to
        spare for clocks and for reads refreshing it at most every TOUCH_EVERY_S; else None."""
        try:
            mtime = self.io.stat_path(path).st_mtime
        except OSError:
            return None
        return mtime if mtime >= ((value >> _SIZE_BITS) + _SLACK_MINUTES) * 60 else None

    def remove(self, ns: str | None = None) -> int:
        """Delete every entry file (of one namespace), including files other nodes wrote; only
        inside the tree (`scan.remove_entries`)."""
        prefix = None if ns is None else self._ik(ns, b"")
        with self._lock:
            self._removals += 1
            self._removed.append(prefix)
            for k in [k for k in self._lru if prefix is None or k[:2] == prefix]:
                self.used_bytes -= self._lru.pop(k) & _SIZE_MASK
            if self._gone is not None:  # what a running start-up scan found here must not come back
                self._cleared.add(ns)
        return scan.remove_entries(self.root, ns)

    def stats(self) -> dict[str, int | bool]:
        return {
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes,
            "num_entries": len(self._lru),
            "index_ready": self.scan_done.is_set(),
            "direct_io": self.direct,
            "write_budget_bytes": self.config.write_budget_bytes,
            "write_budget_available_bytes": self.budget.available(),
            **vars(self.counters),
        }

    # -- start-up scan ------------------------------------------------------------------------

    def _scan(self) -> None:
        """Index every entry file oldest-first (by mtime) and remove leftover temporaries."""
        started = time.monotonic()
        # What the index knows of a file scanned: it was there now. Known as used the slack
        # before, so that a read elsewhere any time after the scan spares it from an eviction.
        known_s = time.time() - _SLACK_MINUTES * 60
        found = scan.walk(self.root, self._node, self._ik,
                          lambda size: self._value(size, known_s) if size <= _SIZE_MASK else None, self.counters)
        self._merge(found)
        if found.untrusted is not None:
            log.warning("the storage scan skipped %d names under %s that are not what HPKV puts there, e.g. %s: "
                        "HPKV follows no link and reads only regular files in the storage tree, so none is a hit; "
                        "someone who can write the storage directory put them there (see hpkv doctor)",
                        self.counters.untrusted_files, self.root, found.untrusted)
        if self.config.capacity_bytes is None:
            self._sized_bytes += int(self.used_bytes * AUTO_CAPACITY_FRACTION)
            self.capacity_bytes = self._sized_bytes  # none learned yet: not while the scan runs
            if self.capacity_bytes < SMALL_AUTO_CAPACITY:
                fate = "are not written" if self.capacity_bytes == 0 else "are evicted soon after they are written"
                log.warning("the storage tier holds only %d bytes: HPKV_KV_STORAGE_SIZE=auto takes %d%% of the "
                            "space free under %s when the server starts, and there was little; KV files %s. Free "
                            "space there and restart the server, or set HPKV_KV_STORAGE_SIZE",
                            self.capacity_bytes, round(AUTO_CAPACITY_FRACTION * 100), self.root, fate)
        if len(found.keys) > 10_000 or time.monotonic() - started > 2.0:
            log.info("storage index ready: %d files in %.1f s", len(found.keys), time.monotonic() - started)
        if self.used_bytes > self.capacity_bytes:
            self._evict_bytes(self.used_bytes - self.capacity_bytes)
        self.scan_done.set()

    def _merge(self, found: scan.Found) -> None:
        """Add what the walk found, newest first, each to the old end, behind what is known,
        except what was removed meanwhile. In slices, so that lookups and writes are not held
        up for the whole merge of a large directory."""
        newest_first = np.argsort(-np.frombuffer(found.mtimes, dtype=np.float64), kind="stable")  # ties: walk order
        for start in range(0, len(newest_first), _MERGE_SLICE):
            with self._lock:
                gone = self._gone
                cleared = {self._ns_ids.get(ns) for ns in self._cleared if ns is not None}  # no new ids: lock held
                if None in self._cleared:
                    break
                for i in newest_first[start : start + _MERGE_SLICE].tolist():
                    k = found.keys[i]
                    if k in self._lru or k in gone or k[:2] in cleared:
                        continue
                    value = found.values[i]
                    self._lru[k] = value
                    self._lru.move_to_end(k, last=False)
                    self.used_bytes += value & _SIZE_MASK
        with self._lock:
            self._gone = None

    def _warn(self, exc: OSError | None, what: str, then: str = "the entry stays in DRAM only") -> None:
        """Say an I/O error, at most every WARN_EVERY_S per kind: once for the life of the process
        hid a device that failed again hours later; every time flooded the log."""
        code = exc.errno if exc else 0
        now = time.monotonic()
        if now - self._warned_at.get((what, code), -math.inf) < WARN_EVERY_S:
            return
        self._warned_at[(what, code)] = now
        log.warning("%s: %s; %s (errors of this kind are counted, and said at most every %.0f minutes)", what,
                    exc.strerror if exc else "no room within HPKV_KV_STORAGE_SIZE", then, WARN_EVERY_S / 60)


_MERGE_SLICE = 1 << 16  # files merged into the index per hold of the lock
_REMOVALS_KEPT = 64  # removes an eviction tells apart by namespace; past that many, all count as removed
