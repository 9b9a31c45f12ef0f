"""Parts of the key space, and which of them this node owns, in a root many nodes share.

A part is a leaf directory name `<ab>/<cd>` (the first two bytes of the key, across namespaces):
PARTS = 65,536 of them, and the layout already files keys so, so a part's files are found by
listing its leaf directory in each namespace, nothing else. Keys are hashes: parts hold equal
shares of the files and of the writes.

Owners: each part belongs to the live member of highest rendezvous weight (HRW) for it
(`hrw_owners`): a join or a death moves only the parts that member gains or had, spread over all
the others. Each node computes the owners from its own view of the members (`members`).

`PartLedger` is what the index and the evictor consult: bytes and files indexed per part, the
parts this node owns (`owned`) and may evict in now (`evictable`: owned for `hold_s` at least,
and the node not fenced: `evict_until`, a monotonic deadline its membership moves forward), and
the bytes indexed in owned parts (`owned_bytes`, what counts against this node's quota).
Why a hold-off before evicting in a part gained: the previous owner lists the members at least
every `fresh_s` and stops evicting there as soon as its view gives the part away.

Files are also counted per leaf directory, (namespace number, part) (`dir_files`): what a pass's
listing of one is checked against, to find the files others removed there (`owner_pass`).

Primitives: `PARTS`, `part_of`, `hrw_owners`, `PartLedger` (`add`, `set_owned`, `refresh`,
`is_owned`, `may_evict`, `share`, `owned_bytes`, `dir_key`, `dir_files`).
Must not know: the file system, the index's order, how members are learned.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Callable

import numpy as np

from .numbers import NS_ID_BYTES

PARTS = 1 << 16


def part_of(key: bytes) -> int:
    """The part of an engine key: its leaf directory `<ab>/<cd>` as a number (`paths.where`
    pads keys under two bytes with zeros)."""
    return int.from_bytes(key[:2].ljust(2, b"\0"), "big")


def member_hash(member: str) -> int:
    return int.from_bytes(hashlib.blake2b(member.encode(), digest_size=8).digest(), "big")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 arrays (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def hrw_owners(members: list[str], parts: int = PARTS) -> np.ndarray:
    """For each part, the index in `members` of its owner (highest weight mix(mix(h) ^ part)).
    Ties (a 2^-64 chance) go to the first in `members`: callers pass them sorted."""
    best = np.full(parts, -1, dtype=np.int64)
    best_w = np.zeros(parts, dtype=np.uint64)
    ids = np.arange(parts, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i, member in enumerate(members):
            h = _mix(np.array([member_hash(member)], dtype=np.uint64))[0]
            w = _mix(ids ^ h)
            better = (w > best_w) | (best < 0)
            best[better] = i
            best_w[better] = w[better]
    return best


class PartLedger:
    """Per-part bookkeeping of one index in a shared root (see the module docstring). `add` is
    called with the index's lock held; the rest takes the ledger's own lock."""

    def __init__(self, hold_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.hold_s = hold_s
        self._clock = clock
        self._lock = threading.Lock()
        self.part_bytes = np.zeros(PARTS, dtype=np.int64)
        self.part_files = np.zeros(PARTS, dtype=np.int64)
        self.owned = np.zeros(PARTS, dtype=bool)
        self.evictable = np.zeros(PARTS, dtype=bool)
        self._own_since = np.full(PARTS, math.inf)
        self.owned_bytes = 0
        self.evict_until = -math.inf  # monotonic: the node is fenced from then (`members`)
        self._dir_files: dict[bytes, int] = {}  # `dir_key` -> files indexed there (none: absent)

    def add(self, ik: bytes, num_bytes: int, num_files: int) -> None:
        """A file of index key `ik` counted (`num_files` 1) or uncounted (-1). Index lock held."""
        part = self.part_of_ik(ik)
        self.part_bytes[part] += num_bytes
        self.part_files[part] += num_files
        if self.owned[part]:
            self.owned_bytes += num_bytes
        if num_files:
            where = self.dir_key(ik)
            num = self._dir_files.get(where, 0) + num_files
            if num > 0:
                self._dir_files[where] = num
            else:
                self._dir_files.pop(where, None)

    def set_owned(self, owned: np.ndarray, index_lock: threading.Lock) -> tuple[np.ndarray, np.ndarray]:
        """This node's view gives it `owned` now: (parts gained, parts lost). A part gained is
        evictable only `hold_s` from now; one lost is not evictable at once."""
        now = self._clock()
        with self._lock:
            gained = owned & ~self.owned
            lost = self.owned & ~owned
            self._own_since[gained] = now
            self._own_since[lost] = math.inf
            self.evictable &= owned
            with index_lock:
                self.owned = owned.copy()
                self.owned_bytes = int(self.part_bytes[owned].sum())
        return np.flatnonzero(gained), np.flatnonzero(lost)

    def refresh(self, evict_until: float, fenced: bool) -> None:
        """Ownership held long enough becomes evictable; a fenced node starts its holds again
        (a stall: the others may have taken its parts meanwhile)."""
        now = self._clock()
        with self._lock:
            if fenced:
                self._own_since[self.owned] = now
                self.evictable[:] = False
            else:
                self.evictable = self.owned & (now - self._own_since >= self.hold_s)
            self.evict_until = evict_until

    @staticmethod
    def part_of_ik(ik: bytes) -> int:
        return int.from_bytes(ik[NS_ID_BYTES : NS_ID_BYTES + 2].ljust(2, b"\0"), "big")

    @staticmethod
    def dir_key(ik: bytes) -> bytes:
        """The leaf directory of index key `ik`: its namespace number and its part's two bytes."""
        return ik[:NS_ID_BYTES] + ik[NS_ID_BYTES : NS_ID_BYTES + 2].ljust(2, b"\0")

    def dir_files(self, where: bytes) -> int:
        """Files indexed in the leaf directory `where` (`dir_key`)."""
        return self._dir_files.get(where, 0)

    def is_owned(self, ik: bytes) -> bool:
        return bool(self.owned[self.part_of_ik(ik)])

    def evictable_now(self) -> np.ndarray | None:
        """The parts this node may evict in now; None while it is fenced."""
        return self.evictable if self._clock() < self.evict_until else None

    def may_evict(self, ik: bytes) -> bool:
        """Whether this node may unlink `ik`'s file now: its part evictable, the node not fenced
        (asked again just before each unlink: an eviction may have been slow)."""
        return bool(self.evictable[self.part_of_ik(ik)]) and self._clock() < self.evict_until

    def share(self) -> float:
        """The share of the parts this node owns (its share of the capacity)."""
        return int(self.owned.sum()) / PARTS

    def owned_files(self) -> int:
        return int(self.part_files[self.owned].sum())

    def foreign_files(self) -> int:
        """Files indexed in parts this node does not own (it wrote or read them)."""
        return int(self.part_files[~self.owned].sum())
