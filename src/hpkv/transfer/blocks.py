"""Copies whole engine blocks between the engine's paged KV cache and pool entries.

The engine's cache is one byte view per layer, `(num_blocks, page_bytes)` int8, on whatever device
the engine uses (CUDA, Ascend NPU, CPU); an entry is the layers' pages of one block, concatenated
in layer order. On an accelerator, copies go through a staging buffer on the device
(`staging.StagedCopies`: the per-layer gathers and scatters stay on the device, the bus sees one
DMA per run of back-to-back entries), with plain torch ops, so no device-specific code is needed.
On the CPU copies are numpy `copyto` and libc `memmove` instead: torch's CPU `copy_` opens an
OpenMP region per call, whose cost on a busy machine is unbounded.

On the CPU, block ids and pool offsets are split into runs where both advance by a constant step;
a long run costs one strided copy per layer, blocks outside long runs are copied page by page with
`memmove` (ctypes), and a move of more than `SHARE_BYTES` is a list of tasks shared by the calling
thread and one helper thread (both release the GIL; the caller takes tasks until none are left, so
a descheduled helper costs nothing).

The pool is mapped as a CPU tensor; on CUDA each pool mapping is registered as pinned memory in
pieces, in the background (`pinning.PinnedPieces`), so a worker's first copy waits for no
registration: a DMA is cut where pieces end, goes asynchronously to or from a registered piece and
as a pageable copy for one not registered yet (the stream is synchronized once, before
`save`/`load` return). The registration lasts as long as the mapping's `PoolRegion`: once no
client or handle refers to it (a restarted server's old pool) it is unregistered and its tensor
dropped. Given a pinning on the CPU, copies take the accelerators' path.
Must not know: the server, keys, namespaces.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np
import torch

from ..pool.region import PoolRegion
from .pinning import PIECE_BYTES, CudaPinning, PinnedPieces
from .staging import StagedCopies

log = logging.getLogger(__name__)


class PoolTensors:
    """The pool as an int8 CPU tensor. With a `pinning` (CUDA's by default on a CUDA device), one
    tensor per live pool mapping, registered piece by piece in the background (`PinnedPieces`:
    handing it out waits for no registration) and unregistered when the mapping's region is
    collected (no client or handle refers to it any more: its server is gone), then dropped so the
    mapping can go; elsewhere a view made per copy. The unregistering runs on the next `get` or
    `release_dead`, or at once when the collector runs it and no copy is under way here."""

    def __init__(self, device: torch.device, pinning=None, piece_bytes: int = PIECE_BYTES, sweep: bool = True) -> None:
        self.device = device
        self.pinning = pinning if pinning is not None else CudaPinning(device) if device.type == "cuda" else None
        self.piece_bytes, self.sweep = piece_bytes, sweep
        self._tokens: weakref.WeakKeyDictionary[PoolRegion, int] = weakref.WeakKeyDictionary()
        self._held: dict[int, tuple[torch.Tensor, PinnedPieces]] = {}  # token -> (tensor, its pieces)
        self._dead: list[int] = []  # tokens of regions collected, their tensors not unregistered yet
        self._next_token = itertools.count(1)
        self._lock = threading.Lock()  # the forward thread's loads and the saver thread's saves

    def get(self, region: PoolRegion) -> torch.Tensor:
        return self.get_pieces(region)[0]

    def get_pieces(self, region: PoolRegion) -> tuple[torch.Tensor, PinnedPieces | None]:
        """The pool's tensor, and its registration (None: nothing is registered here)."""
        if self.pinning is None:
            # Nothing to register: a view made per copy keeps no pool mapped after its server
            # is gone (a restarted server's old pool keeps its memory while anything maps it).
            return torch.frombuffer(region.buf, dtype=torch.int8), None
        with self._lock:
            self._release_dead()
            token = self._tokens.get(region)
            if token is None:
                tensor = torch.frombuffer(region.buf, dtype=torch.int8)
                pieces = PinnedPieces(tensor.data_ptr(), tensor.numel(), self.pinning, self.piece_bytes, self.sweep)
                token = self._tokens[region] = next(self._next_token)
                self._held[token] = (tensor, pieces)
                # Holds neither the region nor the tensor: collecting the region is the signal.
                # Not at exit: the process's mappings and registrations go with it.
                weakref.finalize(region, self._died, token).atexit = False
            return self._held[token]

    def num_held(self) -> int:
        """Pool mappings registered now."""
        with self._lock:
            return len(self._held)

    def release_dead(self) -> None:
        with self._lock:
            self._release_dead()

    def close(self) -> None:
        """Unregister and drop every tensor now, live regions' too: the caller copies no more,
        and may unmap a pool it owns next."""
        with self._lock:
            self._dead.extend(self._held)
            self._release_dead()

    def _died(self, token: int) -> None:
        self._dead.append(token)  # list.append is atomic: safe from any thread, lock or not
        if self._lock.acquire(blocking=False):  # not when the collector runs inside `get`
            try:
                self._release_dead()
            finally:
                self._lock.release()

    def _release_dead(self) -> None:
        while self._dead:
            held = self._held.pop(self._dead.pop(), None)  # none: gone with `close`
            if held is not None:
                held[1].close()  # before the tensor, the last hold on the mapping, goes
            del held


LONG_RUN = 8  # blocks; shorter runs are copied page by page on the CPU
_CHUNK = 64  # pages a copying thread takes at a time
SHARE_BYTES = 4 << 20  # below this, the helper thread's wake-up costs more than it saves
_memmove = ctypes.memmove  # a ctypes foreign function: releases the GIL while it copies
_helper_lock = threading.Lock()
_helper_pool: ThreadPoolExecutor | None = None


def _helper() -> ThreadPoolExecutor:
    global _helper_pool
    with _helper_lock:
        if _helper_pool is None:
            _helper_pool = ThreadPoolExecutor(1, thread_name_prefix="hpkv-copy")
        return _helper_pool


def _memmove_all(copies: list[tuple[int, int, int]]) -> None:
    for dst, src, size in copies:
        _memmove(dst, src, size)


def _share(tasks: list, num_bytes: int) -> None:
    """Run the copy tasks on the calling thread and, when there is enough to share, on the
    helper thread too; the caller takes tasks until none are left, so a descheduled helper
    costs nothing."""
    if len(tasks) < 2 or num_bytes < SHARE_BYTES:
        for task in tasks:
            task()
        return
    taken = itertools.count()

    def work() -> None:
        while (i := next(taken)) < len(tasks):
            tasks[i]()

    helper = _helper().submit(work)
    try:
        work()
    finally:
        helper.result()  # never return (or raise) while the helper may still be copying


def _runs(block_ids: list[int], offsets: list[int]) -> list[tuple[int, int, int, int, int]]:
    """Split into runs (first block, block step, first offset, offset step, length)."""
    runs = []
    i, n = 0, len(block_ids)
    while i < n:
        j = i + 1
        if j < n:
            block_step, offset_step = block_ids[j] - block_ids[i], offsets[j] - offsets[i]
            while (
                j < n
                and block_ids[j] - block_ids[j - 1] == block_step
                and offsets[j] - offsets[j - 1] == offset_step
                and block_step > 0
                and offset_step > 0
            ):
                j += 1
            if j == i + 1:
                block_step, offset_step = 1, 1
        else:
            block_step, offset_step = 1, 1
        runs.append((block_ids[i], block_step, offsets[i], offset_step, j - i))
        i = j
    return runs


class BlockCopier:
    def __init__(self, layer_views: list[torch.Tensor], layer_offsets: tuple[int, ...], pinning=None) -> None:
        """`pinning`: registers pool mappings (`CudaPinning` on a CUDA device, by default)."""
        self.layer_views = layer_views
        self.layer_offsets = layer_offsets
        self.page_bytes = [v.shape[1] for v in layer_views]
        self.entry_bytes = sum(self.page_bytes)
        self.device = layer_views[0].device if layer_views else torch.device("cpu")
        self.pools = PoolTensors(self.device, pinning)
        self.staged = StagedCopies(layer_views, layer_offsets) if layer_views else None

    def save(self, region: PoolRegion, block_ids: list[int], offsets: list[int]) -> None:
        """Copy blocks into pool entries (device -> pool)."""
        self._move(region, block_ids, offsets, to_pool=True)

    def load(self, region: PoolRegion, block_ids: list[int], offsets: list[int]) -> None:
        """Copy pool entries into blocks (pool -> device)."""
        self._move(region, block_ids, offsets, to_pool=False)

    def _move(self, region: PoolRegion, block_ids: list[int], offsets: list[int], to_pool: bool) -> None:
        region.check_whole()  # a pool cut short: PoolError (the blocks are recomputed), not a SIGBUS
        pool, pieces = self.pools.get_pieces(region)
        if self.device.type == "cpu" and pieces is None:
            self._move_cpu(pool, _runs(block_ids, offsets), to_pool)
            return
        if self.staged is not None:  # None: no layers, nothing to copy
            self.staged.move(pool, pieces, block_ids, offsets, to_pool)

    def _move_cpu(self, pool: torch.Tensor, runs: list[tuple[int, int, int, int, int]], to_pool: bool) -> None:
        """Each long run's layers as numpy strided copies, the other blocks page by page with
        memmove; both release the GIL, so the work is shared with the helper thread."""
        bulk: list[tuple[np.ndarray, np.ndarray]] = []  # (dst, src), one per long run and layer
        singles: list[tuple[int, int]] = []  # (block id, offset) outside long runs
        for run in runs:
            if run[4] < LONG_RUN:
                first_block, block_step, first_offset, offset_step, length = run
                singles.extend((first_block + i * block_step, first_offset + i * offset_step) for i in range(length))
                continue
            for blocks, entries in self._pairs(pool, run):
                bulk.append((entries.numpy(), blocks.numpy()) if to_pool else (blocks.numpy(), entries.numpy()))
        pages = self._pages(pool, singles, to_pool) if singles else []
        tasks = [partial(np.copyto, dst, src) for dst, src in bulk]
        tasks += [partial(_memmove_all, pages[i : i + _CHUNK]) for i in range(0, len(pages), _CHUNK)]
        _share(tasks, sum(dst.nbytes for dst, _ in bulk) + sum(size for _, _, size in pages))

    def _pairs(self, pool: torch.Tensor, run: tuple[int, int, int, int, int]):
        """(engine rows, pool rows) views of one run, for every layer."""
        first_block, block_step, first_offset, offset_step, length = run
        stop = first_block + block_step * (length - 1) + 1
        for view, layer_offset, page in zip(self.layer_views, self.layer_offsets, self.page_bytes):
            yield (
                view[first_block:stop:block_step],
                pool.as_strided((length, page), (offset_step, 1), first_offset + layer_offset),
            )

    def _pages(self, pool: torch.Tensor, singles: list[tuple[int, int]], to_pool: bool) -> list[tuple[int, int, int]]:
        """(dst address, src address, bytes) of every (block, layer) page of `singles`."""
        blocks = np.fromiter((b for b, _ in singles), np.int64, len(singles))
        entries = np.fromiter((o for _, o in singles), np.int64, len(singles)) + pool.data_ptr()
        copies: list[tuple[int, int, int]] = []
        for view, layer_offset, page in zip(self.layer_views, self.layer_offsets, self.page_bytes):
            engine = (view.data_ptr() + blocks * view.stride(0)).tolist()
            stored = (entries + layer_offset).tolist()
            pairs = zip(stored, engine) if to_pool else zip(engine, stored)
            copies.extend((dst, src, page) for dst, src in pairs)
        return copies
