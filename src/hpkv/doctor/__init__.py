"""`hpkv doctor`: checks of this node's setup, each with a verdict and, for a problem, a fix.

Primitives: `run_checks(env)`, and the vocabulary of `check` (`Check`, `Verdict`, `ServerProbe`).
Each check is a small function of the settings (and of what the running server says, when one
answers); none changes anything on the machine. A `fail` means HPKV cannot work as configured; a
`warn` means it works, worse than it could; `info` is something to know. The checks are grouped
by what they look at: `pool`, `storage`, `cluster`, `engines`, and the server itself (`check`).
Must not know: how checks are shown (the CLI renders them).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..config import Settings, load_settings
from ..errors import ConfigError
from .check import Check, ServerProbe, Verdict, check_server, probe_server
from .cluster import check_cluster
from .engines import COLD_LOOKUP_KEYS, check_hash_seed, check_namespaces
from .pool import (
    check_memlock,
    check_pool_fs,
    check_pool_pages,
    check_pool_permissions,
    check_pool_sharing,
    check_pool_space,
    check_socket_path,
)
from .storage import (
    BACKLOG_WARN_SHARE,
    NETWORK_FS,
    PARALLEL_FS,
    check_storage,
    check_storage_direct_io,
    check_storage_fs,
    check_storage_in_use,
    check_storage_permissions,
    check_storage_space,
    check_storage_writers,
    check_write_backlog,
)

__all__ = [
    "BACKLOG_WARN_SHARE",
    "COLD_LOOKUP_KEYS",
    "NETWORK_FS",
    "PARALLEL_FS",
    "Check",
    "ServerProbe",
    "Verdict",
    "check_cluster",
    "check_config",
    "check_hash_seed",
    "check_memlock",
    "check_namespaces",
    "check_pool_fs",
    "check_pool_pages",
    "check_pool_permissions",
    "check_pool_sharing",
    "check_pool_space",
    "check_server",
    "check_socket_path",
    "check_storage",
    "check_storage_direct_io",
    "check_storage_fs",
    "check_storage_in_use",
    "check_storage_permissions",
    "check_storage_space",
    "check_storage_writers",
    "check_write_backlog",
    "probe_server",
    "run_checks",
]


def run_checks(env: Mapping[str, str] | None = None) -> list[Check]:
    env = os.environ if env is None else env
    try:
        settings = load_settings(env)
    except ConfigError as exc:
        return [
            Check(
                "config",
                Verdict.FAIL,
                str(exc),
                "correct that key (see `hpkv config` and docs/configuration.md), then run hpkv doctor again",
            )
        ]
    server = probe_server(settings.pool.dir, settings.server_allow_uids)
    checks = check_config(settings)
    checks += [
        check_pool_fs(settings.pool),
        check_pool_pages(settings.pool),
        check_pool_permissions(settings.pool, settings.server_allow_uids),
        check_socket_path(settings.pool),
        check_pool_space(settings.pool),
        check_memlock(settings.pool, server),
    ]
    if settings.server_allow_uids:
        checks.append(check_pool_sharing(settings.pool, settings.server_allow_uids))
    checks += check_storage(settings.storage, server, settings.pool)
    checks += check_cluster(settings, server)
    checks += [check_server(server), check_hash_seed(env)]
    if server.stats is not None:
        checks.append(check_namespaces(server.stats))
    return checks


def check_config(settings: Settings) -> list[Check]:
    if not settings.warnings:
        source = settings.config_file if settings.config_file.exists() else "none found"
        return [Check("config", Verdict.OK, f"settings resolve without warnings (config file: {source})")]
    return [
        Check("config", Verdict.WARN, warning, "see `hpkv config` for every key and its source")
        for warning in settings.warnings
    ]
