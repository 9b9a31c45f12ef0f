"""The two nodes of an engine test over a shared network file system (`bench.harness.netfs`):
each node's pool directory in /dev/shm, its HPKV server (its own host name) and the documented
variables for an engine on it, storage in `kv/` of the node's mount of one directory. Knows
nothing of the engine: the test starts its engines from `NetfsNode.env` and stops them before
this context ends (servers, pool directories and the work directory go then)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from bench.harness.netfs import NodeServer
from helpers.env import without_hpkv


@dataclass(frozen=True)
class NetfsNode:
    name: str  # "a" or "b"
    pool: Path  # HPKV_SHARE_MEM_FILE_PATH, where the node's server has its socket
    env: dict[str, str]  # the HPKV variables of an engine on this node


@contextlib.contextmanager
def netfs_nodes(bed, prefix: str, extra_env: Mapping[str, str] | None = None) -> Iterator[tuple[list[NetfsNode], Path]]:
    """Nodes a and b on `bed`'s two mounts, each with its HPKV server up, and a work directory
    named `prefix...` for logs: ([a, b], work)."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    (bed.mount_a / "kv").mkdir()
    servers: list[NodeServer] = []
    pools: list[Path] = []
    nodes: list[NetfsNode] = []
    try:
        for name, mount in (("a", bed.mount_a), ("b", bed.mount_b)):
            pools.append(Path(tempfile.mkdtemp(prefix=f"hpkv-node{name}-", dir="/dev/shm")))
            env = {
                **(extra_env or {}),
                "HPKV_KV_MEM_POOL_SIZE": "256m",
                "HPKV_SHARE_MEM_FILE_PATH": str(pools[-1]),
                "HPKV_KV_STORAGE_PATH": str(mount / "kv"),
                "HPKV_CONFIG_FILE_PATH": str(work / "no-config.ini"),
            }
            servers.append(NodeServer(f"node{name}", {**without_hpkv(), **env}, work / f"server-{name}.log"))
            nodes.append(NetfsNode(name, pools[-1], env))
        yield nodes, work
    finally:
        for server in servers:
            server.stop()
        for path in (*pools, work):
            shutil.rmtree(path, ignore_errors=True)
