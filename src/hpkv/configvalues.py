"""The syntax of HPKV's setting values: sizes, booleans, bounded numbers, durations, shares,
words, paths, uids, model ids and hosts.

Primitives: one parser (or parser factory) per kind of value; each takes the text as written
(after expansion) and returns the value or raises ValueError with a short reason. Sizes and
durations are read by `units` (`parse_size`, `parse_duration`), which also writes them back.
Must not know the keys (`configkeys`), the config file or the environment.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

from .units import parse_duration, parse_size


def parse_size_or_auto(text: str) -> int | None:
    return None if text.strip().lower() == "auto" else parse_size(text)


def parse_size_or_unlimited(text: str) -> int | None:
    return None if text.strip().lower() == "unlimited" else parse_size(text)


_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def parse_bool(text: str) -> bool:
    try:
        return _BOOLS[text.strip().lower()]
    except KeyError:
        raise ValueError("not a boolean") from None


def int_in(low: int, high: int | None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            number = int(text.strip())
        except ValueError:
            raise ValueError("not an integer") from None
        if number < low or (high is not None and number > high):
            raise ValueError("out of range")
        return number

    return parse


def parse_threshold(text: str) -> int | None:
    return None if text.strip().lower() == "auto" else int_in(0, None)(text)


def parse_seconds(text: str) -> float:
    try:
        seconds = float(text.strip())
    except ValueError:
        raise ValueError("not a number") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError("out of range")
    return seconds


def parse_positive_seconds(text: str) -> float:
    seconds = parse_seconds(text)
    if seconds == 0:
        raise ValueError("out of range")
    return seconds


def parse_duration_or_off(text: str) -> float | None:
    """`off` or `0` -> None; else `parse_duration`."""
    return None if text.strip().lower() in ("off", "0") else parse_duration(text)


def parse_share(text: str) -> float:
    try:
        share = float(text.strip())
    except ValueError:
        raise ValueError("not a number") from None
    if not 0 < share <= 1:  # NaN too
        raise ValueError("out of range")
    return share


def one_of(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        word = text.strip().lower()
        if word not in choices:
            raise ValueError("not one of the accepted words")
        return word

    return parse


def parse_path(text: str) -> Path:
    # Expansion of ~ and $VAR happens before parsing (see _expand); here only make it absolute.
    if not text.strip():
        raise ValueError("empty path")
    return Path(os.path.abspath(text.strip()))


def parse_pool_dir(text: str) -> Path:
    return parse_path(text.replace("<uid>", str(os.geteuid())))


MAX_UID = 0xFFFFFFFE  # (uid_t)-1 means "no uid" to chown and setreuid: never a user's


def parse_uids(text: str) -> tuple[int, ...]:
    """`1001, 1002` -> (1001, 1002): ASCII digits only (int() takes `_`, signs, other scripts' digits)."""
    parts = [part.strip(" \t") for part in text.split(",")]
    bad = next((x for x in parts if x and not (x.isascii() and x.isdigit() and int(x) <= MAX_UID)), None)
    if bad is not None:
        raise ValueError(f"{bad!r} is not a user id (ASCII digits, at most {MAX_UID})")
    return tuple(int(x) for x in parts if x)


MODEL_ID_MAX_CHARS = 256


def parse_model_id(text: str) -> str | None:
    text = text.strip()
    if not text:
        return None
    if len(text) > MODEL_ID_MAX_CHARS or not text.isprintable():
        raise ValueError(f"at most {MODEL_ID_MAX_CHARS} printable characters")
    return text


def parse_host(text: str) -> str:
    if not text.strip():
        raise ValueError("empty host")
    return text.strip()


def parse_host_port(text: str) -> str:
    """host:port (a name, an IPv4 address, or an IPv6 one in brackets)."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdecimal() or not 0 < int(port) < 65536:
        raise ValueError("not host:port")
    return f"{host}:{int(port)}"


def parse_metadata(text: str) -> str:
    """Mooncake's metadata mode: P2PHANDSHAKE, or a metadata server's http(s):// URL."""
    text = text.strip()
    if text.upper() == "P2PHANDSHAKE":
        return "P2PHANDSHAKE"
    if text.startswith(("http://", "https://")) and len(text) > 8:
        return text
    raise ValueError("neither P2PHANDSHAKE nor an http:// URL")


def parse_optional_host(text: str) -> str:
    return text.strip()
