"""What one HPKV entry is for a vLLM engine: the layers of one block, and its namespace.

An entry holds one vLLM block (all layers of the first KV cache group, this rank's shard): the
bytes of each layer's page, concatenated in the group's layer order. Both connector halves
derive the same description from the engine's config and `KVCacheConfig` (and the model's
identity, `modelid.py`), so the scheduler can look up the keys each worker rank writes without
asking the workers.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from ...errors import ConfigError
from ...identity import ModelIdentity
from ...keys import NamespaceDesc
from . import modelid

log = logging.getLogger("hpkv.vllm.layout")

ENGINE = "vllm"
REQUIRED_LAYOUT = "LBHNC"  # blocks outermost in every layer: one byte row per block


@dataclass(frozen=True)
class BlockLayout:
    layer_names: tuple[str, ...]
    page_bytes: tuple[int, ...]  # per layer, in layer order
    block_size: int
    hashes_per_block: int  # vLLM block hashes per block (block_size / hash_block_size)
    spec: str  # the attention spec's geometry, for the namespace

    @property
    def entry_bytes(self) -> int:
        return sum(self.page_bytes)

    @property
    def layer_offsets(self) -> tuple[int, ...]:
        offsets, total = [], 0
        for page in self.page_bytes:
            offsets.append(total)
            total += page
        return tuple(offsets)


def block_layout(vllm_config, kv_cache_config) -> BlockLayout:
    """The layout of an entry, from the first KV cache group (full attention)."""
    _refuse_context_parallel(vllm_config.parallel_config)
    if len(kv_cache_config.kv_cache_groups) > 1:  # vLLM turns its hybrid manager off for us; else
        raise ConfigError(
            f"HpkvConnectorV1 supports one KV cache group; this model has "
            f"{len(kv_cache_config.kv_cache_groups)} (a hybrid model, or "
            "--no-disable-hybrid-kv-cache-manager): run it without the HPKV connector"
        )
    group = kv_cache_config.kv_cache_groups[0]
    group_spec = group.kv_cache_spec
    per_layer = getattr(group_spec, "kv_cache_specs", None) or {}
    pages, spec_text = [], ""
    for name in group.layer_names:
        spec = per_layer.get(name, group_spec)
        pages.append(spec.page_size_bytes)
        spec_text = (
            f"{type(spec).__name__}:kv_heads={getattr(spec, 'num_kv_heads', '?')},"
            f"head={getattr(spec, 'head_size', '?')},dtype={getattr(spec, 'dtype', '?')}"
        )
    block_size = vllm_config.cache_config.block_size
    # vLLM 0.31's KVCacheConfig has no hash_block_size: there it is prefix_match_unit or the block size.
    hash_block_size = (
        getattr(kv_cache_config, "hash_block_size", None)
        or getattr(vllm_config.cache_config, "prefix_match_unit", None)
        or block_size
    )
    return BlockLayout(
        tuple(group.layer_names), tuple(pages), block_size, max(1, block_size // hash_block_size), spec_text
    )


def _refuse_context_parallel(parallel) -> None:
    """Context parallelism shards each block's tokens over ranks and makes vLLM's blocks (and
    block hashes) that many times longer than --block-size; HPKV's entries and keys assume one
    block per hash boundary and one shard per tensor/pipeline rank, so they would load the wrong
    blocks. Refused at start rather than giving wrong tokens."""
    sizes = {
        name: getattr(parallel, name, 1) or 1
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size")
    }
    used = {name: size for name, size in sizes.items() if size > 1}
    if used:
        flags = ", ".join(f"--{name.replace('_', '-')} {size}" for name, size in used.items())
        raise ConfigError(
            f"HpkvConnectorV1 does not support context parallelism ({flags}): run this engine without "
            "it, or without the HPKV connector"
        )


def world_ranks(vllm_config) -> int:
    parallel = vllm_config.parallel_config
    return parallel.tensor_parallel_size * parallel.pipeline_parallel_size


def namespaces(vllm_config, layout: BlockLayout, identity: ModelIdentity) -> list[NamespaceDesc]:
    """Every rank's namespace, as the scheduler half sees them. vLLM gives it the first pipeline
    stage's `KVCacheConfig` only; a later stage with another number of layers (28 over 3 stages:
    9, 10, 9) has other entries. Their layer counts follow vLLM's own partition (`get_pp_indices`)
    where it gives the first stage's count and every layer's page is the same size; otherwise
    every stage is taken to be the first (its lookups then miss: never a wrong load, since a
    worker leases in the namespace of its own layers)."""
    parallel = vllm_config.parallel_config
    counts = _stage_layer_counts(vllm_config)
    if counts is not None and (counts[0] != len(layout.layer_names) or len(set(layout.page_bytes)) != 1):
        log.warning(
            "HPKV cannot tell the KV layers of each pipeline stage (the first has %d, vLLM's partition "
            "says %d): hits are looked up as if every stage had the first one's; stages with other "
            "layers miss",
            len(layout.layer_names),
            counts[0],
        )
        counts = None
    descs = []
    for rank in range(world_ranks(vllm_config)):
        stage_layout = layout
        pp_rank = rank // parallel.tensor_parallel_size
        if counts is not None and counts[pp_rank] != len(layout.layer_names):
            num = counts[pp_rank]
            stage_layout = dataclasses.replace(
                layout,
                layer_names=tuple(f"stage{pp_rank}.{i}" for i in range(num)),
                page_bytes=layout.page_bytes[:1] * num,
            )
        descs.append(namespace(vllm_config, stage_layout, rank, identity))
    return descs


def _stage_layer_counts(vllm_config) -> list[int] | None:
    """Layers per pipeline stage by vLLM's partition; None for one stage."""
    pp_size = vllm_config.parallel_config.pipeline_parallel_size
    if pp_size <= 1:
        return None
    try:
        from vllm.distributed.utils import get_pp_indices

        total = vllm_config.model_config.get_total_num_hidden_layers()
        counts = [end - start for start, end in (get_pp_indices(total, r, pp_size) for r in range(pp_size))]
    except Exception as exc:  # noqa: BLE001 (a vLLM without it, or a bad VLLM_PP_LAYER_PARTITION)
        log.warning(
            "HPKV cannot tell the layers of each pipeline stage (%s): stages after the first are "
            "taken to have the first one's layers",
            exc,
        )
        return None
    return counts if counts else None


def namespace(vllm_config, layout: BlockLayout, rank: int, identity: ModelIdentity) -> NamespaceDesc:
    """The namespace of one rank's entries; `rank` = pp_rank * tp_size + tp_rank. The model is
    `identity` (modelid.py) and what changes the numerics on load, never the model's path."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    return NamespaceDesc(
        engine=ENGINE,
        model=modelid.model_text(vllm_config, identity),
        dtype=str(
            vllm_config.cache_config.cache_dtype if vllm_config.cache_config.cache_dtype != "auto" else model.dtype
        ),
        layout=f"{REQUIRED_LAYOUT};{layout.spec};pages={','.join(map(str, layout.page_bytes))}",
        block_size=layout.block_size,
        num_layers=len(layout.layer_names),
        entry_bytes=layout.entry_bytes,
        tp_size=parallel.tensor_parallel_size,
        pp_size=parallel.pipeline_parallel_size,
        cp_size=max(1, getattr(parallel, "prefill_context_parallel_size", 1))
        * max(1, getattr(parallel, "decode_context_parallel_size", 1)),
        rank=rank,
        extra=(("model_source", identity.source),),
    )


def block_keys(block_hashes, layout: BlockLayout, start: int, stop: int) -> list[bytes]:
    """The entry keys of blocks [start, stop): the block hash at each block's last boundary."""
    step = layout.hashes_per_block
    stop = min(stop, len(block_hashes) // step)
    return [bytes(block_hashes[(i + 1) * step - 1]) for i in range(start, stop)]
