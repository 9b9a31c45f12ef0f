"""The quick-start scenarios, walked on a real vLLM: what `hpkv demo` runs.

1. Start vLLM as documented (VLLM_ENABLE_HPKV=1, the HPKV_* variables, HpkvConnectorV1).
2. A long request, cold: computed, and its KV saved; KV files appear under HPKV_KV_STORAGE_PATH.
3. The same request: vLLM's own prefix-cache hit, the reference every hit is compared with.
4. POST /reset_prefix_cache, the same request: loaded from HPKV's DRAM pool ("memory hit").
5. Restart the engine (the auto-started HPKV server exits with it, emptying DRAM), the same
   request: loaded from storage ("storage hit").
After each start, before any of these, a request of another prompt takes the engine's own
first-request costs (a new vLLM's first forward passes take seconds, whatever they compute, with
or without HPKV), as an operator's health check would; its row shows them. HPKV's own start-up
(server, pool, connections, registration) is done while the engine starts, so the first hit
pays for nothing a later one does not.
Each step reports the tier that supplied the prefix, how many tokens, the time to first token and
whether the output (token ids and logprobs) is identical to vLLM's own prefix-cache hit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..configkeys import KEYS_BY_NAME
from ..server import protocol
from .engine import Completion, VllmServer
from .model import build_model, prompt_text
from .progress import running


@dataclass
class Step:
    name: str
    tier: str
    hit_tokens: int
    ttft_ms: float
    identical: str  # "yes", "no", or "reference" / "-"
    num_files: int | None = None  # the KV-files step: files found (no hit tokens)


@dataclass
class DemoConfig:
    workdir: Path
    model: str | None = None  # None: build the tiny random model (CPU demo)
    prompt_words: int = 2000
    pool_size: str = "1g"
    log: Callable[[str], None] = print
    console: Any = None  # a rich Console: a spinner while vLLM starts, where it is a terminal


def has_accelerator() -> bool:
    try:
        import torch

        npu = getattr(torch, "npu", None)  # Ascend's torch_npu adds it
        return torch.cuda.is_available() or bool(npu and npu.is_available())
    except Exception:
        return False


def documented_env(pool_size: str, pool_dir: Path, storage: Path, workdir: Path) -> dict[str, str]:
    """The documented exports (pool size scaled to the machine), isolated from user config."""
    return {
        "VLLM_ENABLE_HPKV": "1",
        "HPKV_KV_MEM_POOL_SIZE": pool_size,
        "HPKV_SHARE_MEM_FILE_PATH": str(pool_dir),
        "HPKV_KV_STORAGE_PATH": str(storage),
        "HPKV_CONFIG_FILE_PATH": str(workdir / "no-config.ini"),
    }


@dataclass
class Walk:
    """What a walk runs on: the model, a fresh storage directory, a pool directory of its own,
    the documented exports and the prompt."""

    model: str
    storage: Path
    pool_dir: Path
    env: dict[str, str]
    prompt: str


# The one HPKV setting of the shell a walk keeps: it changes what the engines log, not the walk.
KEPT_FROM_SHELL = ("HPKV_LOG_LEVEL",)


@contextlib.contextmanager
def shell_settings_aside(log: Callable[[str], None]) -> Iterator[dict[str, str]]:
    """This process's HPKV settings (what a user following the quick start exported: a tuned
    threshold, storage turned off, a config file) taken out of its environment until the block
    ends, each logged: the engines a walk starts inherit that environment, and the walk is the
    documented set-up. Yields what was set aside."""
    aside = {k: os.environ.pop(k) for k in list(os.environ) if k in KEYS_BY_NAME and k not in KEPT_FROM_SHELL}
    for key, value in aside.items():
        log(f"  ignoring {key}={value} from the environment: the demo runs with the exports below only")
    try:
        yield aside
    finally:
        os.environ.update(aside)


@contextlib.contextmanager
def walk(cfg: DemoConfig, engine: str) -> Iterator[Walk]:
    """A walk's set-up for `engine` ("vllm": with VLLM_ENABLE_HPKV=1; otherwise the HPKV_*
    exports only), each export logged, the shell's own HPKV settings set aside; its pool
    directory is removed afterwards."""
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    model = cfg.model or str(build_model(cfg.workdir / "tiny-qwen2"))
    storage = cfg.workdir / "storage"
    shutil.rmtree(storage, ignore_errors=True)
    pool_dir = Path(tempfile.mkdtemp(prefix="hpkv-demo-", dir="/dev/shm"))
    try:
        with shell_settings_aside(cfg.log):
            env = documented_env(cfg.pool_size, pool_dir, storage, cfg.workdir)
            if engine != "vllm":
                env = {k: v for k, v in env.items() if k.startswith("HPKV_")}
            for key, value in env.items():
                cfg.log(f"  export {key}={value}")
            yield Walk(model, storage, pool_dir, env, prompt_text(cfg.prompt_words, seed=2024))
    finally:
        shutil.rmtree(pool_dir, ignore_errors=True)


WARM_UP_WORDS = 200  # under the token threshold: the warm-up loads nothing


def warm_up(engine: VllmServer, name: str, seed: int) -> Step:
    """The engine's first request, of a prompt of its own (no prefix shared with the walk's)."""
    completion = engine.complete(prompt_text(WARM_UP_WORDS, seed=seed))
    return Step(name, "-", 0, completion.ttft_s * 1e3, "-")


def written_files(storage: Path, quiet_s: float = 0.5, timeout_s: float = 10.0) -> int:
    """The KV files under `storage` once the write-through, which runs behind the requests, has
    written none for `quiet_s` (or after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    count, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now = sum(1 for _ in storage.rglob("*.kv"))
        if now != count:
            count, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
        time.sleep(0.1)
    return count


def run_demo(cfg: DemoConfig) -> list[Step]:
    steps: list[Step] = []
    with walk(cfg, "vllm") as w:
        with _engine(w.model, w.env, cfg) as engine:
            steps.append(warm_up(engine, "warm-up: another prompt, the engine's first request", seed=1))
            cold = _measure(engine, w.prompt)
            steps.append(Step("cold request (computed)", "-", 0, cold[0].ttft_s * 1e3, "-"))
            files = written_files(w.storage)
            steps.append(Step(f"{files} KV files written under {w.storage}", "storage", 0, 0.0, "-", files))
            reference = _measure(engine, w.prompt)
            steps.append(
                Step(
                    "same request: vLLM's own prefix cache",
                    "device",
                    int(reference[1].get("device", 0)),
                    reference[0].ttft_s * 1e3,
                    "reference",
                )
            )
            engine.reset_prefix_cache()
            dram = _measure(engine, w.prompt)
            steps.append(_hit_step("POST /reset_prefix_cache, same request", "host", dram, reference[0]))
        wait_for_server_exit(w.pool_dir)
        with _engine(w.model, w.env, cfg, "restarting vLLM") as engine:
            steps.append(warm_up(engine, "engine restarted, warm-up: another prompt", seed=2))  # computed, no hit
            disk = _measure(engine, w.prompt)
            steps.append(_hit_step("engine restarted, same request", "disk", disk, reference[0]))
    return steps


def _engine(
    model: str, env: dict[str, str], cfg: DemoConfig, what: str = "starting vLLM"
) -> contextlib.AbstractContextManager[VllmServer]:
    cfg.log(
        f"{what} (python -m vllm.entrypoints.openai.api_server ... --kv-transfer-config "
        '\'{"kv_connector":"HpkvConnectorV1", "kv_role":"kv_both"}\')'
    )
    server = VllmServer(model, env, log_path=cfg.workdir / "vllm.log")
    return running(server, what, cfg.log, cfg.console)


def _measure(engine: VllmServer, prompt: str) -> tuple[Completion, dict[str, float]]:
    before = engine.cached_tokens_by_source()
    completion = engine.complete(prompt)
    after = engine.cached_tokens_by_source()
    return completion, {k: after.get(k, 0) - before.get(k, 0) for k in after}


def _hit_step(name: str, tier: str, measured: tuple[Completion, dict[str, float]], reference: Completion) -> Step:
    completion, hits = measured
    same = completion.token_ids == reference.token_ids and completion.logprobs == reference.logprobs
    label = {"host": "DRAM", "disk": "storage"}[tier]
    return Step(
        name,
        label if hits.get(tier, 0) else f"{label}: none",
        int(hits.get(tier, 0)),
        completion.ttft_s * 1e3,
        "yes" if same else "no",
    )


def wait_for_server_exit(pool_dir: Path, timeout_s: float = 120.0) -> None:
    """An auto-started server exits HPKV_SERVER_IDLE_EXIT_S after its last client, removing its
    socket; until then DRAM is still warm. Only the socket file is watched: connecting to the
    server to ask would make it a client and keep it alive."""
    path = pool_dir / protocol.SOCKET_NAME
    deadline = time.monotonic() + timeout_s
    while path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the HPKV server on {path} did not exit after the engine stopped")
        time.sleep(0.5)


def passed(steps: list[Step]) -> bool:
    hits = [s for s in steps if s.identical in ("yes", "no")]
    files = any(s.num_files for s in steps)
    return bool(hits) and all(s.identical == "yes" and s.hit_tokens > 0 for s in hits) and files
