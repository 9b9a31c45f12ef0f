"""Publishing entry files: room made first, the file written at a temporary name and renamed
into place (by `write_entry_file`, here or in a write-through process), then indexed.

A write the budget (HPKV_KV_STORAGE_WRITE_BUDGET) cannot pay for is not made (`over_budget`). A
directory removed under the tier (`rm -rf` of the root or a namespace) is made again, once (a
root moved away is not: `tree.Root`). A
full disk or quota (`ENOSPC`/`EDQUOT`) evicts 4 entries' worth or 1% of what this tier holds and
retries once: evicting again and again emptied whole shared directories on one quota error. Only a
retry that finds no room either teaches the capacity what fits (one "no room" alone is often a
moment's: a Lustre OST full for a while), and not while the start-up scan runs (this tier's files
are not all counted yet). A write that still fails is dropped (counted, said), never raised; one
reported failed whose file is in place all the same (a writer killed after its rename) is indexed.

Primitives: `Publisher.write_version`, `write_from`, `publish`, `publish_many` (first writes in one call).
Must not know: the pool, write-through processes (a `write` callable is given), how files are read.
"""

from __future__ import annotations

import errno
import functools
import threading
from collections.abc import Callable

from ..stats import StorageCounters
from . import format as fmt
from . import tree
from .budget import WriteBudget
from .capacity import CapacityPolicy
from .eviction import Evictor
from .fileio import ALIGN, FileTarget, aligned, write_entry_file
from .index import FileIndex
from .paths import EntryPaths
from .reading import ErrorLog, Reader

_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)

Write = Callable[[FileTarget], "OSError | None"]
WriteOne = Callable[[int, FileTarget], "OSError | None"]
WriteMany = Callable[[list[tuple[int, FileTarget]]], "list[OSError | None]"]
Item = tuple[str, bytes, int, int]  # ns, key, payload bytes, format version


class Publisher:
    def __init__(
        self,
        paths: EntryPaths,
        index: FileIndex,
        capacity: CapacityPolicy,
        evictor: Evictor,
        reader: Reader,
        budget: WriteBudget,
        counters: StorageCounters,
        errors: ErrorLog,
        fsync: str,
        scan_done: threading.Event,
    ) -> None:
        self._paths = paths
        self._index = index
        self._capacity = capacity
        self._evictor = evictor
        self._reader = reader
        self._budget = budget
        self._counters = counters
        self._errors = errors
        self._fsync = fsync
        self._scan_done = scan_done
        self._dirs: set[str] = set()  # directories known to exist: not made again for each file

    def write_version(self, payload_bytes: int) -> int:
        """The format version of new files: aligned for direct I/O when it can be."""
        return fmt.VERSION_ALIGNED if self._reader.direct and payload_bytes % ALIGN == 0 else fmt.VERSION

    def write_from(self, ns: str, key: bytes, payload: memoryview) -> bool:
        """Publish `payload` as (ns, key) from this process. False when it could not be written
        (counted, logged)."""
        version = self.write_version(len(payload))
        header = fmt.encode_header(bytes.fromhex(ns), key, payload, version)
        direct = version == fmt.VERSION_ALIGNED and aligned(payload)
        return self.publish(
            ns,
            key,
            len(payload),
            version,
            lambda target: write_entry_file(self._paths.io, target, [header, payload], self._fsync, direct),
        )

    def publish(self, ns: str, key: bytes, payload_bytes: int, version: int, write: Write) -> bool:
        """Make room for (ns, key) and have `write` put its file, in format `version`, at a target
        named here (`write_entry_file`'s contract: the whole file or nothing, the error returned,
        not raised). False when it could not be written (counted, logged); what `write` raises
        is raised, with nothing charged to the budget."""
        return self.publish_many(
            [(ns, key, payload_bytes, version)], lambda todo: [write(todo[0][1])], lambda _, target: write(target)
        )[0]

    def publish_many(self, items: list[Item], write_many: WriteMany, write_one: WriteOne) -> list[bool]:
        """`publish` for several entries (ns, key, payload_bytes, version) whose first writes go
        in one call, `write_many([(i, target)...])` for those there is room and budget for (i:
        the item's place in `items`; their errors, in order); retries go one by one to
        `write_one(i, target)`. Whether each was published.
        What a write raises is raised once every entry is settled (nothing charged for the one
        it concerns; the others are published or not as their own writes went)."""
        results = [False] * len(items)
        admitted = [(i, size) for i, size in enumerate(self._size(item) for item in items) if self._admit(size)]
        targets = [self._paths.target(items[i][0], items[i][1], self._dirs) for i, _ in admitted]
        try:
            errors = write_many([(i, target) for (i, _), target in zip(admitted, targets)]) if targets else []
        except BaseException:
            for _, size in admitted:
                self._budget.refund(size)
                self._capacity.release(size)
            raise
        raised: BaseException | None = None
        for (i, size), target, error in zip(admitted, targets, errors, strict=True):
            ns, key, payload_bytes, _ = items[i]
            try:
                retry = functools.partial(write_one, i)
                results[i] = self._settle(ns, key, size, payload_bytes, target, error, retry)
            except BaseException as exc:  # a retry's: e.g. no writer process, the caller may write it another way
                raised = raised or exc
                self._budget.refund(size)
            finally:
                self._capacity.release(size)
        if raised is not None:
            raise raised
        return results

    @staticmethod
    def _size(item: Item) -> int:
        _, key, payload_bytes, version = item
        return fmt.header_bytes(len(key), version) + payload_bytes

    def _admit(self, size: int) -> bool:
        """Charge the budget and make room for `size` bytes; False (counted) where either cannot."""
        if not self._budget.spend(size):
            self._counters.over_budget += 1
            return False
        if not self._make_room(size):
            self._budget.refund(size)
            self._counters.write_failures += 1
            return False
        return True

    def _settle(
        self,
        ns: str,
        key: bytes,
        size: int,
        payload_bytes: int,
        target: FileTarget,
        error: OSError | None,
        write: Write,
    ) -> bool:
        """After the first write of (ns, key) to `target` gave `error`: retry where that can help,
        index or adopt the file, count, say."""
        error = self._put(ns, key, size, write, target, error)
        published = error is None or self._adopt(ns, key)
        if error is None:
            self._counters.writes += 1
            self._counters.write_bytes += payload_bytes
        if published:
            return True
        if isinstance(error, tree.Untrusted):  # a link planted on the way: not followed
            self._counters.untrusted_files += 1
        self._errors.warn(error, f"cannot write KV files under {self._paths.root}")
        self._counters.write_failures += 1
        self._budget.refund(size)  # nothing was written
        return False

    def _make_room(self, size: int) -> bool:
        """Count `size` bytes in flight and evict until they fit; False if they never can."""
        if not self._capacity.reserve(size):
            return False
        self._evictor.evict(lambda freed: self._capacity.excess(self._index.counted_bytes))
        return True

    def _put(
        self, ns: str, key: bytes, size: int, write: Write, target: FileTarget, error: OSError | None
    ) -> OSError | None:
        """Index the file the first write put at `target`, retrying with `write` where `error`
        says a retry can help; the error where it could not."""
        if error is not None and error.errno == errno.ENOENT:
            renewed = self._paths.tree.check(create=True)  # the root removed: made again (never one replaced)
            if renewed or not target.mkdir:
                self._dirs.clear() if renewed else self._dirs.discard(target.directory)
                target = self._paths.target(ns, key, self._dirs)
                error = write(target)
        if error is not None and error.errno in _SPACE_ERRNOS:
            self._counters.space_errors += 1  # one an eviction cures does not hold off the recovery
            self._evictor.evict_bytes(max(4 * size, self._index.counted_bytes // 100))
            target = self._paths.target(ns, key, self._dirs)
            error = write(target)
            if error is not None and error.errno in _SPACE_ERRNOS:  # given up: a miss later, never a lost entry
                self._counters.space_errors += 1
                self._capacity.no_room()
                if self._scan_done.is_set():
                    self._capacity.learn(self._index.counted_bytes, size)
        if error is not None:
            self._dirs.discard(target.directory)
            return error
        self._dirs.add(target.directory)
        ik = self._index.key(ns, key)
        self._index.remember(ik, size)
        self._index.marks.unmark(ik)
        return None

    def _adopt(self, ns: str, key: bytes) -> bool:
        """Index the file of (ns, key) if one is in place after a failed write (its writer was
        killed after its rename, or another node wrote it), unless that file is one this tier
        cannot read (the one in place before, still)."""
        ik = self._index.key(ns, key)
        if self._index.being_evicted(ik) or self._index.marks.is_marked(ik):
            return False
        return self._reader.find_in_place(ns, key)  # used now: just written
