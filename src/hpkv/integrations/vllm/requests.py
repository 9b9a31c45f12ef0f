"""A request as the scheduler half of HpkvConnectorV1 tracks it: its leases, its promotions, its saves.

Owns `RequestState` (one per vLLM request the scheduler half has seen) and the transitions that
touch only that request: releasing its leases, timing its promotions, where to save from after a
load it rests on failed; and `unhash_failed`, which takes failed blocks out of vLLM's prefix
cache. Must not decide what to load or save (`scheduler.py`) nor talk to the server beyond
releasing what the request holds and asking whether its leases are ready.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ...errors import HpkvError
from ...server.client import Client, LeaseHandle
from ...tiers import Tier

NEVER = 1 << 62  # saved_blocks of a request whose KV may rest on a block that failed to load


@dataclass
class RequestState:
    request: Any  # vLLM's Request
    block_ids: list[int] = field(default_factory=list)  # of KV cache group 0
    other_block_ids: list[list[int]] = field(default_factory=list)  # of groups 1.. (hybrid models)
    saved_blocks: int = 0
    lease_start: int = -1
    leases: dict[int, LeaseHandle] = field(default_factory=dict)  # by namespace index
    lease_sizes: dict[int, int] = field(default_factory=dict)  # the keys each lease asked for
    tiers: tuple[Tier, ...] = ()
    leased_at: float = 0.0
    num_load_blocks: int = 0
    num_promoting: int = 0  # storage blocks of the lease, until their promotion has been timed
    asked_at: float = 0.0  # perf_counter before the lease
    polled_at: float = 0.0  # perf_counter of the last poll that saw promotions running
    uncached: bool = False  # neither looked up nor saved (a LoRA request)
    load_failed: bool = False  # an asynchronous load of it failed: vLLM recomputes it all

    def set_blocks(self, block_ids) -> None:
        """The request's blocks, one list per KV cache group, as vLLM's scheduler output gives them."""
        lists = [list(ids) for ids in block_ids or ()]
        self.block_ids = lists[0] if lists else []
        self.other_block_ids = lists[1:]

    def add_blocks(self, new_block_ids) -> None:
        self.block_ids.extend(new_block_ids[0])
        for ids, new in zip(self.other_block_ids, new_block_ids[1:]):
            ids.extend(new)

    def group_block_ids(self) -> list[list[int]]:
        return [self.block_ids, *self.other_block_ids]

    def release(self, client: Client) -> None:
        leases, self.leases, self.lease_start = self.leases, {}, -1
        self.lease_sizes = {}
        try:  # all of them in one round trip
            client.release(*leases.values())
        except HpkvError:
            pass  # a vanished server's leases vanish with it

    def ready_counts(self, client: Client, wait_s: float) -> list[int | None] | None:
        """Each lease's leading entries ready to copy (None: promotions still running), asked in
        one `LeaseWait` the server answers within `wait_s` when some are not known without it;
        None when a lease's connection is gone (it pins nothing any more)."""
        leases = list(self.leases.values())
        if not all(client.alive(lease) for lease in leases):
            return None
        sizes = [self.lease_sizes.get(i, 0) for i in self.leases]
        counts = [_ready_now(lease, size) for lease, size in zip(leases, sizes)]
        if None in counts:
            waited = iter(client.wait_all([lease for lease, n in zip(leases, counts) if n is None], wait_s))
            counts = [n if n is not None else next(waited) for n in counts]
        return counts

    def take_promotion_time(self, poll_s: float) -> tuple[int, float] | None:
        """(storage blocks promoted, seconds they took) once they are done, or None when the
        timing is too loose to learn from. The promotions took from the lease until now, give or
        take the time since the last poll that saw them running: kept only when that gap is small
        (a busy engine polls once per step, and a step can take seconds)."""
        now = time.perf_counter()
        elapsed, gap = now - self.asked_at, now - self.polled_at
        num, self.num_promoting = self.num_promoting, 0
        if self.polled_at == self.asked_at or gap <= max(0.25 * elapsed, 2 * poll_s):
            return num, elapsed
        return None

    def after_failed_load(self, invalid: set[int], block_size: int) -> None:
        """vLLM has just rolled back the requests reading a failed block (update_from_output runs
        before this): one of those that hold it recomputes from it, and HPKV saves its blocks
        again as it does; the others (sharing the block through vLLM's prefix cache) keep
        theirs as computed and rely on that recompute, which need not have happened when they
        next compute: nothing more of theirs is saved."""
        first = first_failed(self.block_ids, invalid)
        recomputes_from = getattr(self.request, "num_computed_tokens", None)
        if first is not None and recomputes_from is not None and recomputes_from <= first * block_size:
            self.saved_blocks = min(self.saved_blocks, recomputes_from // block_size)
        else:
            self.saved_blocks = NEVER


def _ready_now(lease: LeaseHandle, size: int) -> int | None:
    """The leading entries of `lease` known ready without asking: all, once its promotions are
    done; the `size` it must hold when those are all DRAM hits (pinned, whatever promotes past)."""
    if lease.num_ready is not None:
        return lease.num_ready
    if len(lease.tiers) >= size and Tier.STORAGE not in lease.tiers[:size]:
        return size
    return None


def unhash_failed(kv_cache_manager, reqs: dict[str, RequestState], invalid: set[int], req_ids: set[str]) -> None:
    """Under kv_load_failure_policy=recompute vLLM leaves a block that failed to load in its
    prefix cache (hashed when it was allocated) for the request that recomputes it; were that
    request preempted or aborted first, a later prompt would hit the garbage in it, and HPKV
    would save KV computed on it. So the failed blocks leave the prefix cache, with every
    block after them (computed on them: a lookup stops at the failed block's hash, unless
    another block holds that hash too). The requests holding them keep them; vLLM does not
    hash them again once recomputed, HPKV saves them again instead."""
    if kv_cache_manager is None:
        return
    blocks = set(invalid)
    for req_id in req_ids:
        block_ids = reqs[req_id].block_ids if req_id in reqs else []
        first = first_failed(block_ids, invalid)
        blocks.update(block_ids[first:] if first is not None else ())
    kv_cache_manager.evict_blocks(blocks)


def first_failed(block_ids: list[int], invalid: set[int]) -> int | None:
    """The index of a request's first block that failed to load, or None."""
    return next((i for i, block in enumerate(block_ids) if block in invalid), None)
