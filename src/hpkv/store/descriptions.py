"""What engines said each block of their namespaces is (KV events), kept for the engines that start
after them: a restarted engine announces what the tiers still hold without waiting for a request
to touch it.

A description is an opaque blob per (namespace, key), the engine's own encoding (the server never
parses it). It is kept whether or not anyone watches the namespace now (the engine that gave it
may be gone), and goes:
- when a journal read passes the key's removal from a tier and no tier holds it any more
  (`Watches.read`: within one poll of a publishing engine);
- at the latest by the bound: MAX_DESCRIPTIONS per server and MAX_DESCRIPTION_BYTES (blobs, keys
  and ENTRY_BYTES each for the dicts holding them), the oldest given dropped first, whatever
  its namespace. The count is about what a large DRAM pool holds (a 256 GiB pool of 2 MiB
  blocks is 131,072) with room for storage's most recent; the bytes bound the server's memory
  when blobs are large (long blocks, multimodal keys) to about 128 MiB.
A blob over MAX_BLOB_BYTES, or a key over MAX_KEY_BYTES, is not kept. A description of a key no
tier holds yet (a save not committed) is kept too: it becomes announceable when the key enters
a tier; one that never does goes by the bound. `page` never returns a stale description: the
caller answers only keys a tier holds (`Watches.snapshot`). At worst a description is lost
(the bound, or a key stored again between the check and the drop): its block is then announced
once a request touches it, never wrongly.

Pages: each description has a number, increasing in the order given (given again: a new number);
`page(ns, after)` reads on from `after` in that order, so a reader paging while others describe
sees every description kept throughout, at most once each.
Primitives: `put`, `drop`, `has`, `page`, `stats`. Must not know: the protocol, the blobs' format.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from ..keys import MAX_KEY_BYTES

MAX_DESCRIPTIONS = 1 << 18
MAX_DESCRIPTION_BYTES = 128 << 20
MAX_BLOB_BYTES = 16 << 10  # a block of 1,024 tokens (5 bytes each at most) with room for its extra keys
ENTRY_BYTES = 320  # Python's own per description: its entries in three dicts/lists, two bytes objects


@dataclass(frozen=True)
class DescribedPage:
    """Descriptions of one namespace numbered past a reader's `after`, on to `last`; `more`:
    others past `last` wait for the next page."""

    keys: list[bytes]
    blobs: list[bytes]
    last: int
    more: bool


class _Kept:
    __slots__ = ("by_key", "order")

    def __init__(self) -> None:
        self.by_key: dict[bytes, tuple[int, bytes]] = {}  # key -> (number, blob)
        # (number, key) in number order; an entry whose number is not by_key's is a tombstone,
        # skipped by readers and compacted away once they are half of it.
        self.order: list[tuple[int, bytes]] = []


class Descriptions:
    def __init__(self, max_count: int = MAX_DESCRIPTIONS, max_bytes: int = MAX_DESCRIPTION_BYTES) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_dropped = 0  # by the bound
        self._lock = threading.Lock()
        self._number = 0
        self._kept: dict[str, _Kept] = {}
        self._oldest: OrderedDict[tuple[str, bytes], None] = OrderedDict()  # every description, oldest first

    def put(self, ns: str, keys: Sequence[bytes], blobs: Sequence[bytes]) -> int:
        """Keep `blobs[i]` as the description of `keys[i]` in `ns` (replacing one kept), dropping
        the oldest past the bound; those too large are not kept. The number kept."""
        num_kept = 0
        with self._lock:
            kept = self._kept.get(ns)
            if kept is None:
                kept = self._kept[ns] = _Kept()
            for key, blob in zip(keys, blobs):
                if len(blob) > MAX_BLOB_BYTES or len(key) > MAX_KEY_BYTES:
                    continue
                self._remove(ns, kept, key)
                self._number += 1
                kept.by_key[key] = (self._number, blob)
                kept.order.append((self._number, key))
                self._oldest[(ns, key)] = None
                self.num_bytes += _size(key, blob)
                num_kept += 1
            while self._oldest and (len(self._oldest) > self.max_count or self.num_bytes > self.max_bytes):
                old_ns, old_key = next(iter(self._oldest))
                self._remove(old_ns, self._kept[old_ns], old_key)
                self.num_dropped += 1
            self._tidy()
        return num_kept

    def drop(self, ns: str, keys: Sequence[bytes]) -> None:
        """Forget the descriptions of `keys` in `ns` (no tier holds them)."""
        with self._lock:
            kept = self._kept.get(ns)
            if kept is not None:
                for key in keys:
                    self._remove(ns, kept, key)
                self._tidy()

    def has(self, ns: str, keys: Sequence[bytes]) -> list[bytes]:
        """Those of `keys` described in `ns`."""
        with self._lock:
            kept = self._kept.get(ns)
            return [key for key in keys if key in kept.by_key] if kept is not None else []

    def page(self, ns: str, after: int, max_count: int, max_bytes: int) -> DescribedPage:
        """The descriptions of `ns` numbered past `after`, in number order: at most `max_count`,
        and at most `max_bytes` of keys and blobs (at least one if `max_bytes` allows a largest)."""
        keys: list[bytes] = []
        blobs: list[bytes] = []
        size = 0
        with self._lock:
            kept = self._kept.get(ns)
            if kept is None:
                return DescribedPage([], [], after, False)
            at = bisect.bisect_right(kept.order, after, key=_number)
            last = after
            while at < len(kept.order) and len(keys) < max_count:
                number, key = kept.order[at]
                live = kept.by_key.get(key)
                if live is not None and live[0] == number:
                    if size + len(key) + len(live[1]) > max_bytes:
                        break
                    size += len(key) + len(live[1])
                    keys.append(key)
                    blobs.append(live[1])
                last = number
                at += 1
            more = at < len(kept.order)  # perhaps only dropped ones: the next page is then empty
        return DescribedPage(keys, blobs, last, more)

    def stats(self) -> tuple[int, int]:
        """(descriptions kept, their bytes as bounded)."""
        with self._lock:
            return len(self._oldest), self.num_bytes

    def _remove(self, ns: str, kept: _Kept, key: bytes) -> None:
        old = kept.by_key.pop(key, None)
        if old is None:
            return
        self._oldest.pop((ns, key), None)
        self.num_bytes -= _size(key, old[1])
        if len(kept.order) > 64 and len(kept.order) > 2 * len(kept.by_key):
            kept.order = [(n, k) for n, k in kept.order if kept.by_key.get(k, (0,))[0] == n]

    def _tidy(self) -> None:
        for ns in [ns for ns, kept in self._kept.items() if not kept.by_key]:
            del self._kept[ns]


def _number(entry: tuple[int, bytes]) -> int:
    return entry[0]


def _size(key: bytes, blob: bytes) -> int:
    return len(key) + len(blob) + ENTRY_BYTES
