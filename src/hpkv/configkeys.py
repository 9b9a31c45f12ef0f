"""HPKV's settings keys: each key's name, default, accepted values and parser.

Owns the table `KEYS` (one `KeySpec` per key), each naming its parser from `configvalues`; a
parser's ValueError becomes, in `hpkv.config`, a ConfigError naming the key and the source.
Must not know the config file, the environment or resolution order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import configvalues as v

CONFIG_FILE_KEY = "HPKV_CONFIG_FILE_PATH"


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
        v.parse_path,
        "~/.config/hpkv/config.ini",
        "The config file (environment only).",
        "a file path",
        env_only=True,
    ),
    KeySpec(
        "HPKV_KV_STORAGE_PATH",
        "path",
        v.parse_path,
        "~/.cache/hpkv/storage",
        "Directory of the persistent storage tier.",
        "a directory path",
    ),
    KeySpec("HPKV_KV_MEM_POOL_SIZE", "size", v.parse_size, "8g", "Size of the shared-memory DRAM pool.", _SIZE_WORDS),
    # Per user: a directory name every uid shares could be made first by another user.
    KeySpec(
        "HPKV_SHARE_MEM_FILE_PATH",
        "path",
        v.parse_pool_dir,
        "/dev/shm/hpkv-<uid>",
        "Directory (ramfs/tmpfs) holding the pool file and server socket.",
        "a directory path on ramfs or tmpfs (<uid> stands for the reader's user id)",
    ),
    KeySpec(
        "VLLM_HPKV_TOKEN_THRESHOLD",
        "int",
        v.parse_threshold,
        "1204",
        "Minimum HPKV-hit tokens for a load; below it the engine recomputes.",
        "an integer >= 0 or 'auto'",
    ),
    KeySpec(
        "VLLM_ENABLE_HPKV", "bool", v.parse_bool, "false", "Enables HPKV in vLLM.", "1/0, true/false, yes/no or on/off"
    ),
    KeySpec(
        "HPKV_MODEL_ID",
        "word",
        v.parse_model_id,
        "",
        "The model's identity in HPKV's namespaces, in place of the fingerprint of its files: engines "
        "with the same value (and the same KV settings) share KV. Set it per engine, never for two models.",
        f"empty (fingerprint the model's files), or an identity of at most {v.MODEL_ID_MAX_CHARS} printable characters",
    ),
    KeySpec(
        "HPKV_KV_STORAGE_ENABLE",
        "bool",
        v.parse_bool,
        "true",
        "Offload KV cache to the storage tier.",
        "1/0, true/false, yes/no or on/off",
    ),
    KeySpec(
        "HPKV_KV_STORAGE_SIZE",
        "size",
        v.parse_size_or_auto,
        "auto",
        "Storage capacity; auto = 80% of the space available to the directory.",
        "'auto', or a size: " + _SIZE_WORDS,
    ),
    KeySpec(
        "HPKV_KV_STORAGE_FSYNC",
        "word",
        v.one_of("off", "data", "full"),
        "off",
        "Durability of storage writes (files are checksummed either way).",
        "off, data or full",
    ),
    KeySpec(
        "HPKV_KV_STORAGE_DIRECT_IO",
        "bool",
        v.parse_bool,
        "false",
        "Read and write KV files with O_DIRECT, bypassing the page cache (where the file system allows).",
        "1/0, true/false, yes/no or on/off",
    ),
    KeySpec(
        "HPKV_KV_STORAGE_WRITE_BUDGET",
        "size",
        v.parse_size_or_unlimited,
        "unlimited",
        "Bytes the storage tier may write per day (SSD wear); past it, new KV stays in DRAM only.",
        "'unlimited', or a size per day: " + _SIZE_WORDS,
    ),
    KeySpec(
        "HPKV_KV_STORAGE_RETENTION",
        "duration",
        v.parse_duration_or_off,
        "off",
        "Remove KV files unused for longer than this (by the server, oldest first); off keeps them "
        "until capacity evicts them.",
        "'off', or seconds, or a number with s, m, h or d (e.g. 12h, 30d)",
    ),
    KeySpec(
        "HPKV_CLUSTER_ENABLE",
        "bool",
        v.parse_bool,
        "false",
        "The cluster tier: a memory tier every node shares, on Mooncake Store, between the DRAM pool and storage.",
        "1/0, true/false, yes/no or on/off",
    ),
    KeySpec(
        "HPKV_CLUSTER_MASTER",
        "host",
        v.parse_host_port,
        "127.0.0.1:50051",
        "The mooncake_master's RPC address.",
        "host:port",
    ),
    KeySpec(
        "HPKV_CLUSTER_PROTOCOL",
        "word",
        v.one_of("tcp", "rdma"),
        "tcp",
        "How nodes move the cluster tier's bytes.",
        "tcp or rdma",
    ),
    KeySpec(
        "HPKV_CLUSTER_RDMA_DEVICES",
        "word",
        v.parse_optional_host,
        "",
        "For rdma: the RDMA devices to use (empty: Mooncake picks).",
        "empty, or device names separated by commas (e.g. mlx5_0,mlx5_1)",
    ),
    KeySpec(
        "HPKV_CLUSTER_METADATA",
        "word",
        v.parse_metadata,
        "P2PHANDSHAKE",
        "Where nodes find each other's segments: P2PHANDSHAKE, or a metadata server's URL.",
        "P2PHANDSHAKE, or an http:// URL",
    ),
    KeySpec(
        "HPKV_CLUSTER_HOST",
        "host",
        v.parse_optional_host,
        "",
        "The address other nodes reach this node's segment at (empty: this host name's address).",
        "empty, or a host name or IP address",
    ),
    KeySpec(
        "HPKV_CLUSTER_SEGMENT_SIZE",
        "size",
        v.parse_size,
        "4g",
        "Memory this node contributes to the cluster tier (0: none, a client only).",
        _SIZE_WORDS,
    ),
    KeySpec(
        "HPKV_CLUSTER_BUFFER_SIZE",
        "size",
        v.parse_size,
        "64m",
        "Mooncake's local staging buffer in each of HPKV's cluster clients.",
        _SIZE_WORDS,
    ),
    KeySpec(
        "HPKV_CLUSTER_REPLICAS",
        "int",
        v.int_in(1, 16),
        "1",
        "Copies of each object, in segments of different nodes.",
        "an integer from 1 to 16",
    ),
    KeySpec(
        "HPKV_CLUSTER_TIMEOUT_S",
        "float",
        v.parse_positive_seconds,
        "0.5",
        "Longest a lookup waits for the cluster tier; then its keys are misses.",
        "a number of seconds > 0 (e.g. 0.5)",
    ),
    KeySpec(
        "HPKV_KV_STORAGE_CLUSTER",
        "word",
        v.one_of("auto", "on", "off"),
        "auto",
        "Nodes sharing the storage directory split its parts among themselves (membership leases "
        "in <path>/cluster): each indexes and evicts only its own parts. auto: on for a network or "
        "parallel file system; off: every node indexes every file and walks the whole directory.",
        "auto, on or off",
    ),
    KeySpec(
        "HPKV_KV_STORAGE_LEASE",
        "duration",
        v.parse_positive_seconds,
        "30",
        "How long a node sharing the storage directory may go silent before the others take its "
        "parts (it renews its lease every third of this).",
        "seconds (e.g. 30)",
    ),
    KeySpec(
        "HPKV_POOL_PREFAULT",
        "bool",
        v.parse_bool,
        "true",
        "Engine processes map every pool page when they attach (page tables: 2 MiB per GiB).",
        "1/0, true/false, yes/no or on/off",
    ),
    KeySpec("HPKV_IO_THREADS", "int", v.int_in(1, 256), "8", "Storage I/O threads.", "an integer from 1 to 256"),
    KeySpec(
        "HPKV_WRITE_NICE",
        "int",
        v.int_in(0, 19),
        "10",
        "CPU niceness of the server's write-through processes (0: the server's own).",
        "an integer from 0 to 19",
    ),
    KeySpec(
        "HPKV_LOG_LEVEL",
        "word",
        v.one_of("debug", "info", "warning", "error"),
        "info",
        "Log level.",
        "debug, info, warning or error",
    ),
    KeySpec(
        "HPKV_METRICS_PORT",
        "int",
        v.int_in(0, 65535),
        "0",
        "Metrics HTTP port; 0 turns metrics off.",
        "an integer from 0 to 65535",
    ),
    KeySpec(
        "HPKV_METRICS_HOST",
        "host",
        v.parse_host,
        "127.0.0.1",
        "Address the metrics endpoint listens on.",
        "a host name or IP address",
    ),
    KeySpec(
        "HPKV_SERVER_IDLE_EXIT_S",
        "float",
        v.parse_seconds,
        "10",
        "Seconds an auto-started server lingers after its last client leaves.",
        "a number of seconds >= 0 (e.g. 10, 2.5)",
    ),
    KeySpec(
        "HPKV_SERVER_FRAME_TIMEOUT_S",
        "float",
        v.parse_positive_seconds,
        "30",
        "Seconds a client may take to finish a message it started, or to read a reply, before the "
        "server closes its connection and releases what it held.",
        "a number of seconds > 0 (e.g. 30, 2.5)",
    ),
    KeySpec(
        "HPKV_SERVER_SLOT_TIMEOUT_S",
        "float",
        v.parse_positive_seconds,
        "300",
        "Seconds a client may keep a pool slot reserved or leased; then the server takes it back (reused "
        "after a 30 s quarantine) and that save or load is a miss.",
        "a number of seconds > 0 (e.g. 300, 60)",
    ),
    KeySpec(
        "HPKV_SERVER_MAX_SLOT_SHARE",
        "float",
        v.parse_share,
        "0.75",
        "Share of the pool one client process (all its connections) may hold reserved or leased at once; "
        "keys past it are not saved or loaded (a miss), so one client cannot take every slot.",
        "a number > 0 and <= 1 (e.g. 0.75; 1: no cap)",
    ),
    KeySpec(
        "HPKV_SERVER_MAX_USER_SLOT_SHARE",
        "float",
        v.parse_share,
        "0.75",
        "Share of the pool all the clients of one user (uid) may hold reserved or leased at once; keys "
        "past it are a miss, so one user cannot take every slot, however many processes it runs.",
        "a number > 0 and <= 1 (e.g. 0.75; 1: no cap)",
    ),
    KeySpec(
        "HPKV_SERVER_MAX_CONNECTIONS_PER_UID",
        "int",
        v.int_in(1, 65536),
        "256",
        "Connections one user (uid) may hold open to the server at once; more are refused.",
        "an integer from 1 to 65536",
    ),
    KeySpec(
        "HPKV_SERVER_CONNECTION_IDLE_S",
        "float",
        v.parse_positive_seconds,
        "600",
        "Seconds a connection that holds no slot may stay silent before the server closes it (a "
        "client reconnects on its next request, which is not lost).",
        "a number of seconds > 0 (e.g. 600, 60)",
    ),
    KeySpec(
        "HPKV_SERVER_ALLOW_UIDS",
        "word",
        v.parse_uids,
        "",
        "Other user ids that share this node's pool: the server lets them reach its socket and accepts "
        "them as clients (its own uid always), and engines trust a server run by one of them (their own "
        "uid and root always).",
        "a comma-separated list of user ids (ASCII digits, each below 4294967295), or empty",
    ),
    KeySpec(
        "HPKV_SERVER_MAX_NAMESPACE_BYTES",
        "size",
        v.parse_size,
        "64k",
        "Largest namespace description (JSON) the server registers (at most 1m); a larger one is refused.",
        _SIZE_WORDS,
    ),
    KeySpec(
        "HPKV_SERVER_MAX_NAMESPACES_PER_UID",
        "int",
        v.int_in(1, None),
        "1024",
        "Namespaces one user id's connections may hold registered at once; past it a new one is refused.",
        "an integer >= 1",
    ),
    KeySpec(
        "HPKV_SERVER_MAX_NAMESPACES",
        "int",
        v.int_in(1, None),
        "4096",
        "Namespaces the server holds at once (registered, or with entries in DRAM); past it a new one is refused.",
        "an integer >= 1",
    ),
)
KEYS_BY_NAME = {spec.name: spec for spec in KEYS}
