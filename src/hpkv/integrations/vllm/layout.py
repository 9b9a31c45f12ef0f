"""What one HPKV entry is for a vLLM engine: the layers of one block, and its namespace.

An entry holds one vLLM block of one KV cache group (all layers of that group, this rank's
shard): the bytes of each layer's page, concatenated in the group's layer order. Each group has
its namespace (a hybrid model's sliding-window groups beside its full-attention ones), all keyed
by the same block hashes, as vLLM's own `BlockHashWithGroupId`. Both connector halves
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
    group: int = 0  # the KV cache group's index in vLLM's KVCacheConfig
    num_groups: int = 1
    # Sliding-window groups: the blocks before a hit's boundary that the window reads (vLLM's
    # own count, cdiv(window - 1, block_size)); 0 for full attention (every block is read);
    # 1 for a linear-attention group, whose block before a boundary holds the state there.
    window_blocks: int = 0
    # A linear-attention (Mamba, GDN) group: an entry is the recurrent state at one block
    # boundary, saved only where vLLM offers it (mamba.py), not every block.
    state: bool = False

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

    def needed(self, start: int, stop: int) -> int:
        """The first block of [start, stop) a hit ending at `stop` loads into this group."""
        return max(start, stop - self.window_blocks) if self.window_blocks else start


def block_layout(vllm_config, kv_cache_config) -> BlockLayout:
    """The layout of the first KV cache group's entries."""
    return group_layouts(vllm_config, kv_cache_config)[0]


def group_layouts(vllm_config, kv_cache_config) -> list[BlockLayout]:
    """One layout per KV cache group: full attention (MLA included) and sliding windows; a group
    HPKV cannot cache (linear attention, chunked local attention, ...) is refused at start."""
    _refuse_context_parallel(vllm_config.parallel_config)
    groups = kv_cache_config.kv_cache_groups
    # vLLM 0.31's KVCacheConfig has no hash_block_size: there it is prefix_match_unit or the block size.
    hash_block_size = (
        getattr(kv_cache_config, "hash_block_size", None)
        or getattr(vllm_config.cache_config, "prefix_match_unit", None)
        or vllm_config.cache_config.block_size
    )
    layouts = []
    for index, group in enumerate(groups):
        per_layer = getattr(group.kv_cache_spec, "kv_cache_specs", None) or {}
        specs = [per_layer.get(name, group.kv_cache_spec) for name in group.layer_names]
        window = _window_blocks(vllm_config, specs[0], len(groups)) if specs else 0
        # One group: exactly as before hybrid models (vLLM's --block-size, the spec text of the last layer).
        block_size = vllm_config.cache_config.block_size if len(groups) == 1 else specs[0].block_size
        layouts.append(
            BlockLayout(
                tuple(group.layer_names),
                tuple(spec.page_size_bytes for spec in specs),
                block_size,
                max(1, block_size // hash_block_size),
                _spec_text(specs[-1], window) if specs else "",
                index,
                len(groups),
                window,
                _is_state(specs[0]) if specs else False,
            )
        )
    if len({layout.block_size for layout in layouts}) > 1:
        raise ConfigError(
            "HpkvConnectorV1 needs one block size for every KV cache group; this model's groups have "
            f"{sorted({layout.block_size for layout in layouts})}: run it without the HPKV connector"
        )
    return layouts


def moved_per_block(layouts: list[BlockLayout]) -> BlockLayout:
    """What a hit moves per block, for the load policy's costs: the entries of the full-attention
    groups (a sliding window's few blocks and a linear-attention group's one state per hit are
    left out); the one group's layout itself for a model with one."""
    if len(layouts) == 1:
        return layouts[0]
    full = [page for layout in layouts if not layout.window_blocks for page in layout.page_bytes]
    return dataclasses.replace(layouts[0], page_bytes=(sum(full) or layouts[0].entry_bytes,))


def moved_per_hit(layouts: list[BlockLayout]) -> int:
    """What a hit moves besides its blocks, for the load policy's costs: each sliding-window
    group's window and each linear-attention group's one state (at most; a hit shorter than a
    window moves less)."""
    if len(layouts) == 1:
        return 0
    return sum(layout.window_blocks * layout.entry_bytes for layout in layouts)


def _is_state(spec) -> bool:
    from vllm.v1.kv_cache_interface import MambaSpec

    return isinstance(spec, MambaSpec)


def _window_blocks(vllm_config, spec, num_groups: int) -> int:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    if isinstance(spec, SlidingWindowSpec):
        return max(1, -(-(spec.sliding_window - 1) // spec.block_size))
    if isinstance(spec, MambaSpec):
        _refuse_state(vllm_config, spec)
        return 1
    if isinstance(spec, FullAttentionSpec) or num_groups == 1:
        return 0
    raise ConfigError(
        f"HpkvConnectorV1 does not cache {type(spec).__name__} layers; this model has them in a KV cache "
        "group of its own (docs/vllm.md lists the supported model families): run it without the HPKV connector"
    )


def _refuse_state(vllm_config, spec) -> None:
    """A linear-attention group is cached only where vLLM keeps a state per block boundary
    (prefix caching's `align` mode), and not for Mamba-2 on the CPU, whose scan there keeps no
    per-chunk states (vLLM 0.32 itself fails such a model's first long request)."""
    mode = getattr(spec, "mamba_cache_mode", "none")
    mamba_type = getattr(getattr(spec, "mamba_type", None), "name", str(getattr(spec, "mamba_type", "")))
    if mode != "align":
        raise ConfigError(
            f"HpkvConnectorV1 caches linear-attention (Mamba, GDN) layers only with vLLM's "
            f"mamba_cache_mode 'align' (a state at each block boundary); this engine has '{mode}': "
            "enable prefix caching and leave --mamba-cache-mode unset (or 'align'), or run it "
            "without the HPKV connector"
        )
    if mamba_type == "MAMBA2" and vllm_config.device_config.device_type == "cpu":
        raise ConfigError(
            "HpkvConnectorV1 does not cache Mamba-2 layers (Nemotron-H, Granite 4, Jamba-style) on "
            "vLLM's CPU build: its scan there keeps no per-chunk states, which prefix caching's 'align' "
            "mode needs (vLLM 0.32 fails such a model's first long request with prefix caching on); "
            "run it without the HPKV connector"
        )


def _spec_text(spec, window: int) -> str:
    if _is_state(spec):
        shapes = ";".join("x".join(map(str, shape)) for shape in spec.shapes)
        dtypes = ",".join(str(dtype) for dtype in spec.dtypes)
        kind = getattr(spec.mamba_type, "name", spec.mamba_type)
        return f"MambaSpec:type={kind},shapes={shapes},dtypes={dtypes}"
    text = (
        f"{type(spec).__name__}:kv_heads={getattr(spec, 'num_kv_heads', '?')},"
        f"head={getattr(spec, 'head_size', '?')},dtype={getattr(spec, 'dtype', '?')}"
    )
    return f"{text},window={spec.sliding_window}" if window else text


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


def namespaces(vllm_config, layouts: list[BlockLayout], identity: ModelIdentity) -> list[NamespaceDesc]:
    """Every rank's namespace of every group, rank-major (rank r's group g at r * groups + g)."""
    if len(layouts) == 1:
        return _stage_namespaces(vllm_config, layouts[0], identity)
    # Hybrid models under pipeline parallelism: every stage is taken to have the first one's groups
    # (a stage with others misses: a worker leases in the namespaces of its own layers).
    return [
        namespace(vllm_config, layout, rank, identity) for rank in range(world_ranks(vllm_config)) for layout in layouts
    ]


def _stage_namespaces(vllm_config, layout: BlockLayout, identity: ModelIdentity) -> list[NamespaceDesc]:
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
        extra=(("model_source", identity.source),)
        + ((("kv_group", f"{layout.group}/{layout.num_groups}"),) if layout.num_groups > 1 else ()),
    )


def block_keys(block_hashes, layout: BlockLayout, start: int, stop: int) -> list[bytes]:
    """The entry keys of blocks [start, stop): the block hash at each block's last boundary."""
    step = layout.hashes_per_block
    stop = min(stop, len(block_hashes) // step)
    return [bytes(block_hashes[(i + 1) * step - 1]) for i in range(start, stop)]
