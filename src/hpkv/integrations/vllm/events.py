"""HPKV's tiers as vLLM KV events: which blocks this engine's namespaces hold in the DRAM pool
and on storage, published through vLLM's own publisher (the connector's `take_events`).

A block is announced `BlockStored` in a tier (medium "CPU" for the DRAM pool, "STORAGE" for
storage: the names vLLM's native offloading gives its CPU and file-system tiers) once every
rank's namespace of its KV cache group holds it, and `BlockRemoved` once one no longer does. The
payload is vLLM's own for that block (`BlockPool`'s): hash, parent hash, token ids, block size,
LoRA name and extra keys, group index, as `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` converts them, so
a consumer joins them with the device's events. What a tier holds is learnt from the server's
journal (`store/journal.py`), in the order it happened there, and from this engine's own lease
answers; both are applied on the scheduler's thread, which is why a removal is never published
before the store it undoes. A block is described once this engine has seen it in a request
(saved it, or leased it): blocks other engines of the same namespaces wrote are theirs to announce.
Each description made is queued for the server (`outbox`, its first rank's namespace of the
group), which keeps it for the engines that start later; at start an engine adopts those the
server kept of keys a tier holds (`snapshots`, `adopt`), so what the tiers held before it
started is announced without a request. When journal records were lost (the server's bound, or
a server restarted) the tiers are asked again for every block described (`resync`), and the
difference is published.

Primitives: `attach`, `saving`, `leased`, `apply`, `snapshots`, `adopt`, `resync`, `take`;
`outbox`. Full-attention groups only (sliding-window and state groups publish nothing, as in
vLLM's own offloading events). Must not know: the server's store, the poller's thread (`eventfeed.py`).
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence

from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    resolve_block_hashes,
    to_event_extra_keys,
)

from ...server import protocol as p
from ...server.client import Client, LeaseHandle
from ...tiers import Tier
from . import blockdesc
from . import layout as lay
from .blockdesc import BlockMeta

log = logging.getLogger("hpkv.vllm.events")

MEDIUMS = {Tier.DRAM: MEDIUM_CPU, Tier.STORAGE: MEDIUM_STORAGE}
STORED = 4  # in a journal record's code, beside the tier: the entry entered it
MAX_UNHELD = 1 << 17  # blocks described and held in no tier (saves not committed yet): oldest dropped
# Blocks described at most (about 0.5 KiB each, with what the tiers hold of them): past it new
# blocks are not announced (never a stale one); those announced keep theirs until removed.
MAX_DESCRIBED = 1 << 20
HELD_BATCH = 1 << 15  # keys asked per `Journal` when learning the tiers again
MAX_OUTBOX = 1 << 16  # descriptions waiting for the poller to give them to the server: the oldest dropped past it

BlockId = tuple[int, bytes]  # (KV cache group, entry key)


class TierEvents:
    def __init__(self, layouts: Sequence[lay.BlockLayout], num_ranks: int) -> None:
        self.layouts = list(layouts)
        self.num_ranks = num_ranks
        self.namespaces: list[str] = []
        self.cursors: dict[str, int] = {}  # per namespace, the last journal record applied
        self._group_of: dict[str, int] = {}  # namespace -> index into layouts (full attention only)
        self._meta: dict[BlockId, BlockMeta] = {}
        self._unheld: OrderedDict[BlockId, None] = OrderedDict()  # described, announced in no tier
        self._held: dict[Tier, list[set[bytes]]] = {}  # per tier, per namespace: the keys it holds
        self._announced: dict[Tier, set[BlockId]] = {tier: set() for tier in Tier}
        self._events: list[KVCacheEvent] = []
        self._said_full = False
        # (ns, key, blob) of the descriptions made, for the server; read by the poller's thread.
        self.outbox: deque[tuple[str, bytes, bytes]] = deque(maxlen=MAX_OUTBOX)

    def attach(self, namespaces: Sequence[str]) -> None:
        """This engine's namespaces, rank-major as `layout.namespaces` gives them."""
        self.namespaces = list(namespaces)
        num_groups = len(self.layouts)
        for i, ns in enumerate(self.namespaces):
            layout = self.layouts[i % num_groups]
            if not layout.state and not layout.window_blocks:
                self._group_of[ns] = i % num_groups
        self._held = {tier: [set() for _ in self.namespaces] for tier in Tier}

    # -- what this engine sees of blocks ---------------------------------------------------------

    def saving(self, request, start: int, stop: int) -> None:
        """Blocks [start, stop) of `request` are being saved: describe them (before their commit
        can reach the journal)."""
        for group, layout in enumerate(self.layouts):
            if not layout.state and not layout.window_blocks:
                self._describe(request, group, layout, start, stop)

    def leased(self, request, start: int, leases: Sequence[LeaseHandle], namespaces: Sequence[str]) -> None:
        """A lease answer from block `start` on, per namespace: its leading hits and their tiers
        (a storage hit is promoted: its DRAM copy comes through the journal)."""
        for ns, lease in zip(namespaces, leases):
            group = self._group_of.get(ns)
            if group is None or not lease.tiers:
                continue
            keys = self._describe(request, group, self.layouts[group], start, start + len(lease.tiers))
            index = self.namespaces.index(ns)
            for key, tier in zip(keys, lease.tiers):
                self._set(index, group, tier, key, True)

    def _describe(self, request, group: int, layout: lay.BlockLayout, start: int, stop: int) -> list[bytes]:
        keys = lay.block_keys(request.block_hashes, layout, start, stop)
        hash_block_size = layout.block_size // layout.hashes_per_block
        hashes = resolve_block_hashes(request.block_hashes, hash_block_size, layout.block_size)
        lora = getattr(request, "lora_request", None)
        for i, key in enumerate(keys, start):
            block = (group, key)
            if block in self._meta:
                continue
            if len(self._meta) >= MAX_DESCRIBED:
                self._full()
                break
            begin, end = i * layout.block_size, (i + 1) * layout.block_size
            extra, _ = generate_block_hash_extra_keys(request, begin, end, 0)
            meta = self._meta[block] = BlockMeta(
                bytes(hashes[i]),
                bytes(hashes[i - 1]) if i else None,
                array("i", request.all_token_ids[begin:end]),
                layout.block_size,
                extra,
                lora.name if lora is not None else None,
                lora.adapter_id if lora is not None else None,
                getattr(request, "session_id", None),
            )
            self._unheld[block] = None
            blob = blockdesc.encode(meta)
            if len(blob) <= p.MAX_BLOB_BYTES:  # a larger one is announced on its next touch only
                self.outbox.append((self.namespaces[group], key, blob))
        while len(self._unheld) > MAX_UNHELD:  # saves that never committed (skipped: held already, no room)
            self._meta.pop(self._unheld.popitem(last=False)[0], None)
        return keys

    # -- what the tiers hold -------------------------------------------------------------------------

    def apply(self, ns: str, codes: bytes, keys: Sequence[bytes], last: int) -> None:
        """Journal records of `ns` numbered up to `last`, in order; those applied already skipped."""
        group, cursor = self._group_of.get(ns), self.cursors.get(ns, 0)
        first = last - len(keys) + 1
        if group is not None:
            index = self.namespaces.index(ns)
            for number, code, key in zip(range(first, last + 1), codes, keys):
                tier, stored = Tier(code & 3), bool(code & STORED)
                if number > cursor and ((group, key) in self._meta or (not stored and key in self._held[tier][index])):
                    self._set(index, group, tier, key, stored)
        self.cursors[ns] = max(cursor, last)

    def snapshots(self) -> list[p.Snapshot]:
        """What to ask the server at start: per full-attention group, the descriptions kept in its
        first rank's namespace, with the tiers holding each in every rank's."""
        num_groups, ns = len(self.layouts), self.namespaces
        return [
            p.Snapshot(ns[group], 0, [ns[r * num_groups + group] for r in range(self.num_ranks)])
            for group in sorted(set(self._group_of.values()))
        ]

    def adopt(self, page: p.SnapshotPage) -> None:
        """Descriptions the server kept (of keys a tier holds), with the tiers holding each on
        every rank (`page.held`, as `snapshots` asked): described here as if seen in a request,
        and announced where every rank holds them. One that does not decode is skipped."""
        group = self._group_of.get(page.ns)
        if group is None or len(page.held) != self.num_ranks:
            return
        layout = self.layouts[group]
        for i, (key, blob) in enumerate(zip(page.keys, page.blobs)):
            block = (group, key)
            if block not in self._meta:
                meta = blockdesc.decode(blob, layout.block_size)
                if meta is None:
                    continue
                if len(self._meta) >= MAX_DESCRIBED:
                    self._full()
                    return
                self._meta[block] = meta
                self._unheld[block] = None
            for rank, bits in enumerate(page.held):
                for tier in Tier:
                    self._set(rank * len(self.layouts) + group, group, tier, key, bool(bits[i] & tier))
        while len(self._unheld) > MAX_UNHELD:
            self._meta.pop(self._unheld.popitem(last=False)[0], None)

    def resync(self, client: Client) -> str:
        """Learn again what the tiers hold of every block described (journal records were lost):
        watch each namespace from now, ask the tiers, and publish the difference; the server's
        journal life."""
        watched = client.journal([(ns, -1) for ns in self.namespaces])
        for page in watched.pages:
            self.cursors[page.ns] = page.last
        for index, ns in enumerate(self.namespaces):
            group = self._group_of.get(ns)
            if group is None:
                continue
            keys = [key for g, key in self._meta if g == group]
            for at in range(0, len(keys), HELD_BATCH):
                batch = keys[at : at + HELD_BATCH]
                (bits,) = client.journal([], [(ns, batch)]).held
                for key, held in zip(batch, bits):
                    for tier in Tier:
                        self._set(index, group, tier, key, bool(held & tier))
        return watched.life

    def _set(self, index: int, group: int, tier: Tier, key: bytes, held: bool) -> None:
        keys = self._held[tier][index]
        if held:
            keys.add(key)
        else:
            keys.discard(key)
        block = (group, key)
        now = all(key in self._held[tier][r * len(self.layouts) + group] for r in range(self.num_ranks))
        announced = self._announced[tier]
        if now and block not in announced and block in self._meta:
            announced.add(block)
            self._unheld.pop(block, None)
            self._events.append(self._stored(block, tier))
        elif not now and block in announced:
            announced.discard(block)
            meta = self._meta[block]
            removed = [maybe_convert_block_hash(meta.block_hash)]
            self._events.append(BlockRemoved(block_hashes=removed, medium=MEDIUMS[tier], group_idx=group))
            if not any(block in self._announced[t] for t in Tier):
                self._forget(block)

    def _full(self) -> None:
        if not self._said_full:
            self._said_full = True
            log.warning(
                "HPKV KV events: %d blocks described; blocks past them are not announced until some "
                "of these leave HPKV's tiers",
                MAX_DESCRIBED,
            )

    def _forget(self, block: BlockId) -> None:
        """Held in no tier: its description goes once no namespace of any rank lists it."""
        group, key = block
        if not any(key in self._held[t][r * len(self.layouts) + group] for t in Tier for r in range(self.num_ranks)):
            self._meta.pop(block, None)

    def _stored(self, block: BlockId, tier: Tier) -> BlockStored:
        meta = self._meta[block]
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(meta.block_hash)],
            parent_block_hash=maybe_convert_block_hash(meta.parent) if meta.parent is not None else None,
            token_ids=meta.token_ids.tolist(),
            block_size=meta.block_size,
            lora_id=meta.lora_id,
            medium=MEDIUMS[tier],
            lora_name=meta.lora_name,
            extra_keys=to_event_extra_keys([meta.extra_keys]),
            group_idx=self.layouts[block[0]].group,
            session_id=meta.session_id,
        )

    # -- publishing ------------------------------------------------------------------------------

    def held_blocks(self, tier: Tier) -> set[BlockId]:
        """The blocks announced held in `tier` (for tests and status)."""
        return set(self._announced[tier])

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, in order, batched: the stores between two removals
        joined into one event per chain of blocks (vLLM's device cache sends a request's new
        blocks as one), the removals between two stores into one per tier and group. Only stores
        of different blocks are reordered, never a store and a removal."""
        events, self._events = self._events, []
        out: list[KVCacheEvent] = []
        run: list[BlockStored] = []
        for event in events:
            if isinstance(event, BlockStored):
                run.append(event)
                continue
            out += _chains(run)
            run = []
            last = out[-1] if out else None
            if isinstance(last, BlockRemoved) and (last.medium, last.group_idx) == (event.medium, event.group_idx):
                last.block_hashes.extend(event.block_hashes)
            else:
                out.append(event)
        return out + _chains(run)


def _chains(stores: list[BlockStored]) -> list[BlockStored]:
    """Single-block stores joined along their parent links (where a block has one child in the
    run): one event per chain, in the order of each chain's first block."""
    children: dict[tuple, list[BlockStored]] = {}
    for event in stores:
        children.setdefault((event.medium, event.group_idx, event.parent_block_hash), []).append(event)

    def only_child(event: BlockStored) -> BlockStored | None:
        kids = children.get((event.medium, event.group_idx, event.block_hashes[0]), [])
        return kids[0] if len(kids) == 1 else None

    joined = {id(child) for event in stores if (child := only_child(event)) is not None}
    chains = []
    for event in stores:
        if id(event) in joined:
            continue  # in the chain of its parent
        chain = BlockStored(**{f: _copied(getattr(event, f)) for f in event.__struct_fields__})
        extra = list(event.extra_keys) if event.extra_keys else [None]
        child = only_child(event)
        while child is not None:
            chain.block_hashes.append(child.block_hashes[0])
            chain.token_ids.extend(child.token_ids)
            extra += list(child.extra_keys) if child.extra_keys else [None]
            child = only_child(child)
        chain.extra_keys = extra if any(key is not None for key in extra) else None
        chains.append(chain)
    return chains


def _copied(value):
    return list(value) if isinstance(value, list) else value
