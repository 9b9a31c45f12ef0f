"""A KV-event subscriber as a router runs one: a ZMQ SUB socket that vLLM's publisher connects to
(`--kv-events-config` with `"endpoint": "tcp://127.0.0.1:<port>"`: the SUB binds, the PUB
connects, so nothing listens beyond loopback), every batch decoded with vLLM's own
`KVEventBatch`, and a per-medium index of the blocks it says are held, emptied when the engine's
sequence starts again (a restarted engine), as docs/vllm.md's subscriber does. Knows nothing of HPKV."""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

from helpers.cli import free_port


@dataclass
class Block:
    """One block as a `BlockStored` described it."""

    parent: object
    token_ids: tuple[int, ...]
    block_size: int
    extra_keys: object
    lora_name: str | None
    group_idx: int | None


@dataclass
class Subscriber:
    port: int = field(default_factory=free_port)
    held: dict[str, set] = field(default_factory=lambda: defaultdict(set))  # medium -> block hashes
    described: dict[tuple[str, object], Block] = field(default_factory=dict)  # (medium, hash) -> last store
    log: list[tuple[float, object]] = field(default_factory=list)  # (arrival, event), in order
    seqs: list[int] = field(default_factory=list)
    restarts: int = 0  # sequences started again (the engine restarted)

    def __post_init__(self) -> None:
        import zmq

        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.bind(f"tcp://127.0.0.1:{self.port}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def flag(self) -> str:
        """The engine's `--kv-events-config` value."""
        endpoint = f"tcp://127.0.0.1:{self.port}"
        return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint})

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            _, seq, payload = self._sock.recv_multipart()
            batch = decoder.decode(payload)
            with self._lock:
                number = int.from_bytes(seq, "big")
                if self.seqs and number <= self.seqs[-1]:  # a restarted engine: forget what it said (docs/vllm.md)
                    self.restarts += 1
                    for blocks in self.held.values():
                        blocks.clear()
                self.seqs.append(number)
                for event in batch.events:
                    self._apply(event)

    def _apply(self, event) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        self.log.append((time.monotonic(), event))
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            for i, block_hash in enumerate(event.block_hashes):
                size = event.block_size
                tokens = tuple(event.token_ids[i * size : (i + 1) * size])
                extra = event.extra_keys[i] if event.extra_keys else None
                self.held[event.medium].add(block_hash)
                self.described[(event.medium, block_hash)] = Block(
                    parent, tokens, size, extra, event.lora_name, event.group_idx
                )
                parent = block_hash
        elif isinstance(event, BlockRemoved):
            self.held[event.medium].difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):  # vLLM's own, for its device cache: no medium
            self.held["GPU"].clear()

    def holds(self, medium: str) -> set:
        with self._lock:
            return set(self.held[medium])

    def events_since(self, since: float) -> list:
        with self._lock:
            return [event for at, event in self.log if at >= since]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()
