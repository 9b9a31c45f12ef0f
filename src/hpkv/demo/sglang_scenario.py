"""The quick-start scenarios walked on a real SGLang: what `hpkv demo --engine sglang` runs.

1. Start SGLang as documented (`sglang serve --model-path MODEL --enable-ct-hpkv ...`, the
   HPKV_* variables; SGLang's CPU flags where there is no accelerator).
2. A long request, cold: computed; its pages reach HPKV after the response.
3. The same request: SGLang's own device-cache hit, the reference every hit is compared with.
4. POST /flush_cache (it empties SGLang's device and host caches), the same request: loaded
   from HPKV's DRAM pool.
5. Restart the engine (the auto-started HPKV server exits with it, emptying DRAM), the same
   request: loaded from HPKV's storage.
SGLang reports every HPKV hit as a `storage` hit (its L3); HPKV's per-namespace counters say
which of HPKV's tiers served it. The engine runs with `--hicache-storage-prefetch-policy
wait_complete`: SGLang's default `timeout` policy gives up on a load after about a second (plus
0.25 s per 1K tokens), which a busy CPU can exceed, and the walk would show a miss.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from ..server import protocol
from ..server.client import Client
from .progress import running
from .scenario import DemoConfig, Step, has_accelerator, wait_for_server_exit, walk
from .sglang_engine import SglangCompletion, SglangServer

WAIT_FLAGS = ("--hicache-storage-prefetch-policy", "wait_complete")


def run_sglang_demo(cfg: DemoConfig) -> list[Step]:
    steps: list[Step] = []
    with walk(cfg, "sglang") as w:
        with _engine(w.model, w.env, cfg) as engine:
            cold = engine.complete(w.prompt)
            steps.append(Step("cold request (computed)", "-", 0, cold.ttft_s * 1e3, "-"))
            _wait_stored(engine, cold)
            files = _wait_files(w.storage)
            steps.append(Step(f"{files} KV files written under {w.storage}", "storage", 0, 0.0, "-", files))
            reference = engine.complete(w.prompt)
            steps.append(
                Step(
                    "same request: SGLang's own device cache",
                    "device",
                    int(reference.cached.get("device", 0)),
                    reference.ttft_s * 1e3,
                    "reference",
                )
            )
            engine.flush_cache()
            steps.append(_hit_step("POST /flush_cache, same request", "dram", engine, w.pool_dir, w.prompt, reference))
        wait_for_server_exit(w.pool_dir)
        with _engine(w.model, w.env, cfg, "restarting SGLang") as engine:
            steps.append(
                _hit_step("engine restarted, same request", "storage", engine, w.pool_dir, w.prompt, reference)
            )
    return steps


def _engine(
    model: str, env: dict[str, str], cfg: DemoConfig, what: str = "starting SGLang"
) -> contextlib.AbstractContextManager[SglangServer]:
    cpu = not has_accelerator()
    cfg.log(
        f"{what} (sglang serve --model-path MODEL --enable-ct-hpkv ..."
        + (" --device cpu --attention-backend torch_native ..." if cpu else "")
        + ")"
    )
    server = SglangServer(
        model, env, launcher="serve", cpu=cpu, extra_flags=WAIT_FLAGS, log_path=cfg.workdir / "sglang.log"
    )
    return running(server, what, cfg.log, cfg.console)


def _wait_stored(engine: SglangServer, cold: SglangCompletion, timeout_s: float = 60.0) -> None:
    """Pages reach HPKV after the response: wait for SGLang's count of tokens written to it."""
    deadline = time.monotonic() + timeout_s
    while engine.backed_up_tokens() < cold.prompt_tokens // engine.page_size * engine.page_size:
        if time.monotonic() > deadline:
            raise RuntimeError("SGLang did not write the cold request's pages to HPKV in time")
        time.sleep(0.2)


def _wait_files(storage: Path, timeout_s: float = 60.0) -> int:
    """The entry files under `storage` once there are some: the server writes them through after
    the pages reach its DRAM pool."""
    deadline = time.monotonic() + timeout_s
    while not (files := sum(1 for _ in storage.rglob("*.kv"))) and time.monotonic() < deadline:
        time.sleep(0.2)
    return files


def _tier_hits(pool_dir: Path) -> dict[str, int]:
    """HPKV's hit counters for SGLang's namespaces, read from the running server."""
    with Client(pool_dir, kind="demo", autostart=False) as client:
        stats = client.stats()
    out = {"dram": 0, "storage": 0}
    for ns in stats.namespaces.values():
        if json.loads(ns.desc).get("engine") == "sglang":
            out["dram"] += ns.hit_keys_dram
            out["storage"] += ns.hit_keys_storage
    return out


def _hit_step(
    name: str, tier: str, engine: SglangServer, pool_dir: Path, prompt: str, reference: SglangCompletion
) -> Step:
    before = _tier_hits(pool_dir) if (pool_dir / protocol.SOCKET_NAME).exists() else {"dram": 0, "storage": 0}
    completion = engine.complete(prompt)
    after = _tier_hits(pool_dir)
    pages = after[tier] - before[tier]
    loaded = int(completion.cached.get("storage", 0))
    same = completion.token_ids == reference.token_ids and completion.logprobs == reference.logprobs
    label = {"dram": "DRAM", "storage": "storage"}[tier]
    return Step(
        name,
        label if loaded and pages else f"{label}: none",
        loaded if pages else 0,
        completion.ttft_s * 1e3,
        "yes" if same else "no",
    )
