"""HPKV's settings keys: each key's name, default, accepted values and parser.

Owns the table `KEYS` (one `KeySpec` per key) and the value syntax (`parse_size` and the private
parsers the specs name). A parser takes the text as written (after expansion) and returns the
value or raises ValueError with a short reason; `hpkv.config` turns that into a ConfigError naming
the key and the source. Must not know the config file, the environment or resolution order.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

CONFIG_FILE_KEY = "HPKV_CONFIG_FILE_PATH"


# --- value syntax -------------------------------------------------------------------------

_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(?:i?b)?)?", re.IGNORECASE)
_UNITS = {"k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str) -> int:
    """`4096`, `512m`, `1.5g`, `8GiB` -> bytes (binary multiples). ValueError on anything else."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise ValueError("not a size")
    number, unit = match.groups()
    if unit is None and not number.isdigit():
        raise ValueError("a plain byte count must be a whole number")
    size_bytes = math.floor(Fraction(number) * 1024 ** _UNITS.get((unit or "").lower(), 0))
    if size_bytes <= 0:
        raise ValueError("must be greater than 0")
    return size_bytes


def _parse_size_or_auto(text: str) -> int | None:
    return None if text.strip().lower() == "auto" else parse_size(text)


def _parse_size_or_unlimited(text: str) -> int | None:
    return None if text.strip().lower() == "unlimited" else parse_size(text)


_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _parse_bool(text: str) -> bool:
    try:
        return _BOOLS[text.strip().lower()]
    except KeyError:
        raise ValueError("not a boolean") from None


def _int_in(low: int, high: int | None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            number = int(text.strip())
        except ValueError:
            raise ValueError("not an integer") from None
        if number < low or (high is not None and number > high):
            raise ValueError("out of range")
        return number

    return parse


def _parse_threshold(text: str) -> int | None:
    return None if text.strip().lower() == "auto" else _int_in(0, None)(text)


def _parse_seconds(text: str) -> float:
    try:
        seconds = float(text.strip())
    except ValueError:
        raise ValueError("not a number") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError("out of range")
    return seconds


def _parse_positive_seconds(text: str) -> float:
    seconds = _parse_seconds(text)
    if seconds == 0:
        raise ValueError("out of range")
    return seconds


_DURATION = re.compile(r"(\d+(?:\.\d*)?)\s*([smhd]?)", re.IGNORECASE)
_DURATION_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def _parse_duration_or_off(text: str) -> float | None:
    """`off` or `0` -> None; `3600`, `90m`, `12h`, `30d` -> seconds."""
    if text.strip().lower() in ("off", "0"):
        return None
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise ValueError("not a duration")
    seconds = float(match.group(1)) * _DURATION_UNIT_S[match.group(2).lower()]
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError("out of range")
    return seconds


def _parse_share(text: str) -> float:
    try:
        share = float(text.strip())
    except ValueError:
        raise ValueError("not a number") from None
    if not 0 < share <= 1:  # NaN too
        raise ValueError("out of range")
    return share


def _one_of(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        word = text.strip().lower()
        if word not in choices:
            raise ValueError("not one of the accepted words")
        return word

    return parse


def _parse_path(text: str) -> Path:
    # Expansion of ~ and $VAR happens before parsing (see _expand); here only make it absolute.
    if not text.strip():
        raise ValueError("empty path")
    return Path(os.path.abspath(text.strip()))


def _parse_pool_dir(text: str) -> Path:
    return _parse_path(text.replace("<uid>", str(os.geteuid())))


MAX_UID = 0xFFFFFFFE  # (uid_t)-1 means "no uid" to chown and setreuid: never a user's


def _parse_uids(text: str) -> tuple[int, ...]:
    """`1001, 1002` -> (1001, 1002): ASCII digits only (int() takes `_`, signs, other scripts' digits)."""
    parts = [part.strip(" \t") for part in text.split(",")]
    bad = next((x for x in parts if x and not (x.isascii() and x.isdigit() and int(x) <= MAX_UID)), None)
    if bad is not None:
        raise ValueError(f"{bad!r} is not a user id (ASCII digits, at most {MAX_UID})")
    return tuple(int(x) for x in parts if x)


MODEL_ID_MAX_CHARS = 256


def _parse_model_id(text: str) -> str | None:
    text = text.strip()
    if not text:
        return None
    if len(text) > MODEL_ID_MAX_CHARS or not text.isprintable():
        raise ValueError(f"at most {MODEL_ID_MAX_CHARS} printable characters")
    return text


def _parse_host(text: str) -> str:
    if not text.strip():
        raise ValueError("empty host")
    return text.strip()


# --- the keys ------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeySpec:
    """One key. Adding a key is adding one of these to KEYS (and a field to Settings)."""

    name: str
    kind: str  # path, size, bool, int, float, word, host: for display and docs
    parse: Callable[[str], object]
    default: str
    doc: str
    accepted: str
    env_only: bool = False


_SIZE_WORDS = "bytes or a number with k, m, g or t (e.g. 8g, 512m, 1t)"

KEYS: tuple[KeySpec, ...] = (
    KeySpec(
        CONFIG_FILE_KEY,
        "path",
        _parse_path,
        "~/.config/hpkv/config.ini",
        "The config file (environment only).",
        "a file path",
        env_only=True,
    ),
    KeySpec(
        "HPKV_KV_STORAGE_PATH",
        "path",
        _parse_path,
        "~/.cache/hpkv/storage",
        "Directory of the persistent storage tier.",
        "a directory path",
    ),
    KeySpec("HPKV_KV_MEM_POOL_SIZE", "size", parse_size, "8g", "Size of the shared-memory DRAM pool.", _SIZE_WORDS),
    # Per user: a directory name every uid shares could be made first by another user.
    KeySpec(
        "HPKV_SHARE_MEM_FILE_PATH",
        "path",
        _parse_pool_dir,
        "/dev/shm/hpkv-<uid>",
        "Directory (ramfs/tmpfs) holding the pool file and server socket.",
        "a directory path on ramfs or tmpfs (<uid> stands for the reader's user id)",
    ),
    KeySpec(
        "VLLM_HPKV_TOKEN_THRESHOLD",
        "int",
        _parse_threshold,
        "1204",
        "Minimum HPKV-hit tokens for a load; below it the engine recomputes.",
        "an integer >= 0 or 'auto'",
    ),
    KeySpec(
        "VLLM_ENABLE_HPKV", "bool", _parse_bool, "false", "Enables HPKV in vLLM.", "1/0, true/false, yes/no or on/off"
    ),
    KeySpec(
        "HPKV_MODEL_ID",
        "word",
        _parse_model_id,
        "",
        "The model's identity in HPKV's namespaces, in place of the fingerprint of its files: engines "
        "with the same value (and the same KV settings) share KV. Set it per engine, never for two models.",
        f"empty (fingerprint the model's files), or an identity of at most {MODEL_ID_MAX_CHARS} printable characters",
    ),
    KeySpec(
        "HPKV_KV_STORAGE_ENABLE",
        "bool",
        _parse_bool,
        "true",
        "Offload KV cache to the storage tier.",
        "1/0, true/false, yes/no or on/off",
    ),
    KeySpec(
        "HPKV_KV_STORAGE_SIZE",
        "size",
        _parse_size_or_auto,
        "auto",
        "Storage capacity; auto = 80% of the space available to the directory.",
        "'auto', or a size: " + _SIZE_WORDS,
    ),
    KeySpec(
        "HPKV_KV_STORAGE_FSYNC",
        "word",
        _one_of("off", "data", "full"),
        "off",
        "Durability of storage writes (files are checksummed either way).",
        "off, data or full",
    ),
    KeySpec(
        "HPKV_KV_STORAGE_DIRECT_IO",
        "bool",
        _parse_bool,
        "false",
        "Read and write KV files with O_DIRECT, bypassing the page cache (where the file system allows).",
        "1/0, true/false, yes/no or on/off",
    ),
    KeySpec(
        "HPKV_KV_STORAGE_WRITE_BUDGET",
        "size",
        _parse_size_or_unlimited,
        "unlimited",
        "Bytes the storage tier may write per day (SSD wear); past it, new KV stays in DRAM only.",
        "'unlimited', or a size per day: " + _SIZE_WORDS,
    ),
    KeySpec(
        "HPKV_KV_STORAGE_RETENTION",
        "duration",
        _parse_duration_or_off,
        "off",
        "Remove KV files unused for longer than this (by the server, oldest first); off keeps them "
        "until capacity evicts them.",
        "'off', or seconds, or a number with s, m, h or d (e.g. 12h, 30d)",
    ),
    KeySpec(
        "HPKV_POOL_PREFAULT",
        "bool",
        _parse_bool,
        "true",
        "Engine processes map every pool page when they attach (page tables: 2 MiB per GiB).",
        "1/0, true/false, yes/no or on/off",
    ),
    KeySpec("HPKV_IO_THREADS", "int", _int_in(1, 256), "8", "Storage I/O threads.", "an integer from 1 to 256"),
    KeySpec(
        "HPKV_WRITE_NICE",
        "int",
        _int_in(0, 19),
        "10",
        "CPU niceness of the server's write-through processes (0: the server's own).",
        "an integer from 0 to 19",
    ),
    KeySpec(
        "HPKV_LOG_LEVEL",
        "word",
        _one_of("debug", "info", "warning", "error"),
        "info",
        "Log level.",
        "debug, info, warning or error",
    ),
    KeySpec(
        "HPKV_METRICS_PORT",
        "int",
        _int_in(0, 65535),
        "0",
        "Metrics HTTP port; 0 turns metrics off.",
        "an integer from 0 to 65535",
    ),
    KeySpec(
        "HPKV_METRICS_HOST",
        "host",
        _parse_host,
        "127.0.0.1",
        "Address the metrics endpoint listens on.",
        "a host name or IP address",
    ),
    KeySpec(
        "HPKV_SERVER_IDLE_EXIT_S",
        "float",
        _parse_seconds,
        "10",
        "Seconds an auto-started server lingers after its last client leaves.",
        "a number of seconds >= 0 (e.g. 10, 2.5)",
    ),
    KeySpec(
        "HPKV_SERVER_FRAME_TIMEOUT_S",
        "float",
        _parse_positive_seconds,
        "30",
        "Seconds a client may take to finish a message it started, or to read a reply, before the "
        "server closes its connection and releases what it held.",
        "a number of seconds > 0 (e.g. 30, 2.5)",
    ),
    KeySpec(
        "HPKV_SERVER_SLOT_TIMEOUT_S",
        "float",
        _parse_positive_seconds,
        "300",
        "Seconds a client may keep a pool slot reserved or leased; then the server takes it back (reused "
        "after a 30 s quarantine) and that save or load is a miss.",
        "a number of seconds > 0 (e.g. 300, 60)",
    ),
    KeySpec(
        "HPKV_SERVER_MAX_SLOT_SHARE",
        "float",
        _parse_share,
        "0.75",
        "Share of the pool one client process (all its connections) may hold reserved or leased at once; "
        "keys past it are not saved or loaded (a miss), so one client cannot take every slot.",
        "a number > 0 and <= 1 (e.g. 0.75; 1: no cap)",
    ),
    KeySpec(
        "HPKV_SERVER_MAX_USER_SLOT_SHARE",
        "float",
        _parse_share,
        "0.75",
        "Share of the pool all the clients of one user (uid) may hold reserved or leased at once; keys "
        "past it are a miss, so one user cannot take every slot, however many processes it runs.",
        "a number > 0 and <= 1 (e.g. 0.75; 1: no cap)",
    ),
    KeySpec(
        "HPKV_SERVER_MAX_CONNECTIONS_PER_UID",
        "int",
        _int_in(1, 65536),
        "256",
        "Connections one user (uid) may hold open to the server at once; more are refused.",
        "an integer from 1 to 65536",
    ),
    KeySpec(
        "HPKV_SERVER_CONNECTION_IDLE_S",
        "float",
        _parse_positive_seconds,
        "600",
        "Seconds a connection that holds no slot may stay silent before the server closes it (a "
        "client reconnects on its next request, which is not lost).",
        "a number of seconds > 0 (e.g. 600, 60)",
    ),
    KeySpec(
        "HPKV_SERVER_ALLOW_UIDS",
        "word",
        _parse_uids,
        "",
        "Other user ids that share this node's pool: the server lets them reach its socket and accepts "
        "them as clients (its own uid always), and engines trust a server run by one of them (their own "
        "uid and root always).",
        "a comma-separated list of user ids (ASCII digits, each below 4294967295), or empty",
    ),
)
KEYS_BY_NAME = {spec.name: spec for spec in KEYS}
