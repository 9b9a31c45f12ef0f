"""Whether loading a hit from HPKV beats recomputing it: the policy behind VLLM_HPKV_TOKEN_THRESHOLD.

Primitives:
- `FixedThreshold`: the documented rule, load the whole hit iff it is at least N tokens.
- `AffineCost`: seconds = fixed_s + units * per_unit_s, learned online (two EWMAs).
- `CostModel`: one engine's costs (prefill, DRAM load, storage read); `plan(start_token, tiers)`:
  how many leading hit blocks to load; `break_even()`: the smallest hit worth loading, per tier.
- `AutoThreshold`: `VLLM_HPKV_TOKEN_THRESHOLD=auto`, a `CostModel` fed with observations of each
  engine step, which logs its break-even whenever it changes materially.
Must not know: any engine (vLLM's scheduler half translates steps into observations; SGLang does
not use it: docs/sglang.md, "Tuning"), or anything server-side (an engine process loads it).

The model, for a hit of n blocks of `block_size` tokens whose first token is at position p, of
which the first k are loaded and the rest recomputed:

    T(k) = [k > 0] * (F_dram + k * E / bw_dram)                      copy into the engine's cache
         + [a storage block among the k] * F_sto + s_k * E * R / bw_sto   promote from storage first
         + c * sum over the recomputed tokens t of (1 + kappa * t)   prefill them instead

E is the entry (one block, one rank) in bytes, plus H bytes per hit whatever its length (a hybrid
model's sliding-window blocks and linear-attention states: F_dram and F_sto grow by their
copy and read), R the number of ranks (the server reads one file
per rank; ranks copy in parallel), s_k the storage blocks among the first k. Recomputing is a
marginal cost (the step runs anyway for the prompt's tail), so its fixed part is not counted.
Per token, prefill costs c plus c * kappa * t for attention over the t tokens before it: kappa
comes from the model's shape (`attention_kappa`), c is learned. `plan` picks the k that minimizes
T, so a DRAM prefix can be loaded while a slower storage tail is recomputed.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from .tiers import Tier

log = logging.getLogger("hpkv.vllm.costmodel")  # the name docs/vllm.md tells users to read: vLLM runs it

EWMA_ALPHA = 0.2  # weight of a new observation: the estimate follows about the last 5-10
MATERIAL_CHANGE = 0.25  # a break-even that moves by more than this fraction (and a block) is logged again


class FixedThreshold:
    """VLLM_HPKV_TOKEN_THRESHOLD=N: load the whole hit when it is at least N tokens."""

    learns = False

    def __init__(self, threshold: int, block_size: int) -> None:
        self.threshold = threshold
        self.block_size = block_size

    def may_pay(self, start_token: int, num_blocks: int) -> bool:
        return num_blocks * self.block_size >= self.threshold

    def plan(self, start_token: int, tiers: Sequence[Tier]) -> int:
        return len(tiers) if len(tiers) * self.block_size >= self.threshold else 0

    def describe(self) -> str:
        return f"the threshold {self.threshold}"

    def promoted(self, num_bytes: int, seconds: float) -> None:
        pass

    def step_built(self, chunks: Sequence[tuple[int, int]], num_load_jobs: int) -> None:
        pass  # a fixed threshold learns nothing from a step (`learns` is False: never called)

    def step_done(self, connector_s: float, load_s: float, load_bytes: float) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class AffineCost:
    """seconds = fixed_s + units * per_unit_s. An observation refines the part that dominates it:
    the slope when the variable part is the larger, the fixed part otherwise. The first
    observation of a part replaces its start-up estimate (a proxy: a host copy for a device
    load, a placeholder for prefill); later ones move it by an EWMA. Observations of the slope
    count at least half of their time as variable, so one slow fixed cost cannot drive the slope
    to zero."""

    fixed_s: float
    per_unit_s: float
    num_slope: int = 0  # observations so far, of each part
    num_fixed: int = 0

    @property
    def num_observed(self) -> int:
        return self.num_slope + self.num_fixed

    def seconds(self, units: float) -> float:
        return self.fixed_s + units * self.per_unit_s

    def observe(self, units: float, seconds: float) -> None:
        if units * self.per_unit_s >= self.fixed_s:
            self.observe_variable(units, seconds)
        else:
            self.observe_fixed(units, seconds)

    def observe_variable(self, units: float, seconds: float) -> None:
        if units > 0 and math.isfinite(seconds) and seconds > 0:
            sample = max(seconds - self.fixed_s, seconds / 2) / units
            self.per_unit_s += (EWMA_ALPHA if self.num_slope else 1.0) * (sample - self.per_unit_s)
            self.num_slope += 1

    def observe_fixed(self, units: float, seconds: float) -> None:
        if units >= 0 and math.isfinite(seconds) and seconds >= 0:
            sample = max(seconds - units * self.per_unit_s, 0.0)
            self.fixed_s += (EWMA_ALPHA if self.num_fixed else 1.0) * (sample - self.fixed_s)
            self.num_fixed += 1


def attention_kappa(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int) -> float:
    """Attention work per token and per earlier token, relative to a token's other work (both in
    FLOPs of one decoder layer): QK^T and AV are 4 * heads * head_dim per pair of tokens; the
    projections and a gated MLP are 2 * (hidden * (q + k + v) + q * hidden + 3 * hidden * intermediate)."""
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    linear = 2 * (hidden * (q + 2 * kv) + q * hidden + 3 * hidden * intermediate)
    return 4 * q / linear if linear > 0 else 0.0


@dataclass
class CostModel:
    block_size: int
    entry_bytes: int  # one block of one rank
    num_ranks: int
    kappa: float
    prefill: AffineCost  # units: prefill work (see `work`); fixed part: a step's own cost
    dram: AffineCost  # units: bytes copied by one rank; fixed part: one load's RPCs and setup
    storage: AffineCost | None  # units: bytes read by the server; None: no storage tier
    hit_bytes: int = 0  # one rank's bytes a hit moves besides its blocks (windows, states)

    def work(self, start_token: int, num_tokens: int) -> float:
        """Prefill work of tokens [start, start + n): n + kappa * (sum of their positions)."""
        n = num_tokens
        return n + self.kappa * (n * start_token + n * (n - 1) / 2)

    def recompute_s(self, start_token: int, num_tokens: int) -> float:
        return self.prefill.per_unit_s * self.work(start_token, num_tokens) if num_tokens > 0 else 0.0

    def block_load_s(self, tier: Tier) -> float:
        seconds = self.entry_bytes * self.dram.per_unit_s
        if tier == Tier.STORAGE:
            seconds += self.entry_bytes * self.num_ranks * self._storage().per_unit_s
        return seconds

    def _storage(self) -> AffineCost:
        return self.storage or AffineCost(math.inf, math.inf)

    def hit_fixed_s(self, tier: Tier) -> float:
        """A hit's fixed cost in `tier`: the RPCs, and its bytes besides its blocks."""
        seconds = self.dram.fixed_s + self.hit_bytes * self.dram.per_unit_s
        if tier == Tier.STORAGE:
            seconds += self._storage().fixed_s + self.hit_bytes * self.num_ranks * self._storage().per_unit_s
        return seconds

    def plan(self, start_token: int, tiers: Sequence[Tier]) -> int:
        """How many leading blocks of a hit at `start_token` to load (0: recompute them all)."""
        bs, n = self.block_size, len(tiers)
        best_k, best_s = 0, self.recompute_s(start_token, n * bs)
        load_s = self.hit_fixed_s(Tier.DRAM)
        from_storage = False
        for k, tier in enumerate(tiers, start=1):
            if tier == Tier.STORAGE and not from_storage:
                from_storage, load_s = True, load_s - self.hit_fixed_s(Tier.DRAM) + self.hit_fixed_s(Tier.STORAGE)
            load_s += self.block_load_s(tier)
            total_s = load_s + self.recompute_s(start_token + k * bs, (n - k) * bs)
            if total_s < best_s:
                best_k, best_s = k, total_s
        return best_k

    def seed_prefill(self, threshold: int) -> None:
        """Before the engine has computed anything: the prefill slope that makes `threshold`
        tokens the break-even of a DRAM hit at position 0 (the documented default's rule)."""
        load_s = self.hit_fixed_s(Tier.DRAM) + threshold * self.block_load_s(Tier.DRAM) / self.block_size
        self.prefill.per_unit_s = load_s / self.work(0, threshold)

    def pays(self, start_token: int, num_blocks: int) -> bool:
        """Whether a hit of `num_blocks` DRAM blocks is worth loading, in O(1): for a hit in one
        tier, T(k) is concave for k >= 1 (each later block costs more to recompute, the same to
        load), so `plan` loads all of it or none."""
        load_s = self.hit_fixed_s(Tier.DRAM) + num_blocks * self.block_load_s(Tier.DRAM)
        return num_blocks > 0 and load_s < self.recompute_s(start_token, num_blocks * self.block_size)

    def break_even(self, tier: Tier, max_tokens: int = 1 << 20) -> int | None:
        """The smallest hit at position 0, all in `tier`, that is loaded (tokens, whole blocks);
        None if none up to `max_tokens` is. Loading m tokens pays when
        F + m * L / bs < c * (m + kappa * m * (m - 1) / 2); solved for m."""
        fixed_s = self.hit_fixed_s(tier)
        per_token_s = self.block_load_s(tier) / self.block_size
        c = self.prefill.per_unit_s
        a, b = c * self.kappa / 2, c * (1 - self.kappa / 2) - per_token_s
        if not (math.isfinite(fixed_s) and math.isfinite(per_token_s)):
            return None
        if a > 0:
            m = (-b + math.sqrt(b * b + 4 * a * fixed_s)) / (2 * a)
        elif b > 0:
            m = fixed_s / b
        else:
            return None
        tokens = max(1, math.floor(m / self.block_size) + 1) * self.block_size
        return tokens if tokens <= max_tokens else None


@dataclass(frozen=True)
class _Step:
    built_at: float
    work: float
    has_prefill: bool
    num_load_jobs: int


class AutoThreshold:
    """VLLM_HPKV_TOKEN_THRESHOLD=auto: `CostModel.plan` with costs learned from the engine.

    The scheduler reports each step when it is built (`step_built`: the (start, num_tokens) of
    every request in it) and when its output is back (`step_done`: the connector's own seconds
    in it, from the workers' stats), and each promotion from storage (`promoted`). A step's
    time is from when it was built (or the previous one finished, if later) to its output,
    less the connector's copies: steps with a prompt chunk of at least a block refine the
    prefill slope, the others (decodes) a step's fixed cost."""

    learns = True

    def __init__(self, model: CostModel, max_tokens: int, why: str, clock=time.perf_counter) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self._clock = clock
        self._steps: deque[_Step] = deque(maxlen=4)  # built, output not back yet (async scheduling: 2)
        self._last_done = 0.0
        self._logged: dict[Tier, int | None] = {}
        self._log(f"start, {why}")

    # -- decisions ----------------------------------------------------------------------------

    def may_pay(self, start_token: int, num_blocks: int) -> bool:
        return self.model.pays(start_token, num_blocks)

    def plan(self, start_token: int, tiers: Sequence[Tier]) -> int:
        return self.model.plan(start_token, tiers)

    def describe(self) -> str:
        return f"auto ({self._thresholds_text(self._thresholds())})"

    # -- observations -------------------------------------------------------------------------

    def step_built(self, chunks: Sequence[tuple[int, int]], num_load_jobs: int) -> None:
        work = sum(self.model.work(start, n) for start, n in chunks)
        has_prefill = any(n >= self.model.block_size for _, n in chunks)
        self._steps.append(_Step(self._clock(), work, has_prefill, num_load_jobs))

    def step_done(self, connector_s: float, load_s: float, load_bytes: float) -> None:
        """`connector_s`: the workers' load and save seconds in the step (per rank);
        `load_s`, `load_bytes`: its loads (per rank)."""
        if not self._steps:
            return
        step, now = self._steps.popleft(), self._clock()
        elapsed = now - max(step.built_at, self._last_done)
        self._last_done = now
        m = self.model
        if step.num_load_jobs and load_bytes > 0:
            m.dram.observe(load_bytes / step.num_load_jobs, load_s / step.num_load_jobs)
        compute_s = elapsed - connector_s
        if step.work > 0 and compute_s > 0:
            if step.has_prefill:
                m.prefill.observe_variable(step.work, compute_s)
            else:
                m.prefill.observe_fixed(step.work, compute_s)
        self._log_if_changed()

    def promoted(self, num_bytes: int, seconds: float) -> None:
        if self.model.storage is not None and num_bytes > 0:
            self.model.storage.observe(num_bytes, seconds)
            self._log_if_changed()

    def close(self) -> None:
        self._log("at shutdown")

    # -- the log ------------------------------------------------------------------------------

    def _thresholds(self) -> dict[Tier, int | None]:
        tiers = (Tier.DRAM, Tier.STORAGE) if self.model.storage is not None else (Tier.DRAM,)
        return {tier: self.model.break_even(tier, self.max_tokens) for tier in tiers}

    def _log_if_changed(self) -> None:
        now = self._thresholds()
        for tier, tokens in now.items():
            old = self._logged.get(tier)
            if (old is None) != (tokens is None):  # a tier starts or stops being worth loading
                self._log("measured")
                return
            # Break-evens are whole blocks: a move of one block near the bottom (32 <-> 64 tokens,
            # as the measured prefill rate wanders) is noise, not news.
            if (
                old is not None
                and tokens is not None
                and abs(tokens - old) > max(MATERIAL_CHANGE * old, self.model.block_size)
            ):
                self._log("measured")
                return

    def _log(self, why: str) -> None:
        self._logged = self._thresholds()
        log.info(
            "VLLM_HPKV_TOKEN_THRESHOLD=auto (%s): %s; %s", why, self._thresholds_text(self._logged), self.figures()
        )

    @staticmethod
    def _thresholds_text(thresholds: dict[Tier, int | None]) -> str:
        names = {Tier.DRAM: "DRAM", Tier.STORAGE: "storage"}
        return ", ".join(
            f"{names[tier]} hits load from {tokens} tokens"
            if tokens is not None
            else f"{names[tier]} hits are recomputed (never faster to load)"
            for tier, tokens in thresholds.items()
        )

    def figures(self) -> str:
        m = self.model
        p, d = m.prefill, m.dram
        doubling = f", twice that per token by position {1 / m.kappa:,.0f}" if m.kappa > 0 else ""
        parts = [
            f"prefill {1 / p.per_unit_s:,.0f} tokens/s at position 0{doubling} ({_source(p)})",
            f"DRAM load {_rate(d.per_unit_s)} per rank + {d.fixed_s * 1e3:.1f} ms ({_source(d)})",
        ]
        if m.storage is not None:
            s = m.storage
            parts.append(f"storage read {_rate(s.per_unit_s)} + {s.fixed_s * 1e3:.1f} ms ({_source(s)})")
        parts.append(f"{m.entry_bytes * m.num_ranks / m.block_size / 1024:.1f} KiB of KV per token")
        return "; ".join(parts)


def _rate(s_per_byte: float) -> str:
    return f"{1 / s_per_byte / 1e9:.2f} GB/s" if s_per_byte > 0 else "unbounded"


def _source(cost: AffineCost) -> str:
    n = cost.num_observed
    return f"measured, {n} observation{'s' if n > 1 else ''}" if n else "start-up estimate"
