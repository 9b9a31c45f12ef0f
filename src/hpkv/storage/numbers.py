"""The namespace numbers of the storage index: the short prefix of each index key that stands for
its namespace, given out on first use and taken back once unused, so that namespaces may come and
go for ever (an engine per model, a model per fine-tune) without running out.

A number is in use while a key of it is indexed (`counted`/`uncounted`, kept by the index as keys
enter and leave its order), while its namespace is pinned (registered with the store: lookups
hold its prefix), and while any operation holds index keys outside the index's lock (`busy`: a
walk of the root, an eviction, a retention pass: what they hold must not come back as another
namespace's). Unused numbers are taken back in batches (`reclaim`), when a new namespace needs one
and none is left or a RECLAIM_SHARE of those given out may be unused: a batch costs one pass
over the candidates, so a namespace that comes and goes costs O(1) in all.

Primitives: `ids` (namespace -> number, read without the lock), `new_id`, `name_of`, `pin`,
`unpin`, `busy`, `counted`, `uncounted`, `reclaim`; `changes`, told (ns, key, entered) of each key
as it enters or leaves the index (the tier journal's hook; None: nobody journals). Not
thread-safe by itself: callers hold the index's lock (`busy`, `pin`, `unpin` take it).
Must not know: the index's order, files.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from ..errors import StorageError

NS_ID_BYTES = 3  # a 3-byte prefix costs a key no more memory than 2 (allocations are 8-byte rounded)
MAX_NAMESPACES = 1 << (8 * NS_ID_BYTES)
RECLAIM_SHARE = 8  # take back unused numbers once they may be 1/8 of those given out
RECLAIM_MIN = 64  # ... and at least this many have been given out


class NamespaceNumbers:
    def __init__(
        self,
        where: str,
        lock: threading.Lock,
        max_namespaces: int = MAX_NAMESPACES,
        blocked: Callable[[], bool] = lambda: False,
        freed: Callable[[set[bytes]], None] = lambda ids: None,
    ) -> None:
        """`blocked()`: whether the index holds keys outside its order now (nothing is taken back
        then); `freed(ids)`: numbers taken back (the index drops what else it keeps of them)."""
        self._where = where  # the root, for messages
        self._lock = lock
        self._blocked = blocked
        self._freed = freed
        self._max = min(max_namespaces, MAX_NAMESPACES)
        self.ids: dict[str, bytes] = {}
        self._names: list[str | None] = []  # by number; None: free
        self._free: list[bytes] = []
        self._per_ns: dict[bytes, int] = {}  # keys indexed, by number (absent: none)
        self._idle: set[bytes] = set()  # numbers that may be unused now (`reclaim` checks)
        self._pinned: set[str] = set()
        self._busy = 0
        self.changes: Callable[[str, bytes, bool], None] | None = None

    def __len__(self) -> int:
        """Numbers given out and not taken back."""
        return len(self.ids)

    def name_of(self, ik: bytes) -> str:
        ns = self._names[int.from_bytes(ik[:NS_ID_BYTES], "big")]
        if ns is None:  # a bug: a number taken back while a key of it was held
            raise StorageError(f"an index key of a namespace number taken back, under {self._where}")
        return ns

    def new_id(self, ns: str) -> bytes:
        """A number for `ns`: a free one, a new one, or one taken back (`reclaim`). StorageError
        when every one is in use. Caller holds the lock."""
        given = len(self._names) - len(self._free)
        if not self._free and (
            len(self._names) >= self._max or len(self._idle) * RECLAIM_SHARE >= given >= RECLAIM_MIN
        ):
            self.reclaim()
        if self._free:
            ns_id = self._free.pop()
            self._names[int.from_bytes(ns_id, "big")] = ns
        elif len(self._names) < self._max:
            ns_id = len(self._names).to_bytes(NS_ID_BYTES, "big")
            self._names.append(ns)
        else:
            raise StorageError(
                f"all {self._max} namespace numbers of the storage index under {self._where} are in use "
                "(namespaces with files there, or registered now)"
                + ("; a walk of the root or an eviction is running: try again" if self._busy else "")
            )
        self.ids[ns] = ns_id
        self._idle.add(ns_id)  # unused until a key of it is indexed, or it is pinned
        return ns_id

    def reclaim(self) -> set[bytes]:
        """Take back the numbers nothing uses; those taken back. Caller holds the lock."""
        if self._busy or self._blocked():
            return set()
        freed = set()
        for ns_id in self._idle:
            ns = self._names[int.from_bytes(ns_id, "big")]
            if ns is None or ns_id in self._per_ns or ns in self._pinned:
                continue
            del self.ids[ns]
            self._names[int.from_bytes(ns_id, "big")] = None
            freed.add(ns_id)
        self._idle.clear()
        self._free.extend(freed)
        if freed:
            self._freed(freed)
        return freed

    def pin(self, ns: str) -> None:
        with self._lock:
            self._pinned.add(ns)

    def unpin(self, ns: str) -> None:
        with self._lock:
            self._pinned.discard(ns)
            ns_id = self.ids.get(ns)
            if ns_id is not None and ns_id not in self._per_ns:
                self._idle.add(ns_id)

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """While it lasts, no number is taken back: the caller holds index keys outside the lock."""
        with self._lock:
            self._busy += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1

    def counted(self, ik: bytes) -> None:
        """`ik` entered the index. Caller holds the lock."""
        ns_id = ik[:NS_ID_BYTES]
        self._per_ns[ns_id] = self._per_ns.get(ns_id, 0) + 1
        if self.changes is not None:
            self.changes(self.name_of(ik), ik[NS_ID_BYTES:], True)

    def uncounted(self, ik: bytes) -> None:
        """`ik` left the index. Caller holds the lock."""
        if self.changes is not None:  # named before its number may be taken back
            self.changes(self.name_of(ik), ik[NS_ID_BYTES:], False)
        ns_id = ik[:NS_ID_BYTES]
        num = self._per_ns[ns_id] - 1
        if num:
            self._per_ns[ns_id] = num
        else:
            del self._per_ns[ns_id]
            self._idle.add(ns_id)
