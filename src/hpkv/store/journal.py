"""The tier journal: what entered and left each tier, per namespace, in the order it happened,
for the engines that publish KV events (vLLM's `--kv-events-config`).

A namespace is journaled only while some client watches it (`watch`, undone when the client
goes: `unwatch_owner`); with no watcher nothing is recorded, and the tiers' hooks are not even
set (`TieredStore.watch`). Each record is one entry of one tier: (tier, stored or removed, key),
numbered from 1 in the namespace's own sequence. A namespace keeps its last `max_records`
records (MAX_RECORDS: a few MiB at most); a reader whose cursor fell behind the oldest kept is
told `lost` and must learn the tiers' state again (`TieredStore.held`) before reading on.
Records are written under the DRAM tier's lock (the store's) or the storage index's; this lock
is taken last and never held while calling out.

Primitives: `watch`, `unwatch_owner`, `watched`, `record` (`recorder`, a tier's), `read`. `life`: this journal's
identity (a restarted server's cursors start again).
Must not know: the protocol, the tiers' internals (it is told (ns, tier, key, stored)).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..tiers import Tier

MAX_RECORDS = 1 << 16  # per namespace: about 100 bytes each with its key
PAGE_RECORDS = 1 << 13  # at most this many records of one namespace in one `read`
STORED = 4  # a record's code: its tier's value, plus STORED when the entry entered the tier


@dataclass(frozen=True)
class Page:
    """Records of one namespace after a cursor: `codes[i]` (tier | STORED) of `keys[i]`, numbered
    `after + 1 ...` up to `last`; `lost`: records between the cursor and the first given were
    dropped (the journal's bound); `more`: records past `last` wait for the next read."""

    codes: bytes
    keys: list[bytes]
    last: int
    lost: bool
    more: bool


class _Log:
    __slots__ = ("records", "seq")

    def __init__(self, max_records: int) -> None:
        self.records: deque[tuple[int, bytes]] = deque(maxlen=max_records)
        self.seq = 0  # the number of the last record (0: none yet)


class TierJournal:
    def __init__(self, max_records: int = MAX_RECORDS) -> None:
        self.max_records = max_records
        self.life = f"{os.getpid()}-{time.time_ns()}"  # one per journal: a cursor of another means nothing here
        self._lock = threading.Lock()
        self._logs: dict[str, _Log] = {}
        self._watchers: dict[str, set[int]] = {}

    def watch(self, ns: str, owner: int) -> int:
        """Journal `ns` while `owner` watches it (from now on); the number of its last record."""
        with self._lock:
            log = self._logs.get(ns)
            if log is None:
                log = self._logs[ns] = _Log(self.max_records)
            self._watchers.setdefault(ns, set()).add(owner)
            return log.seq

    def unwatch_owner(self, owner: int) -> None:
        """`owner` is gone: the namespaces only it watched are no longer journaled (their records go)."""
        with self._lock:
            for ns in [ns for ns, owners in self._watchers.items() if owner in owners]:
                owners = self._watchers[ns]
                owners.discard(owner)
                if not owners:
                    del self._watchers[ns]
                    del self._logs[ns]

    @property
    def watched(self) -> bool:
        """Whether any namespace is journaled (read without the lock: a hint for the tiers' hooks)."""
        return bool(self._logs)

    def record(self, ns: str, tier: Tier, key: bytes, stored: bool) -> None:
        """`key` of `ns` entered (`stored`) or left `tier`. Nothing if `ns` is not watched."""
        self.recorder(tier)(ns, key, stored)

    def recorder(self, tier: Tier) -> Callable[[str, bytes, bool], None]:
        """`record` for one tier, as a tier's hook calls it (ns, key, stored): it runs for every
        entry committed, evicted or written, so it does the least a record needs."""
        logs, lock, codes = self._logs, self._lock, (int(tier), int(tier) | STORED)

        def record(ns: str, key: bytes, stored: bool) -> None:
            log = logs.get(ns)  # not watched: nothing, without the lock
            if log is not None:
                with lock:
                    log.seq += 1
                    log.records.append((codes[stored], key))

        return record

    def read(self, ns: str, after: int, max_records: int = PAGE_RECORDS) -> Page | None:
        """The records of `ns` numbered past `after`, at most `max_records`; None if `ns` is not
        watched."""
        with self._lock:
            log = self._logs.get(ns)
            if log is None:
                return None
            first = log.seq - len(log.records) + 1  # the number of the oldest record kept
            lost = after + 1 < first
            start = max(after + 1, first)
            stop = min(log.seq, start + max_records - 1)
            taken = list(itertools.islice(log.records, start - first, stop - first + 1))
        return Page(bytes(code for code, _ in taken), [key for _, key in taken], max(stop, after), lost, stop < log.seq)
