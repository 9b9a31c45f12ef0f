"""Real vLLM engines for the end-to-end tests: engines with their counters, the tiny model and
its prompts, and the oracle (a hit must give exactly what vLLM's own hit gives).

An `Engine` is the demo's `VllmServer` (started exactly as the documentation says) plus what a
test needs to read a story off it: how many tokens each request took from each cache tier, once
vLLM's metrics have caught up with the requests sent.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from bench.harness.shim import after_import, install
from helpers.env import HPKV_ENV_PREFIXES
from helpers.server import kill_server, server_pid
from helpers.waiting import wait_for
from hpkv.demo.engine import Completion, VllmServer

BLOCK_SIZE = 32
# The engine tests' tiny random Qwen2, kept between runs: vLLM caches its compile by model path.
MODEL_DIR = Path(tempfile.gettempdir()) / f"hpkv-e2e-model-{os.getuid()}"
# A tiny random Gemma 3 text model (sliding window of 128 tokens on every other layer): with vLLM's
# hybrid KV cache manager on, a sliding-window group beside a full-attention one.
GEMMA3_DIR = Path(tempfile.gettempdir()) / f"hpkv-e2e-gemma3-{os.getuid()}"
GEMMA3_WINDOW = 128
# A tiny random Qwen3-Next (three Gated DeltaNet layers, one full attention): Mamba-state groups.
QWEN3_NEXT_DIR = Path(tempfile.gettempdir()) / f"hpkv-e2e-qwen3next-{os.getuid()}"
_COUNTER_PREFIX = {
    "source": "vllm:prompt_tokens_cached_by_source_total{",
    "hpkv": "vllm:hpkv_",
    "finished": "vllm:request_success_total{",
}
_LOCAL_HITS = "vllm:prefix_cache_hits_total"


@functools.cache
def _has_sources() -> bool:
    try:
        import vllm
    except ImportError:
        return True
    from hpkv.integrations.versions import parse

    return (parse(vllm.__version__) or (0, 32)) >= (0, 32)


def prompt(num_words: int, seed: int) -> str:
    """A prompt of about `num_words` tokens, the same for the same seed."""
    from hpkv.demo.model import prompt_text

    return prompt_text(num_words, seed)


def reseed(model: Path, seed: int) -> None:
    """Other weights in place: every tensor drawn again (same scale) from another seed; same names,
    shapes, dtypes and file size (another training run)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = model / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    new = {}
    for name, tensor in tensors.items():
        scale = tensor.float().std().item() if tensor.numel() > 1 else 1.0
        new[name] = (torch.randn(tensor.shape, generator=generator) * (scale or 1.0)).to(tensor.dtype)
    save_file(new, path, metadata={"format": "pt"})


def retune_rows(model: Path, token_ids: list[int], seed: int) -> None:
    """A partial fine-tune in place: the embedding rows of `token_ids` drawn again (same scale),
    every other byte of the model as it was (tokens added or retuned)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = model / "model.safetensors"
    tensors = load_file(path)
    embed = tensors["model.embed_tokens.weight"]
    rows = torch.tensor(sorted(set(token_ids)))
    generator = torch.Generator().manual_seed(seed)
    new = torch.randn((len(rows), embed.shape[1]), generator=generator) * embed.float().std().item()
    embed[rows] = new.to(embed.dtype)
    save_file(tensors, path, metadata={"format": "pt"})


def build_gemma3(path: Path = GEMMA3_DIR) -> Path:
    """The tiny random Gemma 3 (`bench.harness.hybrid_model`), window GEMMA3_WINDOW."""
    from bench.harness.hybrid_model import TINY
    from bench.harness.hybrid_model import build_gemma3 as build

    assert TINY.window == GEMMA3_WINDOW
    return build(path, TINY)


def build_qwen3_next(path: Path = QWEN3_NEXT_DIR) -> Path:
    """The tiny random Qwen3-Next (`bench.harness.hybrid_model.TINY_NEXT`)."""
    from bench.harness.hybrid_model import build_qwen3_next as build

    return build(path)


def kv_cache_tokens(engine: Engine) -> int:
    """The KV cache size vLLM reports at start ("KV cache size: N tokens"), the last if several."""
    import re

    sizes = re.findall(r"KV cache size: ([\d,]+) tokens", engine.log_text())
    assert sizes, f"engine {engine.name} logged no KV cache size"
    return int(sizes[-1].replace(",", ""))


def same_output(a: Completion, b: Completion) -> bool:
    """The oracle: identical token ids and bit-identical logprobs."""
    return a.token_ids == b.token_ids and a.logprobs == b.logprobs and len(a.logprobs) > 0


# -- engines --------------------------------------------------------------------------------


@dataclass
class Counters:
    """Cumulative prompt tokens by cache source ('device', 'host', 'disk') and HPKV counters
    ('skipped_tokens', 'hit_tokens_dram', ...) of one engine."""

    values: dict[str, float]

    def __getitem__(self, name: str) -> float:
        return self.values.get(name, 0.0)

    def __sub__(self, other: Counters) -> Counters:
        names = set(self.values) | set(other.values)
        return Counters({n: self[n] - other[n] for n in names})


class Engine:
    def __init__(self, name: str, model: Path, env: dict[str, str], log_dir: Path, **options) -> None:
        self.name = name
        self.log_path = log_dir / f"vllm-{name}.log"
        self.server = VllmServer(str(model), env, log_path=self.log_path, **options)
        self._lock = threading.Lock()
        self._num_requests = 0
        self._references: dict[object, Completion] = {}

    def start(self) -> Engine:
        try:
            self.server.start(timeout_s=600)
        except Exception as exc:
            raise RuntimeError(f"engine {self.name}: {exc}\n{self.log_tail()}") from None
        return self

    def stop(self) -> None:
        # The whole process group, the engine core's too (it may outlive an API server that died
        # at start); a SIGKILL here would take Python's resource tracker with it and leave vLLM's
        # shared-memory queues in /dev/shm.
        self.server.stop()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, num_lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-num_lines:])

    # -- requests ---------------------------------------------------------------------------

    def complete(self, prompt: str | list[int], max_tokens: int = 16, **extra) -> Completion:
        with self._lock:
            self._num_requests += 1
        return self.server.complete(prompt, max_tokens, **extra)

    def reference(self, prompt: str | list[int], max_tokens: int = 16) -> Completion:
        """vLLM's own prefix-cache hit: the prompt sent twice, the second answer (memoized). Take
        it on an engine without HPKV: on one with HPKV, a second send after a load reuses the
        loaded blocks, so a bad load would agree with itself."""
        key = (prompt if isinstance(prompt, str) else tuple(prompt), max_tokens)
        if key not in self._references:
            self.complete(prompt, max_tokens)
            self._references[key] = self.complete(prompt, max_tokens)
        return self._references[key]

    def tokenize(self, text: str) -> list[int]:
        return self.server.post("/tokenize", {"model": self.server.served_name, "prompt": text})["tokens"]

    def reset_prefix_cache(self, external: bool = False) -> None:
        # vLLM refuses while blocks of finishing requests are still held: try again briefly.
        wait_for(
            lambda: self.server.reset_prefix_cache(external),
            timeout_s=30,
            interval_s=0.1,
            what=f"{self.name}: /reset_prefix_cache (reset_external={external}) to succeed",
        )

    # -- counters ---------------------------------------------------------------------------

    def counters(self) -> Counters:
        """The counters once vLLM's metrics include every request sent so far (the stats of a
        request reach /metrics a little after its last token reaches the client)."""
        with self._lock:
            expected = self._num_requests
        snapshot: dict[str, float] = {}

        def caught_up() -> bool:
            snapshot.clear()
            snapshot.update(self._read_counters())
            return snapshot["finished"] >= expected

        wait_for(caught_up, timeout_s=60, interval_s=0.1, what=f"{self.name}: metrics of {expected} requests")
        return Counters(dict(snapshot))

    def _read_counters(self) -> dict[str, float]:
        out = {"finished": 0.0}
        for name, value in self.server.metrics().items():
            if name.startswith(_COUNTER_PREFIX["source"]):
                source = name.split('source="')[1].split('"')[0]
                out[source] = out.get(source, 0.0) + value
            elif name.startswith(_COUNTER_PREFIX["hpkv"]):
                counter = name[len(_COUNTER_PREFIX["hpkv"]) :].split("{")[0].removesuffix("_total")
                out[counter] = out.get(counter, 0.0) + value
            elif name.startswith(_COUNTER_PREFIX["finished"]):
                out["finished"] += value
            elif name.startswith(_LOCAL_HITS):
                out["local_hits"] = out.get("local_hits", 0.0) + value
        if not _has_sources():
            # vLLM before 0.32 has no hit-by-source series: the same counts from vLLM's own
            # prefix-cache hits and HPKV's connector counters.
            out["device"] = out.get("local_hits", 0.0)
            out["host"] = out.get("hit_tokens_dram", 0.0)
            out["disk"] = out.get("hit_tokens_storage", 0.0)
        return out


def start_all(engines: list[Engine], gate=None) -> None:
    """Start engines side by side (a start mostly waits, so two overlap well on two cores). With
    `gate`, the first starts alone until gate() is true (or its start has ended)."""
    errors: list[BaseException] = []

    def start(engine: Engine) -> None:
        try:
            engine.start()
        except BaseException as exc:  # reported below, after every start has ended
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(e,)) for e in engines]
    threads[0].start()
    if gate is not None:
        wait_for(
            lambda: gate() or not threads[0].is_alive(),
            timeout_s=600,
            interval_s=0.5,
            what=f"{engines[0].name} to get far enough in its start",
        )
    for thread in threads[1:]:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def num_saved_blocks(completion: Completion) -> int:
    """Full blocks a request computed: its prompt and all generated tokens but the last."""
    return (completion.prompt_tokens + len(completion.token_ids or []) - 1) // BLOCK_SIZE


@contextlib.contextmanager
def without_hpkv_environ():
    """This process without its HPKV variables for the block (an engine gets only those it is given)."""
    saved = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith(HPKV_ENV_PREFIXES)}
    try:
        yield
    finally:
        os.environ.update(saved)


@contextlib.contextmanager
def serving(engine: Engine, shm_dir: Path):
    """Start `engine` without this process's own HPKV settings (an engine gets only those it was
    given); on the way out stop it and the HPKV server it auto-started in `shm_dir`."""
    with without_hpkv_environ():
        try:
            engine.start()
            yield engine
        finally:
            pid = server_pid(shm_dir)
            engine.stop()
            kill_server(pid)


# A load that fails inside the engine (its lease lost between the scheduler's and the worker's,
# say), on demand: once `flag` exists, the worker's next load zeroes the blocks it was loading
# into (a copy torn by the failure) and reports them all failed, and `flag` is removed. The real
# engine, server and connector otherwise; inert while `flag` does not exist.
_LOAD_FAULT = """
import os
load = module.HpkvWorker._load
def failing_load(self, jobs, _load=load, _flag={flag!r}):
    try:
        os.unlink(_flag)
    except FileNotFoundError:
        return _load(self, jobs)
    for job in jobs:  # the step's loads: all of them fail
        for view in self.copiers[job.group].layer_views:
            view[job.block_ids] = 0
    return [0] * len(jobs)
module.HpkvWorker._load = failing_load
"""


def with_load_fault(env: dict[str, str], shim_dir: Path, flag: Path) -> dict[str, str]:
    """`env` for an engine whose next load fails once `flag` exists (see _LOAD_FAULT)."""
    code = after_import("hpkv.integrations.vllm.worker", _LOAD_FAULT.format(flag=str(flag)))
    return install(env, shim_dir, code)
