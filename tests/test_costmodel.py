"""The load policy: from given measurements, which hits are loaded and which recomputed."""

from __future__ import annotations

import logging

import pytest

from helpers.clock import FakeClock
from hpkv.costmodel import (
    AffineCost,
    AutoThreshold,
    CostModel,
    FixedThreshold,
    attention_kappa,
)
from hpkv.tiers import Tier

D, S = Tier.DRAM, Tier.STORAGE
BS = 32
BENCH_KAPPA = attention_kappa(hidden=1024, num_heads=16, num_kv_heads=4, head_dim=64, intermediate=2816)
GB = 1e9


def model(
    prefill_tokens_per_s: float,
    dram_gbps: float,
    dram_fixed_ms: float,
    storage_gbps: float | None = None,
    storage_fixed_ms: float = 0.0,
    kv_bytes_per_token: int = 8192,
    kappa: float = 0.0,
    num_ranks: int = 1,
) -> CostModel:
    storage = None if storage_gbps is None else AffineCost(storage_fixed_ms / 1e3, 1 / (storage_gbps * GB))
    return CostModel(
        BS,
        kv_bytes_per_token * BS,
        num_ranks,
        kappa,
        prefill=AffineCost(0.0, 1 / prefill_tokens_per_s),
        dram=AffineCost(dram_fixed_ms / 1e3, 1 / (dram_gbps * GB)),
        storage=storage,
    )


def cpu_engine() -> CostModel:
    """The BENCH model on this project's 2-core CPU: prefill about 2,600 tokens/s, loads are
    memory copies at 3.5 GB/s after 3 ms of RPCs, storage reads at 1 GB/s after 5 ms."""
    return model(2600, 3.5, 3.0, storage_gbps=1.0, storage_fixed_ms=5.0, kappa=BENCH_KAPPA)


# -- the documented rule ----------------------------------------------------------------------


def test_the_fixed_threshold_loads_the_whole_hit_from_1204_tokens():
    policy = FixedThreshold(1204, BS)

    assert policy.plan(0, [D] * 37) == 0  # 1184 tokens
    assert policy.plan(0, [D] * 38) == 38  # 1216 tokens
    assert policy.plan(0, [D] * 20 + [S] * 20) == 40  # tiers do not matter to it
    assert not policy.may_pay(0, 37) and policy.may_pay(0, 38)


def test_threshold_zero_loads_every_hit():
    assert FixedThreshold(0, BS).plan(0, [S]) == 1


# -- decisions from measurements --------------------------------------------------------------


def test_on_a_cpu_engine_loading_beats_recomputing_from_the_first_block():
    m = cpu_engine()

    assert m.break_even(D) == BS
    assert m.break_even(S) == BS
    assert m.plan(0, [D] * 256) == 256  # the documented 8K DRAM hit
    assert m.plan(0, [S] * 256) == 256  # and from storage


def test_a_fast_prefill_recomputes_a_short_hit_and_loads_a_long_one():
    # A GPU prefilling 20,000 tokens/s, 28 KiB of KV per token over PCIe at 25 GB/s, 3 ms per load.
    m = model(20_000, 25, 3.0, kv_bytes_per_token=28 << 10)

    threshold = m.break_even(D)
    assert threshold == 64  # 3 ms / (50 us - 1.1 us per token) = 61.7 tokens: two blocks
    assert m.plan(0, [D] * 1) == 0
    assert m.plan(0, [D] * 2) == 2


def test_storage_slower_than_recompute_loads_the_dram_prefix_and_recomputes_the_storage_tail():
    # Prefill 100,000 tokens/s (10 us per token); storage at 0.5 GB/s reads 28 KiB in 57 us.
    m = model(100_000, 25, 0.5, storage_gbps=0.5, storage_fixed_ms=2.0, kv_bytes_per_token=28 << 10)

    assert m.break_even(D) == 64
    assert m.break_even(S) is None
    assert m.plan(0, [D] * 64 + [S] * 64) == 64
    assert m.plan(0, [S] * 128) == 0
    assert m.plan(0, [D] * 1 + [S] * 64) == 0  # a one-block DRAM prefix does not pay its fixed cost


def test_a_storage_hit_costs_its_fixed_read_latency_on_top_of_the_copy():
    m = model(2600, 3.5, 3.0, storage_gbps=1.0, storage_fixed_ms=40.0)  # a slow file system to open

    assert m.break_even(D) == BS
    assert m.break_even(S) == 4 * BS  # 43 ms of fixed costs against 12.3 ms of prefill per block
    assert m.plan(0, [S] * 3) == 0
    assert m.plan(0, [S] * 4) == 4


def test_a_hit_deep_in_the_context_pays_sooner_because_attention_grows_with_position():
    # Position-independent prefill of 20,000 tokens/s; attention doubles a token's cost by position 1,000.
    m = model(20_000, 25, 3.0, kv_bytes_per_token=28 << 10, kappa=1e-3)

    assert m.break_even(D) == 64
    assert m.plan(0, [D]) == 0
    assert m.plan(8192, [D]) == 1  # the same block after 8K tokens costs 9x as much to recompute


def test_plan_and_break_even_agree():
    for m in (
        cpu_engine(),
        model(20_000, 25, 3.0, kv_bytes_per_token=28 << 10, kappa=1e-4),
        model(50_000, 10, 1.0, storage_gbps=2.0, storage_fixed_ms=5.0, kv_bytes_per_token=16 << 10),
    ):
        for tier in (D, S) if m.storage else (D,):
            threshold = m.break_even(tier)
            for num_blocks in range(1, 200):
                loads = m.plan(0, [tier] * num_blocks) == num_blocks
                assert loads == (threshold is not None and num_blocks * BS >= threshold), (tier, num_blocks)


def test_before_any_measurement_of_prefill_the_dram_break_even_is_the_documented_default():
    m = cpu_engine()
    m.seed_prefill(1204)

    assert m.break_even(D) == FixedThreshold(1204, BS).threshold // BS * BS + BS  # 1216: as the fixed rule
    assert m.break_even(S) > m.break_even(D)


def test_attention_kappa_of_the_bench_model():
    # 4 * 1024 attention FLOPs per earlier token against 22.5 MFLOPs of projections and MLP.
    assert BENCH_KAPPA == pytest.approx(4 * 1024 / 22_544_384)


# -- learning ---------------------------------------------------------------------------------


def test_the_affine_cost_learns_a_faster_copy_and_its_fixed_part():
    cost = AffineCost(fixed_s=0.001, per_unit_s=1 / GB)  # seeded at 1 GB/s
    for _ in range(30):
        cost.observe(64 << 20, 0.004 + (64 << 20) / (4 * GB))  # 64 MiB at 4 GB/s after 4 ms
    for _ in range(30):
        cost.observe(4096, 0.004)  # tiny loads: the fixed part
    for _ in range(30):
        cost.observe(64 << 20, 0.004 + (64 << 20) / (4 * GB))

    assert cost.fixed_s == pytest.approx(0.004, rel=0.1)
    assert 1 / cost.per_unit_s == pytest.approx(4 * GB, rel=0.1)
    assert cost.num_observed == 90


def step(
    policy: AutoThreshold,
    clock: FakeClock,
    chunks,
    seconds: float,
    connector_s: float = 0.0,
    load_s: float = 0.0,
    load_bytes: float = 0.0,
    num_load_jobs: int = 0,
) -> None:
    policy.step_built(chunks, num_load_jobs)
    clock.now += seconds
    policy.step_done(connector_s, load_s, load_bytes)


def seeded_policy(caplog, clock: FakeClock) -> tuple[CostModel, AutoThreshold]:
    """auto over the CPU engine, seeded to break even at the documented 1204 tokens (call it
    inside caplog.at_level: its start line is checked)."""
    m = cpu_engine()
    m.seed_prefill(1204)
    policy = AutoThreshold(m, 32768, "test", clock=clock)
    assert "DRAM hits load from 1216 tokens" in caplog.text
    return m, policy


def test_auto_learns_the_prefill_rate_from_the_engines_steps_and_logs_the_new_break_even(caplog):
    clock = FakeClock(100.0)
    with caplog.at_level(logging.INFO, logger="hpkv.vllm.costmodel"):
        m, policy = seeded_policy(caplog, clock)
        assert not policy.plan(0, [D] * 20)

        for _ in range(20):  # decodes: 20 ms a step, whatever the batch
            step(policy, clock, [(4000, 1), (900, 1)], 0.020)
        for i in range(20):  # prompts of 2K tokens at 2,600 tokens/s (plus attention) and 20 ms
            seconds = 0.020 + m.work(0, 2048) / 2600
            step(policy, clock, [(0, 2048), (5000 + i, 1)], seconds + 0.010, connector_s=0.010)

    assert 1 / m.prefill.per_unit_s == pytest.approx(2600, rel=0.05)
    assert m.prefill.fixed_s == pytest.approx(0.020, rel=0.1)
    assert policy.plan(0, [D] * 20) == 20
    assert "(measured)" in caplog.text and "DRAM hits load from 32 tokens" in caplog.text
    assert policy.figures().startswith("prefill 2,6")  # later changes were not material: not logged


def test_auto_learns_the_dram_rate_from_the_workers_loads_and_storage_from_promotions():
    m = cpu_engine()
    clock = FakeClock(100.0)
    policy = AutoThreshold(m, 32768, "test", clock=clock)
    for _ in range(30):
        step(policy, clock, [(8192, 1)], 0.05, connector_s=0.02, load_s=0.02, load_bytes=64 << 20, num_load_jobs=1)
        policy.promoted(64 << 20, 0.5)  # 64 MiB in half a second: 0.13 GB/s

    assert 1 / m.dram.per_unit_s == pytest.approx((64 << 20) / (0.02 - m.dram.fixed_s), rel=0.1)
    assert 1 / m.storage.per_unit_s == pytest.approx((64 << 20) / (0.5 - 0.005), rel=0.1)
    assert m.break_even(S) == BS  # 2 MiB/s... still far faster than 2,600 tokens/s of prefill


def test_steps_that_overlap_are_timed_from_the_end_of_the_previous_one():
    m = cpu_engine()
    clock = FakeClock(100.0)
    policy = AutoThreshold(m, 32768, "test", clock=clock)
    for _ in range(30):  # async scheduling: the next step is built before this one's output is back
        policy.step_built([(0, 2600)], 0)
        policy.step_built([(0, 2600)], 0)
        clock.now += 1.0
        policy.step_done(0.0, 0.0, 0.0)
        clock.now += 1.0
        policy.step_done(0.0, 0.0, 0.0)

    assert m.prefill.per_unit_s * m.work(0, 2600) == pytest.approx(1.0, rel=0.05)


def test_a_hit_in_one_tier_is_loaded_whole_or_not_at_all():
    for m in (cpu_engine(), model(20_000, 25, 3.0, kv_bytes_per_token=28 << 10, kappa=1e-3)):
        for start in (0, 4096):
            for num_blocks in range(1, 100):
                k = m.plan(start, [D] * num_blocks)
                assert k in (0, num_blocks)
                assert (k == num_blocks) == m.pays(start, num_blocks)


def test_the_first_measurement_replaces_the_start_up_estimate():
    cost = AffineCost(fixed_s=0.001, per_unit_s=1 / (100 * GB))  # a placeholder
    cost.observe_variable(1 << 30, 1.001)
    assert 1 / cost.per_unit_s == pytest.approx(1 << 30, rel=1e-6)
    cost.observe_variable(1 << 30, 0.501)
    assert 1 / cost.per_unit_s == pytest.approx((1 << 30) / 0.9, rel=1e-6)  # then an EWMA: 0.8 * 1 s + 0.2 * 0.5 s


def test_auto_does_not_log_a_break_even_that_moves_by_one_block(caplog):
    """Prefill rates that wander put the storage break-even at one block or two, back and forth:
    logged once, not at every swing; a move of two blocks is logged again."""
    with caplog.at_level(logging.INFO, logger="hpkv.vllm.costmodel"):
        _, policy = seeded_policy(caplog, FakeClock(100.0))
        logged = {"tokens": 1216}
        policy._thresholds = lambda: {D: logged["tokens"]}
        lines = []
        for tokens in (32, 64, 32, 64, 32, 128):
            logged["tokens"] = tokens
            before = caplog.text.count("VLLM_HPKV_TOKEN_THRESHOLD=auto (measured)")
            policy._log_if_changed()
            lines.append(caplog.text.count("VLLM_HPKV_TOKEN_THRESHOLD=auto (measured)") - before)

    assert lines == [1, 0, 0, 0, 0, 1]  # 1216 -> 32 and 32 -> 128 are news; 32 <-> 64 is not


def test_storage_reads_that_grow_slow_make_storage_hits_recomputed_without_failing(caplog):
    """Storage hits load from some length, until promotions from a disk gone slow push that
    break-even past the longest prompt: from then on they are recomputed, and the log says so
    (the engine's scheduler calls this: it must not raise)."""
    with caplog.at_level(logging.INFO, logger="hpkv.vllm.costmodel"):
        m, policy = seeded_policy(caplog, FakeClock(100.0))
        assert m.break_even(S, 32768) is not None

        for _ in range(20):  # 64 MiB a promotion, at 1 MB/s
            policy.promoted(64 << 20, 64.0)

    assert m.break_even(S, 32768) is None
    assert "storage hits are recomputed" in caplog.text
    assert policy.plan(0, [S] * 100) == 0


def test_a_hybrid_hit_costs_its_windows_and_states_once_not_per_block():
    """A hybrid model's hit moves its full-attention blocks and, once, the sliding windows and
    linear-attention states at its end: those bytes raise the break-even like a fixed cost."""
    plain = model(2600, 0.5, 3.0, storage_gbps=0.2, storage_fixed_ms=5.0)
    hybrid = model(2600, 0.5, 3.0, storage_gbps=0.2, storage_fixed_ms=5.0)
    hybrid.hit_bytes = 64 << 20  # e.g. three Mamba states and a window, as one rank moves them

    for tier in (D, S):
        assert plain.break_even(tier) < hybrid.break_even(tier)
    extra_s = hybrid.hit_fixed_s(S) - plain.hit_fixed_s(S)
    assert extra_s == pytest.approx((64 << 20) * (1 / (0.5 * GB) + 1 / (0.2 * GB)))
    n = hybrid.break_even(D) // BS
    assert hybrid.pays(0, n) and not hybrid.pays(0, n - 1)
    assert hybrid.plan(0, [D] * n) == n and hybrid.plan(0, [D] * (n - 1)) == 0
