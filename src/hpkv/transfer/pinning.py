"""A pool mapping registered with the device piece by piece, in the background, never all at once.

The mapping is cut into pieces of `PIECE_BYTES` from its start. A registration thread per mapping
registers the pieces a copy asked for first, then (with `sweep`) every other piece, lowest first
(the pool hands out its lowest slabs first). A copy asks `ready(piece)` for each piece it touches:
True once the piece is registered (a pinned, asynchronous DMA); while the piece is being registered
it waits for that one registration; otherwise it asks for the piece to be registered next and
copies it as pageable memory now. A copy never spans two pieces (`split`): a device transfer across
two registrations may be taken for a pinned one it is not.

The device calls sit behind one seam, a pinning with `register(address, nbytes) -> bool` and
`unregister(address, nbytes)`: `CudaPinning` (cudaHostRegister) and `LockPinning` (mlock, the
CPU's page locking, which the piece bookkeeping is tested through).

Primitives: `PinnedPieces(address, nbytes, pinning, piece_bytes, sweep)`: `piece_of`, `split`,
`ready`, `registered_bytes`, `wait_idle`, `close` (unregisters every piece; the caller copies no more).
Must not know: engines, the server, what the pool holds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections import deque

log = logging.getLogger(__name__)

PIECE_BYTES = 256 << 20
_NOT, _REGISTERING, _REGISTERED, _FAILED = 0, 1, 2, 3


class CudaPinning:
    """Registers host memory with CUDA (`cudaHostRegister`) for `device` (None: the calling
    thread's device now), from whichever thread registers."""

    def __init__(self, device=None) -> None:
        import torch

        self.device = torch.cuda.current_device() if device is None or device.index is None else device.index

    def register(self, address: int, nbytes: int) -> bool:
        import torch

        with torch.cuda.device(self.device):  # the registration thread's own device is cuda:0
            result = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
        code = result[0] if isinstance(result, tuple) else result
        # 712, cudaErrorHostMemoryAlreadyRegistered: another copier in this process (another KV
        # cache group's, another engine's) registered this piece first; it is pinned all the same.
        if int(code) in (0, 712):
            return True
        log.warning(
            "could not register %d bytes of the HPKV pool as pinned memory (cuda error %s); the rest of "
            "the pool is not registered, and copies to and from it are slower",
            nbytes,
            code,
        )
        return False

    def unregister(self, address: int, nbytes: int) -> None:
        import torch

        with torch.cuda.device(self.device):
            torch.cuda.cudart().cudaHostUnregister(address)


class LockPinning:
    """Page-locks host memory with `mlock` (what a device registration does to the pages, without
    a device): False where the process may not lock that much."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)

    def register(self, address: int, nbytes: int) -> bool:
        return self._libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes)) == 0

    def unregister(self, address: int, nbytes: int) -> None:
        self._libc.munlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes))


class PinnedPieces:
    """One mapping's registration, piece by piece (module docstring)."""

    def __init__(self, address: int, nbytes: int, pinning, piece_bytes: int = PIECE_BYTES, sweep: bool = True) -> None:
        self.address, self.nbytes, self.piece_bytes = address, nbytes, piece_bytes
        self.pinning = pinning
        self.num_pieces = -(-nbytes // piece_bytes)
        self.sweep = sweep
        self.order: list[int] = []  # the pieces in the order they were registered
        self._state = bytearray(self.num_pieces)
        self._asked: deque[int] = deque()
        self._next_sweep = 0
        self._busy = False
        self._closed = False
        self.failed = False  # a registration failed: no other is tried, the rest stays pageable
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        with self._cond:
            self._wake()

    def piece_of(self, offset: int) -> int:
        return offset // self.piece_bytes

    def split(self, start: int, stop: int) -> list[tuple[int, int]]:
        """[start, stop) of the mapping cut at piece boundaries: (start, stop) parts."""
        parts = []
        while start < stop:
            end = min(stop, (start // self.piece_bytes + 1) * self.piece_bytes)
            parts.append((start, end))
            start = end
        return parts

    def ready(self, piece: int) -> bool:
        """Whether `piece` is registered: waits while it is being registered; else asks for it
        first (a copy now goes as pageable memory)."""
        with self._cond:
            while self._state[piece] == _REGISTERING:
                self._cond.wait()
            if self._state[piece] == _NOT and not self.failed and piece not in self._asked:
                self._asked.appendleft(piece)
                self._wake()
            return self._state[piece] == _REGISTERED

    def registered_bytes(self) -> int:
        with self._cond:
            return sum(self._size(i) for i, s in enumerate(self._state) if s == _REGISTERED)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until nothing is left to register now (every piece, with `sweep`)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._thread is None, timeout)

    def close(self) -> None:
        """Stop registering and unregister every piece registered."""
        with self._cond:
            self._closed = True
            self._asked.clear()
            if threading.current_thread() is not self._thread:  # the collector may run us there
                self._cond.wait_for(lambda: not self._busy)
            done = [i for i, s in enumerate(self._state) if s == _REGISTERED]
            for i in done:
                self._state[i] = _NOT
        for i in done:
            self.pinning.unregister(self.address + i * self.piece_bytes, self._size(i))

    def _size(self, piece: int) -> int:
        return min(self.piece_bytes, self.nbytes - piece * self.piece_bytes)

    def _wake(self) -> None:
        """Start the registration thread if there is work and none runs. Caller holds the lock."""
        if self._thread is None and not self._closed and not self.failed and self._next() is not None:
            self._thread = threading.Thread(target=self._run, name="hpkv-pin", daemon=True)
            self._thread.start()

    def _next(self) -> int | None:
        """The next piece to register, asked ones first. Caller holds the lock."""
        while self._asked:
            if self._state[self._asked[0]] == _NOT:
                return self._asked[0]
            self._asked.popleft()
        while self.sweep and self._next_sweep < self.num_pieces:
            if self._state[self._next_sweep] == _NOT:
                return self._next_sweep
            self._next_sweep += 1
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                piece = None if self._closed or self.failed else self._next()
                if piece is None:
                    self._thread = None
                    self._cond.notify_all()
                    return
                self._state[piece], self._busy = _REGISTERING, True
            address, size = self.address + piece * self.piece_bytes, self._size(piece)
            try:
                ok = bool(self.pinning.register(address, size))
            except Exception:  # a device error raised: that piece stays pageable
                log.exception("could not register a piece of the HPKV pool")
                ok = False
            with self._cond:
                closed = self._closed
                self._state[piece] = _REGISTERED if ok and not closed else _FAILED if not ok else _NOT
                if ok and not closed:
                    self.order.append(piece)
                self.failed = self.failed or not ok
                self._busy = False
                self._cond.notify_all()
            if ok and closed:  # closed while it registered: not left registered
                self.pinning.unregister(address, size)
