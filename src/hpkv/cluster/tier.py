"""The cluster tier as the store sees it: entries of a namespace looked up, written from pool
slots and read into pool slots, by (namespace, key), each object verified on every read.

Writes put the header (from a buffer of this tier) and the payload (the slot itself) as the two
parts of one object: the slot is not copied. Reads get the header into a buffer of this tier and
the payload straight into the slot, then check the header against the namespace, the key, the
length and the payload's checksum: anything else (a damaged object, another namespace's or
key's, an object of another size) is a miss, and the object is removed, since a put of an
existing name keeps the old value and would else leave it there for ever.
Owns: the client (`client.ClusterClient`), the counters the status and the metrics show.
Primitives: `start`, `contains`, `write`, `read_into` (-> `Read` per slot), `remove`, `count`, `stats`,
`close`.
Must not know: the DRAM index, leases, reservations (the caller keeps the slots it names
reserved or pinned for the call's length).
"""

from __future__ import annotations

import ctypes
import enum
import logging
import threading
import time
from collections.abc import Sequence

import msgspec

from ..config import ClusterConfig
from ..stats import ClusterStats
from . import objects
from .client import INVALID_PARAMS, SAFE_GET_FAILURES, TRANSFER_FAIL, ClusterClient

log = logging.getLogger(__name__)

Slot = tuple[bytes, int, int]  # (key, offset in the memory, payload length)
UNSAFE_KEEP_S = 60.0  # buffers of a call whose I/O may still run are kept this long


class Read(enum.IntEnum):
    """What a read left in a slot."""

    HIT = 1  # the verified payload
    MISS = 2  # nothing of use; the slot may be used again at once
    UNSAFE = 3  # a miss whose I/O may still be writing into the slot: keep it out of use a while


def address_of(buf: memoryview) -> int:
    """The address of a writable buffer's first byte (a pool's map: valid while it is mapped)."""
    anchor = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # the export ends here, so the map can still be closed


class ClusterTier:
    def __init__(self, config: ClusterConfig, memory: memoryview, client: ClusterClient | None = None) -> None:
        """`memory`: the pool's map (slot offsets are into it), registered with Mooncake."""
        self.config = config
        self.client = client if client is not None else ClusterClient(config)
        self._memory = memory
        self._base = address_of(memory)
        self._lock = threading.Lock()  # the counters
        self._kept: list[tuple[float, object]] = []  # buffers an unfinished I/O may still use
        self.stats_ = ClusterStats(master=config.master, protocol=config.protocol, segment_bytes=config.segment_bytes)

    def start(self) -> bool:
        """Register the pool and try to connect (a cluster not there yet is a miss until it is)."""
        self.client.register(self._base, len(self._memory))
        return self.client.connect()

    def count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self.stats_, name, getattr(self.stats_, name) + delta)

    def contains(self, ns: str, keys: Sequence[bytes]) -> list[bool]:
        """Which keys the cluster holds an object of (one round trip, bounded by `timeout_s`)."""
        found = self.client.exists([objects.object_name(ns, key) for key in keys])
        self.count(lookups=1, lookup_keys=len(keys), found_keys=sum(found))
        return found

    def write(self, ns: str, slots: Sequence[Slot]) -> int:
        """Put each slot's payload under its key, with its header; how many the cluster took.
        The caller keeps the slots pinned until this returns."""
        if not slots:
            return 0
        headers = [objects.make_header(ns, key, self._memory[off : off + n]) for key, off, n in slots]
        # Kept alive until the call returns: Mooncake reads them by address.
        head_bufs = [ctypes.create_string_buffer(h, len(h)) for h in headers]
        codes = self.client.put(
            [objects.object_name(ns, key) for key, _, _ in slots],
            [[ctypes.addressof(h), self._base + off] for h, (_, off, _) in zip(head_bufs, slots)],
            [[len(h), n] for h, (_, _, n) in zip(headers, slots)],
        )
        if any(code < 0 and code not in SAFE_GET_FAILURES for code in codes):
            self._keep(head_bufs)  # its I/O may still read them (a bad object then: checked on read)
        taken = [n for code, (_, _, n) in zip(codes, slots) if code == 0]
        self.count(objects_written=len(taken), bytes_written=sum(taken), errors=len(codes) - len(taken))
        return len(taken)

    def read_into(self, ns: str, slots: Sequence[Slot]) -> list[Read]:
        """Get each key's object, its payload into its slot; per key what the slot now holds
        (`Read`). The caller keeps the slots reserved until this returns, and those UNSAFE for
        a while after (`UNSAFE_KEEP_S` at least: Mooncake's own transfer timeouts are shorter)."""
        if not slots:
            return []
        names = [objects.object_name(ns, key) for key, _, _ in slots]
        head_lens = [objects.header_len(key) for key, _, _ in slots]
        head_bufs = [ctypes.create_string_buffer(n) for n in head_lens]
        got = self.client.get_into(
            names,
            [[ctypes.addressof(h), self._base + off] for h, (_, off, _) in zip(head_bufs, slots)],
            [[hn, n] for hn, (_, _, n) in zip(head_lens, slots)],
        )
        reads, bad = [], []
        for i, (key, off, n) in enumerate(slots):
            expected, why = head_lens[i] + n, None
            read = Read.HIT if got[i] >= 0 else Read.MISS if got[i] in SAFE_GET_FAILURES else Read.UNSAFE
            if got[i] == INVALID_PARAMS:
                why = "larger than an entry of its namespace"
            elif got[i] == TRANSFER_FAIL and 0 <= (size := self.client.size_of(names[i])) != expected:
                why = f"{size} bytes, expected {expected}"  # Mooncake fails a smaller one so
            elif got[i] >= 0:
                if got[i] != expected:
                    why = f"{got[i]} bytes, expected {expected}"
                else:
                    why = objects.verify(ns, key, head_bufs[i].raw, self._memory[off : off + n])
                read = Read.HIT if why is None else Read.MISS
            if why is not None:
                log.warning("cluster tier: object %s is bad (%s): a miss, removed", names[i], why)
                bad.append(names[i])
            reads.append(read)
        if Read.UNSAFE in reads:
            self._keep(head_bufs)
        hits = reads.count(Read.HIT)
        self.count(
            hits=hits,
            misses=len(slots) - hits,
            bad_objects=len(bad),
            bytes_read=sum(n for read, (_, _, n) in zip(reads, slots) if read is Read.HIT),
        )
        self.client.remove(bad)
        return reads

    def _keep(self, buffers: object) -> None:
        now = time.monotonic()
        with self._lock:
            self._kept = [(t, b) for t, b in self._kept if now - t < UNSAFE_KEEP_S] + [(now, buffers)]

    def remove(self, ns: str | None = None) -> int:
        """Remove the namespace's objects from the cluster (every HPKV object's for None)."""
        return self.client.remove_matching(objects.namespace_pattern(ns))

    def stats(self, probe: bool = False) -> ClusterStats:
        """A copy of the counters; `probe` asks the master whether it answers (a round trip)."""
        c, breaker = self.client.counters, self.client.breaker
        with self._lock:
            stats = msgspec.structs.replace(self.stats_)
        stats.errors += c.errors + c.setup_failures
        stats.timeouts = c.timeouts
        stats.breaker_open = breaker.is_open
        stats.breaker_trips = breaker.trips
        stats.reachable = self.client.healthy() if probe else not breaker.is_open and c.setups > c.setup_failures
        return stats

    def close(self) -> None:
        self.client.close()
