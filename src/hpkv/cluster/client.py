"""Mooncake Store's client, as the cluster tier uses it: every failure a miss, every cost bounded.

- Set up lazily and again after a failure, while the breaker allows (a master that is down
  costs one set-up of about 4 s per breaker wait, in the caller that finds it so, never more).
- `exists` (batch_is_exist) runs on a thread of its own and is waited for at most `timeout_s`:
  a lookup never waits longer, whatever the cluster does; the late answer is dropped.
- `put` (batch_put_from_multi_buffers: the header and the slot, no copy) and `get_into`
  (batch_get_into_multi_buffers: the header apart, the payload straight into the slot) are
  waited for, never abandoned: Mooncake may still be writing into the memory given, which must
  not be handed to anyone else meanwhile. Mooncake bounds them itself (about 1 s for a read from
  a node that died, about 4 s with the master down), and the breaker stops further calls.
- A failure of the transport or of the master (codes <= -800, a timeout, an exception) counts
  against the breaker; a missing object (-704) is a plain miss.
Owns: the `MooncakeDistributedStore`, the thread that runs lookups, the breaker, the counters.
Primitives: `connect`, `exists`, `put`, `get_into`, `size_of`, `remove`, `remove_matching`, `register`, `healthy`,
`close`, `counters`.
Must not know: namespaces, keys, the object format, the pool.
"""

from __future__ import annotations

import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from ..config import ClusterConfig
from .breaker import Breaker

log = logging.getLogger(__name__)

INVALID_PARAMS = -600  # from a get: the object is larger than the buffers given
TRANSFER_FAIL = -800  # from a get: the node holding it is gone, or the object is smaller than the buffers
OBJECT_NOT_FOUND = -704
# A get that failed with one of these never wrote into the buffers, or had finished writing
# (Mooncake 0.3.x: checked before its I/O, or its lease after): NO_AVAILABLE_HANDLE,
# INVALID_PARAMS, INVALID_REPLICA, REPLICA_IS_NOT_READY, OBJECT_NOT_FOUND, OBJECT_ALREADY_EXISTS,
# LEASE_EXPIRED, RPC_FAIL, RPC_TIMEOUT. After any other (TRANSFER_FAIL above all) its I/O may
# still be in flight: the buffers must not be used for anything else for a while.
SAFE_GET_FAILURES = frozenset({-200, -600, -702, -703, -704, -705, -707, -900, -901})
TRANSPORT_FAILURES = -800  # this and below: TRANSFER_FAIL, RPC_FAIL, ... (the cluster, not the object)


class ClusterUnavailable(Exception):
    """Mooncake's client cannot be loaded on this machine (the library or a system library)."""


def load_store_class() -> Any:
    """`MooncakeDistributedStore`, or ClusterUnavailable saying what is missing."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ClusterUnavailable(
            f"Mooncake Store's client does not load ({exc}): install the `cluster` extra "
            "(pip install 'ct-hpkv[cluster]') and, on Debian or Ubuntu, apt-get install libibverbs1 libnuma1"
        ) from exc
    return MooncakeDistributedStore


def advertised_host(config: ClusterConfig) -> str:
    """The address other nodes reach this node's segment at: the key's, else this host's."""
    if config.host:
        return config.host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


@dataclass
class ClientCounters:
    setups: int = 0
    setup_failures: int = 0
    errors: int = 0  # calls or objects that failed for the cluster's sake (not misses)
    timeouts: int = 0
    skipped: int = 0  # calls not made: the breaker was open


class ClusterClient:
    def __init__(self, config: ClusterConfig, segment_bytes: int = 0, breaker: Breaker | None = None) -> None:
        """`segment_bytes`: the memory this client contributes (0: a client only, the segment
        being another process's, `cluster.segment`)."""
        self.config = config
        self.segment_bytes = segment_bytes
        self.breaker = breaker if breaker is not None else Breaker()
        self.counters = ClientCounters()
        self._store: Any = None
        self._setup_lock = threading.Lock()
        self._registered: list[tuple[int, int]] = []
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix="hpkv-cluster")
        self._closed = False

    def connect(self) -> bool:
        """Whether a set-up client is at hand: sets one up if none is and the breaker allows."""
        if self._store is not None:
            return True
        if not self.breaker.allow():
            self.counters.skipped += 1
            return False
        with self._setup_lock:
            if self._store is None and not self._closed:
                self._setup()
        return self._store is not None

    def _setup(self) -> None:
        cls = load_store_class()
        store = cls()
        c = self.config
        self.counters.setups += 1
        try:
            rc = store.setup(
                advertised_host(c),
                c.metadata,
                self.segment_bytes,
                c.buffer_bytes,
                c.protocol,
                c.rdma_devices,
                c.master,
            )
        except Exception as exc:  # a bad argument, or the library's own failure
            log.warning("cluster tier: Mooncake set-up failed: %s", exc)
            rc = -1
        if rc != 0:
            self.counters.setup_failures += 1
            self.breaker.failed()
            log.warning("cluster tier: no Mooncake master at %s (set-up returned %s); misses until it is", c.master, rc)
            return
        for ptr, size in self._registered:
            store.register_buffer(ptr, size)
        self._store = store
        self.breaker.succeeded()

    def register(self, ptr: int, size: int) -> None:
        """Memory that objects are put from and got into (the pool): registered with Mooncake
        (RDMA needs it; over TCP it spares nothing but is harmless), now and at every set-up."""
        self._registered.append((ptr, size))
        if self._store is not None:
            self._store.register_buffer(ptr, size)

    def _outcome(self, codes: list[int]) -> None:
        if any(code <= TRANSPORT_FAILURES for code in codes):
            self.counters.errors += sum(code <= TRANSPORT_FAILURES for code in codes)
            self.breaker.failed()
        else:
            self.breaker.succeeded()

    def exists(self, names: list[str]) -> list[bool]:
        """Which objects the cluster holds; all False where it cannot say within `timeout_s`."""
        if not names or not self.connect():
            return [False] * len(names)
        future = self._lookups.submit(self._store.batch_is_exist, names)
        try:
            found = future.result(timeout=self.config.timeout_s)
        except FutureTimeout:
            self.counters.timeouts += 1
            self.breaker.failed()
            return [False] * len(names)
        except Exception:
            log.exception("cluster tier: batch_is_exist failed")
            self.counters.errors += 1
            self.breaker.failed()
            return [False] * len(names)
        self._outcome([min(0, code) for code in found])
        return [code == 1 for code in found]

    def put(self, names: list[str], buffers: list[list[int]], sizes: list[list[int]]) -> list[int]:
        """Put each object from its buffers (pointers, sizes); a code per object (0: put, or
        the cluster has it already: Mooncake keeps the first value)."""
        if not names:
            return []
        if not self.connect():
            return [TRANSPORT_FAILURES] * len(names)
        from mooncake.store import ReplicateConfig

        cfg = ReplicateConfig()
        cfg.replica_num = self.config.replicas
        try:
            codes = list(self._store.batch_put_from_multi_buffers(names, buffers, sizes, cfg))
        except Exception:
            log.exception("cluster tier: batch_put_from_multi_buffers failed")
            codes = [TRANSPORT_FAILURES] * len(names)
        self._outcome(codes)
        return codes

    def get_into(self, names: list[str], buffers: list[list[int]], sizes: list[list[int]]) -> list[int]:
        """Get each object into its buffers; per object the bytes got, or a negative code."""
        if not names:
            return []
        if not self.connect():
            return [TRANSPORT_FAILURES] * len(names)
        try:
            got = list(self._store.batch_get_into_multi_buffers(names, buffers, sizes))
        except Exception:
            log.exception("cluster tier: batch_get_into_multi_buffers failed")
            got = [TRANSPORT_FAILURES] * len(names)
        self._outcome([min(0, n) for n in got])
        return got

    def size_of(self, name: str) -> int:
        """The object's size in bytes, or a negative code (it is gone, the master does not answer)."""
        try:
            return int(self._store.get_size(name)) if self._store is not None else TRANSPORT_FAILURES
        except Exception:
            return TRANSPORT_FAILURES

    def remove(self, names: list[str]) -> None:
        """Remove objects at once (leases or not): damaged ones, which would else stay for ever
        (a put of an existing name keeps the old value)."""
        if names and self.connect():
            try:
                self._store.batch_remove(names, True)
            except Exception:
                log.exception("cluster tier: batch_remove failed")

    def remove_matching(self, pattern: str) -> int:
        """Remove the objects whose names match `pattern` (force: leases or not); how many."""
        if not self.connect():
            return 0
        removed = int(self._store.remove_by_regex(pattern, True))
        return max(removed, 0)

    def healthy(self) -> bool:
        """Whether the master answers now (Mooncake's `health_check`)."""
        if self._store is None:
            return self.connect()
        try:
            return int(self._store.health_check()) == 0
        except Exception:
            return False

    def close(self) -> None:
        with self._setup_lock:
            self._closed = True
            store, self._store = self._store, None
        self._lookups.shutdown(wait=False, cancel_futures=True)
        if store is not None:
            try:
                store.close()
            except Exception:
                log.exception("cluster tier: Mooncake close failed")
