"""Linear-attention (Mamba, GDN) groups of a hybrid model: which state blocks a step saves, and
how far a hit can go, for `HpkvScheduler`.

vLLM's prefix caching of these models (`mamba_cache_mode="align"`) keeps a group's recurrent
state only at some block boundaries (where a scheduler step ends, the prefill checkpoint before
a prompt's last block, the points `--prefix-cache-retention-interval` keeps), in blocks it picks:
its block table for such a group is not positional. So the states saved are the ones vLLM hands
to connectors (`SchedulerOutput.kv_connector_block_state.boundary_state_offloads`: group, block,
token boundary), each under the block hash at its boundary in its group's namespace, an entry
being that block's page (conv and SSM state of the group's layers). A hit of n blocks needs each
state group's entry of block n - 1 (vLLM gives that group n - 1 null blocks and one block to
resume from, `lay.BlockLayout.needed`) as well as the attention groups' blocks: the longest
boundary where all are there, all or nothing.
Primitives: `lay.block_keys`, `Client.lookup`. Knows nothing of leases or of the workers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ...server.client import Client
from ...tiers import Tier
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


def hit_tiers(client: Client, layouts: Sequence[lay.BlockLayout], namespaces: Sequence[str], keys) -> tuple[Tier, ...]:
    """The tier of each block of the longest hit of `keys` (namespaces rank-major, as
    `lay.namespaces`): the attention groups' leading blocks, cut back to the last boundary
    whose state every state group has; a block's tier is the slowest of its entries."""
    stateful = [layouts[i % len(layouts)].state for i in range(len(namespaces))]
    hits = [client.lookup(ns, keys) for ns, state in zip(namespaces, stateful) if not state]
    num_hit = min((hit.num_hit for hit in hits), default=len(keys))
    tiers = [max((hit.tiers[i] for hit in hits), default=Tier.DRAM) for i in range(num_hit)]
    state_nss = [ns for ns, state in zip(namespaces, stateful) if state]
    if not state_nss:
        return tuple(tiers)
    num, tier = _state_boundary(client, state_nss, keys, num_hit)
    return tuple(tiers[: num - 1]) + ((max(tiers[num - 1], tier),) if num else ())


def _state_boundary(client: Client, namespaces: Sequence[str], keys, num_hit: int) -> tuple[int, Tier]:
    """The largest n <= num_hit with the entry of block n - 1 in every namespace, and the
    slowest tier among them; (0, DRAM) if none."""
    for num in range(num_hit, 0, -1):
        tiers = []
        for ns in namespaces:
            hit = client.lookup(ns, [keys[num - 1]])
            if not hit.num_hit:
                break
            tiers.append(hit.tiers[0])
        else:
            return num, max(tiers)
    return 0, Tier.DRAM


def plan_hit(
    client: Client, layouts, namespaces: Sequence[str], keys, plan: Callable[[tuple[Tier, ...]], int]
) -> tuple[int, tuple[Tier, ...]]:
    """The blocks of the longest hit, and the tiers of those the load policy takes
    (`plan(tiers)` -> how many leading ones). With state groups a hit cut short must end where
    states are: it is looked up again, that short, until the policy takes all of one."""
    tiers = hit_tiers(client, layouts, namespaces, keys)
    num_hit, num = len(tiers), plan(tiers)
    while any(layout.state for layout in layouts) and 0 < num < len(tiers):
        tiers = hit_tiers(client, layouts, namespaces, keys[:num])
        num = plan(tiers)
    return num_hit, tiers[:num]
