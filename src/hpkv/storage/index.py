"""The storage index: the entry files this tier counts as hits, least recently used first.

An index key is a namespace's number (NS_ID_BYTES) and the engine key in one bytes object
(`key`); an index value packs a file's size and the minute this index last knew it used in one int, shared
by every file of that size and minute (`value_of`; read with `size_of`, `used_minute_s`). Why
packed: a directory may hold millions of files.

Entries in use (`touch(..., in_use=True)`: a promotion is about to read them; `marks.InUse`)
are never popped as victims until `in_use.done`: the files of other nodes, however many, cannot
evict what a reader is about to read.
Besides the order it keeps what must not become a hit again: victims an eviction popped and has
not unlinked yet (`being_evicted`), files this tier cannot read (`marks.UnreadableMarks`, until a
time or for good), and, while the start-up scan runs, what left the index meanwhile
(`add_scanned` does not bring it back).

Namespace numbers (`numbers.NamespaceNumbers`) are freed once unused, with the unreadable marks
of their keys: namespaces come and go for ever.

Primitives: `key`/`split`, `in`, `items`, `has` (the bare membership test, for walks over many keys),
`remember`, `forget`, `touch`, `in_use` (`InUse`), `was_read`, `pop_victims`/`evicted`/`unpop`/`put_back` (an
eviction's steps), `oldest`/`pop_if_oldest`/`refresh` (retention's), `remove`,
`add_scanned`/`scan_merged`; `numbers` (`pin`/`unpin`), `busy`; `used_bytes`. Thread-safe: one lock
(`lock`), which the marks share.
Must not know: the file system, capacity, how files are read or written.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

from .marks import MAX_UNREADABLE, InUse, UnreadableMarks
from .numbers import MAX_NAMESPACES, NS_ID_BYTES, NamespaceNumbers
from .parts import PartLedger

SIZE_BITS = 40  # an index value: the file's size in its low bits, the minute above them
MAX_FILE_BYTES = (1 << SIZE_BITS) - 1  # a file larger than this (1 TiB) is no KV file of ours: never indexed
MAX_VALUES = 1 << 16  # distinct index values kept for sharing (`value_of`)
REMOVALS_KEPT = 64  # removes an eviction tells apart by namespace; past that many, all count as removed

Clock = Callable[[], float]
Victims = list[tuple[bytes, int]]  # (index key, index value)


def size_of(value: int) -> int:
    """The file size an index value holds."""
    return value & MAX_FILE_BYTES


def used_minute_s(value: int) -> float:
    """The start of the minute (wall clock seconds) an index value knew its file used."""
    return (value >> SIZE_BITS) * 60


class FileIndex:
    def __init__(
        self,
        where: str,
        clock: Clock = time.monotonic,
        wall_clock: Clock = time.time,
        max_marks: int = MAX_UNREADABLE,
        max_namespaces: int = MAX_NAMESPACES,
    ) -> None:
        self._where = where  # the root, for messages
        self._wall_clock = wall_clock  # file mtimes are wall clock times: so are the minutes here
        self.lock = threading.Lock()
        self._lru: OrderedDict[bytes, int] = OrderedDict()
        self.has: Callable[[bytes], bool] = self._lru.__contains__  # `in` without a Python call
        self.used_bytes = 0
        self.marks = UnreadableMarks(self.lock, clock, max_marks)
        # Numbers are not taken back while the start-up scan is unmerged or victims are out; the
        # marks of their keys go with them.
        self.numbers = NamespaceNumbers(
            where,
            self.lock,
            max_namespaces,
            blocked=lambda: self._gone is not None or bool(self._evicting),
            freed=lambda ids: self.marks.drop_prefixes(ids),
        )
        self.busy = self.numbers.busy
        self._counted, self._uncounted = self.numbers.counted, self.numbers.uncounted
        self._values: dict[int, int] = {}  # one int object per (size, minute), not one per file
        self._evicting: set[bytes] = set()
        self.in_use = InUse(self.lock)
        # `remove`s so far, and the prefixes of the last ones (None: all): a victim an eviction
        # spared must not come back past a remove of its namespace.
        self._removals = 0
        self._removed: deque[bytes | None] = deque(maxlen=REMOVALS_KEPT)
        # Until the start-up scan is merged: keys that left the index, namespaces removed (None: all).
        self._gone: set[bytes] | None = set()
        self._cleared: set[str | None] = set()
        self.scan_known_s: float | None = None  # the time the start-up scan gave what it found
        # In a root shared by a cluster (`parts`): bytes per part, and which victims this node may take.
        self.ledger: PartLedger | None = None

    @property
    def counted_bytes(self) -> int:
        """What counts against this tier's capacity: every indexed file, or in a cluster the
        files of the parts this node owns (`parts.PartLedger`)."""
        return self.used_bytes if self.ledger is None else self.ledger.owned_bytes

    def __contains__(self, ik: bytes) -> bool:
        return ik in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def items(self) -> list[tuple[bytes, int]]:
        """(index key, index value) of every file, least recently used first: a snapshot."""
        with self.lock:
            return list(self._lru.items())

    def key(self, ns: str, key: bytes) -> bytes:
        """The index key of (ns, key). StorageError when every namespace number is in use."""
        ns_id = self.numbers.ids.get(ns)
        if ns_id is None:
            with self.lock:
                ns_id = self.numbers.ids.get(ns)
                if ns_id is None:
                    ns_id = self.numbers.new_id(ns)
        return ns_id + key

    def split(self, ik: bytes) -> tuple[str, bytes]:
        """(ns, key) of an index key."""
        return self.numbers.name_of(ik), ik[NS_ID_BYTES:]

    def value_of(self, size: int, used_s: float) -> int:
        """An index value: `size` and the minute of `used_s` (wall clock), shared by every file of
        that size and minute. So files get the minute they are used, found or scanned in, never
        their own mtimes: millions of distinct ints."""
        value = (int(used_s // 60) << SIZE_BITS) | size
        if len(self._values) >= MAX_VALUES:  # bounded: values already indexed stay, only less shared
            self._values.clear()
        return self._values.setdefault(value, value)

    def remember(self, ik: bytes, size: int) -> None:
        """Index `ik` as the most recently used, now."""
        value = self.value_of(size, self._wall_clock())
        with self.lock:
            old = self._lru.get(ik)
            self._lru[ik] = value
            _count(self, ik, size - (size_of(old) if old is not None else 0), 0 if old is not None else 1)
            self._lru.move_to_end(ik)
            if old is None:
                self._counted(ik)

    def forget(self, ik: bytes, unreadable_s: float | None = None) -> None:
        """Out of the index; and marked unreadable for `unreadable_s` if given, in the same hold
        of the lock, so that no lookup adopts the file in between."""
        with self.lock:
            value = self._lru.pop(ik, None)
            if value is not None:
                _count(self, ik, -size_of(value), -1)
                self._uncounted(ik)
            if self._gone is not None:
                self._gone.add(ik)
            if unreadable_s is not None:
                self.marks.mark(ik, unreadable_s)

    def touch(self, prefix: bytes, keys: Iterable[bytes], in_use: bool = False) -> None:
        """Make `prefix + key` of each key indexed the most recently used, in the order given;
        with `in_use`, also never a victim until as many `in_use.done(ik)` (indexed now or later)."""
        with self.lock:
            for key in keys:
                if in_use:
                    self.in_use.add(prefix + key)
                if prefix + key in self._lru:
                    self._lru.move_to_end(prefix + key)

    def was_read(self, ik: bytes) -> None:
        """`ik`'s file was just read whole: readable (no mark), and the most recently used."""
        with self.lock:
            self.marks.unmark(ik, locked=True)
            value = self._lru.get(ik)
            if value is not None:
                self._lru[ik] = self.value_of(size_of(value), self._wall_clock())
                self._lru.move_to_end(ik)

    def being_evicted(self, ik: bytes) -> bool:
        """Popped by an eviction and not unlinked yet: a lookup's `stat` must not adopt it."""
        return ik in self._evicting

    def pop_victims(self, excess: Callable[[int], int], freed: int) -> tuple[Victims, int]:
        """Pop the least recently used not in use while `excess(freed)`, less what is popped, is positive;
        with the number of removes so far (for `put_back`). `excess` is called with the lock held."""
        victims: Victims = []
        with self.lock:
            removals = self._removals
            over = excess(freed)
            ledger = self.ledger
            evictable = None if ledger is None else ledger.evictable_now()
            if over > 0 and (ledger is None or evictable is not None):
                for ik, value in self._lru.items():  # oldest first; those in use stay where they are
                    if over <= 0:
                        break
                    if ik not in self.in_use and (evictable is None or evictable[ledger.part_of_ik(ik)]):  # type: ignore[union-attr]
                        victims.append((ik, value))
                        over -= size_of(value)
            for ik, value in victims:
                del self._lru[ik]
                self._uncounted(ik)
                _count(self, ik, -size_of(value), -1)
                self._evicting.add(ik)
            if self._gone is not None:
                self._gone.update(ik for ik, _ in victims)
        return victims, removals

    def oldest(self) -> tuple[bytes, int] | None:
        """(index key, index value) of the least recently used file, or None when empty."""
        with self.lock:
            return next(iter(self._lru.items()), None)

    def pop_if_oldest(self, ik: bytes, value: int) -> bool:
        """Pop `ik` as an eviction victim if it is still the least recently used, as `value`, and
        not in use."""
        with self.lock:
            if next(iter(self._lru.items()), None) != (ik, value) or ik in self.in_use:
                return False
            self._lru.popitem(last=False)
            self._uncounted(ik)
            _count(self, ik, -size_of(value), -1)
            self._evicting.add(ik)
            if self._gone is not None:
                self._gone.add(ik)
        return True

    def refresh(self, ik: bytes, value: int, used_s: float) -> None:
        """`ik`, still `value`, was used at `used_s` (elsewhere): the most recently used now."""
        with self.lock:
            if self._lru.get(ik) == value:
                self._lru[ik] = self.value_of(size_of(value), used_s)
                self._lru.move_to_end(ik)

    def evicted(self, ik: bytes) -> None:
        """A victim settled (unlinked, spared or kept): no longer a miss to lookups."""
        with self.lock:
            self._evicting.discard(ik)

    def unpop(self, victims: Victims) -> None:
        """Victims an eviction popped and did not get to (something raised): back at the old end,
        counted again, no longer misses to lookups."""
        if not victims:
            return
        with self.lock:
            for ik, value in reversed(victims):
                self._evicting.discard(ik)
                if ik not in self._lru:
                    self._lru[ik] = value
                    self._lru.move_to_end(ik, last=False)
                    _count(self, ik, size_of(value), 1)
                    self._counted(ik)

    def put_back(self, spared: Victims, removals: int) -> int:
        """Index the victims an eviction spared (at the recent end), unless written again or
        found unreadable meanwhile, or removed since `removals` (their files are going: their
        bytes, returned, count as freed)."""
        freed = 0
        with self.lock:
            removed = self._removed_since(removals)
            for ik, value in spared:
                if removed is None or ik[:NS_ID_BYTES] in removed:
                    freed += size_of(value)
                elif ik not in self._lru and not self.marks.is_marked(ik, locked=True):
                    self._lru[ik] = value
                    _count(self, ik, size_of(value), 1)
                    self._counted(ik)
        return freed

    def remove(self, ns: str | None) -> None:
        """Forget every file (of namespace `ns`)."""
        with self.lock:
            # No number given out for a namespace the index does not know: b"" prefixes no key.
            prefix = None if ns is None else self.numbers.ids.get(ns, b"")
            self._removals += 1
            self._removed.append(prefix)
            for k in [k for k in self._lru if prefix is None or k[:NS_ID_BYTES] == prefix]:
                _count(self, k, -size_of(self._lru.pop(k)), -1)
                self._uncounted(k)
            if self._gone is not None:  # what a running start-up scan found here must not come back
                self._cleared.add(ns)

    def add_scanned(self, found: Iterable[tuple[bytes, int]]) -> bool:
        """Index files the start-up scan found, each at the old end, behind what is known, except
        what left the index or was removed since the scan began. False, adding nothing, once
        every namespace was removed."""
        with self.lock:
            if None in self._cleared:
                return False
            gone = self._gone if self._gone is not None else set()
            cleared = {self.numbers.ids.get(ns) for ns in self._cleared if ns is not None}  # no new ids: lock held
            for ik, value in found:
                if ik in self._lru or ik in gone or ik[:NS_ID_BYTES] in cleared:
                    continue
                self._lru[ik] = value
                self._lru.move_to_end(ik, last=False)
                _count(self, ik, size_of(value), 1)
                self._counted(ik)
        return True

    def scan_merged(self) -> None:
        """The start-up scan is in: stop keeping what left the index for it (later walks of the
        root, `rescan`, add what they find now)."""
        with self.lock:
            self._gone = None
            self._cleared = set()

    def _removed_since(self, removals: int) -> set[bytes] | None:
        """The prefixes removed since `removals` (None: all namespaces). Caller holds the lock."""
        num = self._removals - removals
        if num > len(self._removed):
            return None
        recent = list(self._removed)[len(self._removed) - num :] if num else []
        return None if None in recent else {p for p in recent if p is not None}


def _count(index: FileIndex, ik: bytes, num_bytes: int, num_files: int) -> None:
    """`num_bytes` more (or fewer) indexed for `ik`, a file more (1), fewer (-1) or the same (0).
    Caller holds the lock."""
    index.used_bytes += num_bytes
    if index.ledger is not None:
        index.ledger.add(ik, num_bytes, num_files)
