"""BlockCopier moves whole blocks between an engine's per-layer pages and pool entries, whatever
order the engine's block ids and the pool's slots come in: on the CPU's own path, and on the
accelerators' (a staging buffer, chunked; run on the CPU with page locking as the pinning)."""

from __future__ import annotations

import random
import sys
import threading

import pytest
import torch

from hpkv.pool.region import PoolRegion
from hpkv.transfer import blocks, staging
from hpkv.transfer.blocks import LONG_RUN, BlockCopier
from hpkv.transfer.pinning import LockPinning

NUM_BLOCKS = 96
PAGES = (4096, 1024, 4096)  # layers need not have the same page size


def engine_layers(seed: int) -> list[torch.Tensor]:
    """Per-layer byte views like vLLM's: one row per block, rows further apart than a page."""
    gen = torch.Generator().manual_seed(seed)
    views = []
    for page in PAGES:
        backing = torch.randint(-128, 128, (NUM_BLOCKS, page + 512), dtype=torch.int8, generator=gen)
        views.append(backing[:, :page])
    return views


def layer_offsets() -> tuple[int, ...]:
    return tuple(sum(PAGES[:i]) for i in range(len(PAGES)))


def entry_of(views: list[torch.Tensor], block: int) -> bytes:
    return b"".join(bytes(v[block].numpy().tobytes()) for v in views)


PATTERNS = {
    "one long run": lambda rng: (list(range(10, 10 + 40)), list(range(40))),
    "scattered": lambda rng: (rng.sample(range(NUM_BLOCKS), 40), rng.sample(range(64), 40)),
    "mixed": lambda rng: (
        list(range(0, 2 * LONG_RUN)) + rng.sample(range(50, NUM_BLOCKS), 30),
        list(range(2 * LONG_RUN)) + list(range(40, 70)),
    ),
    "a few": lambda rng: ([5, 7, 3], [9, 1, 2]),
}


@pytest.fixture(params=["cpu", "staged"])
def copier_of(request, monkeypatch):
    """BlockCopier on the CPU's path, or on the accelerators' staged one in chunks of 5 entries."""
    if request.param == "cpu":
        return lambda views: BlockCopier(views, layer_offsets())
    monkeypatch.setattr(staging, "STAGING_BYTES", 5 * sum(PAGES))
    return lambda views: BlockCopier(views, layer_offsets(), pinning=LockPinning())


@pytest.mark.parametrize("pattern", PATTERNS)
def test_blocks_saved_then_loaded_come_back_byte_for_byte(shm_dir, pattern, copier_of):
    entry = sum(PAGES)
    source, target = engine_layers(seed=1), engine_layers(seed=2)
    saver, loader = copier_of(source), copier_of(target)
    region = PoolRegion.create(shm_dir, 64 * entry + (1 << 20))
    try:
        block_ids, slots = PATTERNS[pattern](random.Random(7))
        offsets = [slot * entry for slot in slots]
        saver.save(region, block_ids, offsets)
        for block, offset in zip(block_ids, offsets):
            assert bytes(region.buf[offset : offset + entry]) == entry_of(source, block)

        padding = [view._base[:, view.shape[1] :].clone() for view in target]
        untouched = [b for b in range(NUM_BLOCKS) if b not in block_ids]
        before = {b: entry_of(target, b) for b in untouched}
        moved = list(reversed(range(NUM_BLOCKS)))[: len(block_ids)]  # loaded into other blocks
        loader.load(region, moved, offsets)
        for block, dst in zip(block_ids, moved):
            assert entry_of(target, dst) == entry_of(source, block)
        for b in untouched:
            if b not in moved:
                assert entry_of(target, b) == before[b]
        for view, before_padding in zip(target, padding):  # bytes between rows are not pages: untouched
            assert torch.equal(view._base[:, view.shape[1] :], before_padding)
    finally:
        saver.pools.close()
        loader.pools.close()
        region.close()


@pytest.fixture
def always_shared(monkeypatch):
    """Copies of any size are shared with the helper thread."""
    monkeypatch.setattr(blocks, "SHARE_BYTES", 0)


def test_long_scattered_lists_are_shared_with_the_copy_thread(shm_dir, always_shared):
    """Enough scattered pages to hand part to the helper thread; every page still lands."""
    entry = sum(PAGES)
    region = PoolRegion.create(shm_dir, NUM_BLOCKS * entry + (1 << 20))
    try:
        rng = random.Random(3)
        block_ids = rng.sample(range(NUM_BLOCKS), NUM_BLOCKS)
        offsets = [slot * entry for slot in rng.sample(range(NUM_BLOCKS), NUM_BLOCKS)]
        source = engine_layers(seed=5)
        BlockCopier(source, layer_offsets()).save(region, block_ids, offsets)
        target = engine_layers(seed=6)
        BlockCopier(target, layer_offsets()).load(region, block_ids, offsets)
        for view_in, view_out in zip(source, target):
            assert torch.equal(view_in, view_out)
    finally:
        region.close()


def test_long_runs_are_shared_with_the_copy_thread_layer_by_layer(shm_dir, always_shared):
    """Two long runs of three layers each: six strided copies split between two threads, each
    landing where its own run and layer say."""
    entry = sum(PAGES)
    region = PoolRegion.create(shm_dir, NUM_BLOCKS * entry + (1 << 20))
    try:
        block_ids = list(range(0, 24)) + list(range(60, 84, 2))
        offsets = [slot * entry for slot in list(range(40, 64)) + list(range(0, 12))]
        source = engine_layers(seed=8)
        BlockCopier(source, layer_offsets()).save(region, block_ids, offsets)
        for block, offset in zip(block_ids, offsets):
            assert bytes(region.buf[offset : offset + entry]) == entry_of(source, block)
        target = engine_layers(seed=9)
        BlockCopier(target, layer_offsets()).load(region, block_ids, offsets)
        for block in block_ids:
            assert entry_of(target, block) == entry_of(source, block)
    finally:
        region.close()


def test_a_failing_copy_reaches_the_caller(shm_dir, always_shared, monkeypatch):
    """A copy that raises on either thread is not lost: load raises."""
    entry = sum(PAGES)
    region = PoolRegion.create(shm_dir, NUM_BLOCKS * entry + (1 << 20))
    calls = []

    def failing_copyto(dst, src):
        calls.append(dst.shape)
        if len(calls) == 4:
            raise MemoryError("copy failed")
        dst[...] = src

    monkeypatch.setattr(blocks.np, "copyto", failing_copyto)
    try:
        with pytest.raises(MemoryError):
            BlockCopier(engine_layers(seed=10), layer_offsets()).load(
                region, list(range(0, 24)) + list(range(40, 64)), [i * entry for i in range(48)]
            )
        assert len(calls) == 6  # every task still ran
    finally:
        region.close()


@pytest.fixture
def fast_switching():
    """The threads interleave between any two copies."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def test_copiers_of_two_groups_share_one_staging_buffer_per_direction_from_three_threads(
    shm_dir, monkeypatch, fast_switching
):
    """Two KV cache groups (entries of different sizes) loading on a thread each while a third
    saves, through the process's one buffer per direction: every block lands exact."""
    monkeypatch.setattr(staging, "STAGING_BYTES", 3 * sum(PAGES))
    monkeypatch.setattr(staging, "_buffers", {})
    entry = sum(PAGES)
    region = PoolRegion.create(shm_dir, 4 * NUM_BLOCKS * entry + (1 << 20))
    small = [v[:, :1024] for v in engine_layers(seed=11)]
    groups = [(engine_layers(seed=12), layer_offsets()), (small, tuple(i * 1024 for i in range(len(small))))]
    stored = [[v[:48].clone() for v in views] for views, _ in groups]
    copiers = [BlockCopier(views, offsets, pinning=LockPinning()) for views, offsets in groups]
    bases = [0, 2 * NUM_BLOCKS * entry]  # each group's entries in a pool area of its own
    errors: list[AssertionError] = []

    def saves() -> None:
        for round_ in range(20):
            for copier, base in zip(copiers, bases):
                ids = random.Random(round_).sample(range(48, NUM_BLOCKS), 30)
                copier.save(region, ids, [base + (NUM_BLOCKS + i) * entry for i in range(30)])

    def loads(copier: BlockCopier, base: int, before: list[torch.Tensor]) -> None:
        try:
            for round_ in range(20):
                ids = random.Random(100 + round_).sample(range(48), 48)
                for view in copier.layer_views:
                    view[:48].zero_()
                copier.load(region, ids, [base + i * entry for i in ids])
                for view, kept in zip(copier.layer_views, before):
                    assert torch.equal(view[:48], kept), f"round {round_}"
        except AssertionError as e:
            errors.append(e)

    try:
        for copier, base in zip(copiers, bases):  # what the loads read back
            copier.save(region, list(range(48)), [base + i * entry for i in range(48)])
        threads = [threading.Thread(target=saves)]
        threads += [threading.Thread(target=loads, args=args) for args in zip(copiers, bases, stored)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert sorted(staging._buffers, key=str) == [(torch.device("cpu"), False), (torch.device("cpu"), True)]
    finally:
        for copier in copiers:
            copier.pools.close()
        region.close()
