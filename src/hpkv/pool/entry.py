"""One entry of the DRAM tier: a key's pool slot and the state the tier and its room policies
read (`reserved`, `ready`, `refs`, `dead`, and `stamp`, its place in the LRU).

Owns: `DramEntry`. Written by the tier (`pool/dram_tier.py`) and its evictable entries (`pool/lru.py`)
only; everyone else reads.
Must not know: the index, the LRU, the policies, or the bytes in the slot.
"""

from __future__ import annotations


class DramEntry:
    __slots__ = ("ns", "key", "offset", "slot_bytes", "reserved", "ready", "refs", "dead", "stamp")

    def __init__(self, ns: str, key: bytes, offset: int, slot_bytes: int) -> None:
        self.ns = ns
        self.key = key
        self.offset = offset
        self.slot_bytes = slot_bytes
        self.reserved = True  # a writer owns the slot until commit or abort
        self.ready = False
        self.refs = 0
        self.dead = False  # out of the index; the slot is freed once nobody holds it
        self.stamp = 0

    @property
    def evictable(self) -> bool:
        return self.ready and self.refs == 0 and not self.dead
