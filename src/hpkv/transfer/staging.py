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
(`PinnedPieces.split`): it is asynchronous where its piece is pinned, pageable otherwise. The caller
synchronizes the stream before the pool's bytes are used.
Each direction has a buffer and a lock of its own: loads run on the forward thread and the
engine's stream, saves on the saver thread and a side stream, and a buffer stays on one stream.
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
        self._buffers: dict[bool, torch.Tensor] = {}
        self._locks = {True: threading.Lock(), False: threading.Lock()}

    def move(
        self, pool: torch.Tensor, pieces: PinnedPieces | None, block_ids: list[int], offsets: list[int], to_pool: bool
    ) -> None:
        """Copy blocks to pool entries (`to_pool`) or back, without synchronizing the stream."""
        with self._locks[to_pool]:
            everything = self._index(block_ids)
            for first in range(0, len(block_ids), self.rows):
                index, chunk = everything[first : first + self.rows], offsets[first : first + self.rows]
                self._move_chunk(pool, pieces, index, chunk, to_pool)

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        """The block ids on the device, in one upload; asynchronous from pinned memory on CUDA,
        where a pageable upload would wait for every copy queued before it."""
        index = torch.tensor(block_ids, dtype=torch.long)
        if self.device.type == "cuda":
            return index.pin_memory().to(self.device, non_blocking=True)
        return index.to(self.device)

    def _move_chunk(
        self, pool: torch.Tensor, pieces: PinnedPieces | None, index: torch.Tensor, offsets: list[int], to_pool: bool
    ) -> None:
        rows = self._buffer(to_pool)[: len(offsets)]
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

    def _buffer(self, to_pool: bool) -> torch.Tensor:
        """This direction's buffer, made on first use (on the stream that then uses it)."""
        buffer = self._buffers.get(to_pool)
        if buffer is None:
            buffer = self._buffers[to_pool] = torch.empty(
                (self.rows, self.entry_bytes), dtype=torch.int8, device=self.device
            )
        return buffer
