"""The policies a store is built with (`StorePolicy`): what a benchmark may vary, apart from the
mechanism. The defaults are the store's own.

Owns: `StorePolicy`; `PrefixOrder`, the order in which entries used together (a commit, a
lease's release) reach the DRAM tier's LRU; `BACKLOG_LIMIT_SHARE`, the share of the pool the
write backlog may pin. The room policy is the DRAM tier's (`pool/room.py`).
Must not know: the store's state or its lock.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from ..pool.room import OldestFirst, RoomPolicy

# Entries waiting for their write-through pin their pool slots, at most this share of the pool;
# past it a committed entry waits unpinned (deferred): a storage device slower than the engines
# must not pin the whole pool.
BACKLOG_LIMIT_SHARE = 0.5

T = TypeVar("T")


class PrefixOrder(enum.Enum):
    """How a prefix's entries, used together, reach the LRU (the last to reach it goes last)."""

    LAST_FIRST = "last first"  # the store's: eviction shortens a prefix from its end
    FIRST_FIRST = "first first"  # plain LRU in prefix order: a baseline for benchmarks

    def arrange(self, entries: Sequence[T]) -> Iterable[T]:
        """`entries` (in prefix order) in the order they are to be published or unpinned."""
        return reversed(entries) if self is PrefixOrder.LAST_FIRST else iter(entries)


@dataclass(frozen=True)
class StorePolicy:
    order: PrefixOrder = PrefixOrder.LAST_FIRST
    room: RoomPolicy = field(default_factory=OldestFirst)  # how the DRAM tier finds room
    backlog_share: float = BACKLOG_LIMIT_SHARE  # of the pool; math.inf: no limit (all pinned)

    def backlog_limit(self, pool_bytes: int) -> float:
        """Payload bytes the write backlog may pin."""
        return math.inf if math.isinf(self.backlog_share) else int(pool_bytes * self.backlog_share)
