"""What one HPKV entry is for SGLang: one page of the HiCache host pool, and its namespace.

An entry holds the bytes of one host-pool page, in the order of the buffer regions SGLang's own
`get_page_buffer_meta` gives for it: K then V for `page_first`, K and V of every layer for
`layer_first`, one region for MLA `page_first`, K/V/indexer parts for Ascend's
`page_first_kv_split`. The layout is measured once from the pool itself (pointer arithmetic on
one page, nothing is read), so every pool SGLang can describe that way is supported without
HPKV knowing its shapes.

SGLang's page keys are content hashes of tokens only, the same on every rank and model. The
namespace adds everything that makes the bytes incompatible: served model name, dtype, host
layout and region sizes, page size, layers, and the shard the bytes belong to. MHA: every
(pp, attn-cp, tp) rank stores its own head shard. MLA: the KV is the same on every TP rank, so
one namespace per (pp, attn-cp) shard, written by TP rank 0 and read by all (SGLang skips the
backups of the other ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...keys import Key, NamespaceDesc, make_key

ENGINE = "sglang"


@dataclass(frozen=True)
class PageLayout:
    page_size: int  # tokens per page (the host indices of one page)
    num_layers: int
    dtype: str
    mem_layout: str  # --hicache-mem-layout as the host pool resolved it
    pool_kind: str  # the host pool class
    geometry: str  # head or latent sizes, for the namespace
    region_bytes: tuple[int, ...]  # the buffer regions of one page, in SGLang's order
    layer_sharded: bool = False  # MLA with layers split over TP ranks: no longer rank-replicated

    @property
    def entry_bytes(self) -> int:
        return sum(self.region_bytes)

    @property
    def num_regions(self) -> int:
        return len(self.region_bytes)


def page_layout(host_pool) -> PageLayout:
    """Measure one page of `host_pool` (an SGLang HostKVCache). ValueError: a layout SGLang
    cannot describe for zero-copy storage I/O (the message names the fix)."""
    page_size = int(getattr(host_pool, "logical_page_size", None) or host_pool.page_size)
    try:
        _, sizes = host_pool.get_page_buffer_meta(torch.arange(page_size, dtype=torch.int64))
    except (ValueError, NotImplementedError, AttributeError) as exc:
        raise ValueError(
            f"HPKV cannot store pages of the SGLang host pool {type(host_pool).__name__} with layout "
            f"{host_pool.layout!r}: {exc}. Use --hicache-mem-layout page_first (or leave it unset)") from None
    return PageLayout(
        page_size=page_size,
        num_layers=int(host_pool.layer_num),
        dtype=str(host_pool.dtype),
        mem_layout=str(host_pool.layout),
        pool_kind=type(host_pool).__name__,
        geometry=_geometry(host_pool),
        region_bytes=tuple(int(size) for size in sizes),
        layer_sharded=bool(getattr(host_pool, "_layer_shard_enabled", False)),
    )


def _geometry(host_pool) -> str:
    names = ("head_num", "head_dim", "v_head_dim", "kv_lora_rank", "qk_rope_head_dim", "kv_cache_dim")
    return ",".join(f"{name}={getattr(host_pool, name)}" for name in names if getattr(host_pool, name, None))


def namespace(config, layout: PageLayout) -> NamespaceDesc:
    """The namespace of this rank's pages; `config` is SGLang's HiCacheStorageConfig."""
    replicated = bool(config.is_mla_model) and not layout.layer_sharded
    tp_size, tp_rank = (1, 0) if replicated else (config.tp_size, config.tp_rank)
    cp_size, cp_rank = max(1, config.attn_cp_size), config.attn_cp_rank
    extra = [("kv", "rank-replicated" if replicated else "tp-sharded"), ("geometry", layout.geometry)]
    dcp_size = getattr(config, "dcp_size", 1)
    if dcp_size > 1:  # decode-CP splits each page over the DCP ranks
        extra.append(("dcp", f"{config.dcp_rank}/{dcp_size}"))
    return NamespaceDesc(
        engine=ENGINE,
        model=config.model_name or "unnamed",
        dtype=layout.dtype,
        layout=f"{layout.mem_layout};{layout.pool_kind};regions={','.join(map(str, layout.region_bytes))}",
        block_size=layout.page_size,
        num_layers=layout.num_layers,
        entry_bytes=layout.entry_bytes,
        tp_size=tp_size,
        pp_size=max(1, config.pp_size),
        cp_size=cp_size,
        rank=(config.pp_rank * cp_size + cp_rank) * tp_size + tp_rank,
        extra=tuple(sorted(extra)),
    )


def page_keys(keys: list[str]) -> list[Key]:
    """SGLang's page hashes (hex strings) as entry keys, taken as given."""
    return [make_key(key) for key in keys]
