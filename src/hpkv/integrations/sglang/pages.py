"""Byte copies between pages of SGLang's host pool and entries of HPKV's shared-memory pool.

SGLang's host pool gives the memory of the pages behind some host indices as raw pointers and
sizes (`get_page_buffer_meta`, SGLang's zero-copy storage interface); the pool gives entries as
offsets in a mapped file. An entry is its page's regions back to back, so a copy is one
`memmove` per region, which releases the GIL: SGLang's three storage threads copy in parallel.

Primitives: `PageBuffers.of(host_pool, host_indices, num_pages, layout)`,
`save(region, offsets, pages, which)`, `load(region, offsets, pages)`.
The caller guarantees the pool bytes stay valid while it copies (a reservation or a lease).
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from dataclasses import dataclass

from ...pool.region import PoolRegion
from .layout import PageLayout


@dataclass(frozen=True)
class PageBuffers:
    """The host memory of `num_pages` pages: `ptrs[p]` are page p's region addresses."""

    ptrs: list[list[int]]
    sizes: tuple[int, ...]

    @classmethod
    def of(cls, host_pool, host_indices, num_pages: int, layout: PageLayout) -> PageBuffers:
        """ValueError if SGLang describes the pages otherwise than the layout measured at start."""
        if len(host_indices) != num_pages * layout.page_size:
            raise ValueError(f"{len(host_indices)} host indices for {num_pages} pages of {layout.page_size} tokens")
        ptrs, sizes = host_pool.get_page_buffer_meta(host_indices)
        n = layout.num_regions
        if len(ptrs) != num_pages * n or tuple(sizes) != layout.region_bytes * num_pages:
            raise ValueError(
                f"the host pool describes {num_pages} pages as {len(ptrs)} regions of sizes "
                f"{sorted(set(sizes))}; expected {n} regions per page of sizes {layout.region_bytes}"
            )
        return cls([list(ptrs[p * n : (p + 1) * n]) for p in range(num_pages)], layout.region_bytes)


def save(region: PoolRegion, offsets: list[int], pages: PageBuffers, which: list[int]) -> None:
    """Copy host pages `which[i]` into the entries at `offsets[i]`."""
    with _address(region) as base:
        for offset, page in zip(offsets, which):
            for ptr, size in zip(pages.ptrs[page], pages.sizes):
                ctypes.memmove(base + offset, ptr, size)
                offset += size


def load(region: PoolRegion, offsets: list[int], pages: PageBuffers) -> None:
    """Copy the entries at `offsets[i]` into host page i."""
    with _address(region) as base:
        for offset, page_ptrs in zip(offsets, pages.ptrs):
            for ptr, size in zip(page_ptrs, pages.sizes):
                ctypes.memmove(ptr, base + offset, size)
                offset += size


@contextmanager
def _address(region: PoolRegion):
    """The mapped pool's address, exported only while copying: a map a client keeps exported
    could never be unmapped, and an unlinked pool file's memory is freed only on unmap. PoolError
    where the pool file was cut short: a copy past its end would be a SIGBUS."""
    region.check_whole()
    anchor = ctypes.c_char.from_buffer(region.buf)
    try:
        yield ctypes.addressof(anchor)
    finally:
        del anchor
