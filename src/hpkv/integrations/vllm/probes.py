"""Start-up measurements of this machine for VLLM_HPKV_TOKEN_THRESHOLD=auto, taken by the scheduler
half once, so its first decisions rest on this machine's figures before the engine's own steps
refine them (`loadpolicy.py` seeds the cost model with them).

Primitives: `round_trip_s` (one RPC to the HPKV server, such as `empty_lookup`), `copy_cost` (a
memory copy the size of a large load), `storage_read_cost` (a file read back from the storage
directory with its pages dropped from the page cache), `kappa_of` (the model's attention share,
from its config). Each returns None or a default when it cannot measure; none raises for the
engine to see. Must not know the load decision.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from pathlib import Path

import numpy as np

from ...costmodel import AffineCost, attention_kappa
from ...errors import HpkvError
from ...server.channel import ServerError

log = logging.getLogger("hpkv.vllm.probes")

COPY_BYTES = 32 << 20
PROBE_BYTES = 8 << 20
SMALL_BYTES = 4096


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
