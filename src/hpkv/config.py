"""HPKV settings: where each key's value came from, and the frozen config components take.

Owns the config-file format and the resolution order; the keys and their value syntax live in
`hpkv.configkeys` (re-exported here: `KEYS`; and `parse_size`, from `hpkv.units`). The one primitive is
`load_settings(env)`, which resolves every key once, at the edge, into frozen dataclasses;
components take the part they need (`PoolConfig`, `StorageConfig`) and never read the
environment themselves.

Resolution, per key: config file > environment > default. The file is named by
`HPKV_CONFIG_FILE_PATH` (environment only), else `~/.config/hpkv/config.ini`; it holds
`KEY=VALUE` lines. Every problem a person must fix is a `ConfigError` naming the key, the value,
where it came from and what is accepted. This module must not know about pools, storage layout
or engines beyond the shape of their config.
"""

from __future__ import annotations

import difflib
import enum
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpkv.configkeys import CONFIG_FILE_KEY, KEYS, KEYS_BY_NAME, KeySpec
from hpkv.configvalues import MODEL_ID_MAX_CHARS
from hpkv.errors import ConfigError
from hpkv.units import parse_size

__all__ = [
    "CONFIG_FILE_KEY",
    "KEYS",
    "MODEL_ID_MAX_CHARS",
    "KeySpec",
    "PoolConfig",
    "Setting",
    "Settings",
    "Source",
    "StorageConfig",
    "load_settings",
    "parse_size",
]

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
    retention_s: float | None = None  # files unused longer than this are removed; None: kept
    cluster: str = "auto"  # split the root's parts among the nodes sharing it: auto, on, off
    lease_s: float = 30.0  # a node silent this long loses its parts


@dataclass(frozen=True)
class ClusterConfig:
    """The cluster tier (`hpkv.cluster`): Mooncake Store's client settings and HPKV's bounds."""

    enabled: bool = False
    master: str = "127.0.0.1:50051"  # the mooncake_master's RPC address, host:port
    protocol: str = "tcp"  # or "rdma"
    rdma_devices: str = ""  # for rdma: the devices, comma-separated ("" lets Mooncake choose)
    metadata: str = "P2PHANDSHAKE"  # or the http://... URL of a metadata server
    host: str = ""  # the address other nodes reach this node's segment at ("": this host's address)
    segment_bytes: int = 4 << 30  # the memory this node contributes to the cluster
    buffer_bytes: int = 64 << 20  # Mooncake's local staging buffer of each client
    replicas: int = 1
    timeout_s: float = 0.5  # a lookup's longest wait for the cluster: then it is a miss


@dataclass(frozen=True)
class Settings:
    pool: PoolConfig
    storage: StorageConfig
    cluster: ClusterConfig
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
    server_max_namespace_bytes: int
    server_max_namespaces_per_uid: int
    server_max_namespaces: int
    server_max_user_slot_share: float
    server_max_connections_per_uid: int
    server_connection_idle_s: float
    config_file: Path
    settings: tuple[Setting, ...]
    warnings: tuple[str, ...]

    def source_of(self, key: str) -> Setting:
        for setting in self.settings:
            if setting.key == key:
                return setting
        raise KeyError(key)


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
            f"e.g. export {CONFIG_FILE_KEY}=~/config.ini"
        )
    if key not in KEYS_BY_NAME:
        match = _suggest(key, list(KEYS_BY_NAME))
        hint = f"did you mean {match}?" if match else "known keys: " + ", ".join(KEYS_BY_NAME)
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
                f"HPKV_KV_STORAGE_PATH=~/.cache/hpkv/storage, or start comments with #"
            )
        key, value = match.group(1), _unquote(match.group(2).strip())
        _check_file_key(key, where)
        if key in entries:
            warnings.append(f"{key} is set twice in the config file; {where} wins over {entries[key].where}")
        entries[key] = _Entry(value, where)
    return entries, warnings


def _read_file(path: Path, explicit: bool) -> tuple[dict[str, _Entry], list[str]]:
    try:
        text = path.read_text(encoding="utf-8-sig")  # an editor's byte-order mark is not part of the first key
    except FileNotFoundError:
        if not explicit:
            return {}, []
        return {}, [
            f"config file {path} (named by {CONFIG_FILE_KEY}) does not exist; using the environment and defaults"
        ]
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(
            f"cannot read config file {path}: {reason}; make it a readable UTF-8 text file, "
            f"or point {CONFIG_FILE_KEY} at another file"
        ) from None
    return _parse_file(text, path)


# --- resolution ----------------------------------------------------------------------------


def _describe(source: Source, where: str) -> str:
    return {Source.FILE: f"config file {where}", Source.ENV: "environment", Source.DEFAULT: "default"}[source]


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
        raise ConfigError(
            f"{spec.name}={shown} (from {_describe(source, where)}): {exc}; use {spec.accepted}"
        ) from None
    return Setting(spec.name, value, raw, source, where)


def _env_warnings(env: Mapping[str, str]) -> list[str]:
    warnings = []
    for name in sorted(env):
        if name.startswith(_ENV_PREFIXES) and name not in KEYS_BY_NAME and not name.startswith(_BENCH_PREFIX):
            match = _suggest(name, list(KEYS_BY_NAME))
            hint = f" (did you mean {match}?)" if match else ""
            warnings.append(f"environment variable {name} is not an HPKV setting{hint}; ignored")
    return warnings


def _config_file(env: Mapping[str, str]) -> tuple[Setting, bool]:
    """The config file's own setting, and whether the user named it explicitly."""
    setting = _resolve(KEYS_BY_NAME[CONFIG_FILE_KEY], {}, env)
    return setting, setting.source is Source.ENV


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Resolve every key: config file > environment > default. Raises ConfigError."""
    env = os.environ if env is None else env
    file_setting, explicit = _config_file(env)
    assert isinstance(file_setting.value, Path)  # a "path" key, with a default
    entries, warnings = _read_file(file_setting.value, explicit)
    resolved = [file_setting] + [_resolve(spec, entries, env) for spec in KEYS if spec.name != CONFIG_FILE_KEY]
    return _build(resolved, tuple(warnings + _env_warnings(env)))


def _build(resolved: list[Setting], warnings: tuple[str, ...]) -> Settings:
    v: dict[str, Any] = {setting.key: setting.value for setting in resolved}  # each parsed by its KeySpec
    return Settings(
        pool=PoolConfig(
            dir=v["HPKV_SHARE_MEM_FILE_PATH"], size_bytes=v["HPKV_KV_MEM_POOL_SIZE"], prefault=v["HPKV_POOL_PREFAULT"]
        ),
        storage=StorageConfig(
            path=v["HPKV_KV_STORAGE_PATH"],
            enabled=v["HPKV_KV_STORAGE_ENABLE"],
            capacity_bytes=v["HPKV_KV_STORAGE_SIZE"],
            fsync=v["HPKV_KV_STORAGE_FSYNC"],
            io_threads=v["HPKV_IO_THREADS"],
            write_nice=v["HPKV_WRITE_NICE"],
            direct_io=v["HPKV_KV_STORAGE_DIRECT_IO"],
            write_budget_bytes=v["HPKV_KV_STORAGE_WRITE_BUDGET"],
            retention_s=v["HPKV_KV_STORAGE_RETENTION"],
            cluster=v["HPKV_KV_STORAGE_CLUSTER"],
            lease_s=v["HPKV_KV_STORAGE_LEASE"],
        ),
        cluster=ClusterConfig(
            enabled=v["HPKV_CLUSTER_ENABLE"],
            master=v["HPKV_CLUSTER_MASTER"],
            protocol=v["HPKV_CLUSTER_PROTOCOL"],
            rdma_devices=v["HPKV_CLUSTER_RDMA_DEVICES"],
            metadata=v["HPKV_CLUSTER_METADATA"],
            host=v["HPKV_CLUSTER_HOST"],
            segment_bytes=v["HPKV_CLUSTER_SEGMENT_SIZE"],
            buffer_bytes=v["HPKV_CLUSTER_BUFFER_SIZE"],
            replicas=v["HPKV_CLUSTER_REPLICAS"],
            timeout_s=v["HPKV_CLUSTER_TIMEOUT_S"],
        ),
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
        server_max_namespace_bytes=v["HPKV_SERVER_MAX_NAMESPACE_BYTES"],
        server_max_namespaces_per_uid=v["HPKV_SERVER_MAX_NAMESPACES_PER_UID"],
        server_max_namespaces=v["HPKV_SERVER_MAX_NAMESPACES"],
        server_max_user_slot_share=v["HPKV_SERVER_MAX_USER_SLOT_SHARE"],
        server_max_connections_per_uid=v["HPKV_SERVER_MAX_CONNECTIONS_PER_UID"],
        server_connection_idle_s=v["HPKV_SERVER_CONNECTION_IDLE_S"],
        config_file=v[CONFIG_FILE_KEY],
        settings=tuple(resolved),
        warnings=warnings,
    )
