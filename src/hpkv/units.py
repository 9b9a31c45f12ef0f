"""Sizes as people read them: binary units (KiB, MiB, GiB, TiB).

Owns the one table of units and the three ways HPKV writes a size: `human_bytes` (one decimal:
status, logs), `exact_bytes` (as few digits as the value needs: settings) and `whole_unit_bytes`
(only a whole number of a unit, else bytes: benchmark entry sizes). Parsing sizes is
`configvalues.parse_size`. Also `short_duration`, for the one duration setting. Must not know
where a size comes from.
"""

from __future__ import annotations

_UNITS = (("TiB", 4), ("GiB", 3), ("MiB", 2), ("KiB", 1))


def human_bytes(num_bytes: float) -> str:
    """1.5 GiB, 64.0 KiB, 512 B."""
    for unit, power in _UNITS:
        if num_bytes >= 1024**power:
            return f"{num_bytes / 1024**power:.1f} {unit}"
    return f"{int(num_bytes)} B"


def exact_bytes(num_bytes: int) -> str:
    """8 GiB, 1.5 GiB, 1000 B."""
    for unit, power in _UNITS:
        if num_bytes >= 1024**power:
            return f"{num_bytes / 1024**power:g} {unit}"
    return f"{num_bytes} B"


def whole_unit_bytes(num_bytes: int) -> str:
    """64 KiB, 1 MiB; a size that is no whole number of a unit (up to GiB) in bytes."""
    for unit, power in _UNITS[1:]:
        if num_bytes >= 1024**power and num_bytes % 1024**power == 0:
            return f"{num_bytes // 1024**power} {unit}"
    return f"{num_bytes} B"


def short_duration(seconds: float) -> str:
    """A duration as HPKV_KV_STORAGE_RETENTION takes it: 30d, 12h, 90m, 45s."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"
