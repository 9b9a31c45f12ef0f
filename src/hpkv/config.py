"""HPKV settings: every key, how it is written, and where its value came from.

Owns the table of keys (`KEYS`), the value syntax (`parse_size` and friends), the config-file
format and the resolution order. The one primitive is `load_settings(env)`, which resolves every
key once, at the edge, into frozen dataclasses; components take the part they need
(`PoolConfig`, `StorageConfig`) and never read the environment themselves.

Resolution, per key: config file > environment > default. The file is named by
`HPKV_CONFIG_FILE_PATH` (environment only), else `~/.config/hpkv/config.ini`; it holds
`KEY=VALUE` lines. Every problem a person must fix is a `ConfigError` naming the key, the value,
where it came from and what is accepted. This module must not know about pools, storage layout
or engines beyond the shape of their config.
"""

from __future__ import annotations

import difflib
import enum
import math
import os
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable, Mapping

from hpkv.errors import ConfigError

CONFIG_FILE_KEY = "HPKV_CONFIG_FILE_PATH"
# Other tools may share these prefixes, so an unknown name there is only a warning.
_ENV_PREFIXES = ("HPKV_", "VLLM_HPKV_")
_BENCH_PREFIX = "HPKV_BENCH_"  # the benchmarks' own switches (docs/benchmarks.md), not settings


class Source(enum.Enum):
    FILE = "file"
    ENV = "env"
    DEFAULT = "default"


@dataclass(frozen=True)
class Setting:
    """One resolved key. `raw` is the text as written, before `~`/`$VAR` expansion."""

    key: str
    value: object
    raw: str
    source: Source
    where: str  # "env", "default", or "/path/config.ini:3"


@dataclass(frozen=True)
class PoolConfig:
    dir: Path
    size_bytes: int
    prefault: bool = True  # copying clients map every pool page when they attach


@dataclass(frozen=True)
class StorageConfig:
    path: Path
    enabled: bool
    capacity_bytes: int | None  # None means auto: the store sizes it when it starts
    fsync: str
    io_threads: int
    write_nice: int = 10  # niceness of the write-through processes
    direct_io: bool = False  # O_DIRECT for entry files, where the file system takes it
    write_budget_bytes: int | None = None  # bytes the tier may write per day; None: unlimited


@dataclass(frozen=True)
class Settings:
    pool: PoolConfig
    storage: StorageConfig
    token_threshold: int | None  # None means "auto"
    enable_vllm: bool
    model_id: str | None  # HPKV_MODEL_ID: None means the model's content fingerprint
    log_level: str
    metrics_port: int
    metrics_host: str
    server_idle_exit_s: float
    server_frame_timeout_s: float
    server_slot_timeout_s: float
    server_max_slot_share: float
    server_allow_uids: tuple[int, ...]
    config_file: Path
    settings: tuple[Setting, ...]
    warnings: tuple[str, ...]

    def source_of(self, key: str) -> Setting:
        for setting in self.settings:
            if setting.key == key:
                return setting
        raise KeyError(key)


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


_BOOLS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}


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


def _parse_uids(text: str) -> tuple[int, ...]:
    try:
        uids = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError("not a list of user ids") from None
    if any(uid < 0 for uid in uids):
        raise ValueError("user ids are >= 0")
    return uids


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
    KeySpec(CONFIG_FILE_KEY, "path", _parse_path, "~/.config/hpkv/config.ini",
            "The config file (environment only).", "a file path", env_only=True),
    KeySpec("HPKV_KV_STORAGE_PATH", "path", _parse_path, "~/.cache/hpkv/storage",
            "Directory of the persistent storage tier.", "a directory path"),
    KeySpec("HPKV_KV_MEM_POOL_SIZE", "size", parse_size, "8g",
            "Size of the shared-memory DRAM pool.", _SIZE_WORDS),
    # Per user: a directory name every uid shares could be made first by another user.
    KeySpec("HPKV_SHARE_MEM_FILE_PATH", "path", _parse_pool_dir, "/dev/shm/hpkv-<uid>",
            "Directory (ramfs/tmpfs) holding the pool file and server socket.",
            "a directory path on ramfs or tmpfs (<uid> stands for the reader's user id)"),
    KeySpec("VLLM_HPKV_TOKEN_THRESHOLD", "int", _parse_threshold, "1204",
            "Minimum HPKV-hit tokens for a load; below it the engine recomputes.",
            "an integer >= 0 or 'auto'"),
    KeySpec("VLLM_ENABLE_HPKV", "bool", _parse_bool, "false",
            "Enables HPKV in vLLM.", "1/0, true/false, yes/no or on/off"),
    KeySpec("HPKV_MODEL_ID", "word", _parse_model_id, "",
            "The model's identity in HPKV's namespaces, in place of the fingerprint of its files: engines "
            "with the same value (and the same KV settings) share KV. Set it per engine, never for two models.",
            f"empty (fingerprint the model's files), or an identity of at most {MODEL_ID_MAX_CHARS} printable "
            "characters"),
    KeySpec("HPKV_KV_STORAGE_ENABLE", "bool", _parse_bool, "true",
            "Offload KV cache to the storage tier.", "1/0, true/false, yes/no or on/off"),
    KeySpec("HPKV_KV_STORAGE_SIZE", "size", _parse_size_or_auto, "auto",
            "Storage capacity; auto = 80% of the space available to the directory.",
            "'auto', or a size: " + _SIZE_WORDS),
    KeySpec("HPKV_KV_STORAGE_FSYNC", "word", _one_of("off", "data", "full"), "off",
            "Durability of storage writes (files are checksummed either way).",
            "off, data or full"),
    KeySpec("HPKV_KV_STORAGE_DIRECT_IO", "bool", _parse_bool, "false",
            "Read and write KV files with O_DIRECT, bypassing the page cache (where the file system allows).",
            "1/0, true/false, yes/no or on/off"),
    KeySpec("HPKV_KV_STORAGE_WRITE_BUDGET", "size", _parse_size_or_unlimited, "unlimited",
            "Bytes the storage tier may write per day (SSD wear); past it, new KV stays in DRAM only.",
            "'unlimited', or a size per day: " + _SIZE_WORDS),
    KeySpec("HPKV_POOL_PREFAULT", "bool", _parse_bool, "true",
            "Engine processes map every pool page when they attach (page tables: 2 MiB per GiB).",
            "1/0, true/false, yes/no or on/off"),
    KeySpec("HPKV_IO_THREADS", "int", _int_in(1, 256), "8",
            "Storage I/O threads.", "an integer from 1 to 256"),
    KeySpec("HPKV_WRITE_NICE", "int", _int_in(0, 19), "10",
            "CPU niceness of the server's write-through processes (0: the server's own).",
            "an integer from 0 to 19"),
    KeySpec("HPKV_LOG_LEVEL", "word", _one_of("debug", "info", "warning", "error"), "info",
            "Log level.", "debug, info, warning or error"),
    KeySpec("HPKV_METRICS_PORT", "int", _int_in(0, 65535), "0",
            "Metrics HTTP port; 0 turns metrics off.", "an integer from 0 to 65535"),
    KeySpec("HPKV_METRICS_HOST", "host", _parse_host, "127.0.0.1",
            "Address the metrics endpoint listens on.", "a host name or IP address"),
    KeySpec("HPKV_SERVER_IDLE_EXIT_S", "float", _parse_seconds, "10",
            "Seconds an auto-started server lingers after its last client leaves.",
            "a number of seconds >= 0 (e.g. 10, 2.5)"),
    KeySpec("HPKV_SERVER_FRAME_TIMEOUT_S", "float", _parse_positive_seconds, "30",
            "Seconds a client may take to finish a message it started, or to read a reply, before the "
            "server closes its connection and releases what it held.",
            "a number of seconds > 0 (e.g. 30, 2.5)"),
    KeySpec("HPKV_SERVER_SLOT_TIMEOUT_S", "float", _parse_positive_seconds, "300",
            "Seconds a client may keep a pool slot reserved or leased; then the server takes it back (reused "
            "after a 30 s quarantine) and that save or load is a miss.",
            "a number of seconds > 0 (e.g. 300, 60)"),
    KeySpec("HPKV_SERVER_MAX_SLOT_SHARE", "float", _parse_share, "0.75",
            "Share of the pool one client may hold reserved or leased at once; keys past it are not saved or "
            "loaded (a miss), so one client cannot take every slot.",
            "a number > 0 and <= 1 (e.g. 0.75; 1: no cap)"),
    KeySpec("HPKV_SERVER_ALLOW_UIDS", "word", _parse_uids, "",
            "Other user ids that share this node's pool: the server accepts them as clients (its own uid "
            "always), and engines trust a server run by one of them (their own uid and root always).",
            "a comma-separated list of user ids, or empty"),
)
_BY_NAME = {spec.name: spec for spec in KEYS}


# --- expansion -----------------------------------------------------------------------------

_VAR = re.compile(r"\$(\w+)|\$\{([^}]*)\}")


def _expand(text: str, env: Mapping[str, str]) -> str:
    """os.path.expanduser(os.path.expandvars(text)), but reading `env` rather than os.environ."""
    text = _VAR.sub(lambda m: env.get(m.group(1) or m.group(2), m.group(0)), text)
    home = env.get("HOME")
    if home and (text == "~" or text.startswith("~/")):
        return home + text[1:]
    return os.path.expanduser(text)


# --- the config file -----------------------------------------------------------------------

_LINE = re.compile(r"(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*=(.*)")


@dataclass(frozen=True)
class _Entry:
    raw: str
    where: str  # "/path/config.ini:3"


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value


def _suggest(key: str, known: list[str]) -> str | None:
    matches = difflib.get_close_matches(key.upper(), known, n=1)
    return matches[0] if matches else None


def _check_file_key(key: str, where: str) -> None:
    if key == CONFIG_FILE_KEY:
        raise ConfigError(
            f"{CONFIG_FILE_KEY} cannot be set in the config file ({where}): it names the file "
            f"itself; remove that line and set it in the environment instead, "
            f"e.g. export {CONFIG_FILE_KEY}=~/config.ini")
    if key not in _BY_NAME:
        match = _suggest(key, list(_BY_NAME))
        hint = f"did you mean {match}?" if match else "known keys: " + ", ".join(_BY_NAME)
        raise ConfigError(f"unknown key {key!r} in config file {where}; {hint}")


def _parse_file(text: str, path: Path) -> tuple[dict[str, _Entry], list[str]]:
    entries: dict[str, _Entry] = {}
    warnings: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line[0] in "#;" or (line[0] == "[" and line[-1] == "]"):
            continue
        where = f"{path}:{number}"
        match = _LINE.fullmatch(line)
        if match is None:
            raise ConfigError(
                f"config file {where}: {line!r} is not a KEY=VALUE line; write lines like "
                f"HPKV_KV_STORAGE_PATH=~/.cache/hpkv/storage, or start comments with #")
        key, value = match.group(1), _unquote(match.group(2).strip())
        _check_file_key(key, where)
        if key in entries:
            warnings.append(f"{key} is set twice in the config file; {where} wins over "
                            f"{entries[key].where}")
        entries[key] = _Entry(value, where)
    return entries, warnings


def _read_file(path: Path, explicit: bool) -> tuple[dict[str, _Entry], list[str]]:
    try:
        text = path.read_text(encoding="utf-8-sig")  # an editor's byte-order mark is not part of the first key
    except FileNotFoundError:
        if not explicit:
            return {}, []
        return {}, [f"config file {path} (named by {CONFIG_FILE_KEY}) does not exist; "
                    f"using the environment and defaults"]
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(
            f"cannot read config file {path}: {reason}; make it a readable UTF-8 text file, "
            f"or point {CONFIG_FILE_KEY} at another file") from None
    return _parse_file(text, path)


# --- resolution ----------------------------------------------------------------------------

def _describe(source: Source, where: str) -> str:
    return {Source.FILE: f"config file {where}", Source.ENV: "environment",
            Source.DEFAULT: "default"}[source]


def _resolve(spec: KeySpec, entries: Mapping[str, _Entry], env: Mapping[str, str]) -> Setting:
    if spec.name in entries:
        raw, source, where = entries[spec.name].raw, Source.FILE, entries[spec.name].where
    elif env.get(spec.name, ""):  # an empty variable counts as unset
        raw, source, where = env[spec.name], Source.ENV, "env"
    else:
        raw, source, where = spec.default, Source.DEFAULT, "default"
    # Every value from the file is expanded; paths are expanded from any source.
    text = _expand(raw, env) if source is Source.FILE or spec.kind == "path" else raw
    try:
        value = spec.parse(text)
    except ValueError as exc:
        shown = f"{raw!r}" if text == raw else f"{raw!r} (expanded to {text!r})"
        raise ConfigError(f"{spec.name}={shown} (from {_describe(source, where)}): {exc}; "
                          f"use {spec.accepted}") from None
    return Setting(spec.name, value, raw, source, where)


def _env_warnings(env: Mapping[str, str]) -> list[str]:
    warnings = []
    for name in sorted(env):
        if name.startswith(_ENV_PREFIXES) and name not in _BY_NAME and not name.startswith(_BENCH_PREFIX):
            match = _suggest(name, list(_BY_NAME))
            hint = f" (did you mean {match}?)" if match else ""
            warnings.append(f"environment variable {name} is not an HPKV setting{hint}; "
                            f"ignored")
    return warnings


def _config_file(env: Mapping[str, str]) -> tuple[Setting, bool]:
    """The config file's own setting, and whether the user named it explicitly."""
    setting = _resolve(_BY_NAME[CONFIG_FILE_KEY], {}, env)
    return setting, setting.source is Source.ENV


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Resolve every key: config file > environment > default. Raises ConfigError."""
    env = os.environ if env is None else env
    file_setting, explicit = _config_file(env)
    entries, warnings = _read_file(file_setting.value, explicit)
    resolved = [file_setting] + [_resolve(spec, entries, env)
                                 for spec in KEYS if spec.name != CONFIG_FILE_KEY]
    return _build(resolved, tuple(warnings + _env_warnings(env)))


def _build(resolved: list[Setting], warnings: tuple[str, ...]) -> Settings:
    v = {setting.key: setting.value for setting in resolved}
    return Settings(
        pool=PoolConfig(dir=v["HPKV_SHARE_MEM_FILE_PATH"], size_bytes=v["HPKV_KV_MEM_POOL_SIZE"],
                        prefault=v["HPKV_POOL_PREFAULT"]),
        storage=StorageConfig(path=v["HPKV_KV_STORAGE_PATH"],
                              enabled=v["HPKV_KV_STORAGE_ENABLE"],
                              capacity_bytes=v["HPKV_KV_STORAGE_SIZE"],
                              fsync=v["HPKV_KV_STORAGE_FSYNC"],
                              io_threads=v["HPKV_IO_THREADS"],
                              write_nice=v["HPKV_WRITE_NICE"],
                              direct_io=v["HPKV_KV_STORAGE_DIRECT_IO"],
                              write_budget_bytes=v["HPKV_KV_STORAGE_WRITE_BUDGET"]),
        token_threshold=v["VLLM_HPKV_TOKEN_THRESHOLD"],
        enable_vllm=v["VLLM_ENABLE_HPKV"],
        model_id=v["HPKV_MODEL_ID"],
        log_level=v["HPKV_LOG_LEVEL"],
        metrics_port=v["HPKV_METRICS_PORT"],
        metrics_host=v["HPKV_METRICS_HOST"],
        server_idle_exit_s=v["HPKV_SERVER_IDLE_EXIT_S"],
        server_frame_timeout_s=v["HPKV_SERVER_FRAME_TIMEOUT_S"],
        server_slot_timeout_s=v["HPKV_SERVER_SLOT_TIMEOUT_S"],
        server_max_slot_share=v["HPKV_SERVER_MAX_SLOT_SHARE"],
        server_allow_uids=v["HPKV_SERVER_ALLOW_UIDS"],
        config_file=v[CONFIG_FILE_KEY],
        settings=tuple(resolved),
        warnings=warnings,
    )
