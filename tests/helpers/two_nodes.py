"""Two nodes for the engine tests across nodes: node a's and node b's pool directories in /dev/shm,
where the engine on each node finds its HPKV server, and the two servers, started per scenario
(`TwoNodes.serve`) with that scenario's storage and cluster settings, each in its own UTS
namespace (its own host name). One pair of engines serves every scenario of a module: each
scenario sends prompts of its own, and its servers are managed (`INVOCATION_ID`, as under
systemd), so no engine auto-starts a server of its own settings while the next ones start; an
engine idle across the change sends its next call to the new server (what an operator's restart
of a node's server does to its engines).

Owns: the work directory, the pool directories, the servers and their segment processes.
Primitives: `two_nodes` -> `TwoNodes.engine_env`, `TwoNodes.serve`.
Must not know: the engine, the file system or cluster a scenario uses.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from bench.harness.netfs import NodeServer
from helpers.env import without_hpkv
from helpers.server import server_stats
from hpkv.cluster import segment

NAMES = ("a", "b")


@dataclass(frozen=True)
class TwoNodes:
    work: Path  # logs, and whatever a scenario keeps beside its nodes
    pools: tuple[Path, Path]  # HPKV_SHARE_MEM_FILE_PATH of node a and node b

    def engine_env(self, node: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The documented variables of an engine on `node` (0: a, 1: b): where its server is."""
        return {
            **(extra or {}),
            "HPKV_KV_MEM_POOL_SIZE": "256m",
            "HPKV_SHARE_MEM_FILE_PATH": str(self.pools[node]),
            "HPKV_CONFIG_FILE_PATH": str(self.work / "no-config.ini"),
        }

    @contextlib.contextmanager
    def serve(self, scenario: str, settings: tuple[Mapping[str, str], Mapping[str, str]]) -> Iterator[None]:
        """Node a's and node b's servers with `settings` (each node's HPKV variables: storage,
        cluster) for the block, logs named after `scenario`; stopped after, with the segment
        processes a cluster tier started."""
        servers: list[NodeServer] = []
        try:
            for node, name in enumerate(NAMES):
                assert server_stats(self.pools[node]) is None, f"node {name}'s server of another scenario still serves"
                env = {**without_hpkv(), **self.engine_env(node), **settings[node], "INVOCATION_ID": scenario}
                servers.append(NodeServer(f"node{name}", env, self.work / f"server-{scenario}-{name}.log"))
            yield
        finally:
            for server in servers:
                server.stop()
            for pool in self.pools:
                segment.stop(pool)


@contextlib.contextmanager
def two_nodes(prefix: str) -> Iterator[TwoNodes]:
    """Two nodes with no server yet, and a work directory named `prefix...`; removed after (stop
    the engines first)."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    pools = tuple(Path(tempfile.mkdtemp(prefix=f"{prefix}{name}-", dir="/dev/shm")) for name in NAMES)
    try:
        yield TwoNodes(work, (pools[0], pools[1]))
    finally:
        for path in (*pools, work):
            shutil.rmtree(path, ignore_errors=True)
