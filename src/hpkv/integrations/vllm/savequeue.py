"""The worker's queue of asynchronous saves, and the fence that keeps vLLM from overwriting a
block a queued save still reads.

Owns: the queue, the saver thread (started on the first save) and the count of queued saves
reading each block. Primitives: `put(save)`, `fence(block_ids)`, `drain(timeout_s)`, `close(join_s)`.
Must not know: what a save does (the worker's `save` callable), the server, vLLM.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class _Reads(Protocol):
    block_ids: list[int]


S = TypeVar("S", bound=_Reads)


class SaveQueue(Generic[S]):
    def __init__(self, save: Callable[[S], object]) -> None:
        self._save = save
        self._cond = threading.Condition()
        self._queue: deque[S] = deque()
        self._reading: dict[int, int] = {}  # block id -> queued saves that still read it
        self._thread: threading.Thread | None = None
        self._closing = False
        self._pending = 0  # saves put and not yet done

    @property
    def idle(self) -> bool:
        """Nothing queued and no saver thread started."""
        return not self._queue and self._thread is None

    def put(self, save: S) -> None:
        with self._cond:
            for block in save.block_ids:
                self._reading[block] = self._reading.get(block, 0) + 1
            self._pending += 1
            self._queue.append(save)
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="hpkv-saver", daemon=True)
                self._thread.start()

    def fence(self, block_ids: list[int]) -> float | None:
        """Return once no queued save reads any of `block_ids`: the seconds waited, or None
        when none of them was being read."""
        with self._cond:
            if not self._reading or not any(block in self._reading for block in block_ids):
                return None
            started = time.perf_counter()
            while any(block in self._reading for block in block_ids):
                self._cond.wait()
        return time.perf_counter() - started

    def drain(self, timeout_s: float) -> bool:
        """Return once every save put so far is done (True), or after `timeout_s` (False)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, join_s: float) -> None:
        """Let the queued saves finish (waiting at most `join_s`), then stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(join_s)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                save = self._queue.popleft()
            try:
                self._save(save)
            finally:
                with self._cond:
                    self._pending -= 1
                    for block in save.block_ids:
                        left = self._reading[block] - 1
                        if left:
                            self._reading[block] = left
                        else:
                            del self._reading[block]
                    self._cond.notify_all()
