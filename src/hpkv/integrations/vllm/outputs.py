"""Reading a vLLM step: the blocks and chunks of a scheduler output, and the settling of a
connector output (failed loads, finished loads, pending saves) on the scheduler half's
`RequestTable`.

Primitives: `settle(table, client, stats, kv_cache_manager, block_size, connector_output)`,
`PendingSaves.affected/poison/step_done`, `Client.settle`. Knows nothing of lookups, of the load
policy, nor of `HpkvScheduler` (the table is the state they share).
"""

from __future__ import annotations

import logging

from ...errors import HpkvError
from ...server.client import Client
from .connectorstats import HpkvConnectorStats
from .pending import HpkvWorkerMeta
from .requests import unhash_failed
from .table import RequestTable

log = logging.getLogger("hpkv.vllm.scheduler")


def settle(
    table: RequestTable,
    client: Client,
    stats: HpkvConnectorStats,
    kv_cache_manager,
    block_size: int,
    connector_output,
) -> None:
    """Requests whose blocks failed to load (as vLLM finds them: any of their blocks in
    `invalid_block_ids`) lose the saves held on top of that load and save again from the
    first failed block, which vLLM recomputes; then the pending saves of the steps this
    output covers are settled."""
    invalid = set(connector_output.invalid_block_ids or ())
    if invalid:
        _fail_loads(table, kv_cache_manager, block_size, invalid)
    for req_id in getattr(connector_output, "failed_recving", None) or ():
        # An asynchronous load failed: vLLM frees its blocks (never cached) and recomputes the
        # request from its start, with no KV computed on the failed blocks meanwhile.
        state = table.get(req_id)
        if state is not None:
            state.load_failed = True
            state.release(client)
    meta = connector_output.kv_connector_worker_meta
    seqs, failed = (meta.seqs, meta.failed) if isinstance(meta, HpkvWorkerMeta) else (set(), set())
    _settle_holds(table, client, stats, seqs, failed)


def _fail_loads(table: RequestTable, kv_cache_manager, block_size: int, invalid: set[int]) -> None:
    failed = table.pending.affected(invalid)
    failed.update(req_id for req_id, state in table.reqs.items() if not invalid.isdisjoint(state.block_ids))
    table.pending.poison(failed, table.seq)
    for req_id in failed:
        state = table.get(req_id)
        if state is not None:
            state.after_failed_load(invalid, block_size)
    # last: a vLLM that raises in it must not keep the poison from its saves
    unhash_failed(kv_cache_manager, table.reqs, invalid, failed)


def _settle_holds(
    table: RequestTable, client: Client, stats: HpkvConnectorStats, seqs: set[int], failed: set[int]
) -> None:
    if seqs:
        # The workers have copied what those steps loaded: the scheduler's leases need not pin
        # those entries for the rest of the requests' lives.
        for done in table.loads_done(max(seqs)):
            done.release(client)
    for settle in table.pending.step_done(seqs, failed):
        try:
            client.settle(settle.hold, settle.abort)
        except HpkvError as exc:  # the server, and the reservations with it, are gone
            log.debug("HPKV hold %s not settled: %s", settle.hold, exc)
        for req_id, first in settle.resave.items():  # saved again once recomputed
            state = table.get(req_id)
            if state is not None:
                state.saved_blocks = min(state.saved_blocks, first)
        if settle.abort:
            stats.add("held_saves_aborted", len(settle.abort))
            log.warning(
                "HPKV: %d saved blocks were not published: computed on KV that failed to load, or not copied in full",
                len(settle.abort),
            )


def allocated_blocks(scheduler_output) -> list[int]:
    """Every block given to a request in this step (new, resumed or grown), tracked or not."""
    blocks: list[int] = []
    groups = [new.block_ids for new in scheduler_output.scheduled_new_reqs]
    for group_ids in groups + list(scheduler_output.scheduled_cached_reqs.new_block_ids):
        for ids in group_ids or ():  # every KV cache group's (hybrid models have several)
            blocks.extend(ids)
    return blocks


def chunks(scheduler_output) -> list[tuple[int, int]]:
    """(first position, number of tokens) of what the step computes for each request."""
    scheduled = scheduler_output.num_scheduled_tokens
    chunks = [(new.num_computed_tokens, scheduled.get(new.req_id, 0)) for new in scheduler_output.scheduled_new_reqs]
    cached = scheduler_output.scheduled_cached_reqs
    chunks += [(cached.num_computed_tokens[i], scheduled.get(req_id, 0)) for i, req_id in enumerate(cached.req_ids)]
    return chunks
