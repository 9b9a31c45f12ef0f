"""Sizes and durations as people write them: binary units (KiB, MiB, GiB, TiB) and d, h, m, s.

Owns the one table of each and both directions. Read: `parse_size` (`4096`, `512m`, `8GiB`) and
`parse_duration` (`3600`, `90m`, `30d`), each raising ValueError with a short reason. Written:
`human_bytes` (one decimal: status, logs), `exact_bytes` (as few digits as the value needs:
settings), `whole_unit_bytes` (only a whole number of a unit, else bytes: benchmark entry sizes)
and `short_duration`. Must not know where a size comes from or which setting takes it
(`configvalues`).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_UNITS = (("TiB", 4), ("GiB", 3), ("MiB", 2), ("KiB", 1))
_POWERS = {unit[0].lower(): power for unit, power in _UNITS}  # k, m, g, t as parse_size reads them
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(?:i?b)?)?", re.IGNORECASE)

_DURATION_UNITS = (("d", 86400), ("h", 3600), ("m", 60))
_DURATION_S = {"": 1, "s": 1, **dict(_DURATION_UNITS)}
_DURATION = re.compile(r"(\d+(?:\.\d*)?)\s*([smhd]?)", re.IGNORECASE)


def parse_size(text: str) -> int:
    """`4096`, `512m`, `1.5g`, `8GiB` -> bytes (binary multiples). ValueError on anything else."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise ValueError("not a size")
    number, unit = match.groups()
    if unit is None and not number.isdigit():
        raise ValueError("a plain byte count must be a whole number")
    size_bytes = math.floor(Fraction(number) * 1024 ** _POWERS.get((unit or "").lower(), 0))
    if size_bytes <= 0:
        raise ValueError("must be greater than 0")
    return size_bytes


def parse_duration(text: str) -> float:
    """`3600`, `90m`, `12h`, `30d` -> seconds, greater than 0. ValueError on anything else."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise ValueError("not a duration")
    seconds = float(match.group(1)) * _DURATION_S[match.group(2).lower()]
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError("out of range")
    return seconds


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
    """A duration as `parse_duration` reads it: 30d, 12h, 90m, 45s."""
    for unit, size in _DURATION_UNITS:
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"
