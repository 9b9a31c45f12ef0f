"""One node of a module's vLLM engine tests: a pool directory in /dev/shm, a storage tree and
logs under the module's temporary directory, the documented variables pointing at them, the stop
that leaves no HPKV server behind, and HPKV's restart under a running engine (in place of the
engine's own, which costs an engine start). Knows nothing of the model or the scenarios."""

from __future__ import annotations

import contextlib
import itertools
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from helpers.engines import stop_all
from helpers.processes import wait_gone
from helpers.server import kill_server, server_pid
from helpers.vllm import Engine, without_hpkv_environ
from helpers.waiting import wait_for
from hpkv.demo.model import prompt_text


@dataclass(frozen=True)
class EngineNode:
    root: Path
    shm: Path
    storage: Path
    logs: Path
    extra_env: Mapping[str, str] = field(default_factory=dict)

    @property
    def load_fault(self) -> Path:
        """Touch it and the next HPKV load of an engine started `with_load_fault` fails."""
        return self.root / "fail-next-load"

    @property
    def no_config(self) -> dict[str, str]:
        """For an engine without HPKV: no config file of the machine's is read."""
        return {"HPKV_CONFIG_FILE_PATH": str(self.root / "no-config.ini")}

    def env(self) -> dict[str, str]:
        return {
            "VLLM_ENABLE_HPKV": "1",
            "HPKV_KV_MEM_POOL_SIZE": "256m",
            "HPKV_SHARE_MEM_FILE_PATH": str(self.shm),
            "HPKV_KV_STORAGE_PATH": str(self.storage),
            "HPKV_SERVER_IDLE_EXIT_S": "2",
            **self.no_config,
            **self.extra_env,
        }


@contextlib.contextmanager
def engine_node(
    root: Path, prefix: str, extra_env: Mapping[str, str] | None = None, storage: Path | None = None
) -> Iterator[EngineNode]:
    """A node under `root`, its pool directory named `prefix...`, its storage `storage` (by
    default `root/storage`); the pool directory is removed with its server after."""
    shm = Path(tempfile.mkdtemp(prefix=prefix, dir="/dev/shm"))
    node = EngineNode(root, shm, storage or root / "storage", root / "logs", dict(extra_env or {}))
    for path in (node.storage, node.logs):
        path.mkdir(parents=True)
    try:
        with without_hpkv_environ():
            yield node
    finally:
        kill_server(server_pid(shm))
        shutil.rmtree(shm, ignore_errors=True)


def stop_engines(*engines: Engine, shm: Path) -> None:
    """Stops the engines, then their HPKV server, and waits until it is gone."""
    pid = server_pid(shm)
    stop_all(engines)
    kill_server(pid)
    if pid is not None:
        wait_gone(pid, timeout_s=30)


def restart_server(engine: Engine, shm: Path, prompt_words: int = 1500) -> int:
    """HPKV restarted under a running engine: the node's server is killed (its DRAM pool goes with
    it), the engine's next calls auto-start the next one; once a fresh prompt of `prompt_words`
    is a DRAM hit from it (the scheduler's and the workers' clients are back), vLLM's own prefix
    cache is reset, so the engine's next hits of what it saved before come from storage. The new
    server's pid."""
    old = server_pid(shm)
    assert old is not None, "no HPKV server to restart"
    kill_server(old)
    wait_gone(old, timeout_s=30)
    seeds = itertools.count(9000)

    def back() -> int | None:
        prompt = prompt_text(prompt_words, seed=next(seeds))  # fresh: only the next server can hold it
        engine.complete(prompt)
        engine.reset_prefix_cache()
        before = engine.counters()
        engine.complete(prompt)
        pid = server_pid(shm)
        return pid if (engine.counters() - before)["host"] > 0 and pid not in (None, old) else None

    pid = wait_for(back, timeout_s=120, interval_s=0.5, what=f"{engine.name}: a DRAM hit from the next HPKV server")
    engine.reset_prefix_cache()
    return pid
