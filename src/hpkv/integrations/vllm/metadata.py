"""What the scheduler half tells the worker halves each step (the connector's stats are in
`connectorstats.py`).

It travels between processes by pickle/msgpack: plain types only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ...identity import ModelIdentity


@dataclass
class LoadJob:
    """Copy the entries of `keys` into `block_ids`. The scheduler holds leases on them; each
    worker takes its own lease for the copy, so its bytes are pinned for exactly as long as it
    reads them, whatever happens to the scheduler's connection."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    group: int = 0  # the KV cache group (and namespace) of the blocks
    # An asynchronous load (hybrid models): the request waits for it, and the workers report it
    # in finished_recving, with failed_recving when it failed (vLLM then recomputes it).
    notify: bool = False


@dataclass
class SaveJob:
    """Save full blocks: the workers reserve, copy and commit (the server skips held keys)."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    group: int = 0


@dataclass
class HpkvConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    # Blocks allocated to requests in this step: the only blocks vLLM can overwrite that an
    # earlier step's save may still be reading (the worker fences on them).
    allocated: list[int] = field(default_factory=list)
    seq: int = 0  # the step's number, sent back in HpkvWorkerMeta when it loads or holds
    # Reserve this step's saves in this hold and do not commit them: the scheduler settles it
    # once it knows no load they depend on failed (pending.py). "": commit them.
    hold: str = ""
    # The model's identity once the scheduler knows it (the workers name their namespaces by it);
    # None before: no loads or saves then.
    identity: ModelIdentity | None = None
