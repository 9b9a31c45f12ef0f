"""How far a request's hit goes and in which tiers, for `HpkvScheduler`: one request to the server
whatever the ranks, KV cache groups and blocks.

A model whose every group loads every block of a hit (full attention) asks nothing before its
lease: `leased_tiers` reads the hit from the leases' own answer (one `Lease` over every
namespace, each lease's leading hits and their tiers). A model with sliding-window or
linear-attention (state) groups leases only part of each group's blocks, which depends on the
hit's length, so it looks the hit up first (`looked_up`: one `Lookup` over every namespace, the
state namespaces answered key by key) and searches that one answer for the longest boundary
every group has (`plan_hit`); the lease follows (`groups.lease_ranges`).
A hit of n blocks needs the attention groups' leading n blocks and, in each state group, the
entry of block n - 1 (vLLM resumes from that state: `mamba.py` says which states are saved);
a block's tier is the slowest of its entries.
Primitives: `needs_lookup`, `looked_up`, `plan_hit`, `leased_tiers`, `Client.lookup_many`.
Knows nothing of leases' lifetimes or of the workers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...server.client import Client, LeaseHandle
from ...tiers import Tier
from . import layout as lay

_TIERS = {int(t): t for t in Tier}


def needs_lookup(layouts: Sequence[lay.BlockLayout]) -> bool:
    """Whether a hit's length must be known before its lease: some group leases only part of it."""
    return any(layout.state or layout.window_blocks for layout in layouts)


@dataclass
class Answer:
    """One `Lookup` of a request's keys in every namespace (rank-major, as `lay.namespaces`)."""

    attention: list[bytes]  # each attention namespace's leading hits (tier codes)
    states: list[bytes]  # each state namespace's tier code of every key (0: a miss)
    num_keys: int

    def tiers(self, limit: int) -> tuple[Tier, ...]:
        """The tier of each block of the longest hit of at most `limit` blocks: the attention
        groups' leading blocks, cut back to the last boundary whose state every state group has."""
        num_hit = min([len(hit) for hit in self.attention] + [limit, self.num_keys])
        tiers = [_TIERS[max((hit[i] for hit in self.attention), default=int(Tier.DRAM))] for i in range(num_hit)]
        if not self.states:
            return tuple(tiers)
        for num in range(num_hit, 0, -1):
            codes = [state[num - 1] for state in self.states]
            if all(codes):
                return tuple(tiers[: num - 1]) + (max(tiers[num - 1], _TIERS[max(codes)]),)
        return ()


def looked_up(
    client: Client, layouts: Sequence[lay.BlockLayout], namespaces: Sequence[str], keys: Sequence[bytes]
) -> Answer:
    """One `Lookup` of `keys` in every namespace."""
    stateful = [layouts[i % len(layouts)].state for i in range(len(namespaces))]
    each = [i for i, state in enumerate(stateful) if state]
    answers = client.lookup_many([(ns, keys) for ns in namespaces], each)
    return Answer(
        [hit for hit, state in zip(answers, stateful) if not state],
        [hit for hit, state in zip(answers, stateful) if state],
        len(keys),
    )


def plan_hit(answer: Answer, plan: Callable[[tuple[Tier, ...]], int]) -> tuple[int, tuple[Tier, ...]]:
    """The blocks of the longest hit, and the tiers of those the load policy takes
    (`plan(tiers)` -> how many leading ones). With state groups a hit cut short must end where
    states are: cut there, from the same answer, until the policy takes all of one."""
    tiers = answer.tiers(answer.num_keys)
    num_hit, num = len(tiers), plan(tiers)
    while answer.states and 0 < num < len(tiers):
        tiers = answer.tiers(num)
        num = plan(tiers)
    return num_hit, tiers[:num]


def leased_tiers(leases: Sequence[LeaseHandle]) -> tuple[Tier, ...]:
    """The hit every lease holds (each over the same keys): its leading blocks, a block's tier
    the slowest of its entries."""
    num_hit = min((len(lease.tiers) for lease in leases), default=0)
    return tuple(max(lease.tiers[i] for lease in leases) for i in range(num_hit))
