"""Block copies between an accelerator's paged KV cache and the pool, through a staging buffer on
the accelerator.

A block's pages lie in one tensor per layer, so copying blocks straight to the pool is one DMA per
(block, layer) page: 28 layers x 256 blocks are 7,168 transfers of 32 KiB, each paying a DMA's
fixed cost (1.4-1.6 GB/s on an H200, against 54 GB/s for one large pinned copy). Here the
per-layer work stays on the device, where it is cheap, and the bus sees few large transfers:
- save: each layer's pages are gathered (`index_select`) into the rows of a staging buffer, one
  row per block laid out as a pool entry (the layers' pages in layer order); then one DMA per run
  of entries that lie back to back in the pool (a reservation hands out consecutive slots), else
  one per entry;
- load: the same DMAs into the staging rows, then each layer's pages are scattered (`index_copy_`)
  into the engine's blocks.
Moves larger than the buffer go in chunks of `STAGING_BYTES` (at least one entry), in stream order,
so the buffer is reused without waiting. A DMA never spans two pieces of the pool's registration
(`PinnedPieces.split`): it is asynchronous where its piece is pinned, pageable otherwise.
A process has one buffer per device and direction, shared by every KV cache group's copier, each
under a lock held until the move's stream is synchronized: loads run on the forward thread and the
engine's stream, saves on the saver thread and a side stream, and whichever stream uses a buffer
next finds it idle. So the device memory taken is 2 x `STAGING_BYTES` per process, whatever the
number of groups.
Primitives: `StagedCopies(layer_views, layer_offsets)`: `move(pool, pieces, block_ids, offsets,
to_pool)`. Must not know: the server, keys, namespaces, how pool mappings are registered.
"""

from __future__ import annotations

import threading

import torch

from .pinning import PinnedPieces

STAGING_BYTES = 64 << 20  # per direction; an H200 moved 0.50 / 0.64 / 0.72 / 0.76 of one copy at 16 / 32 / 64 / 128 MiB


def spans(offsets: list[int], entry_bytes: int) -> list[tuple[int, int, int]]:
    """(first row, pool offset, bytes) of each run of entries that lie back to back in the pool."""
    out: list[tuple[int, int, int]] = []
    for row, offset in enumerate(offsets):
        if out and out[-1][1] + out[-1][2] == offset:
            first, start, size = out[-1]
            out[-1] = (first, start, size + entry_bytes)
        else:
            out.append((row, offset, entry_bytes))
    return out


class StagedCopies:
    def __init__(self, layer_views: list[torch.Tensor], layer_offsets: tuple[int, ...]) -> None:
        self.layers = [(view, offset, view.shape[1]) for view, offset in zip(layer_views, layer_offsets)]
        self.entry_bytes = sum(page for _, _, page in self.layers)
        self.device = layer_views[0].device
        self.rows = max(1, STAGING_BYTES // self.entry_bytes)

    def move(
        self, pool: torch.Tensor, pieces: PinnedPieces | None, block_ids: list[int], offsets: list[int], to_pool: bool
    ) -> None:
        """Copy blocks to pool entries (`to_pool`) or back; returns once the stream has done so."""
        lock, held = _staging(self.device, to_pool)
        with lock:
            if not held or held[0].numel() < self.rows * self.entry_bytes:
                held[:] = [torch.empty(max(STAGING_BYTES, self.entry_bytes), dtype=torch.int8, device=self.device)]
            everything = self._index(block_ids)
            for first in range(0, len(block_ids), self.rows):
                index, chunk = everything[first : first + self.rows], offsets[first : first + self.rows]
                rows = held[0][: len(chunk) * self.entry_bytes].view(len(chunk), self.entry_bytes)
                self._move_chunk(rows, pool, pieces, index, chunk, to_pool)
            synchronize(self.device)

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        """The block ids on the device, in one upload; asynchronous from pinned memory on CUDA,
        where a pageable upload would wait for every copy queued before it."""
        index = torch.tensor(block_ids, dtype=torch.long)
        if self.device.type == "cuda":
            return index.pin_memory().to(self.device, non_blocking=True)
        return index.to(self.device)

    def _move_chunk(
        self,
        rows: torch.Tensor,
        pool: torch.Tensor,
        pieces: PinnedPieces | None,
        index: torch.Tensor,
        offsets: list[int],
        to_pool: bool,
    ) -> None:
        if to_pool:
            for view, offset, page in self.layers:
                rows[:, offset : offset + page].copy_(view.index_select(0, index))
        flat = rows.view(-1)
        for row, start, size in spans(offsets, self.entry_bytes):
            parts = pieces.split(start, start + size) if pieces is not None else [(start, start + size)]
            for begin, end in parts:
                staged = flat[row * self.entry_bytes + begin - start : row * self.entry_bytes + end - start]
                pinned = pieces is not None and pieces.ready(pieces.piece_of(begin))
                if to_pool:
                    pool[begin:end].copy_(staged, non_blocking=pinned)
                else:
                    staged.copy_(pool[begin:end], non_blocking=pinned)
        if not to_pool:
            for view, offset, page in self.layers:
                view.index_copy_(0, index, rows[:, offset : offset + page])


_buffers: dict[tuple[torch.device, bool], tuple[threading.Lock, list[torch.Tensor]]] = {}
_buffers_lock = threading.Lock()


def _staging(device: torch.device, to_pool: bool) -> tuple[threading.Lock, list[torch.Tensor]]:
    """This process's buffer for `device` and direction (a list: empty until first used), and its lock."""
    with _buffers_lock:
        return _buffers.setdefault((device, to_pool), (threading.Lock(), []))


def synchronize(device: torch.device) -> None:
    """Wait for the calling thread's current stream on `device`."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    elif device.type == "npu":
        torch.npu.current_stream(device).synchronize()
