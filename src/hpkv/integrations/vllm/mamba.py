"""Linear-attention (Mamba, GDN) groups of a hybrid model: which state blocks a step saves, for
`HpkvScheduler` (how far a hit goes, states included, is `hitplan.py`'s).

vLLM's prefix caching of these models (`mamba_cache_mode="align"`) keeps a group's recurrent
state only at some block boundaries (where a scheduler step ends, the prefill checkpoint before
a prompt's last block, the points `--prefix-cache-retention-interval` keeps), in blocks it picks:
its block table for such a group is not positional. So the states saved are the ones vLLM hands
to connectors (`SchedulerOutput.kv_connector_block_state.boundary_state_offloads`: group, block,
token boundary), each under the block hash at its boundary in its group's namespace, an entry
being that block's page (conv and SSM state of the group's layers). A hit of n blocks needs each
state group's entry of block n - 1 (vLLM gives that group n - 1 null blocks and one block to
resume from, `lay.BlockLayout.needed`) as well as the attention groups' blocks.
Primitives: `lay.block_keys`. Knows nothing of the server, of leases or of the workers.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import layout as lay
from .metadata import SaveJob

Offer = tuple[int, int, int]  # (KV cache group, block id, token boundary of the state in it)


def offers_of(scheduler_output) -> dict[str, list[Offer]]:
    """vLLM's boundary-state hand-offs of this step, by request (none before vLLM 0.32)."""
    state = getattr(scheduler_output, "kv_connector_block_state", None)
    return dict(getattr(state, "boundary_state_offloads", None) or {})


def offered_saves(
    req_id: str, layouts: Sequence[lay.BlockLayout], block_hashes, offers: Sequence[Offer], null_block: int
) -> list[SaveJob]:
    """One save job per state group of the states vLLM offers at block boundaries (a state at a
    boundary inside a block has no key a later hit asks for)."""
    by_group = {layout.group: layout for layout in layouts if layout.state}
    jobs: dict[int, SaveJob] = {}
    for group, block_id, boundary in offers:
        layout = by_group.get(group)
        if layout is None or block_id == null_block or boundary <= 0 or boundary % layout.block_size:
            continue
        index = boundary // layout.block_size - 1
        keys = lay.block_keys(block_hashes, layout, index, index + 1)
        if keys:
            job = jobs.setdefault(group, SaveJob(req_id, [], [], group))
            job.keys += keys
            job.block_ids.append(block_id)
    return list(jobs.values())
