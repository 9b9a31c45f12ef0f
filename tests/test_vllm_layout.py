"""The byte rows HPKV reads a vLLM layer's blocks from, on the views vLLM's own allocator builds.

vLLM takes the connector's KV cache layout (LBHNC) only as a wish: an attention backend that does
not support it, or VLLM_KV_CACHE_LAYOUT, gets another, and a kernel block size below
--block-size splits every block. Each story builds a layer's cache with vLLM's
`create_kv_cache_views` for one layout and checks that HPKV either reads each block as the bytes
of its heads, tokens and content in that order, or refuses at start with the fix.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm

NUM_BLOCKS, NUM_LAYERS = 4, 2


def _layer_cache(layout_name: str, kernel_block_size: int | None = None):
    """Layer 0 of a two-layer cache in `layout_name`, as vLLM hands it to a connector, with every
    element numbered in the logical (blocks, heads, tokens, content) order."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views, group_kernel_blocks
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=16, dtype=torch.float16)
    page = spec.page_size_bytes
    layout = KVCacheLayout[layout_name]
    if layout.is_layer_compact:  # each layer one region: its blocks side by side
        placement = KVCacheTensor(
            size=page * NUM_BLOCKS * NUM_LAYERS, layers=["l0", "l1"], layer_stride=page * NUM_BLOCKS, block_stride=page
        )
    else:  # each block one region: its layers side by side
        placement = KVCacheTensor(
            size=page * NUM_BLOCKS * NUM_LAYERS, layers=["l0", "l1"], layer_stride=page, block_stride=page * NUM_LAYERS
        )
    raw = torch.zeros(placement.size, dtype=torch.int8)
    cache = group_kernel_blocks(
        create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, placement, kernel_block_size=kernel_block_size)[0],
        NUM_BLOCKS,
    )
    cache.copy_(torch.arange(cache.numel(), dtype=torch.float32).reshape(cache.shape).to(cache.dtype))
    return cache, page


@pytest.mark.parametrize("layout_name", ["LBHNC", "BLHNC"])
def test_a_block_whose_heads_tokens_and_content_are_one_run_is_one_row(layout_name):
    import torch

    from hpkv.integrations.vllm.worker import block_rows

    cache, page = _layer_cache(layout_name)

    rows = block_rows("l0", cache, NUM_BLOCKS, page, layout_name)

    assert tuple(rows.shape) == (NUM_BLOCKS, page)
    for b in (0, 3):  # a block's row is its elements in (heads, tokens, content) order
        assert torch.equal(rows[b].view(cache.dtype), cache[b].reshape(-1))


@pytest.mark.parametrize("layout_name", ["LBNHC", "BLNHC"])
def test_tokens_before_heads_is_refused_with_the_fix(layout_name):
    from hpkv.errors import ConfigError
    from hpkv.integrations.vllm.worker import block_rows

    cache, page = _layer_cache(layout_name)

    with pytest.raises(ConfigError, match=f"KV cache layout {layout_name}.*VLLM_KV_CACHE_LAYOUT.*LBHNC"):
        block_rows("l0", cache, NUM_BLOCKS, page, layout_name)


def test_blocks_split_in_kernel_blocks_are_refused_with_the_fix():
    """Each 32-token block as two 16-token kernel blocks: its bytes would be in (kernel block,
    heads, tokens, content) order, which an engine with other kernel blocks reads differently."""
    from hpkv.errors import ConfigError
    from hpkv.integrations.vllm.worker import block_rows

    cache, page = _layer_cache("LBHNC", kernel_block_size=16)

    with pytest.raises(ConfigError, match="split in 2 kernel blocks.*--block-size"):
        block_rows("l0", cache, NUM_BLOCKS, page, "LBHNC")


def _model():
    from hpkv.identity import override_identity

    return override_identity("m")


MODEL = _model()


def _config(num_layers: int, pp_size: int, tp_size: int = 1):
    """What `namespaces` reads of a vLLM config: the model, its layers, the parallel sizes."""
    from types import SimpleNamespace

    model = SimpleNamespace(
        model="/models/m",
        revision=None,
        quantization=None,
        hf_overrides=None,
        dtype="float16",
        get_total_num_hidden_layers=lambda: num_layers,
    )
    parallel = SimpleNamespace(
        tensor_parallel_size=tp_size,
        pipeline_parallel_size=pp_size,
        prefill_context_parallel_size=1,
        decode_context_parallel_size=1,
    )
    return SimpleNamespace(
        model_config=model, parallel_config=parallel, cache_config=SimpleNamespace(cache_dtype="auto")
    )


def _stage(num_layers: int, page: int = 4096):
    from hpkv.integrations.vllm.layout import BlockLayout

    return BlockLayout(
        tuple(f"model.layers.{i}.attn" for i in range(num_layers)),
        (page,) * num_layers,
        32,
        1,
        "FullAttentionSpec:kv_heads=2,head=16,dtype=torch.float16",
    )


def test_the_scheduler_looks_up_each_pipeline_stage_in_the_namespace_its_workers_write():
    """28 layers over 3 stages are 9, 10 and 9 (vLLM's partition: the spare layer goes to a middle
    stage); the scheduler has only the first stage's cache config, yet names each TP rank of each
    stage as that rank's worker does."""
    from hpkv.integrations.vllm.layout import namespace, namespaces

    config = _config(28, pp_size=3, tp_size=2)

    descs = namespaces(config, [_stage(9)], MODEL)

    workers = [namespace(config, _stage(layers), rank, MODEL) for rank, layers in enumerate([9, 9, 10, 10, 9, 9])]
    assert descs == workers
    assert [d.num_layers for d in descs] == [9, 9, 10, 10, 9, 9]
    assert descs[2].entry_bytes == 10 * 4096


def test_one_stage_is_named_from_its_own_layers():
    from hpkv.integrations.vllm.layout import namespace, namespaces

    config = _config(28, pp_size=1, tp_size=2)

    assert namespaces(config, [_stage(28)], MODEL) == [namespace(config, _stage(28), rank, MODEL) for rank in (0, 1)]


def test_a_padded_page_is_one_row_with_its_padding_after_the_block():
    """vLLM pads the pages of layers with fewer KV heads to one size (`page_size_padded`): the
    row is the whole padded page, the block's own bytes first."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from hpkv.integrations.vllm.worker import block_rows

    plain = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=16, dtype=torch.float16)
    spec = FullAttentionSpec(
        block_size=32, num_kv_heads=2, head_size=16, dtype=torch.float16, page_size_padded=plain.page_size_bytes + 512
    )
    page = spec.page_size_bytes
    placement = KVCacheTensor(size=page * NUM_BLOCKS, layers=["l0"], layer_stride=page * NUM_BLOCKS, block_stride=page)
    raw = torch.zeros(placement.size, dtype=torch.int8)
    cache = create_kv_cache_views(raw, spec, NUM_BLOCKS, KVCacheLayout.LBHNC, placement)[0]
    cache.copy_(torch.arange(cache.numel(), dtype=torch.float32).reshape(cache.shape).to(cache.dtype))

    rows = block_rows("l0", cache, NUM_BLOCKS, page, "LBHNC")

    assert tuple(rows.shape) == (NUM_BLOCKS, page)
    own = plain.page_size_bytes
    assert torch.equal(rows[2][:own].view(cache.dtype), cache[2].reshape(-1))


def test_saves_are_synchronous_where_vllm_writes_reused_blocks_before_the_fence():
    """Mixed KV precisions make vLLM zero reused blocks; hash blocks smaller than a block make it
    copy into them; either happens before HPKV's fence in vLLM's V2 model runner, after it in V1."""
    import dataclasses
    from types import SimpleNamespace

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, UniformTypeKVCacheSpecs

    from hpkv.integrations.vllm.views import writes_reused_blocks_early

    def config(*dtypes):
        specs = {
            f"l{i}": FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=16, dtype=dtype)
            for i, dtype in enumerate(dtypes)
        }
        group = KVCacheGroupSpec(list(specs), UniformTypeKVCacheSpecs(block_size=32, kv_cache_specs=specs))
        return KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[group])

    v1, v2 = SimpleNamespace(use_v2_model_runner=False), SimpleNamespace(use_v2_model_runner=True)
    plain = _stage(2)
    assert not writes_reused_blocks_early(v2, plain, config(torch.float16, torch.float16))
    assert writes_reused_blocks_early(v2, plain, config(torch.float16, torch.float8_e4m3fn))
    assert writes_reused_blocks_early(v2, dataclasses.replace(plain, hashes_per_block=2), config(torch.float16))
    assert not writes_reused_blocks_early(v1, plain, config(torch.float16, torch.float8_e4m3fn))
