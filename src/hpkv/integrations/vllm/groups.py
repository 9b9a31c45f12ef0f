"""What a hit loads and a step saves in each KV cache group of a request, for `HpkvScheduler`.

A hit of `num` blocks from block `start` is all-or-nothing per boundary: every group's entries
that vLLM reads past that boundary are leased and loaded together, or none is (the request
recomputes). Full-attention groups load every block of the hit; sliding-window groups only the
window before the hit's end (vLLM gives the blocks before it no memory: the null block);
linear-attention groups the one state block before it (`mamba.py`). Saves take every computed
block of every attention group, so any later prefix can hit (state groups save what vLLM offers).
Primitives: `BlockLayout.needed`, `lay.block_keys`. Knows nothing of the server or of leases.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import layout as lay
from .metadata import LoadJob, SaveJob


def lease_ranges(layouts: Sequence[lay.BlockLayout], num_ranks: int, num: int) -> list[tuple[int, int]]:
    """For each namespace (rank-major, as `lay.namespaces`): the [first, num) keys of a hit of
    `num` blocks it must hold."""
    return [(layout.needed(0, num), num) for _ in range(num_ranks) for layout in layouts]


def load_jobs(
    req_id: str,
    layouts: Sequence[lay.BlockLayout],
    keys: list[bytes],
    group_block_ids: Sequence[Sequence[int]],
    start: int,
    null_block: int,
    notify: bool,
) -> list[LoadJob]:
    """One job per group for a hit whose `keys` are blocks [start, start + len(keys)). A group
    whose blocks to load are not all real (a vLLM that laid them out otherwise) loads nothing,
    which the workers report failed: vLLM recomputes the request."""
    jobs = []
    for layout, ids in zip(layouts, group_block_ids):
        first = layout.needed(0, len(keys))
        block_ids = list(ids[start + first : start + len(keys)])
        ok = len(block_ids) == len(keys) - first and null_block not in block_ids
        jobs.append(LoadJob(req_id, keys[first:] if ok else [], block_ids, layout.group, notify))
    return jobs


def save_jobs(
    req_id: str,
    layouts: Sequence[lay.BlockLayout],
    block_hashes,
    group_block_ids: Sequence[Sequence[int]],
    saved: int,
    full: int,
    null_block: int,
) -> tuple[list[bytes], list[SaveJob]]:
    """The keys of blocks [saved, full) and one save job per attention group. A block vLLM gave no
    memory (the null block) is not saved: a hit stops before it. State groups are left out: their
    block tables are not positional (`mamba.offered_saves`)."""
    keys = lay.block_keys(block_hashes, layouts[0], saved, full)
    jobs = []
    for layout, ids in zip(layouts, group_block_ids):
        if layout.state:
            continue
        pairs = [(key, block) for key, block in zip(keys, ids[saved : saved + len(keys)]) if block != null_block]
        if pairs:
            jobs.append(SaveJob(req_id, [k for k, _ in pairs], [b for _, b in pairs], layout.group))
    return keys, jobs
