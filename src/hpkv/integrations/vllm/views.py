"""A vLLM layer's paged KV cache as HPKV reads and writes it: one byte row per block.

Primitives: `block_rows` (a layer's cache as `(num_blocks, page_bytes)` bytes, or a refusal with
the fix), `writes_reused_blocks_early` (whether vLLM writes reused blocks before HPKV can fence
them), `saves_overlap` (whether saves may run beside the next step).
Must not know: keys, the server, what is loaded or saved.
"""

from __future__ import annotations

import logging

import torch

from ...errors import ConfigError
from . import layout as lay

log = logging.getLogger("hpkv.vllm.worker")


def saves_overlap(wanted: bool | None, device: str, vllm_config, layout: lay.BlockLayout, kv_cache_config) -> bool:
    """Whether a worker's saves run asynchronously (beside the next step): as `wanted`, or (None)
    off the CPU, where a saver thread would take cores from the forward pass it overlaps; never
    where vLLM writes reused blocks before the fence, or the device has no streams and events."""
    overlap = device != "cpu" if wanted is None else wanted
    if overlap and writes_reused_blocks_early(vllm_config, layout, kv_cache_config):
        log.warning(
            "HPKV: saves are synchronous: vLLM's V2 model runner zeroes or copies into reused KV "
            "blocks before HPKV can fence them"
        )
        return False
    device_mod = getattr(torch, device, None)
    needed = ("Event", "Stream", "stream", "current_stream")
    if overlap and device != "cpu" and not all(hasattr(device_mod, name) for name in needed):
        log.warning("HPKV: torch.%s has no streams and events; saves are synchronous", device)
        return False
    return overlap


def writes_reused_blocks_early(vllm_config, layout: lay.BlockLayout, kv_cache_config) -> bool:
    """Whether vLLM zeroes reused blocks (mixed KV precisions) or copies into them (hash blocks
    smaller than a block: copy-on-write) before the saves' fence. Its V2 model runner does that
    as it updates the step's requests, before `handle_preemptions` (the V1 runner after it), so
    an asynchronous save still copying such a block would publish zeros or another request's
    bytes."""
    writes = layout.hashes_per_block > 1 or bool(getattr(kv_cache_config, "needs_kv_cache_zeroing", False))
    return writes and bool(getattr(vllm_config, "use_v2_model_runner", True))


def block_rows(name: str, cache: torch.Tensor, num_blocks: int, page_bytes: int, layout: str | None) -> torch.Tensor:
    """One layer's cache as `(num_blocks, page_bytes)` bytes, one row per block, in the byte order
    every HPKV engine stores (`lay.REQUIRED_LAYOUT`: each block's heads, tokens, content).

    `cache` is vLLM's logical (B, H, N, C) view whose strides follow the layout vLLM chose. vLLM
    takes the connector's layout only as a wish: an attention backend that does not support it
    (or VLLM_KV_CACHE_LAYOUT) gets another, and a kernel block size below --block-size splits
    each block in kernel blocks. A block whose bytes are not one run in that order would be
    saved as garbage, or loaded over other blocks, or read by another engine in another order:
    wrong tokens. Refused at start instead, with the fix."""
    elem = cache.element_size()
    block = cache[0]
    # A padded page (vLLM pads pages to one size across layers) has its padding after the block:
    # the row takes it along, as vLLM's own page does.
    if cache.dim() == 4 and block.is_contiguous() and block.numel() * elem <= page_bytes <= cache.stride(0) * elem:
        return torch.tensor([], dtype=torch.int8, device=cache.device).set_(
            cache.untyped_storage(),
            cache.storage_offset() * elem,
            (num_blocks, page_bytes),
            (cache.stride(0) * elem, 1),
        )
    if cache.dim() != 4:
        why = (
            f"its blocks are split in {cache.shape[1]} kernel blocks each (the attention backend's kernel block "
            "size is below --block-size); set --block-size to the attention backend's kernel block size"
        )
    else:
        why = (
            f"vLLM chose the KV cache layout {layout or 'unknown'} (strides {tuple(cache.stride())} for the "
            f"(blocks, heads, tokens, content) shape {tuple(cache.shape)}), not {lay.REQUIRED_LAYOUT}, where "
            f"a block's bytes are one run; unset VLLM_KV_CACHE_LAYOUT or set it to {lay.REQUIRED_LAYOUT}, or "
            "pick an attention backend that supports that layout (--attention-backend)"
        )
    raise ConfigError(
        f"HpkvConnectorV1 cannot store layer {name}: {why}; or run this engine without the HPKV connector"
    )
