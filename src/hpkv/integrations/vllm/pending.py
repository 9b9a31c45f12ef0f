"""Pending saves: saves reserved in a server-side hold until the steps they depend on are known
not to have read a failed load.

A step that loads KV computes the rest of its prompts on the loaded bytes; when a load fails on a
worker, vLLM learns it from that step's output (`invalid_block_ids`) and recomputes, but the KV
the step computed on the failed blocks, saved, would be wrong KV under the right keys. With async
scheduling the next step may compute on them too. So while the output of any step with loads is
outstanding, every step's saves are reserved in a hold named after the step
(`Client.reserve(hold=)`); once a step's output is back, the holds of it and every step before it
are settled (`Client.settle`): keys of requests that read a failed block aborted, the rest
committed, in every rank's namespace at once. Steps carry a sequence number the workers send back
(`HpkvWorkerMeta`); a hold nobody settles (an engine stopping) is aborted by the server.

Primitives: `PendingSaves.begin_step(seq, has_loads)` -> the hold of that step's saves ("" when
they need none), `add(seq, req_id, keys, blocks)`, `affected(invalid_block_ids)`,
`poison(req_ids, up_to_seq)`, `step_done(seqs, failed)` -> [Settle(hold, keys to abort, blocks to
save again)].
Must not know: the server, vLLM's objects (the scheduler passes plain ids).
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata


@dataclass
class HpkvWorkerMeta(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler after a step: its sequence number, when it loaded
    or held saves, and the steps whose held saves a rank did not copy in full (a reservation
    that timed out on the client but may have been made, a copy that failed, a connection gone):
    those holds must be aborted whole. Aggregated over ranks by union."""

    seqs: set[int]
    failed: set[int] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> HpkvWorkerMeta:
        if isinstance(other, HpkvWorkerMeta):
            self.seqs |= other.seqs
            self.failed |= other.failed
        return self


@dataclass
class _Held:
    req_id: str
    keys: list[bytes]
    blocks: list[int]  # the request's blocks up to the saved ones (the loaded ones among them)
    first_block: int  # the index of the first saved block in the request


@dataclass
class Settle:
    hold: str
    abort: list[bytes]  # keys to abort; the rest of the hold is committed
    resave: dict[str, int]  # request -> first block to save again (good KV a rank did not copy)


class PendingSaves:
    def __init__(self) -> None:
        self._prefix = f"vllm.{os.getpid()}.{os.urandom(4).hex()}"  # unique per engine
        self._loading: set[int] = set()  # steps with loads whose output is not back
        self._steps: OrderedDict[int, list[_Held]] = OrderedDict()  # held saves by step, in order
        self._poisoned: dict[str, int] = {}  # request -> the last step built on its failed load

    def name(self, seq: int) -> str:
        return f"{self._prefix}.{seq}"

    def begin_step(self, seq: int, has_loads: bool) -> str:
        if has_loads:
            self._loading.add(seq)
        return self.name(seq) if self._loading else ""

    def add(self, seq: int, req_id: str, keys: list[bytes], blocks: list[int], first_block: int) -> None:
        self._steps.setdefault(seq, []).append(_Held(req_id, keys, blocks, first_block))

    def pending(self) -> int:
        return sum(len(held) for held in self._steps.values())

    def abandon(self) -> list[Settle]:
        """Every hold not settled yet, all its keys to abort (the engine is stopping: their
        steps' outputs will not come)."""
        settles = [
            Settle(self.name(seq), [key for h in held for key in h.keys], {}) for seq, held in self._steps.items()
        ]
        self._steps.clear()
        return settles

    def affected(self, invalid_block_ids: set[int]) -> set[str]:
        """Requests with held saves whose blocks include a failed one (finished ones too)."""
        return {h.req_id for held in self._steps.values() for h in held if not invalid_block_ids.isdisjoint(h.blocks)}

    def poison(self, req_ids: set[str], up_to_seq: int) -> None:
        """These requests read a failed load: their saves held in steps up to `up_to_seq` (the
        last step built before vLLM rolled them back) are aborted."""
        for req_id in req_ids:
            self._poisoned[req_id] = max(up_to_seq, self._poisoned.get(req_id, -1))

    def step_done(self, seqs: AbstractSet[int], failed: AbstractSet[int] = frozenset()) -> list[Settle]:
        """The output of steps `seqs` is back (and every earlier step's, outputs come in order):
        the holds to settle now, each with the keys to abort (those of poisoned requests, and
        all of a step in `failed`) and, for each request whose good KV a rank did not copy, the
        first block to save again."""
        if not seqs:
            return []
        top = max(seqs)
        self._loading = {seq for seq in self._loading if seq > top}
        settles = []
        while self._steps and next(iter(self._steps)) <= top:
            seq, held = self._steps.popitem(last=False)
            poisoned = [h for h in held if self._poisoned.get(h.req_id, -1) >= seq]
            uncopied = [h for h in held if seq in failed and h not in poisoned]
            resave: dict[str, int] = {}  # good KV that was not copied: saved again (poisoned KV never)
            for h in uncopied:
                resave[h.req_id] = min(h.first_block, resave.get(h.req_id, h.first_block))
            settles.append(Settle(self.name(seq), [key for h in poisoned + uncopied for key in h.keys], resave))
        low = next(iter(self._steps), math.inf)  # steps built later come after every poisoned one
        self._poisoned = {req_id: seq for req_id, seq in self._poisoned.items() if seq >= low}
        return settles
