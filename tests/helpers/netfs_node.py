"""One node of the network file system tests, run as `unshare --uts python -m
helpers.netfs_node HOST ROOT CAPACITY [CLUSTER LEASE_S]` (HPKV_KV_STORAGE_CLUSTER, default off,
and HPKV_KV_STORAGE_LEASE): it takes the host name HOST (its own UTS namespace, so temporaries'
names and the start-up scan's dead-writer check see two nodes), makes a real `StorageTier` on
ROOT (its node's mount of the shared file system), and runs one JSON command a line from stdin,
answering one JSON line each. Whatever the tier raises is answered as an error, with its
traceback: the tests want none.

Payloads say who wrote them: `payload(key, tag)`, tag 1 for node A and 2 for node B, so a reader
knows a right byte from a wrong one whichever node's version it got.
"""

from __future__ import annotations

import errno
import json
import socket
import sys
import threading
import time
import traceback

import msgspec

from helpers.keys import entry_keys, payload

ENTRY_BYTES = 64 << 10
NS = "ab" * 16
TAGS = (1, 2)


def counted_unlinks():
    """The tier's seam, counting unlinks that removed a file and those that found none (another
    node removed it first: with one owner per part, only a clear does)."""
    from hpkv.storage.fileio import FileIO

    class CountedUnlinks(FileIO):
        removed = 0
        absent = 0

        def unlink(self, path, dir_fd=None):
            try:
                super().unlink(path, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno == errno.ENOENT and path.endswith(".kv"):
                    CountedUnlinks.absent += 1
                raise
            if path.endswith(".kv"):
                CountedUnlinks.removed += 1

    return CountedUnlinks()


class NodeLoop:
    def __init__(self, root: str, capacity_bytes: int, cluster: str = "off", lease_s: float = 30.0) -> None:
        from dataclasses import replace

        from helpers.config import make_storage_config
        from hpkv.storage.storage_tier import StorageTier

        config = replace(make_storage_config(root, capacity_bytes, io_threads=2), cluster=cluster, lease_s=lease_s)
        self.io = counted_unlinks()
        self.tier = StorageTier(config, io=self.io)
        self._good: dict[bytes, tuple[bytes, ...]] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._race: dict = {}

    def good(self, key: bytes) -> tuple[bytes, ...]:
        if key not in self._good:
            self._good[key] = tuple(payload(key, tag, ENTRY_BYTES) for tag in TAGS)
        return self._good[key]

    def op_start(self, wait: bool = True) -> dict:
        started = time.monotonic()
        self.tier.start()
        if wait:
            self.tier.scan_done.wait(120)
        return {"scan_s": time.monotonic() - started, **self.op_stats()}

    def op_stats(self) -> dict:
        return _stats(self.tier)

    def op_write(self, prefix: str, n: int, tag: int, start: int = 0) -> dict:
        keys = entry_keys(start + n, prefix)[start:]
        done = sum(self.tier.write_from(NS, k, memoryview(self.good(k)[tag - 1])) for k in keys)
        return {"written": done}

    def op_read(self, prefix: str, n: int) -> dict:
        counts = {"hits": 0, "misses": 0, "wrong": 0}
        dest = bytearray(ENTRY_BYTES)
        for key in entry_keys(n, prefix):
            counts[self._read_one(key, dest)] += 1
        return counts

    def _read_one(self, key: bytes, dest: bytearray) -> str:
        if not self.tier.contains(NS, key) or not self.tier.read_into(NS, key, memoryview(dest)):
            return "misses"
        return "hits" if bytes(dest) in self.good(key) else "wrong"

    def op_race(self, prefix: str, n: int, tag: int, readers: int = 2, write: bool = True) -> dict:
        """Until `race_end`: one thread writing the keys again and again (if `write`), `readers`
        reading them."""
        keys = entry_keys(n, prefix)
        self._stop.clear()
        self._race = {"hits": 0, "misses": 0, "wrong": 0, "written": 0, "errors": []}
        self._threads = [threading.Thread(target=self._guard, args=(self._writer, keys, tag))] if write else []
        self._threads += [threading.Thread(target=self._guard, args=(self._reader, keys)) for _ in range(readers)]
        for t in self._threads:
            t.start()
        return {}

    def op_race_end(self) -> dict:
        self._stop.set()
        for t in self._threads:
            t.join()
        return self._race

    def _guard(self, fn, *args) -> None:
        try:
            fn(*args)
        except BaseException:  # the tier must raise nothing: the test shows what it raised
            self._race["errors"].append(traceback.format_exc())

    def _writer(self, keys: list[bytes], tag: int) -> None:
        while not self._stop.is_set():
            for key in keys:
                self._race["written"] += self.tier.write_from(NS, key, memoryview(self.good(key)[tag - 1]))

    def _reader(self, keys: list[bytes]) -> None:
        dest = bytearray(ENTRY_BYTES)
        while not self._stop.is_set():
            for key in keys:
                self._race[self._read_one(key, dest)] += 1

    def op_evict(self, num_bytes: int) -> dict:
        self.tier.evictor.evict_bytes(num_bytes)
        return _stats(self.tier)

    def op_rescan(self) -> dict:
        self.tier.rescan.once()
        return _stats(self.tier)

    def op_pass(self) -> dict:
        """A tick and a pass over this node's parts (the cluster's), as its thread makes them."""
        cluster = self.tier.cluster
        assert cluster is not None, "not in a cluster"
        cluster.tick()
        result = cluster.pass_once()
        return {**vars(result), **self.op_cluster()}

    def op_cluster(self) -> dict:
        cluster = self.tier.cluster
        assert cluster is not None, "not in a cluster"
        ledger = cluster.ledger
        return {
            "member": cluster.members.member,
            "live": len(cluster.members.live()),
            "owned": int(ledger.owned.sum()),
            "evictable": int(ledger.evictable.sum()),
            "fenced": cluster.members.fenced(),
            "indexed": len(self.tier.index),
            "owned_bytes": ledger.owned_bytes,
            "unlinked": self.io.removed,
            "unlink_absent": self.io.absent,
            "usage": cluster.files.total_usage(),
        }

    def op_age(self, prefix: str, n: int, age_s: float) -> dict:
        """Index the keys as used `age_s` ago, at the old end, the first the oldest (this node
        last used them then)."""
        index = self.tier.index
        for key in reversed(entry_keys(n, prefix)):
            ik = index.key(NS, key)
            with index.lock:
                value = index._lru.pop(ik)
                index._lru[ik] = index.value_of(value & ((1 << 40) - 1), time.time() - age_s)
                index._lru.move_to_end(ik, last=False)
        return {}

    def op_indexed(self, prefix: str, n: int) -> dict:
        return {"indexed": sum(self.tier.indexed(NS, k) for k in entry_keys(n, prefix))}


def _stats(tier) -> dict:
    return msgspec.to_builtins(tier.stats())


def main() -> None:
    host, root, capacity = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cluster, lease_s = (sys.argv[4], float(sys.argv[5])) if len(sys.argv) > 5 else ("off", 30.0)
    socket.sethostname(host)
    loop = NodeLoop(root, capacity, cluster, lease_s)
    print(json.dumps({"ready": socket.gethostname()}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        try:
            answer = getattr(loop, "op_" + op)(**command)
        except Exception:
            answer = {"error": traceback.format_exc()}
        print(json.dumps(answer), flush=True)
    loop.tier.close()


if __name__ == "__main__":
    main()
