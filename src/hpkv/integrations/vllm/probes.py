"""Start-up estimates for VLLM_HPKV_TOKEN_THRESHOLD=auto, taken by the scheduler half once, so its
first decisions rest on this machine's figures before the engine's own steps refine them.

Primitives: `round_trip_s` (one RPC to the HPKV server, such as `empty_lookup`), `copy_cost` (a
memory copy the size of a large load), `storage_read_cost` (a file read back from the storage directory with its pages
dropped from the page cache), `kappa_of` (the model's attention share, from its config),
`auto_threshold`, the cost model they seed, and `load_policy`, which picks it or a fixed
threshold. Each returns None or a default when it cannot measure; none raises for the engine to see.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from pathlib import Path

import numpy as np

from ...config import Settings, StorageConfig
from ...costmodel import AffineCost, AutoThreshold, CostModel, FixedThreshold, attention_kappa
from ...errors import HpkvError
from ...server.channel import ServerError

log = logging.getLogger("hpkv.vllm.probes")

COPY_BYTES = 32 << 20
PROBE_BYTES = 8 << 20
SMALL_BYTES = 4096
DEFAULT_THRESHOLD = 1204  # VLLM_HPKV_TOKEN_THRESHOLD's documented default: prefill's seed under auto


def round_trip_s(call, num: int = 5, default_s: float = 1e-3) -> float:
    """The median time of `call()`, an RPC to the HPKV server (default if the server fails)."""
    times = []
    try:
        for _ in range(num):
            started = time.perf_counter()
            call()
            times.append(time.perf_counter() - started)
    except HpkvError as exc:
        log.info("HPKV auto threshold: no server round trip measured (%s); assuming %.1f ms", exc, default_s * 1e3)
        return default_s
    return statistics.median(times)


def empty_lookup(client) -> None:
    """One server round trip in no namespace (the model's may not be known yet)."""
    try:
        client.lookup("0" * 32, [])
    except ServerError as exc:
        if exc.code != "unknown_namespace":
            raise


def copy_cost(fixed_s: float, num_bytes: int = COPY_BYTES) -> AffineCost:
    """Bytes/s of one copy between two host buffers, the second of two (the first maps pages).
    On a CPU engine a load is such a copy; on an accelerator the workers' loads correct it."""
    src = np.ones(num_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    seconds = []
    for _ in range(2):
        started = time.perf_counter()
        np.copyto(dst, src)
        seconds.append(time.perf_counter() - started)
    return AffineCost(fixed_s, max(seconds[-1], 1e-6) / num_bytes)


def storage_read_cost(directory: Path, fixed_s: float) -> AffineCost | None:
    """The cost of reading a file back from `directory` once its pages have left the page cache
    (`posix_fadvise(DONTNEED)` after `fdatasync`): a 4 KiB read gives the per-read latency, an
    8 MiB read the rate. One thread, no checksum: the server's own promotions correct it."""
    path = Path(directory) / f".hpkv-probe-{os.getpid()}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.pwrite(fd, os.urandom(1 << 16) * (PROBE_BYTES // (1 << 16)), 0)
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        # The small read comes from the end: readahead runs forward, so it leaves the rest cold.
        small_s = _timed_read(path, PROBE_BYTES - SMALL_BYTES, SMALL_BYTES)
        big_s = _timed_read(path, 0, PROBE_BYTES - SMALL_BYTES)
    except OSError as exc:
        log.info("HPKV auto threshold: could not probe the storage directory %s (%s)", directory, exc)
        return None
    finally:
        try:
            path.unlink()
        except OSError:
            pass
    return AffineCost(fixed_s + small_s, max(big_s - small_s, big_s / 2) / (PROBE_BYTES - SMALL_BYTES))


def _timed_read(path: Path, offset: int, num_bytes: int) -> float:
    buf = bytearray(num_bytes)
    started = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [buf], offset)
    finally:
        os.close(fd)
    return time.perf_counter() - started


def kappa_of(hf_text_config) -> float:
    """`attention_kappa` from a Hugging Face config; 0 (a linear model) when a field is missing."""
    c = hf_text_config
    try:
        heads = int(c.num_attention_heads)
        head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
        return attention_kappa(
            int(c.hidden_size),
            heads,
            int(getattr(c, "num_key_value_heads", None) or heads),
            head_dim,
            int(c.intermediate_size),
        )
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return 0.0


def auto_threshold(
    storage: StorageConfig,
    model_config,
    block_size: int,
    entry_bytes: int,
    num_ranks: int,
    empty_lookup,
    hit_bytes: int = 0,
) -> AutoThreshold:
    """VLLM_HPKV_TOKEN_THRESHOLD=auto for one engine, seeded by this machine's figures;
    `empty_lookup()` is one round trip to the server; a hit moves `entry_bytes` per block and
    `hit_bytes` more (a hybrid model's windows and states), per rank."""
    rtt_s = round_trip_s(empty_lookup)
    storage_cost = None
    if storage.enabled:  # a promotion: the lease, a poll, then one read per block and rank
        storage_cost = storage_read_cost(storage.path, 2 * rtt_s)
    model = CostModel(
        block_size,
        entry_bytes,
        num_ranks,
        kappa_of(model_config.hf_text_config),
        prefill=AffineCost(0.0, 0.0),
        storage=storage_cost,
        # on a load's critical path: the scheduler's lease, the worker's lease and release
        dram=copy_cost(3 * rtt_s),
        hit_bytes=hit_bytes,
    )
    model.seed_prefill(DEFAULT_THRESHOLD)
    return AutoThreshold(
        model,
        model_config.max_model_len,
        f"start-up estimates: server round trip {rtt_s * 1e3:.2f} ms, a host copy, a "
        f"storage read; prefill set to break even at the documented {DEFAULT_THRESHOLD} "
        f"tokens until the engine has computed a prompt",
    )


def load_policy(
    settings: Settings, model_config, layout, num_ranks: int, lookup, hit_bytes: int = 0
) -> FixedThreshold | AutoThreshold:
    """The load decision: VLLM_HPKV_TOKEN_THRESHOLD if set, else `auto` from start-up estimates."""
    if settings.token_threshold is not None:
        log.info("HPKV loads hits of at least %d tokens (VLLM_HPKV_TOKEN_THRESHOLD)", settings.token_threshold)
        return FixedThreshold(settings.token_threshold, layout.block_size)
    return auto_threshold(
        settings.storage, model_config, layout.block_size, layout.entry_bytes, num_ranks, lookup, hit_bytes
    )
