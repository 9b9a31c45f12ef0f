"""A real SGLang server as a child process, for the demo, the tests and the benchmarks.

It is started as the quick start says (`--enable-ct-hpkv`, the `HPKV_*` variables), by
`python -m sglang.launch_server` or `sglang serve`. Without an accelerator it adds SGLang's CPU
flags (`--device cpu --attention-backend torch_native --disable-cuda-graph --sampling-backend
pytorch`) and sizes its pools for a small machine. Requests use SGLang's native `/generate`,
whose `meta_info.cached_details` says where a prompt's cached tokens came from.

Primitives: `SglangServer` (start, stop, complete, flush_cache, metrics, cached_tokens_by_source,
backed_up_tokens), `cpu_flags()`.
Must not know: HPKV's internals; it speaks HTTP to SGLang only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .engine import Completion, EngineProcess, free_port

HPKV_FLAG = "--enable-ct-hpkv"
LAUNCHERS = ("launch_server", "serve")  # python -m sglang.launch_server / sglang serve
CPU_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def cpu_flags(max_total_tokens: int = 20000) -> list[str]:
    """SGLang's generic platform with pure-torch ops; a device pool sized for a small machine
    (SGLang would otherwise take about 1.8M tokens, and HiCache twice that in host memory), and
    HiCache's default ratio said outright, so that SGLang does not size it from the free host
    memory. SGLang still wants the host pool free beyond a 10 GiB reserve, so a 24 GiB machine runs
    few engines beside one."""
    return [
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--disable-cuda-graph",
        "--sampling-backend",
        "pytorch",
        "--max-total-tokens",
        str(max_total_tokens),
        "--hicache-ratio",
        "2",
    ]


@dataclass
class SglangCompletion(Completion):
    # meta_info.cached_tokens_details ('device', 'host', 'storage' tokens, 'storage_backend') and 'total'
    cached: dict = field(default_factory=dict)


@dataclass
class SglangServer(EngineProcess):
    model: str
    env: dict[str, str]
    hpkv: bool = True
    served_name: str = "hpkv-demo"
    launcher: str = "launch_server"
    flag_after_model_path: bool = False  # `--model-path --enable-ct-hpkv MODEL`, the original order
    page_size: int = 64
    extra_flags: tuple[str, ...] = ()
    cpu: bool = True
    python: str = sys.executable
    log_path: Path | None = None
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        model = [self.model] if not self.hpkv else ([HPKV_FLAG, self.model] if self.flag_after_model_path else [])
        cmd = [self.python, "-m", "sglang.launch_server"]
        if self.launcher == "serve":
            cmd = [str(Path(self.python).parent / "sglang"), "serve"]
        cmd += ["--model-path", *(model or [self.model])]
        if self.hpkv and not self.flag_after_model_path:
            cmd.append(HPKV_FLAG)
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--page-size", str(self.page_size)]
        cmd += ["--served-model-name", self.served_name]
        cmd += ["--enable-metrics", "--enable-cache-report"]
        return cmd + (cpu_flags() if self.cpu else []) + list(self.extra_flags)

    def start(self, timeout_s: float = 600.0) -> SglangServer:
        env = {**CPU_ENV, **os.environ, **self.env} if self.cpu else {**os.environ, **self.env}
        self._launch(self.command(), env, "/health", "SGLang", timeout_s)
        return self

    def complete(self, prompt: str | list[int], max_tokens: int = 16) -> SglangCompletion:
        """A greedy completion through `/generate`, streamed so the time to first token is measured;
        `cached` says where the prompt's cached tokens came from."""
        body = {
            ("text" if isinstance(prompt, str) else "input_ids"): prompt,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0},
            "return_logprob": True,
            "stream": True,
        }
        started = time.perf_counter()
        ttft, last = None, None
        for answer in self.stream("/generate", body):  # each event holds the whole answer so far
            ttft = time.perf_counter() - started if ttft is None else ttft
            last = answer
        if last is None:
            raise RuntimeError("SGLang's /generate streamed no answer")
        return _completion(last, ttft or 0.0, time.perf_counter() - started)

    def flush_cache(self) -> None:
        """POST /flush_cache: empties SGLang's device and host (L2) caches, not its storage (L3)."""
        deadline = time.monotonic() + 60
        while True:
            try:
                self.post("/flush_cache?timeout=30")
                return
            except urllib.error.HTTPError:  # 400 while requests are still finishing
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def cached_tokens_by_source(self) -> dict[str, float]:
        """sglang:cached_tokens_total summed by cache_source ('device', 'host', 'storage')."""
        out: dict[str, float] = {}
        for name, value in self.metrics().items():
            if name.startswith("sglang:cached_tokens_total{") and 'cache_source="' in name:
                source = name.split('cache_source="')[1].split('"')[0]
                out[source] = out.get(source, 0.0) + value
        return out

    def backed_up_tokens(self) -> float:
        """Tokens SGLang has written to its storage backend (pages reach L3 after the response)."""
        return sum(v for n, v in self.metrics().items() if n.split("{")[0] == "sglang:backuped_tokens_total")


def _completion(answer: dict, ttft_s: float, total_s: float) -> SglangCompletion:
    meta = answer.get("meta_info", {})
    logprobs = [entry[0] for entry in meta.get("output_token_logprobs") or []]
    token_ids = answer.get("output_ids") or [entry[1] for entry in meta.get("output_token_logprobs") or []]
    cached = {**(meta.get("cached_tokens_details") or {}), "total": int(meta.get("cached_tokens", 0))}
    prompt_tokens = int(meta.get("prompt_tokens", 0))
    return SglangCompletion(
        answer.get("text", ""), list(token_ids) or None, logprobs, prompt_tokens, ttft_s, total_s, cached
    )
