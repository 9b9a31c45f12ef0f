"""What one HPKV entry is for SGLang: one page of the HiCache host pool, and its namespace.

An entry holds the bytes of one host-pool page, in the order of the buffer regions SGLang's own
`get_page_buffer_meta` gives for it: K then V for `page_first`, K and V of every layer for
`layer_first`, one region for MLA `page_first`, K/V/indexer parts for Ascend's
`page_first_kv_split`. The layout is measured once from the pool itself (pointer arithmetic on
one page, nothing is read), so every pool SGLang can describe that way is supported without
HPKV knowing its shapes.

SGLang's page keys are content hashes of tokens only, the same on every rank and model. The
namespace adds everything that makes the bytes incompatible: the model (`ModelId`: its identity,
the content fingerprint of its files or HPKV_MODEL_ID (`modelid.py`), and what changes its
numerics on load; never its path), the KV dtype, host
layout and region sizes, page size, the layers this stage holds, and the shard the bytes belong
to. MHA: every (pp, attn-cp, tp) rank stores its own head shard. MLA: the KV is the same on every
TP rank, so one namespace per (pp, attn-cp) shard, written by TP rank 0 and read by all (SGLang
skips the backups of the other ranks).

Primitives: `page_layout(host_pool)`, `model_id(override)`, `namespace(config, layout, model)`,
`page_keys(keys)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...identity import ModelIdentity, NoContentIdentity, content_identity
from ...identity import model_text as identity_text
from ...keys import Key, NamespaceDesc, make_key
from . import modelid

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
    layers: str = ""  # the model layers this stage holds, "start-end" (PP splits are configurable)
    format_tag: str = ""  # a host pool's own page format (SGLang's storage_format_tag)

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
            f"{host_pool.layout!r}: {exc}. Use --hicache-mem-layout page_first (or leave it unset)"
        ) from None
    return PageLayout(
        page_size=page_size,
        num_layers=int(host_pool.layer_num),
        dtype=str(host_pool.dtype),
        mem_layout=str(host_pool.layout),
        pool_kind=type(host_pool).__name__,
        geometry=_geometry(host_pool),
        region_bytes=tuple(int(size) for size in sizes),
        layer_sharded=bool(getattr(host_pool, "_layer_shard_enabled", False)),
        layers=f"{getattr(host_pool, 'start_layer', '?')}-{getattr(host_pool, 'end_layer', '?')}",
        format_tag=str(getattr(host_pool, "storage_format_tag", None) or ""),
    )


def _geometry(host_pool) -> str:
    names = ("head_num", "head_dim", "v_head_dim", "kv_lora_rank", "qk_rope_head_dim", "kv_cache_dim")
    return ",".join(f"{name}={getattr(host_pool, name)}" for name in names if getattr(host_pool, name, None))


@dataclass(frozen=True)
class ModelId:
    """The model as far as its KV bytes depend on it, from SGLang's server arguments."""

    text: str  # the identity (modelid.py) plus what changes the numerics on load
    kv_cache_dtype: str  # --kv-cache-dtype as SGLang resolved it: fp8_e4m3 and fp8_e5m2 both store uint8
    source: str = ""  # what the identity was derived from, for `hpkv status`
    identity: ModelIdentity | None = None  # for the log
    model_path: str = ""  # for the log only: never in the namespace


def model_id(override: str | None = None) -> ModelId | None:
    """This scheduler process's model, from the server arguments SGLang publishes in it before it
    builds the cache; None where none are published (SGLang embedded some other way). `override`
    is HPKV_MODEL_ID."""
    try:
        from sglang.srt.runtime_context import get_model, get_server_args

        args = get_server_args()
    except Exception:  # not published ("Global server args is not set yet!"), or another SGLang
        return None
    try:
        kv_cache_dtype = str(get_model().kv_cache_dtype)
    except Exception:  # the resolved view is not readable here: the raw flag
        kv_cache_dtype = str(getattr(args, "kv_cache_dtype", "auto"))
    identity = modelid.model_identity(args, override)
    text = modelid.model_text(args, identity)
    try:
        # fp8 KV scales loaded from a file (load_model_utils): other scales, other bytes' meaning.
        scales = get_model().quantization_param_path
    except Exception:
        scales = None
    if scales:
        try:
            text = identity_text(text, [("kv_scales", content_identity(scales).id)])
        except NoContentIdentity:
            text = identity_text(text, [("kv_scales", "unreadable")])  # SGLang cannot read them either
    return ModelId(text, kv_cache_dtype, identity.source, identity, str(args.model_path))


def namespace(config, layout: PageLayout, model: ModelId | None) -> NamespaceDesc:
    """The namespace of this rank's pages; `config` is SGLang's HiCacheStorageConfig. Without
    `model` the model is named by SGLang's model_name (--served-model-name) only."""
    replicated = bool(config.is_mla_model) and not layout.layer_sharded
    tp_size, tp_rank = (1, 0) if replicated else (config.tp_size, config.tp_rank)
    cp_size, cp_rank = max(1, config.attn_cp_size), config.attn_cp_rank
    extra = [
        ("kv", "rank-replicated" if replicated else "tp-sharded"),
        ("geometry", layout.geometry),
        ("layers", layout.layers),
    ]
    if layout.format_tag:
        extra.append(("format", layout.format_tag))
    if model is not None and model.source:
        extra.append(("model_source", model.source))
    dcp_size = getattr(config, "dcp_size", 1)
    if dcp_size > 1:  # decode-CP splits each page over the DCP ranks
        extra.append(("dcp", f"{config.dcp_rank}/{dcp_size}"))
    dtype = layout.dtype
    if model is not None and model.kv_cache_dtype != "auto":
        dtype = f"{layout.dtype}/{model.kv_cache_dtype}"
    return NamespaceDesc(
        engine=ENGINE,
        model=model.text if model is not None else config.model_name or "unnamed",
        dtype=dtype,
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
