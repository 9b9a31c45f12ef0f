"""Issue 23: a worker's pool registration does not grow with the pool. The pieces are registered
in the background (asked-for pieces first), copies never wait for a registration they do not
need, never span two pieces, and stay byte-exact while pieces are pageable, registering or
registered. Run on the CPU through the same code as CUDA, with `LockPinning` (mlock: the same
page locking a device registration does) as the registration, observed in /proc/self/status."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from hpkv.pool.region import PoolRegion
from hpkv.transfer.blocks import BlockCopier, PoolTensors
from hpkv.transfer.pinning import LockPinning, PinnedPieces
from hpkv.transfer.staging import spans

MiB = 1 << 20
PIECE = 4 * MiB
PAGE = 12 << 10  # two layers: 24 KiB entries, which do not divide a piece


def locked_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmLck:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmLck in /proc/self/status")


@pytest.fixture
def pinning():
    probe = torch.zeros(PIECE, dtype=torch.int8)
    lock = LockPinning()
    if not lock.register(probe.data_ptr(), PIECE):
        pytest.skip("this process may not mlock (RLIMIT_MEMLOCK without CAP_IPC_LOCK)")
    lock.unregister(probe.data_ptr(), PIECE)
    return lock


@pytest.fixture
def pool(shm_dir):
    server = PoolRegion.create(shm_dir, 64 * MiB)
    server.wait_ready(30)
    client = PoolRegion.attach(os.dup(server.share_fd()), server.size_bytes, server.path)
    try:
        yield client
    finally:
        client.close()
        server.close()


def layers(num_blocks: int = 64) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(-128, 127, (num_blocks, PAGE), dtype=torch.int8, generator=gen) for _ in range(2)]


def straddling_offsets(num: int) -> list[int]:
    """Consecutive 24 KiB slots starting 36 KiB before the end of piece 3: the second one
    straddles pieces 3 and 4 (one of its pages is cut in two)."""
    first = 4 * PIECE - 36 * 1024
    return [first + i * 2 * PAGE for i in range(num)]


def test_transfers_are_one_per_run_of_back_to_back_entries_cut_where_pieces_end(pool, pinning):
    """The staged copies' DMAs: entries back to back in the pool go as one transfer, cut at piece
    ends (no DMA spans two registrations); together they cover every entry's bytes once."""
    entry = 2 * PAGE
    offsets = straddling_offsets(12) + [9 * PIECE - entry, 11 * PIECE + 4096]
    assert spans(offsets, entry) == [(0, offsets[0], 12 * entry), (12, offsets[12], entry), (13, offsets[13], entry)]
    pieces = PinnedPieces(0, pool.size_bytes, pinning, PIECE, sweep=False)
    covered = []
    for _, start, size in spans(offsets, entry):
        for begin, end in pieces.split(start, start + size):
            assert begin // PIECE == (end - 1) // PIECE
            covered.extend(range(begin, end, 4096))
    pieces.close()
    assert covered == [b for o in offsets for b in range(o, o + entry, 4096)]


def test_nothing_is_registered_before_a_copy_asks_and_then_only_what_it_touched(pool, pinning):
    before = locked_bytes()
    views = layers()
    copier = BlockCopier(views, (0, PAGE), pinning=pinning)
    copier.pools = PoolTensors(torch.device("cpu"), pinning, piece_bytes=PIECE, sweep=False)
    _, pieces = copier.pools.get_pieces(pool)
    assert isinstance(pieces, PinnedPieces)
    assert pieces.wait_idle(10) and pieces.registered_bytes() == 0 and locked_bytes() == before  # start: nothing

    offsets = [5 * PIECE + 8192, 11 * PIECE]
    copier.save(pool, [3, 7], offsets)  # pageable: the pieces are asked for, not waited for
    assert pieces.wait_idle(30)
    assert sorted(pieces.order) == [5, 11]
    assert pieces.registered_bytes() == 2 * PIECE and locked_bytes() - before == 2 * PIECE
    copier.load(pool, [20, 21], offsets)  # pinned now
    assert torch.equal(views[0][20], views[0][3]) and torch.equal(views[1][21], views[1][7])

    copier.pools.close()
    assert locked_bytes() == before


def test_copies_stay_exact_while_the_pool_is_registered_in_the_background(pool, pinning):
    before = locked_bytes()
    views = layers()
    copier = BlockCopier(views, (0, PAGE), pinning=pinning)
    copier.pools = PoolTensors(torch.device("cpu"), pinning, piece_bytes=PIECE)
    offsets = straddling_offsets(8)
    for round_ in range(6):  # the first rounds overlap the sweep; the last ones find it done
        src, dst = list(range(8 * (round_ % 3), 8 * (round_ % 3) + 8)), list(range(40, 48))
        copier.save(pool, src, offsets)
        copier.load(pool, dst, offsets)
        for s, d in zip(src, dst):
            assert all(torch.equal(v[d], v[s]) for v in views), f"round {round_}: block {s} came back wrong"
    _, pieces = copier.pools.get_pieces(pool)
    assert pieces.wait_idle(60)
    assert pieces.registered_bytes() == pool.size_bytes and locked_bytes() - before == pool.size_bytes
    assert sorted(pieces.order) == list(range(16))
    swept = [p for p in pieces.order if p not in (3, 4)]
    assert swept == sorted(swept)  # lowest first, after the pieces the copies asked for

    copier.pools.close()
    assert locked_bytes() == before


def test_closing_during_the_sweep_leaves_nothing_locked(pool, pinning):
    before = locked_bytes()
    tensors = PoolTensors(torch.device("cpu"), pinning, piece_bytes=1 * MiB)
    _, pieces = tensors.get_pieces(pool)
    tensors.close()  # at once: the sweep has 64 pieces to go
    assert pieces.wait_idle(30)
    assert pieces.registered_bytes() == 0 and locked_bytes() == before


def test_an_old_pool_is_unregistered_once_nothing_refers_to_it(shm_dir, pinning):
    before = locked_bytes()
    server = PoolRegion.create(shm_dir, 16 * MiB)
    client = PoolRegion.attach(os.dup(server.share_fd()), server.size_bytes, server.path)
    tensors = PoolTensors(torch.device("cpu"), pinning, piece_bytes=PIECE)
    _, pieces = tensors.get_pieces(client)
    assert pieces.wait_idle(30) and locked_bytes() - before == 16 * MiB
    del pieces, client
    gc.collect()
    tensors.release_dead()
    assert tensors.num_held() == 0 and locked_bytes() == before
    server.close()


class RaisingOnce(LockPinning):
    """A registration whose first call raises (a device error surfacing as an exception)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def register(self, address: int, nbytes: int) -> bool:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("cudaHostRegister failed")
        return super().register(address, nbytes)


def test_a_failed_registration_leaves_every_copy_pageable_and_exact(pool, pinning):
    before = locked_bytes()
    views = layers()
    copier = BlockCopier(views, (0, PAGE), pinning=RaisingOnce())
    copier.pools = PoolTensors(torch.device("cpu"), copier.pools.pinning, piece_bytes=PIECE)
    _, pieces = copier.pools.get_pieces(pool)
    assert pieces.wait_idle(30) and pieces.failed
    offsets = straddling_offsets(4)
    copier.save(pool, [1, 2, 3, 4], offsets)
    copier.load(pool, [50, 51, 52, 53], offsets)
    assert all(torch.equal(v[50 + i], v[1 + i]) for v in views for i in range(4))
    assert pieces.registered_bytes() == 0 and locked_bytes() == before  # no retry per piece
    copier.pools.close()
