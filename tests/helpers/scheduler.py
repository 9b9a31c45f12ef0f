"""The vLLM scheduler half (`HpkvScheduler`) as vLLM's engine core holds it, on a real server and
no engine: built by hand, loading every hit, with requests whose blocks every rank has saved."""

from __future__ import annotations

from types import SimpleNamespace

from helpers.keys import desc, entry_key

BS = 32


def scheduler_half(node, num_ranks: int):
    """The half as vLLM's engine core holds it, loading every hit (threshold 0)."""
    from hpkv.costmodel import FixedThreshold
    from hpkv.identity import IdentityTask, override_identity
    from hpkv.integrations.vllm.connectorstats import HpkvConnectorStats
    from hpkv.integrations.vllm.layout import BlockLayout
    from hpkv.integrations.vllm.scheduler import HpkvScheduler
    from hpkv.integrations.vllm.table import RequestTable

    scheduler = HpkvScheduler.__new__(HpkvScheduler)
    scheduler.client = node.client("vllm-scheduler", retry_interval_s=0.0)
    scheduler._ns = [scheduler.client.register(desc(r)) for r in range(num_ranks)]
    scheduler.descs = [desc(r) for r in range(num_ranks)]
    scheduler.identity = IdentityTask.of(override_identity("test"))  # known: loads and saves from the start
    scheduler.stats, scheduler.policy = HpkvConnectorStats(), FixedThreshold(0, BS)
    scheduler.table, scheduler._pending_loads = RequestTable(), []
    scheduler.block_size, scheduler.layout = BS, BlockLayout(("l0",), (1,), BS, 1, "")
    scheduler.layouts, scheduler.num_ranks, scheduler.async_loads = [scheduler.layout], num_ranks, False
    scheduler.kv_cache_manager = None
    return scheduler


def saved(node, scheduler, keys: list[bytes]) -> None:
    """Every rank's worker has saved `keys`."""
    for rank, ns in enumerate(scheduler._ns):
        worker = node.client(f"vllm-worker-{rank}")
        worker.register(desc(rank))
        worker.commit(worker.reserve(ns, keys))


def prompt(node, scheduler, num_blocks: int, **request_kw):
    """A request whose first `num_blocks` blocks every rank has saved (and one token more)."""
    keys = [entry_key("prompt", i) for i in range(num_blocks)]
    saved(node, scheduler, keys)
    return SimpleNamespace(request_id="r", num_tokens=num_blocks * BS + 1, block_hashes=keys, **request_kw)


def blocks(*block_ids: int):
    return SimpleNamespace(get_block_ids=lambda: (list(block_ids),))
